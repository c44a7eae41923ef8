//! OpenAI request bodies, read into what `ScorePods` scores: `/v1/completions` (`prompt` as
//! text or token ids) and `/v1/chat/completions` (`messages`, with `tools`,
//! `chat_template_kwargs` and `add_generation_prompt`), the `model` and the `cache_salt`.
//!
//! Invariant: a body that is not such a request is a [`BodyError`] naming what is wrong, never
//! a panic; nothing here tokenizes (the score path does, with the model's tokenizer and chat
//! template).

use serde_json::Value;
use thiserror::Error;

use kv_proto::kvindexer_v1::{self, score_pods_request::Input};

/// Why a body cannot be read as an OpenAI request.
#[derive(Debug, Error)]
pub enum BodyError {
    /// Not JSON (garbage, or cut short).
    #[error("the body is not JSON: {0}")]
    NotJson(String),
    /// JSON, but not an object.
    #[error("the body is not a JSON object")]
    NotObject,
    /// No `model` string.
    #[error("the body has no \"model\" string")]
    NoModel,
    /// Neither `messages` nor `prompt`, or one of an unsupported shape.
    #[error("{0}")]
    Shape(String),
}

impl BodyError {
    /// A short label for the metric.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::NotJson(_) => "not_json",
            Self::NotObject => "not_object",
            Self::NoModel => "no_model",
            Self::Shape(_) => "shape",
        }
    }
}

/// What a request body asks for, as the score path takes it.
#[derive(Debug, Clone, PartialEq)]
pub struct OpenAiRequest {
    /// The `model` field (a base model, or a LoRA adapter vLLM serves as a model).
    pub model: String,
    /// The prompt: text, token ids or a chat.
    pub input: Input,
    /// `cache_salt` (vLLM's per-tenant prefix-cache isolation), empty when absent.
    pub cache_salt: String,
}

fn shape(message: impl Into<String>) -> BodyError {
    BodyError::Shape(message.into())
}

/// A message's `content`: a string, or the text parts of a list joined by newlines (as vLLM
/// joins them before applying the chat template); `null` (an assistant turn with tool calls)
/// is empty.
fn content(value: Option<&Value>, at: usize) -> Result<String, BodyError> {
    match value {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for part in parts {
                match part.get("text").and_then(Value::as_str) {
                    Some(t) => texts.push(t),
                    None => {
                        return Err(shape(format!(
                            "messages[{at}].content has a part without text (only text parts \
                             are read)"
                        )))
                    }
                }
            }
            Ok(texts.join("\n"))
        }
        Some(_) => Err(shape(format!(
            "messages[{at}].content is neither a string nor a list of parts"
        ))),
    }
}

fn chat(body: &serde_json::Map<String, Value>, messages: &Value) -> Result<Input, BodyError> {
    let Value::Array(list) = messages else {
        return Err(shape("\"messages\" is not a list"));
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| shape(format!("messages[{i}] has no \"role\" string")))?;
        out.push(kvindexer_v1::ChatMessage {
            role: role.to_owned(),
            content: content(m.get("content"), i)?,
        });
    }
    let json = |key: &str| {
        body.get(key)
            .filter(|v| !v.is_null())
            .map_or_else(String::new, Value::to_string)
    };
    Ok(Input::Chat(kvindexer_v1::ChatRequest {
        messages: out,
        // vLLM's default for chat completions.
        add_generation_prompt: body
            .get("add_generation_prompt")
            .and_then(Value::as_bool)
            .unwrap_or(true),
        chat_template_kwargs_json: json("chat_template_kwargs"),
        tools_json: json("tools"),
    }))
}

fn completion(prompt: &Value) -> Result<Input, BodyError> {
    match prompt {
        Value::String(s) => Ok(Input::Prompt(s.clone())),
        Value::Array(items) if items.iter().all(Value::is_number) && !items.is_empty() => {
            let ids = items
                .iter()
                .map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| shape("\"prompt\" has a token id that is not a u32"))?;
            Ok(Input::Tokens(kvindexer_v1::TokenIds { ids }))
        }
        Value::Array(items) if items.len() == 1 => completion(&items[0]),
        Value::Array(_) => Err(shape(
            "\"prompt\" is a list of several prompts (batched completions are not routed as \
             one request)",
        )),
        _ => Err(shape("\"prompt\" is neither text nor token ids")),
    }
}

/// Reads `body` (an OpenAI completions or chat-completions request).
pub fn parse(body: &[u8]) -> Result<OpenAiRequest, BodyError> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| BodyError::NotJson(e.to_string()))?;
    let Value::Object(map) = value else {
        return Err(BodyError::NotObject);
    };
    let model = map
        .get("model")
        .and_then(Value::as_str)
        .filter(|m| !m.is_empty())
        .ok_or(BodyError::NoModel)?
        .to_owned();
    let input = match (map.get("messages"), map.get("prompt")) {
        (Some(messages), _) => chat(&map, messages)?,
        (None, Some(prompt)) => completion(prompt)?,
        (None, None) => {
            return Err(shape(
                "the body has neither \"messages\" (chat completions) nor \"prompt\" \
                 (completions)",
            ))
        }
    };
    let cache_salt = match map.get("cache_salt") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(shape("\"cache_salt\" is not a string")),
    };
    Ok(OpenAiRequest {
        model,
        input,
        cache_salt,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(body: &str) -> OpenAiRequest {
        parse(body.as_bytes()).unwrap_or_else(|e| panic!("{body}: {e}"))
    }

    #[test]
    fn chat_bodies_read_as_chats() {
        let r = ok(r#"{"model":"m","cache_salt":"t1","messages":[
            {"role":"system","content":"be brief"},
            {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},
            {"role":"assistant","content":null}],
            "tools":[{"type":"function"}],"chat_template_kwargs":{"x":1}}"#);
        assert_eq!(r.model, "m");
        assert_eq!(r.cache_salt, "t1");
        let Input::Chat(c) = r.input else {
            panic!("not a chat")
        };
        assert_eq!(c.messages.len(), 3);
        assert_eq!(c.messages[1].content, "a\nb");
        assert_eq!(c.messages[2].content, "");
        assert!(c.add_generation_prompt);
        assert_eq!(c.tools_json, r#"[{"type":"function"}]"#);
        assert_eq!(c.chat_template_kwargs_json, r#"{"x":1}"#);
    }

    #[test]
    fn completion_prompts_read_as_text_or_tokens() {
        assert_eq!(
            ok(r#"{"model":"m","prompt":"hello"}"#).input,
            Input::Prompt("hello".into())
        );
        assert_eq!(
            ok(r#"{"model":"m","prompt":[1,2,3]}"#).input,
            Input::Tokens(kvindexer_v1::TokenIds { ids: vec![1, 2, 3] })
        );
        assert_eq!(
            ok(r#"{"model":"m","prompt":["one"]}"#).input,
            Input::Prompt("one".into())
        );
    }

    #[test]
    fn what_is_not_a_request_is_an_error() {
        for (body, reason) in [
            ("\u{0}\u{1}garbage", "not_json"),
            (
                r#"{"model":"m","messages":[{"role":"user","con"#,
                "not_json",
            ),
            ("[1,2]", "not_object"),
            (r#"{"prompt":"x"}"#, "no_model"),
            (r#"{"model":"","prompt":"x"}"#, "no_model"),
            (r#"{"model":"m"}"#, "shape"),
            (r#"{"model":"m","messages":"hi"}"#, "shape"),
            (r#"{"model":"m","messages":[{"content":"hi"}]}"#, "shape"),
            (r#"{"model":"m","prompt":[1,-2]}"#, "shape"),
            (r#"{"model":"m","prompt":["a","b"]}"#, "shape"),
            (r#"{"model":"m","prompt":"x","cache_salt":5}"#, "shape"),
        ] {
            match parse(body.as_bytes()) {
                Err(e) => assert_eq!(e.reason(), reason, "{body}: {e}"),
                Ok(r) => panic!("{body} was read: {r:?}"),
            }
        }
    }
}

//! OpenAI request bodies, read into the prompt scoring takes: the part of the engine's prompt
//! that is knowable exactly from the body, or none (the request is then picked on load alone,
//! counted by reason).
//!
//! What is scored, by API (the path, else the body's shape):
//! - `/v1/completions`: `prompt` as text or token ids; a batch (a list of prompts) by its first
//!   prompt (vLLM runs each as a request on the pod the batch goes to);
//! - `/v1/chat/completions`: `messages` rendered with the model's chat template (`tools`,
//!   `chat_template_kwargs`, `add_generation_prompt`); text parts of a message's content are
//!   joined by newlines (as vLLM joins them); a message with any other part (an image, audio,
//!   a file) or any field the template would render besides `role` and `content` (`tool_calls`,
//!   `name`, ...) cuts the chat at the start of its content;
//! - `/v1/embeddings`: `input` as text or token ids, a list by its first item;
//! - `/v1/responses`: `instructions` as a system message and `input` (text, or message items
//!   with text parts) as the chat vLLM builds from them, cut at the first item that is not a
//!   plain message; nothing when `previous_response_id` or `conversation` prepends turns the
//!   body does not carry, or when `tools` are given (vLLM converts them);
//! - `/v1/conversations`: nothing (creating a conversation computes no prompt);
//! - any other path: nothing (a valid JSON body with a `model` is picked on load alone).
//!
//! Without a `:path` (NGINX Gateway Fabric's shim sends none) the body's shape decides:
//! `messages` is a chat, `prompt` a completion.
//!
//! Invariant: a body that is not such a request is a [`BodyError`] naming what is wrong, never
//! a panic; refused are only what GIE's parser refuses (not JSON, not an object, no `model`, on
//! a completions or chat path neither `prompt` nor `messages`, an empty prompt or input, a
//! conversation without `items`); a list of token-id lists, which GIE refuses and vLLM serves,
//! is read; nothing here tokenizes.

use serde_json::{json, Map, Value};
use thiserror::Error;

use crate::scoring::Prompt;
use kv_tokenize::{ChatInput, ChatMessage};

impl PickRequest {
    /// A body Envoy cut at its buffer limit (BUFFERED_PARTIAL) that does not parse: nothing of
    /// it is read, so it is picked on load alone, counted as `partial_body`.
    pub fn partial(body_len: usize) -> Self {
        Self {
            model: String::new(),
            prompt: None,
            unscored: Some("partial_body"),
            cache_salt: String::new(),
            body_len,
        }
    }
}

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
    /// A completions or chat body with neither `messages` nor `prompt`, or one of a shape no
    /// engine accepts.
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

/// What a request body asks for, as the pick takes it.
#[derive(Debug, Clone)]
pub struct PickRequest {
    /// The `model` field (a base model, or a LoRA adapter vLLM serves as a model).
    pub model: String,
    /// The part of the prompt knowable exactly (`None`: picked on load alone).
    pub prompt: Option<Prompt>,
    /// Why there is no prompt to score, for the metric (`None` when there is one).
    pub unscored: Option<&'static str>,
    /// `cache_salt` (vLLM's per-tenant prefix-cache isolation), empty when absent.
    pub cache_salt: String,
    /// The body's length in bytes.
    pub body_len: usize,
}

impl PickRequest {
    /// For a chat cut short of its end: the message it is cut at and the chat's length (the
    /// fuzz target checks the first is within the second).
    pub fn chat_cut(&self) -> Option<(usize, usize)> {
        match &self.prompt {
            Some(Prompt::Chat(c)) => c.cut.map(|cut| (cut, c.messages.len())),
            _ => None,
        }
    }
}

/// The API a request is for.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Api {
    Completions,
    Chat,
    Embeddings,
    Responses,
    Conversations,
    Other,
}

impl Api {
    /// By the path (its query string aside), else by the body's fields.
    fn of(path: Option<&str>, body: &Map<String, Value>) -> Self {
        let path = path.map(|p| p.split('?').next().unwrap_or(p).trim_end_matches('/'));
        match path {
            Some(p) if p.ends_with("/conversations") => Self::Conversations,
            Some(p) if p.ends_with("/chat/completions") => Self::Chat,
            Some(p) if p.ends_with("/completions") => Self::Completions,
            Some(p) if p.ends_with("/embeddings") => Self::Embeddings,
            Some(p) if p.ends_with("/responses") => Self::Responses,
            Some(_) => Self::Other,
            None if body.contains_key("messages") => Self::Chat,
            None if body.contains_key("prompt") => Self::Completions,
            None => Self::Other,
        }
    }
}

fn shape(message: impl Into<String>) -> BodyError {
    BodyError::Shape(message.into())
}

/// Keys of a chat message the template sees that the daemon renders as the engine does.
const PLAIN_MESSAGE_KEYS: [&str; 2] = ["role", "content"];

/// Whether `v` carries nothing (`null`, an empty list, string or object).
fn is_empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Array(a) => a.is_empty(),
        Value::String(s) => s.is_empty(),
        Value::Object(o) => o.is_empty(),
        _ => false,
    }
}

/// A message's content as text: a string, or its text parts joined by newlines (as vLLM joins
/// them). `None`: it has a part that is not text (the knowable prompt ends at its start).
fn content_text(value: Option<&Value>, at: usize) -> Result<Option<String>, BodyError> {
    match value {
        None | Some(Value::Null) => Ok(Some(String::new())),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for part in parts {
                let kind = part.get("type").and_then(Value::as_str);
                match (kind, part.get("text").and_then(Value::as_str)) {
                    (None | Some("text" | "input_text" | "output_text"), Some(t)) => texts.push(t),
                    _ => return Ok(None),
                }
            }
            Ok(Some(texts.join("\n")))
        }
        Some(_) => Err(shape(format!(
            "messages[{at}].content is neither a string nor a list of parts"
        ))),
    }
}

/// Chat messages, and the message whose content the knowable prompt ends at, if any.
fn messages(list: &[Value], field: &str) -> Result<(Vec<ChatMessage>, Option<usize>), BodyError> {
    let mut out = Vec::with_capacity(list.len());
    let mut cut = None;
    for (i, m) in list.iter().enumerate() {
        let Value::Object(fields) = m else {
            return Err(shape(format!("{field}[{i}] is not an object")));
        };
        let role = fields
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| shape(format!("{field}[{i}] has no \"role\" string")))?;
        let text = content_text(fields.get("content"), i)?;
        let plain = fields
            .iter()
            .all(|(k, v)| PLAIN_MESSAGE_KEYS.contains(&k.as_str()) || is_empty(v));
        if cut.is_none() && (text.is_none() || !plain) {
            cut = Some(i);
        }
        out.push(ChatMessage {
            role: role.to_owned(),
            content: text.unwrap_or_default(),
        });
    }
    Ok((out, cut))
}

/// The body's JSON value at `key`, if present and not null.
fn present<'a>(body: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    body.get(key).filter(|v| !v.is_null())
}

/// `chat_template_kwargs`, an object (empty when absent).
fn template_kwargs(body: &Map<String, Value>) -> Result<Map<String, Value>, BodyError> {
    match present(body, "chat_template_kwargs") {
        None => Ok(Map::new()),
        Some(Value::Object(m)) => Ok(m.clone()),
        Some(_) => Err(shape("\"chat_template_kwargs\" is not an object")),
    }
}

fn chat(body: &Map<String, Value>, list: &Value) -> Result<Prompt, BodyError> {
    let Value::Array(list) = list else {
        return Err(shape("\"messages\" is not a list"));
    };
    let (messages, cut) = messages(list, "messages")?;
    Ok(Prompt::Chat(ChatInput {
        messages,
        // vLLM's default for chat completions.
        add_generation_prompt: body
            .get("add_generation_prompt")
            .and_then(Value::as_bool)
            .unwrap_or(true),
        template_kwargs: template_kwargs(body)?,
        tools: present(body, "tools").cloned(),
        cut,
    }))
}

/// A prompt as text or token ids; a list of prompts by its first.
fn text_or_tokens(value: &Value, field: &str) -> Result<Prompt, BodyError> {
    match value {
        Value::String(s) if s.is_empty() => Err(shape(format!("\"{field}\" is empty"))),
        Value::String(s) => Ok(Prompt::Text(s.clone())),
        Value::Array(items) if !items.is_empty() && items.iter().all(Value::is_number) => {
            let ids = items
                .iter()
                .map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| shape(format!("\"{field}\" has a token id that is not a u32")))?;
            Ok(Prompt::Tokens(ids))
        }
        Value::Array(items) => match items.first() {
            None => Err(shape(format!("\"{field}\" is an empty list"))),
            Some(first @ (Value::String(_) | Value::Array(_))) => text_or_tokens(first, field),
            Some(_) => Err(shape(format!(
                "\"{field}\" is neither text, token ids nor a list of either"
            ))),
        },
        _ => Err(shape(format!(
            "\"{field}\" is neither text, token ids nor a list of either"
        ))),
    }
}

/// A prompt to score, or why there is none.
type Scored = (Option<Prompt>, Option<&'static str>);

/// The Responses API's chat, as vLLM builds it: `instructions` as a system message, then
/// `input` (text as a user message, or its message items), with the generation prompt.
fn responses(body: &Map<String, Value>) -> Result<Scored, BodyError> {
    if present(body, "previous_response_id").is_some() || present(body, "conversation").is_some() {
        return Ok((None, Some("stored_conversation")));
    }
    if present(body, "tools").is_some_and(|t| !is_empty(t)) {
        return Ok((None, Some("responses_tools")));
    }
    let mut list = Vec::new();
    match present(body, "instructions") {
        None => {}
        Some(Value::String(text)) => list.push(json!({"role": "system", "content": text})),
        Some(_) => return Err(shape("\"instructions\" is not text")),
    }
    // The first item that is not a plain message (a function call or its output, reasoning)
    // ends the knowable prompt.
    let mut stop = None;
    match present(body, "input") {
        None => return Ok((None, Some("no_input"))),
        Some(Value::String(text)) => list.push(json!({"role": "user", "content": text})),
        Some(Value::Array(items)) => {
            for item in items {
                let kind = item.get("type").and_then(Value::as_str);
                if !matches!(kind, None | Some("message")) || item.get("role").is_none() {
                    stop = Some(list.len());
                    list.push(json!({"role": "user", "content": ""}));
                    break;
                }
                let mut m = item.clone();
                if let Some(o) = m.as_object_mut() {
                    for key in ["type", "id", "status"] {
                        o.remove(key);
                    }
                }
                list.push(m);
            }
        }
        Some(_) => return Err(shape("\"input\" is neither text nor a list of items")),
    }
    let (messages, cut) = messages(&list, "input")?;
    let cut = match (cut, stop) {
        (Some(c), Some(s)) => Some(c.min(s)),
        (c, s) => c.or(s),
    };
    Ok((
        Some(Prompt::Chat(ChatInput {
            messages,
            add_generation_prompt: true,
            template_kwargs: template_kwargs(body)?,
            tools: None,
            cut,
        })),
        None,
    ))
}

/// The prompt to score for `api`, or why there is none.
fn prompt_of(api: Api, body: &Map<String, Value>) -> Result<Scored, BodyError> {
    let unscored = |reason| Ok((None, Some(reason)));
    match api {
        Api::Chat | Api::Completions => {
            match (present(body, "messages"), present(body, "prompt")) {
                (Some(messages), _) => Ok((Some(chat(body, messages)?), None)),
                (None, Some(prompt)) => Ok((Some(text_or_tokens(prompt, "prompt")?), None)),
                (None, None) => Err(shape(
                    "the body has neither \"messages\" (chat completions) nor \"prompt\" \
                 (completions)",
                )),
            }
        }
        Api::Embeddings => match present(body, "input") {
            Some(input) => Ok((Some(text_or_tokens(input, "input")?), None)),
            None => match present(body, "messages") {
                Some(messages) => Ok((Some(chat(body, messages)?), None)),
                None => unscored("no_input"),
            },
        },
        Api::Responses => responses(body),
        // Creating a conversation stores its items; nothing is computed.
        Api::Conversations => match present(body, "items") {
            Some(Value::Array(_)) => unscored("conversations"),
            _ => Err(shape("a conversations request must have an \"items\" list")),
        },
        Api::Other => unscored("path"),
    }
}

/// Reads `body` (an OpenAI request to `path`, when Envoy named it).
pub fn parse(path: Option<&str>, body: &[u8]) -> Result<PickRequest, BodyError> {
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
    let api = Api::of(path, &map);
    let (prompt, unscored) = prompt_of(api, &map)?;
    let cache_salt = match map.get("cache_salt") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(shape("\"cache_salt\" is not a string")),
    };
    Ok(PickRequest {
        model,
        prompt,
        unscored,
        cache_salt,
        body_len: body.len(),
    })
}

#[cfg(test)]
mod tests;

//! Chat templates rendered as HuggingFace's `apply_chat_template` does, in Rust (minijinja).
//!
//! HuggingFace compiles templates in a sandboxed Jinja2 environment with `trim_blocks=True`,
//! `lstrip_blocks=True` and the loop-controls extension, and adds `raise_exception`, `tojson`
//! (`json.dumps` with `ensure_ascii=False`) and `strftime_now`. The context holds `messages`,
//! `tools`, `add_generation_prompt`, the tokenizer's special tokens (`bos_token`, `eos_token`,
//! ...) and every `chat_template_kwargs` entry (e.g. `enable_thinking`). Python string methods
//! (`.strip()`, `.startswith()`, `.split()`, ...) come from minijinja's pycompat layer.
//!
//! Invariant: a template error is an [`ChatError`] naming the cause (INVALID_ARGUMENT at the API),
//! never a panic.

use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};
use thiserror::Error;

/// Why a chat could not be rendered.
#[derive(Debug, Error)]
pub enum ChatError {
    /// The model has no chat template.
    #[error("the model's tokenizer has no chat template")]
    NoTemplate,
    /// The template failed to compile or render (including `raise_exception`).
    #[error("chat template: {0}")]
    Template(String),
    /// `chat_template_kwargs_json` or `tools_json` is not valid JSON.
    #[error("{field}: {message}")]
    BadJson {
        /// Which request field.
        field: &'static str,
        /// The parse error.
        message: String,
    },
    /// The rendered prompt does not show the cut message's content (the template dropped
    /// it), so where the knowable prefix ends is not known.
    #[error("the chat template does not render message {0}'s content; the prompt's knowable prefix cannot be found")]
    CutNotRendered(usize),
}

/// Stands for the content of the message a chat is cut at (private-use characters no
/// tokenizer merges with text and no client sends).
const CUT_MARKER: &str = "\u{E000}kv-indexer:cut\u{E001}";

/// One chat message.
#[derive(Debug, Clone, serde::Serialize, PartialEq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`.
    pub role: String,
    /// The text.
    pub content: String,
}

/// What to render.
#[derive(Debug, Clone, Default)]
pub struct ChatInput {
    /// The conversation.
    pub messages: Vec<ChatMessage>,
    /// Append the assistant turn header.
    pub add_generation_prompt: bool,
    /// Extra template variables (vLLM's `chat_template_kwargs`), as a JSON object.
    pub template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// Tool definitions (JSON), if any.
    pub tools: Option<serde_json::Value>,
    /// Where the knowable prompt ends: at the start of this message's content (it carries what
    /// a text template cannot render as the engine does, e.g. an image). Rendered with that
    /// content replaced by a marker, the text is cut at the marker; the tokens of the cut text
    /// lose their last one (it may merge with what follows). `None`: the whole chat.
    pub cut: Option<usize>,
}

impl ChatInput {
    /// The bytes of text the chat carries (roles and contents): what rendering and tokenizing
    /// it will cost, roughly.
    pub fn text_bytes(&self) -> usize {
        self.messages
            .iter()
            .map(|m| m.role.len() + m.content.len())
            .sum()
    }

    /// Drops the last token of a cut chat's tokens: it may merge with what follows the cut in
    /// the engine's prompt.
    pub fn trim_cut(&self, ids: &mut Vec<u32>) {
        if self.cut.is_some() {
            ids.pop();
        }
    }

    /// Parses the gRPC request's JSON fields (empty = absent).
    pub fn from_request(
        messages: Vec<ChatMessage>,
        add_generation_prompt: bool,
        kwargs_json: &str,
        tools_json: &str,
    ) -> Result<Self, ChatError> {
        let template_kwargs = if kwargs_json.trim().is_empty() {
            Default::default()
        } else {
            match serde_json::from_str::<serde_json::Value>(kwargs_json) {
                Ok(serde_json::Value::Object(m)) => m,
                Ok(_) => {
                    return Err(ChatError::BadJson {
                        field: "chat_template_kwargs_json",
                        message: "must be a JSON object".into(),
                    })
                }
                Err(e) => {
                    return Err(ChatError::BadJson {
                        field: "chat_template_kwargs_json",
                        message: e.to_string(),
                    })
                }
            }
        };
        let tools = if tools_json.trim().is_empty() {
            None
        } else {
            Some(
                serde_json::from_str(tools_json).map_err(|e| ChatError::BadJson {
                    field: "tools_json",
                    message: e.to_string(),
                })?,
            )
        };
        Ok(Self {
            messages,
            add_generation_prompt,
            template_kwargs,
            tools,
            cut: None,
        })
    }
}

/// A compiled chat template with the tokenizer's special tokens.
pub struct ChatTemplate {
    env: Environment<'static>,
    special_tokens: Vec<(String, String)>,
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=indent)`: `", "` and `": "` separators
/// without indent, newline + indent with it.
fn python_json(
    value: &Value,
    indent: Option<usize>,
    depth: usize,
    out: &mut String,
) -> Result<(), Error> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            let j = serde_json::to_value(value)
                .map_err(|e| Error::new(ErrorKind::BadSerialization, e.to_string()))?;
            out.push_str(&j.to_string());
        }
        ValueKind::String => {
            let s = value.as_str().unwrap_or_default();
            out.push_str(&serde_json::Value::String(s.to_owned()).to_string());
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                    if indent.is_none() {
                        out.push(' ');
                    }
                }
                newline(out, depth + 1);
                python_json(item, indent, depth + 1, out)?;
            }
            newline(out, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let keys: Vec<Value> = value.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                    if indent.is_none() {
                        out.push(' ');
                    }
                }
                newline(out, depth + 1);
                let key = k
                    .as_str()
                    .map(str::to_owned)
                    .unwrap_or_else(|| k.to_string());
                out.push_str(&serde_json::Value::String(key).to_string());
                out.push_str(": ");
                python_json(&value.get_item(k)?, indent, depth + 1, out)?;
            }
            newline(out, depth);
            out.push('}');
        }
        _ => {
            let j = serde_json::to_value(value)
                .map_err(|e| Error::new(ErrorKind::BadSerialization, e.to_string()))?;
            out.push_str(&j.to_string());
        }
    }
    Ok(())
}

fn tojson(value: Value, kwargs: minijinja::value::Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    python_json(&value, indent, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

/// Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// `strftime_now(format)`: the current UTC time, for the directives templates use.
fn strftime_now(format: String) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    let (y, m, d) = civil_from_days(secs.div_euclid(86_400));
    let sod = secs.rem_euclid(86_400);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y % 100)),
            Some('B') => out.push_str(MONTHS[(m - 1) as usize]),
            Some('b') => out.push_str(&MONTHS[(m - 1) as usize][..3]),
            Some('H') => out.push_str(&format!("{:02}", sod / 3600)),
            Some('M') => out.push_str(&format!("{:02}", sod % 3600 / 60)),
            Some('S') => out.push_str(&format!("{:02}", sod % 60)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Template instructions one render may execute (real chat templates use a few thousand per
/// message; a 4,096-message chat stays far below).
pub const RENDER_FUEL: u64 = 50_000_000;

impl ChatTemplate {
    /// Compiles `source` with the HuggingFace environment. `special_tokens` are (name, text)
    /// pairs such as `("bos_token", "<|begin_of_text|>")`.
    pub fn new(source: &str, special_tokens: Vec<(String, String)>) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| ChatError::Template(e.to_string()))?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        // Rendering is bounded: a template's loops run over request input (messages, tools),
        // so a request can make it work, but never without end.
        env.set_fuel(Some(RENDER_FUEL));
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned("chat", source.to_owned())
            .map_err(|e| ChatError::Template(format!("{e:#}")))?;
        Ok(Self {
            env,
            special_tokens,
        })
    }

    /// Renders a chat to the prompt text vLLM would tokenize.
    pub fn render(&self, input: &ChatInput) -> Result<String, ChatError> {
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| ChatError::Template(e.to_string()))?;
        let mut ctx = serde_json::Map::new();
        for (name, text) in &self.special_tokens {
            ctx.insert(name.clone(), serde_json::Value::String(text.clone()));
        }
        for (k, v) in &input.template_kwargs {
            ctx.insert(k.clone(), v.clone());
        }
        let mut messages = serde_json::to_value(&input.messages).unwrap_or_default();
        if let Some(cut) = input.cut {
            if let Some(m) = messages.get_mut(cut).and_then(|m| m.as_object_mut()) {
                m.insert("content".into(), CUT_MARKER.into());
            }
        }
        ctx.insert("messages".into(), messages);
        ctx.insert(
            "add_generation_prompt".into(),
            serde_json::Value::Bool(input.add_generation_prompt),
        );
        ctx.insert(
            "tools".into(),
            input.tools.clone().unwrap_or(serde_json::Value::Null),
        );
        let mut text = template
            .render(Value::from(minijinja::value::Serde(&ctx)))
            .map_err(|e| ChatError::Template(format!("{e:#}")))?;
        if let Some(cut) = input.cut {
            let at = text
                .find(CUT_MARKER)
                .ok_or(ChatError::CutNotRendered(cut))?;
            text.truncate(at);
        }
        Ok(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cut_chat_ends_where_the_cut_message_s_content_begins() {
        let t = ChatTemplate::new(
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}",
            vec![],
        )
        .expect("compiles");
        let message = |role: &str, content: &str| ChatMessage {
            role: role.into(),
            content: content.into(),
        };
        let mut input = ChatInput {
            messages: vec![
                message("system", "s"),
                message("user", "look"),
                message("user", "x"),
            ],
            ..Default::default()
        };
        let whole = t.render(&input).expect("renders");
        input.cut = Some(1);
        let cut = t.render(&input).expect("renders");
        assert_eq!(cut, "<system>s</system><user>");
        assert!(whole.starts_with(&cut));
        let mut ids = vec![1, 2, 3];
        input.trim_cut(&mut ids);
        assert_eq!(ids, [1, 2]);
        // A template that drops the content cannot say where the knowable prompt ends.
        let blind = ChatTemplate::new("{% for m in messages %}<{{ m.role }}>{% endfor %}", vec![])
            .expect("compiles");
        assert!(matches!(
            blind.render(&input),
            Err(ChatError::CutNotRendered(1))
        ));
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let t = ChatTemplate::new("{{ x | tojson }}|{{ x | tojson(indent=2) }}", vec![])
            .expect("compiles");
        let input = ChatInput {
            template_kwargs: serde_json::from_str(r#"{"x": {"a": [1, "é"], "b": null}}"#)
                .expect("json"),
            ..Default::default()
        };
        assert_eq!(
            t.render(&input).expect("renders"),
            "{\"a\": [1, \"é\"], \"b\": null}|{\n  \"a\": [\n    1,\n    \"é\"\n  ],\n  \"b\": null\n}"
        );
    }

    #[test]
    fn raise_exception_and_syntax_errors_are_errors() {
        let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}", vec![])
            .expect("compiles");
        let e = t.render(&ChatInput::default()).expect_err("raises");
        assert!(e.to_string().contains("roles must alternate"), "{e}");
        assert!(matches!(
            ChatTemplate::new("{% for %}", vec![]),
            Err(ChatError::Template(_))
        ));
    }

    #[test]
    fn civil_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_413), (2025, 11, 21));
        assert!(!strftime_now("%d %b %Y".into()).contains('%'));
    }
}

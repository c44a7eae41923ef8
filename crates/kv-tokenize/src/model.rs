//! A model's tokenizer, found and loaded: `tokenizer.json` (HuggingFace tokenizers) plus
//! `tokenizer_config.json` (special tokens, chat template) or `chat_template.jinja`.
//!
//! Where it comes from, in order: an explicit path from configuration (a `tokenizer.json` or its
//! folder); the local cache directory, in the HuggingFace cache layout
//! (`models--Org--Name/snapshots/<rev>/tokenizer.json`) or as a plain `Org/Name/` folder; the
//! HuggingFace Hub by model id (unless offline). Token ids follow vLLM: a completion prompt is
//! encoded with the tokenizer's special tokens (e.g. Llama-3's BOS), a rendered chat without
//! them (the template already has them).

use std::path::{Path, PathBuf};

use thiserror::Error;
use tokenizers::Tokenizer;

use super::chat::{ChatError, ChatInput, ChatTemplate};
use crate::hub::{self, Hub, HubError};

/// Why a tokenizer could not be loaded.
#[derive(Debug, Error, Clone)]
pub enum LoadError {
    /// Not found locally and the hub is off (offline) or unknown.
    #[error("no tokenizer for {model}: {detail}")]
    NotFound {
        /// The model.
        model: String,
        /// Where it was looked for.
        detail: String,
    },
    /// The hub refused or failed (the message never contains the token).
    #[error("downloading the tokenizer of {model}: {detail}")]
    Download {
        /// The model.
        model: String,
        /// What the hub or network said.
        detail: String,
    },
    /// A file could not be read or parsed.
    #[error("loading the tokenizer of {model} from {path}: {detail}")]
    Parse {
        /// The model.
        model: String,
        /// The file.
        path: String,
        /// The parser's message.
        detail: String,
    },
}

/// Where tokenizers are looked for.
#[derive(Debug, Clone, Default)]
pub struct SourceSettings {
    /// model -> explicit `tokenizer.json` (or folder) path.
    pub explicit: std::collections::HashMap<String, String>,
    /// Local cache / download directory.
    pub cache_dir: PathBuf,
    /// HuggingFace token (sent only to the hub, never logged).
    pub hf_token: Option<String>,
    /// Hub base URL (`HF_ENDPOINT`), default `https://huggingface.co`.
    pub hf_endpoint: Option<String>,
    /// Never download.
    pub offline: bool,
}

/// A loaded tokenizer and its chat template.
pub struct LoadedTokenizer {
    /// The model.
    pub model: String,
    /// Where it was loaded from.
    pub source: String,
    tokenizer: Tokenizer,
    chat: Option<ChatTemplate>,
}

/// A plain token list with byte offsets (for the prefix store).
pub struct Encoded {
    /// Token ids.
    pub ids: Vec<u32>,
    /// Byte range of each token in the text.
    pub offsets: Vec<(usize, usize)>,
}

impl LoadedTokenizer {
    /// Encodes a completion prompt as vLLM's completions endpoint does (special tokens added).
    pub fn encode_prompt(&self, text: &str) -> Result<Encoded, String> {
        self.encode(text, true)
    }

    /// Renders and encodes a chat as vLLM's chat endpoint does (no special tokens added).
    pub fn encode_chat(&self, chat: &ChatInput) -> Result<(String, Encoded), ChatError> {
        let template = self.chat.as_ref().ok_or(ChatError::NoTemplate)?;
        let rendered = template.render(chat)?;
        let mut encoded = self.encode(&rendered, false).map_err(ChatError::Template)?;
        chat.trim_cut(&mut encoded.ids);
        encoded.offsets.truncate(encoded.ids.len());
        Ok((rendered, encoded))
    }

    /// Renders a chat without encoding it.
    pub fn render_chat(&self, chat: &ChatInput) -> Result<String, ChatError> {
        self.chat
            .as_ref()
            .ok_or(ChatError::NoTemplate)?
            .render(chat)
    }

    /// Encodes text, with or without the post-processor's special tokens.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Encoded, String> {
        let enc = self
            .tokenizer
            .encode(text, add_special_tokens)
            .map_err(|e| e.to_string())?;
        Ok(Encoded {
            ids: enc.get_ids().to_vec(),
            offsets: enc.get_offsets().to_vec(),
        })
    }

    /// Builds from files (`config` optional).
    pub fn from_files(model: &str, tokenizer_json: &Path) -> Result<Self, LoadError> {
        let parse = |path: &Path, detail: String| LoadError::Parse {
            model: model.to_owned(),
            path: path.display().to_string(),
            detail,
        };
        let tokenizer = Tokenizer::from_file(tokenizer_json)
            .map_err(|e| parse(tokenizer_json, e.to_string()))?;
        let dir = tokenizer_json.parent().unwrap_or(Path::new("."));
        let config_path = dir.join("tokenizer_config.json");
        let config: serde_json::Value = match std::fs::read_to_string(&config_path) {
            Ok(text) => {
                serde_json::from_str(&text).map_err(|e| parse(&config_path, e.to_string()))?
            }
            Err(_) => serde_json::Value::Null,
        };
        let template_text = match std::fs::read_to_string(dir.join("chat_template.jinja")) {
            Ok(t) => Some(t),
            Err(_) => chat_template_of(&config),
        };
        let special_tokens: Vec<(String, String)> =
            ["bos_token", "eos_token", "unk_token", "pad_token"]
                .iter()
                .filter_map(|name| token_text(&config[*name]).map(|t| ((*name).to_owned(), t)))
                .collect();
        let chat = match template_text {
            Some(t) => Some(
                ChatTemplate::new(&t, special_tokens)
                    .map_err(|e| parse(&config_path, e.to_string()))?,
            ),
            None => None,
        };
        Ok(Self {
            model: model.to_owned(),
            source: tokenizer_json.display().to_string(),
            tokenizer,
            chat,
        })
    }
}

/// `chat_template` is a string, or a list of `{name, template}` (the `default` one is used).
fn chat_template_of(config: &serde_json::Value) -> Option<String> {
    match &config["chat_template"] {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(items) => items
            .iter()
            .find(|i| i["name"] == "default")
            .or_else(|| items.first())
            .and_then(|i| i["template"].as_str().map(str::to_owned)),
        _ => None,
    }
}

/// A special token is a string or an AddedToken object `{"content": ...}`.
fn token_text(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => {
            o.get("content").and_then(|c| c.as_str()).map(str::to_owned)
        }
        _ => None,
    }
}

/// A `tokenizer.json` at `spec` (the file, or a folder holding it).
pub fn local_file(spec: &Path) -> Option<PathBuf> {
    if spec.is_file() {
        return Some(spec.to_owned());
    }
    let inside = spec.join("tokenizer.json");
    inside.is_file().then_some(inside)
}

/// `model`'s `tokenizer.json` in `cache_dir`: the HuggingFace cache layout (the snapshot
/// `refs/main` names, else the newest), or a plain `cache_dir/<model>/` folder.
pub fn cached_file(cache_dir: &Path, model: &str) -> Option<PathBuf> {
    let repo = cache_dir.join(format!("models--{}", model.replace('/', "--")));
    let snapshots = repo.join("snapshots");
    if let Ok(rev) = std::fs::read_to_string(repo.join("refs").join("main")) {
        if let Some(f) = local_file(&snapshots.join(rev.trim())) {
            return Some(f);
        }
    }
    if let Ok(entries) = std::fs::read_dir(&snapshots) {
        let mut dirs: Vec<(std::time::SystemTime, PathBuf)> = entries
            .flatten()
            .filter_map(|e| {
                let m = e.metadata().ok()?.modified().ok()?;
                Some((m, e.path()))
            })
            .collect();
        dirs.sort();
        if let Some(f) = dirs.iter().rev().find_map(|(_, d)| local_file(d)) {
            return Some(f);
        }
    }
    local_file(&cache_dir.join(model))
}

/// Downloads `tokenizer.json`, `tokenizer_config.json` and (if present) `chat_template.jinja`
/// into the cache (HuggingFace layout) and returns the tokenizer's path. The token is sent to
/// the Hub's own host only ([`crate::hub`]).
pub async fn download(settings: &SourceSettings, model: &str) -> Result<PathBuf, LoadError> {
    let fail = |e: HubError| LoadError::Download {
        model: model.to_owned(),
        detail: redact(&e.to_string(), settings.hf_token.as_deref()),
    };
    let hub = Hub::new(
        settings.hf_endpoint.as_deref(),
        settings.hf_token.as_deref(),
    )
    .map_err(fail)?;
    let (commit, bytes) = hub.fetch(model, "tokenizer.json").await.map_err(fail)?;
    let tokenizer = hub::store(
        &settings.cache_dir,
        model,
        &commit,
        "tokenizer.json",
        &bytes,
    )
    .map_err(fail)?;
    // The config and template are optional: a model without them still tokenizes.
    for file in ["tokenizer_config.json", "chat_template.jinja"] {
        match hub.fetch(model, file).await {
            Ok((_, bytes)) => {
                hub::store(&settings.cache_dir, model, &commit, file, &bytes).map_err(fail)?;
            }
            Err(HubError::NotFound(_)) => {}
            Err(e) => return Err(fail(e)),
        }
    }
    Ok(tokenizer)
}

/// Removes the token from a message, should a library ever echo it.
pub fn redact(message: &str, token: Option<&str>) -> String {
    match token.filter(|t| !t.is_empty()) {
        Some(t) => message.replace(t, "<redacted>"),
        None => message.to_owned(),
    }
}

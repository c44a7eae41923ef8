//! A LoRA adapter as a model's vLLM hashes it, and the view of a model's hashing that
//! translation and the hash check rebuild keys with (its processor and its adapters' paths).

use std::collections::HashMap;

use crate::hashing::{ExtraKeysFormat, LoraAdapter, TokenProcessor};

/// How a model hashes a prompt: its token processor and its LoRA adapters' paths.
#[derive(Clone, Copy)]
pub(super) struct ModelHashing<'a> {
    /// The model's token processor.
    pub(super) processor: &'a TokenProcessor,
    /// The configured path of each LoRA adapter, by name.
    pub(super) lora_paths: &'a HashMap<String, String>,
}

impl ModelHashing<'_> {
    /// The LoRA adapter `name` as this model's vLLM hashes it: with its configured path, or
    /// with none under the untagged format (which hashes the name only). `None` when the
    /// tagged format needs a path that is not configured (vLLM >= 0.31 hashes it).
    pub(super) fn lora_adapter(&self, name: &str) -> Option<LoraAdapter> {
        let path = match (
            self.lora_paths.get(name),
            self.processor.extra_keys_format(),
        ) {
            (Some(p), _) => p.clone(),
            (None, ExtraKeysFormat::Untagged) => String::new(),
            (None, ExtraKeysFormat::Tagged) => return None,
        };
        Some(LoraAdapter {
            name: name.to_owned(),
            path,
        })
    }
}

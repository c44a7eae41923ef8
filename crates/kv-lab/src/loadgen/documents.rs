//! The documents of a load run, prepared before the clock starts: `documents` prompts of
//! `prompt_blocks` blocks (random token ids, or chats with `--chat-tokenizer`), hashed with the
//! daemon's settings (so the daemon's hash checks pass) and encoded as vLLM-shaped payloads (map
//! form, as vLLM >= 0.24 sends): `BlockStored` runs of 32 blocks with their token ids, and
//! `BlockRemoved` events of one hash each, as vLLM evicts. With `--translated-share`, each
//! prompt is also encoded as an engine with another seed publishes it.

use bytes::Bytes;
use kv_core::EngineHash;
use kv_core::{encode_batch, BlockRemoved, BlockStored, EventBatch, KvEvent, Medium};
use kv_core::{RequestExtras, TokenProcessor, TokenProcessorConfig};

use super::args::LoadgenArgs;
use super::chat;
use super::error::LoadgenError;

/// A prepared prompt: tokens, block hashes, and its payloads.
pub(super) struct Document {
    pub(super) tokens: Vec<u32>,
    /// The chat the tokens were rendered from (with `--chat-tokenizer`).
    pub(super) messages: Option<Vec<kv_tokenize::ChatMessage>>,
    store: Vec<Payload>,
    remove: Vec<Payload>,
    /// The same prompt from an engine that hashes differently (with `--translated-share`).
    translated: Option<Payloads>,
}

/// A message payload and the blocks it carries.
pub(super) type Payload = (Bytes, u64);

/// Payloads of a prompt's stores, and of its removals.
type Payloads = (Vec<Payload>, Vec<Payload>);

impl Document {
    /// The stores and removals pod-kind `translated` publishes.
    pub(super) fn payloads(&self, translated: bool) -> (&[Payload], &[Payload]) {
        match (&self.translated, translated) {
            (Some((store, remove)), true) => (store, remove),
            _ => (&self.store, &self.remove),
        }
    }
}

/// The OpenAI request body of a document: a chat, or a completion of its token ids.
pub(super) fn request_body(model: &str, doc: &Document) -> (&'static str, Vec<u8>) {
    let (path, body) = match &doc.messages {
        Some(m) => (
            "/v1/chat/completions",
            serde_json::json!({"model": model, "messages": m, "max_tokens": 1}),
        ),
        None => (
            "/v1/completions",
            serde_json::json!({"model": model, "prompt": doc.tokens, "max_tokens": 1}),
        ),
    };
    (path, body.to_string().into_bytes())
}

/// Every document's request body, and the path they go to (chats: chat completions).
pub(super) fn request_bodies(model: &str, docs: &[Document]) -> (&'static str, Vec<Vec<u8>>) {
    let mut path = "/v1/completions";
    let bodies = docs
        .iter()
        .map(|d| {
            let (p, body) = request_body(model, d);
            path = p;
            body
        })
        .collect();
    (path, bodies)
}

/// Encodes a prompt's runs (32 blocks, 4 per message) and its removals (leaf first).
fn encode_document(hashes: &[EngineHash], tokens: &[u32], block_size: usize) -> Payloads {
    let mut runs = Vec::new();
    for (r, chunk) in hashes.chunks(RUN_BLOCKS).enumerate() {
        let start = r * RUN_BLOCKS;
        let parent = start.checked_sub(1).map(|p| hashes[p]);
        let toks = &tokens[start * block_size..(start + chunk.len()) * block_size];
        runs.push((
            block_stored(chunk, parent, toks, block_size),
            chunk.len() as u64,
        ));
    }
    let store = runs
        .chunks(RUNS_PER_MESSAGE)
        .map(|group| {
            let events: Vec<KvEvent> = group.iter().map(|(e, _)| e.clone()).collect();
            let blocks = group.iter().map(|(_, n)| n).sum();
            (Bytes::from(batch(events)), blocks)
        })
        .collect();
    // vLLM evicts the leaf end first: remove in reverse.
    let removals: Vec<KvEvent> = hashes.iter().rev().map(|&h| block_removed(h)).collect();
    let remove = removals
        .chunks(RUN_BLOCKS * RUNS_PER_MESSAGE)
        .map(|group| (Bytes::from(batch(group.to_vec())), group.len() as u64))
        .collect();
    (store, remove)
}

/// `BlockStored` of a run, as vLLM 0.33 sends it for a plain full-attention request.
fn block_stored(
    hashes: &[EngineHash],
    parent: Option<EngineHash>,
    tokens: &[u32],
    block_size: usize,
) -> KvEvent {
    KvEvent::BlockStored(Box::new(BlockStored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: parent,
        token_ids: tokens.to_vec(),
        block_size: block_size as u32,
        medium: Some(Medium::Gpu),
        extra_keys: Some(vec![None; hashes.len()]),
        group_idx: Some(0),
        kv_cache_spec_kind: Some("full_attention".into()),
        ..Default::default()
    }))
}

/// `BlockRemoved` of one hash (vLLM sends one event per evicted block).
fn block_removed(hash: EngineHash) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: vec![hash],
        medium: Some(Medium::Gpu),
        group_idx: Some(0),
        ..Default::default()
    })
}

/// `[ts, events, 0]`, map form.
fn batch(events: Vec<KvEvent>) -> Vec<u8> {
    encode_batch(&EventBatch {
        ts: 1.7e9,
        events,
        data_parallel_rank: Some(0),
    })
}

/// Runs per 32-block `BlockStored`, 4 runs per message; evictions 128 per message.
const RUN_BLOCKS: usize = 32;
const RUNS_PER_MESSAGE: usize = 4;

/// Prepares the run's documents: tokens, hashes and payloads.
pub(super) fn prepare(args: &LoadgenArgs) -> Result<Vec<Document>, LoadgenError> {
    let processor = TokenProcessor::new(&TokenProcessorConfig {
        hash_seed: args.seed.clone(),
        block_size: args.block_size,
        ..Default::default()
    })?;
    // Translated pods' engines: the same algorithm and block size, another seed.
    let other_seed = (args.translated_share > 0.0)
        .then(|| {
            TokenProcessor::new(&TokenProcessorConfig {
                hash_seed: Some(format!(
                    "{}-translated",
                    args.seed.as_deref().unwrap_or_default()
                )),
                block_size: args.block_size,
                ..Default::default()
            })
        })
        .transpose()?;
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let mut docs = Vec::with_capacity(args.documents);
    let target_tokens = args.prompt_blocks * args.block_size;
    let mut chats = match &args.chat_tokenizer {
        Some(dir) => Some(chat::ChatMaker::new(dir, &args.model, target_tokens)?),
        None => None,
    };
    for d in 0..args.documents {
        let (tokens, messages) = match chats.as_mut() {
            Some(chats) => {
                let chat = chats.document(d)?;
                (chat.tokens, Some(chat.messages))
            }
            None => {
                let tokens = (0..target_tokens)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        (x % 150_000) as u32
                    })
                    .collect();
                (tokens, None)
            }
        };
        // Aligned pods' engines publish the index's keys as their hashes.
        let keys = processor.block_hashes(&tokens, &RequestExtras::default());
        let hashes: Vec<EngineHash> = keys.iter().map(|&k| EngineHash::aligned(k)).collect();
        let (store, remove) = encode_document(&hashes, &tokens, args.block_size);
        let translated = other_seed.as_ref().map(|other| {
            // Another seed's hashes: what that engine publishes, not the index's keys.
            let theirs: Vec<EngineHash> = other
                .block_hashes(&tokens, &RequestExtras::default())
                .iter()
                .map(|h| EngineHash::new(h.get()))
                .collect();
            encode_document(&theirs, &tokens, args.block_size)
        });
        docs.push(Document {
            tokens,
            messages,
            store,
            remove,
            translated,
        });
    }
    Ok(docs)
}

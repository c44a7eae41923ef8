//! `--chat-tokenizer`: chat prompts for the endpoint picker's callers, as a chat front end sends
//! them. Each document is a conversation: one of [`SYSTEM_PROMPTS`] long system prompts (shared
//! by every document whose index has its remainder), then user and assistant turns of generated
//! text until the rendered prompt reaches the wanted length. It is rendered and tokenized with
//! `kv-tokenize` exactly as the daemon does a `/v1/chat/completions` body (vLLM's chat
//! defaults: the generation prompt added, no template arguments, no tools), so the simulated
//! pods publish the blocks of the very token ids the picker will hash.

use std::path::Path;
use std::time::{Duration, Instant};

use kv_proto::kvindexer_v1::{
    self, kv_indexer_client::KvIndexerClient, score_pods_request::Input, ScorePodsRequest,
};
use kv_tokenize::{ChatInput, ChatMessage, LoadedTokenizer};
use tonic::Code;

use super::args::LoadgenArgs;
use super::calls::channel;
use super::error::LoadgenError;

/// ScorePods answers worth asking again while the daemon warms up.
const RETRY: [Code; 4] = [
    Code::NotFound,
    Code::Unavailable,
    Code::DeadlineExceeded,
    Code::ResourceExhausted,
];

/// Distinct system prompts. At least 3, so that the document a pod stores and the one it
/// evicts in the same round (two apart) never share one: an eviction would otherwise take the
/// shared prefix away from the document just stored.
pub(super) const SYSTEM_PROMPTS: usize = 4;

/// Share of a prompt's tokens its system prompt takes, as a fraction's denominator.
const SYSTEM_SHARE: usize = 4;

/// Words per user or assistant turn.
const TURN_WORDS: usize = 120;

/// Common words the generated text is drawn from (one or two tokens each).
const WORDS: &str =
    "the model cache request answer question system user data time value result server client \
     block token prompt memory network file please explain why how what when where which \
     should could would might always never often sometimes quickly slowly carefully before \
     after during because although while every each some many few small large long short new \
     old first last next other report table figure section chapter page line word number list \
     order customer account invoice payment policy support ticket issue error warning message \
     service health check deploy build test review change update release version feature \
     option setting default and or but with without for from into over under between";

/// A document's conversation and the token ids the daemon will score for it.
pub(super) struct ChatPrompt {
    /// The messages, as the request body carries them.
    pub messages: Vec<ChatMessage>,
    /// The rendered chat's token ids.
    pub tokens: Vec<u32>,
}

/// Renders and encodes chats as the daemon's picker does.
pub(super) struct ChatMaker {
    tokenizer: LoadedTokenizer,
    system: Vec<String>,
    words: Vec<&'static str>,
    target_tokens: usize,
    rng: u64,
}

impl ChatMaker {
    /// Loads the tokenizer (and its chat template) from `dir` and writes the system prompts,
    /// each about a quarter of `target_tokens`.
    pub fn new(dir: &Path, model: &str, target_tokens: usize) -> Result<Self, LoadgenError> {
        let tokenizer = LoadedTokenizer::from_files(model, &dir.join("tokenizer.json"))?;
        let mut maker = Self {
            tokenizer,
            system: Vec::new(),
            words: WORDS.split_whitespace().collect(),
            target_tokens,
            rng: 0x9E37_79B9_7F4A_7C15,
        };
        // About 1.3 tokens per word.
        let system_words = (target_tokens / SYSTEM_SHARE * 10 / 13).max(1);
        maker.system = (0..SYSTEM_PROMPTS)
            .map(|i| {
                format!(
                    "You are assistant number {i} of the support team. {}",
                    maker.text(system_words)
                )
            })
            .collect();
        Ok(maker)
    }

    /// `words` words of generated text.
    fn text(&mut self, words: usize) -> String {
        let mut out = String::with_capacity(words * 8);
        for w in 0..words {
            self.rng ^= self.rng << 13;
            self.rng ^= self.rng >> 7;
            self.rng ^= self.rng << 17;
            if w > 0 {
                out.push(if w % 15 == 0 { '.' } else { ' ' });
                if w % 15 == 0 {
                    out.push(' ');
                }
            }
            out.push_str(self.words[(self.rng % self.words.len() as u64) as usize]);
        }
        out.push('.');
        out
    }

    /// Renders and encodes `messages` as the daemon does a chat-completions body.
    fn encode(&self, messages: Vec<ChatMessage>) -> Result<ChatPrompt, LoadgenError> {
        let input = ChatInput::from_request(messages, true, "", "")?;
        let (_, encoded) = self.tokenizer.encode_chat(&input)?;
        Ok(ChatPrompt {
            messages: input.messages,
            tokens: encoded.ids,
        })
    }

    /// Document `index`: its group's system prompt, then turns until the rendered prompt has
    /// at least the target's tokens (it passes it by less than one turn).
    pub fn document(&mut self, index: usize) -> Result<ChatPrompt, LoadgenError> {
        let mut messages = vec![ChatMessage {
            role: "system".into(),
            content: self.system[index % SYSTEM_PROMPTS].clone(),
        }];
        loop {
            let prompt = self.encode(messages)?;
            if prompt.tokens.len() >= self.target_tokens {
                return Ok(prompt);
            }
            messages = prompt.messages;
            // Enough turns for the tokens missing (about 1.3 tokens per word), at least one.
            let missing = self.target_tokens - prompt.tokens.len();
            let mut turns = (missing * 10 / 13 / TURN_WORDS).max(1);
            // End on a user turn (the one the generation prompt answers).
            if (messages.len() + turns) % 2 == 1 {
                turns += 1;
            }
            for _ in 0..turns {
                let role = if messages.len() % 2 == 1 {
                    "user"
                } else {
                    "assistant"
                };
                let content = self.text(TURN_WORDS);
                messages.push(ChatMessage {
                    role: role.into(),
                    content,
                });
            }
        }
    }
}

/// Before the clock starts: asks ScorePods to score a chat's `messages` (tokenized here as
/// `tokens`) as a chat (so the daemon renders and tokenizes it) against `pod`, which stored
/// it, until the pod matches every full block it published, or at most 10 s. Proves that the daemon's tokens are the load generator's over
/// the whole prompt, not only the shared system prompt; returns the blocks matched.
pub(super) async fn check_daemon_tokens(
    args: &LoadgenArgs,
    (tokens, messages): (&[u32], &[ChatMessage]),
    pod: &str,
) -> Result<u32, LoadgenError> {
    let full = (tokens.len() / args.block_size) as u32;
    let request = ScorePodsRequest {
        model: args.model.clone(),
        input: Some(Input::Chat(kvindexer_v1::ChatRequest {
            messages: messages
                .iter()
                .map(|m| kvindexer_v1::ChatMessage {
                    role: m.role.clone(),
                    content: m.content.clone(),
                })
                .collect(),
            add_generation_prompt: true,
            ..Default::default()
        })),
        pods: vec![pod.to_owned()],
        ..Default::default()
    };
    let mut client = KvIndexerClient::new(channel(&args.grpc).await?);
    let deadline = Instant::now() + Duration::from_secs(10);
    // First the token ids, until the pod's events are all applied: the chat is then tokenized
    // once, whole (a prompt tokenized again may come from the prefix store without its tail).
    let tokens = ScorePodsRequest {
        input: Some(Input::Tokens(kvindexer_v1::TokenIds {
            ids: tokens.to_vec(),
        })),
        ..request.clone()
    };
    while Instant::now() < deadline {
        let held = client
            .score_pods(tokens.clone())
            .await
            .ok()
            .and_then(|r| r.into_inner().scores.first().map(|s| s.matched_blocks));
        if held.is_some_and(|m| m + 1 >= full) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut matched = 0;
    let last = loop {
        let (retry, why) = match client.score_pods(request.clone()).await {
            Ok(r) => {
                matched = r
                    .into_inner()
                    .scores
                    .first()
                    .map_or(0, |s| s.matched_blocks);
                // A prompt of whole blocks may leave its last block unmatched (vLLM reuses all
                // but the last token).
                if matched + 1 >= full {
                    return Ok(matched);
                }
                // The events may not be applied yet.
                (
                    true,
                    format!("{pod} matched {matched} of the {full} blocks it stored"),
                )
            }
            // The model is not known before its first events; the tokenizer may be loading.
            Err(s) if RETRY.contains(&s.code()) => (true, s.to_string()),
            Err(s) => (
                false,
                format!(
                    "{s} (does the daemon have the tokenizer of {:?}?)",
                    args.model
                ),
            ),
        };
        if !retry || Instant::now() >= deadline {
            break why;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    Err(LoadgenError::NoPrefixMatches(format!(
        "ScorePods of document 0 as a chat: {last} (matched {matched} blocks)"
    )))
}

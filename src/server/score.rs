//! `ScorePods`: validate, tokenize (prompt or chat, through the tokenizer pool) or take the
//! tokens, hash the prompt's blocks and walk the index; with `RecordRouting` enabled, keep the
//! hashes behind a prompt key.
//!
//! Invariants: every request is validated before any work (empty or oversize input is
//! INVALID_ARGUMENT, an unknown model NOT_FOUND, before any tokenizing); scoring never blocks
//! event application (reads take no index lock).

use std::time::Instant;

use tonic::Status;

use super::grpc::ScoreService;
use super::routing::ScoredPrompt;
use kv_core::{ScoreError, ScoreResult};
use kv_proto::kvindexer_v1;
use kv_proto::kvindexer_v1::score_pods_request::Input;
use kv_tokenize::{ChatInput, ChatMessage, LoadError, TokenizeError};

impl ScoreService {
    fn check_pods(&self, pods: &[String]) -> Result<(), Status> {
        if pods.len() > self.limits.max_candidate_pods {
            return Err(Status::invalid_argument(format!(
                "{} candidate pods; at most {} (server.maxCandidatePods)",
                pods.len(),
                self.limits.max_candidate_pods
            )));
        }
        Ok(())
    }

    fn check_prompt_text(&self, text: &str) -> Result<(), Status> {
        if text.is_empty() {
            return Err(Status::invalid_argument("the prompt is empty"));
        }
        if text.len() > self.limits.max_prompt_bytes {
            return Err(Status::invalid_argument(format!(
                "the prompt has {} bytes; at most {} (server.maxPromptBytes)",
                text.len(),
                self.limits.max_prompt_bytes
            )));
        }
        Ok(())
    }

    /// The ids of a packed `token_ids_le`, its length checked before anything is allocated.
    fn unpack_tokens(&self, bytes: &[u8]) -> Result<Vec<u32>, Status> {
        if bytes.len() / 4 > self.limits.max_prompt_tokens {
            return Err(Status::invalid_argument(format!(
                "the prompt has {} tokens; at most {} (server.maxPromptTokens)",
                bytes.len() / 4,
                self.limits.max_prompt_tokens
            )));
        }
        kv_proto::token_ids_le::decode(bytes).ok_or_else(|| {
            Status::invalid_argument(format!(
                "token_ids_le has {} bytes, not a multiple of 4 (little-endian u32 ids)",
                bytes.len()
            ))
        })
    }

    /// Fails fast for a model neither configured nor seen in events (before any tokenizing).
    fn check_model(&self, model: &str) -> Result<(), Status> {
        if self.indexer.model(model).is_none() {
            return Err(Status::not_found(
                ScoreError::UnknownModel(model.to_owned()).to_string(),
            ));
        }
        Ok(())
    }

    /// `ScorePods` (validated, tokenized, scored; a prompt key when RecordRouting is on): the
    /// RPC's body, and the endpoint picker's score.
    pub(crate) async fn score(
        &self,
        req: kvindexer_v1::ScorePodsRequest,
        deadline: Instant,
    ) -> Result<kvindexer_v1::ScorePodsResponse, Status> {
        if req.model.is_empty() {
            return Err(Status::invalid_argument("model is required"));
        }
        self.check_pods(&req.pods)?;
        let started = Instant::now();
        let (tokens, input_kind) = match req.input {
            None => {
                return Err(Status::invalid_argument(
                    "input is required: prompt, tokens or chat",
                ))
            }
            Some(Input::Tokens(t)) => (t.ids, "tokens"),
            Some(Input::TokenIdsLe(bytes)) => (self.unpack_tokens(&bytes)?, "token_ids_le"),
            Some(Input::Prompt(text)) => {
                self.check_prompt_text(&text)?;
                self.check_model(&req.model)?;
                let t = self
                    .tokenizers
                    .encode_prompt(&req.model, text, deadline)
                    .await
                    .map_err(tokenize_status)?;
                (t.ids, "prompt")
            }
            Some(Input::Chat(chat)) => {
                if chat.messages.is_empty() {
                    return Err(Status::invalid_argument("the chat has no messages"));
                }
                if chat.messages.len() > self.limits.max_chat_messages {
                    return Err(Status::invalid_argument(format!(
                        "the chat has {} messages; at most {} (server.maxChatMessages)",
                        chat.messages.len(),
                        self.limits.max_chat_messages
                    )));
                }
                let bytes: usize = chat
                    .messages
                    .iter()
                    .map(|m| m.role.len() + m.content.len())
                    .sum::<usize>()
                    + chat.tools_json.len()
                    + chat.chat_template_kwargs_json.len();
                if bytes > self.limits.max_prompt_bytes {
                    return Err(Status::invalid_argument(format!(
                        "the chat has {bytes} bytes; at most {} (server.maxPromptBytes)",
                        self.limits.max_prompt_bytes
                    )));
                }
                self.check_model(&req.model)?;
                let input = ChatInput::from_request(
                    chat.messages
                        .into_iter()
                        .map(|m| ChatMessage {
                            role: m.role,
                            content: m.content,
                        })
                        .collect(),
                    chat.add_generation_prompt,
                    &chat.chat_template_kwargs_json,
                    &chat.tools_json,
                )
                .map_err(|e| Status::invalid_argument(e.to_string()))?;
                let t = self
                    .tokenizers
                    .encode_chat(&req.model, input, deadline)
                    .await
                    .map_err(tokenize_status)?;
                (t.ids, "chat")
            }
        };
        if tokens.is_empty() {
            return Err(Status::invalid_argument("the prompt has no tokens"));
        }
        if tokens.len() > self.limits.max_prompt_tokens {
            return Err(Status::invalid_argument(format!(
                "the prompt has {} tokens; at most {} (server.maxPromptTokens)",
                tokens.len(),
                self.limits.max_prompt_tokens
            )));
        }
        let walk_started = Instant::now();
        let unknown_model = |e: ScoreError| match e {
            ScoreError::UnknownModel(_) => Status::not_found(e.to_string()),
            ScoreError::UnknownLora(_) => Status::invalid_argument(e.to_string()),
        };
        let lora = Some(req.lora_name.as_str());
        let salt = Some(req.cache_salt.as_str());
        // The hashes are kept only when a prompt key can be used (RecordRouting enabled);
        // otherwise the indexer hashes in its per-thread scratch and nothing is kept.
        let mut result = if req.every_rank {
            ScoreResult::with_ranks()
        } else {
            ScoreResult::default()
        };
        let hashes = if self.limits.enable_record_routing {
            let hashes = self
                .indexer
                .block_hashes(&req.model, &tokens, lora, salt)
                .map_err(unknown_model)?;
            self.indexer
                .score_hashes_into(&req.model, &hashes, &req.pods, &mut result)
                .map_err(unknown_model)?;
            Some(hashes)
        } else {
            self.indexer
                .score_tokens_into(&req.model, &tokens, &req.pods, lora, salt, &mut result)
                .map_err(unknown_model)?;
            None
        };
        result.prompt_tokens = tokens.len() as u32;
        self.metrics.scoring.lookup(
            result.scores.iter().any(|s| s.matched_blocks > 0),
            walk_started.elapsed(),
        );
        let scores = result
            .named()
            .map(|(pod, s)| kvindexer_v1::PodScore {
                pod: pod.to_owned(),
                score: s.score,
                matched_blocks: s.matched_blocks,
                speculative_blocks: s.speculative_blocks,
                data_parallel_rank: s.rank,
            })
            .collect();
        let rank_scores = result
            .ranks
            .iter()
            .map(|r| kvindexer_v1::RankScore {
                pod: result.pod_name(r.pod).to_owned(),
                data_parallel_rank: r.rank,
                score: r.score,
                matched_blocks: r.matched_blocks,
            })
            .collect();
        let prompt_key = hashes.map_or_else(Vec::new, |hashes| {
            self.prompt_keys.issue(ScoredPrompt {
                model: req.model.as_str().into(),
                hashes: hashes.into(),
                candidates: req.pods,
            })
        });
        self.metrics.scoring.served(input_kind, started.elapsed());
        Ok(kvindexer_v1::ScorePodsResponse {
            scores,
            total_blocks: result.total_blocks,
            prompt_tokens: result.prompt_tokens,
            prompt_key,
            rank_scores,
        })
    }
}

/// How tokenization failures surface: the model and the cause, with a code a client can act on.
fn tokenize_status(e: TokenizeError) -> Status {
    let msg = e.to_string();
    match e {
        TokenizeError::Load(LoadError::Download { .. }) => Status::unavailable(msg),
        TokenizeError::Load(_) => Status::failed_precondition(msg),
        TokenizeError::Chat(_) | TokenizeError::Encode { .. } => Status::invalid_argument(msg),
        TokenizeError::Overloaded(_) => Status::resource_exhausted(msg),
        TokenizeError::DeadlineExceeded => Status::deadline_exceeded(msg),
    }
}

//! A score: validate, tokenize (text or chat, through the tokenizer pool) or take the tokens,
//! hash the prompt's blocks and walk the index; with routing records on, keep the hashes behind
//! a prompt key.

use std::time::Instant;

use super::routing::ScoredPrompt;
use super::{Prompt, ScoreRequest, Scores, Scoring, ScoringError};
use kv_core::{ScoreError, ScoreResult};
use kv_tokenize::{ChatError, ChatInput, LoadError, TokenizeError};

impl Scoring {
    fn check_pods(&self, pods: &[String]) -> Result<(), ScoringError> {
        if pods.len() > self.limits.max_candidate_pods {
            return Err(ScoringError::Invalid(format!(
                "{} candidate pods; at most {} (server.maxCandidatePods)",
                pods.len(),
                self.limits.max_candidate_pods
            )));
        }
        Ok(())
    }

    fn check_prompt_bytes(&self, what: &str, bytes: usize) -> Result<(), ScoringError> {
        if bytes > self.limits.max_prompt_bytes {
            return Err(ScoringError::Invalid(format!(
                "the {what} has {bytes} bytes; at most {} (server.maxPromptBytes)",
                self.limits.max_prompt_bytes
            )));
        }
        Ok(())
    }

    pub(super) fn check_tokens(&self, n: usize) -> Result<(), ScoringError> {
        if n > self.limits.max_prompt_tokens {
            return Err(ScoringError::Invalid(format!(
                "the prompt has {n} tokens; at most {} (server.maxPromptTokens)",
                self.limits.max_prompt_tokens
            )));
        }
        Ok(())
    }

    /// Fails fast for a model neither configured nor seen in events (before any tokenizing).
    fn check_model(&self, model: &str) -> Result<(), ScoringError> {
        if self.indexer.model(model).is_none() {
            return Err(ScoringError::NotFound(
                ScoreError::UnknownModel(model.to_owned()).to_string(),
            ));
        }
        Ok(())
    }

    fn check_chat(&self, chat: &ChatInput) -> Result<(), ScoringError> {
        if chat.messages.is_empty() {
            return Err(ScoringError::Invalid("the chat has no messages".into()));
        }
        if chat.messages.len() > self.limits.max_chat_messages {
            return Err(ScoringError::Invalid(format!(
                "the chat has {} messages; at most {} (server.maxChatMessages)",
                chat.messages.len(),
                self.limits.max_chat_messages
            )));
        }
        let extras = chat.tools.as_ref().map_or(0, json_len)
            + match chat.template_kwargs.is_empty() {
                true => 0,
                false => json_len(&serde_json::Value::Object(chat.template_kwargs.clone())),
            };
        self.check_prompt_bytes("chat", chat.text_bytes() + extras)
    }

    /// The prompt's token ids: taken, unpacked, or tokenized with the model's tokenizer.
    async fn tokens_of(
        &self,
        model: &str,
        prompt: Prompt,
        deadline: Instant,
    ) -> Result<Vec<u32>, ScoringError> {
        let tokens = match prompt {
            Prompt::Tokens(ids) => ids,
            Prompt::PackedTokens(bytes) => {
                self.check_tokens(bytes.len() / 4)?;
                kv_proto::token_ids_le::decode(&bytes).ok_or_else(|| {
                    ScoringError::Invalid(format!(
                        "token_ids_le has {} bytes, not a multiple of 4 (little-endian u32 ids)",
                        bytes.len()
                    ))
                })?
            }
            Prompt::Text(text) => {
                if text.is_empty() {
                    return Err(ScoringError::Invalid("the prompt is empty".into()));
                }
                self.check_prompt_bytes("prompt", text.len())?;
                self.check_model(model)?;
                let t = self.tokenizers.encode_prompt(model, text, deadline).await;
                t.map_err(tokenize_error)?.ids
            }
            Prompt::Chat(chat) => {
                self.check_chat(&chat)?;
                self.check_model(model)?;
                let t = self.tokenizers.encode_chat(model, chat, deadline).await;
                t.map_err(tokenize_error)?.ids
            }
        };
        if tokens.is_empty() {
            return Err(ScoringError::Invalid("the prompt has no tokens".into()));
        }
        self.check_tokens(tokens.len())?;
        Ok(tokens)
    }

    /// Scores `req`'s prompt on its candidates (validated, tokenized, walked; a prompt key when
    /// routing records are on): `ScorePods`, `GetPodScores` and the endpoint picker's score.
    pub async fn score(
        &self,
        req: ScoreRequest,
        deadline: Instant,
    ) -> Result<Scores, ScoringError> {
        if req.model.is_empty() {
            return Err(ScoringError::Invalid("model is required".into()));
        }
        self.check_pods(&req.candidates)?;
        let started = Instant::now();
        let input_kind = req.prompt.kind();
        let tokens = self.tokens_of(&req.model, req.prompt, deadline).await?;
        let walk_started = Instant::now();
        let lora = Some(req.lora.as_str());
        let salt = Some(req.cache_salt.as_str());
        let mut result = match req.every_rank {
            true => ScoreResult::with_ranks(),
            false => ScoreResult::default(),
        };
        // The hashes are kept only when a prompt key can be used (routing records on);
        // otherwise the indexer hashes in its per-thread scratch and nothing is kept.
        let hashes = if self.limits.enable_record_routing {
            let hashes = self
                .indexer
                .block_hashes(&req.model, &tokens, lora, salt)
                .map_err(ScoringError::from)?;
            self.indexer
                .score_prompt_hashes_into(
                    &req.model,
                    &hashes,
                    tokens.len(),
                    &req.candidates,
                    &mut result,
                )
                .map_err(ScoringError::from)?;
            Some(hashes)
        } else {
            self.indexer
                .score_tokens_into(
                    &req.model,
                    &tokens,
                    &req.candidates,
                    lora,
                    salt,
                    &mut result,
                )
                .map_err(ScoringError::from)?;
            None
        };
        result.prompt_tokens = tokens.len() as u32;
        self.metrics.scoring.lookup(
            result.scores.iter().any(|s| s.matched_blocks > 0),
            walk_started.elapsed(),
        );
        let prompt_key = hashes.map_or_else(Vec::new, |hashes| {
            self.prompt_keys.issue(ScoredPrompt {
                model: req.model.as_str().into(),
                hashes: hashes.into(),
                candidates: req.candidates,
            })
        });
        self.metrics.scoring.served(input_kind, started.elapsed());
        Ok(Scores {
            result,
            prompt_key,
            block_size: self.block_size(&req.model).unwrap_or(0),
        })
    }
}

fn json_len(v: &serde_json::Value) -> usize {
    serde_json::to_vec(v).map_or(0, |b| b.len())
}

/// How tokenization failures surface: the model and the cause, in a kind a client can act on.
fn tokenize_error(e: TokenizeError) -> ScoringError {
    let msg = e.to_string();
    match e {
        TokenizeError::Load(LoadError::Download { .. }) => ScoringError::Unavailable(msg),
        TokenizeError::Load(_) => ScoringError::NotReady(msg),
        TokenizeError::Chat(ChatError::CutNotRendered(_)) => ScoringError::Unscorable(msg),
        TokenizeError::Chat(_) | TokenizeError::Encode { .. } => ScoringError::Invalid(msg),
        TokenizeError::Overloaded(_) => ScoringError::Overloaded(msg),
        TokenizeError::DeadlineExceeded => ScoringError::DeadlineExceeded(msg),
    }
}

//! `kv-indexer loadgen`: drives a running daemon the way a busy fleet would and reports what it
//! sustained.
//!
//! Before the clock starts it prepares `documents` prompts of `prompt_blocks` blocks, hashes
//! them with the daemon's settings (so the daemon's hash checks pass) and encodes vLLM-shaped
//! payloads (map form, as vLLM >= 0.24 sends): `BlockStored` runs of 32 blocks with their token
//! ids, and `BlockRemoved` events of one hash each, as vLLM evicts. Then, for `duration`:
//! - one task publishes over ZMQ at full speed: round `r`, pod `p` stores document
//!   `(p + r) % documents` and evicts the one it stored two rounds before, so the index stays
//!   bounded while every pod keeps churning;
//! - `score_concurrency` tasks call ScorePods with a document's tokens and every pod as a
//!   candidate, or, with `--ext-proc`, ask the daemon's endpoint picker as Envoy would.
//!
//! With `--chat-tokenizer`, the prompts are chats sharing a few long system prompts, rendered
//! and tokenized with the daemon's own code, and the picker is asked with chat bodies.
//!
//! It reports messages and blocks sent, blocks and events the daemon applied (from its
//! `/metrics`, before and after), sequence gaps, and ScorePods latency under load beside the
//! same call measured on an idle daemon first (the baseline, same run). With
//! `--replica-metrics`, it also waits for the other replicas of a replicated deployment to
//! apply the same blocks through the shared log, and reports their end-to-end rate.
//!
//! The files, bottom up: `error` and `args`; `scrape` (the daemon's `/metrics`); `report`;
//! `documents` (prepared before the clock starts) and `chat`; `publisher` and `churn` (the
//! pods' ZMQ side); `calls` (shared by the callers), `callers` (ScorePods), `picks` (the
//! endpoint picker), `http` (a gateway, and the pods served over HTTP); `agree` (other
//! replicas); `run` (the stages in order). This file only wires them.

mod agree;
mod args;
mod callers;
mod calls;
mod chat;
mod churn;
mod documents;
mod error;
mod http;
mod picks;
mod publisher;
mod report;
mod run;
mod scrape;

use std::time::Duration;

pub use args::LoadgenArgs;
pub use error::LoadgenError;
pub use report::{
    AgreementReport, ChurnReport, LoadgenReport, ReplicaReport, ScorePhase, SoakReport, SoakSample,
};

/// Runs the load on its own runtime and returns what it measured (progress goes to stderr).
pub fn run(args: LoadgenArgs) -> Result<LoadgenReport, LoadgenError> {
    args.check()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(LoadgenError::Runtime)?;
    let linger = (args.serve_pods.is_some() && args.linger > 0).then_some(args.linger);
    runtime.block_on(async move {
        let report = run::run(args).await;
        if let Some(seconds) = linger {
            eprintln!("the pods keep serving for {seconds}s (--linger)");
            tokio::time::sleep(Duration::from_secs(seconds)).await;
        }
        report
    })
}

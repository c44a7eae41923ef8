//! `kv-indexer score`: a ScorePods client, for operators and the quickstart (no grpcurl needed).

use anyhow::{bail, Context};
use clap::Args;

use kv_proto::kvindexer_v1::{
    kv_indexer_client::KvIndexerClient, score_pods_request::Input, ScorePodsRequest, TokenIds,
};

/// Flags of `kv-indexer score`.
#[derive(Debug, Args)]
pub struct ScoreArgs {
    /// The daemon's gRPC address.
    #[arg(long, default_value = "http://127.0.0.1:50051")]
    pub grpc: String,
    /// A request in grpcurl's JSON form: {"model", "tokens": {"ids"}, "prompt", "pods"}.
    #[arg(long)]
    pub request: Option<std::path::PathBuf>,
    /// The model (with --prompt or --tokens).
    #[arg(long)]
    pub model: Option<String>,
    /// Completion prompt text.
    #[arg(long)]
    pub prompt: Option<String>,
    /// Token ids, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub tokens: Vec<u32>,
    /// Candidate pods, comma-separated (default: every pod known for the model).
    #[arg(long, value_delimiter = ',')]
    pub pods: Vec<String>,
}

/// Sends one ScorePods request and prints the scores.
pub fn run(args: ScoreArgs) -> anyhow::Result<()> {
    let request = match &args.request {
        Some(path) => {
            let v: serde_json::Value = serde_json::from_str(
                &std::fs::read_to_string(path)
                    .with_context(|| format!("reading {}", path.display()))?,
            )
            .with_context(|| format!("{} is not JSON", path.display()))?;
            let input = if let Some(ids) = v["tokens"]["ids"].as_array() {
                Input::Tokens(TokenIds {
                    ids: ids
                        .iter()
                        .filter_map(|x| x.as_u64().map(|x| x as u32))
                        .collect(),
                })
            } else if let Some(p) = v["prompt"].as_str() {
                Input::Prompt(p.to_owned())
            } else {
                bail!("the request needs tokens.ids or prompt");
            };
            ScorePodsRequest {
                model: v["model"].as_str().unwrap_or_default().to_owned(),
                input: Some(input),
                pods: v["pods"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .filter_map(|p| p.as_str().map(str::to_owned))
                            .collect()
                    })
                    .unwrap_or_default(),
                ..Default::default()
            }
        }
        None => {
            let Some(model) = args.model.clone() else {
                bail!("give --request FILE, or --model with --prompt or --tokens");
            };
            let input = match (&args.prompt, args.tokens.is_empty()) {
                (Some(p), _) => Input::Prompt(p.clone()),
                (None, false) => Input::Tokens(TokenIds {
                    ids: args.tokens.clone(),
                }),
                (None, true) => bail!("--prompt or --tokens is required"),
            };
            ScorePodsRequest {
                model,
                input: Some(input),
                pods: args.pods.clone(),
                ..Default::default()
            }
        }
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let mut client = KvIndexerClient::connect(args.grpc.clone())
            .await
            .with_context(|| format!("connecting to {}", args.grpc))?;
        let r = client
            .score_pods(request)
            .await
            .map_err(|s| anyhow::anyhow!("{:?}: {}", s.code(), s.message()))?
            .into_inner();
        println!(
            "{} prompt tokens, {} full blocks",
            r.prompt_tokens, r.total_blocks
        );
        // Data-parallel pods name the rank their score comes from (a column only then).
        if r.scores.iter().any(|s| s.data_parallel_rank.is_some()) {
            println!(
                "{:<28} {:>10} {:>15} {:>5}",
                "pod", "score", "matched blocks", "rank"
            );
            for s in r.scores {
                let rank = s.data_parallel_rank.map_or("-".into(), |r| r.to_string());
                println!(
                    "{:<28} {:>10.1} {:>15} {:>5}",
                    s.pod, s.score, s.matched_blocks, rank
                );
            }
        } else {
            println!("{:<28} {:>10} {:>15}", "pod", "score", "matched blocks");
            for s in r.scores {
                println!("{:<28} {:>10.1} {:>15}", s.pod, s.score, s.matched_blocks);
            }
        }
        Ok(())
    })
}

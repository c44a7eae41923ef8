//! The flags of `kv-indexer loadgen` and the bounds they must keep.

use clap::Args;

use super::error::LoadgenError;

/// Pods `--serve-pods` serves at most (`127.0.0.10` to `127.0.0.249`).
pub(super) const MAX_SERVED_PODS: u32 = 240;

/// Flags of `kv-indexer loadgen` (its settings).
#[derive(Debug, Clone, Args)]
pub struct LoadgenArgs {
    /// The daemon's ZMQ bind endpoint (the load generator's PUB connects to it).
    #[arg(long, default_value = "tcp://127.0.0.1:5557")]
    pub zmq_endpoint: String,
    /// The daemon's gRPC address.
    #[arg(long, default_value = "http://127.0.0.1:50051")]
    pub grpc: String,
    /// The daemon's metrics address (host:port).
    #[arg(long, default_value = "127.0.0.1:9090")]
    pub metrics: String,
    /// Model name in topics and requests.
    #[arg(long, default_value = "loadgen/model")]
    pub model: String,
    /// Simulated pods.
    #[arg(long, default_value_t = 64)]
    pub pods: u32,
    /// Distinct prompts.
    #[arg(long, default_value_t = 64)]
    pub documents: usize,
    /// Blocks per prompt (ScorePods depth).
    #[arg(long, default_value_t = 500)]
    pub prompt_blocks: usize,
    /// Must equal the daemon's blockSize.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Must equal the daemon's hashSeed (default: unset, vLLM's "vllm-none-hash").
    #[arg(long)]
    pub seed: Option<String>,
    /// Seconds of load.
    #[arg(long, default_value_t = 10)]
    pub duration: u64,
    /// Concurrent ScorePods callers.
    #[arg(long, default_value_t = 4)]
    pub score_concurrency: usize,
    /// Target event rate, blocks per second (stores and removals together). The PUB drops what
    /// the daemon cannot take (as vLLM's would past its high-water mark), so the sustained rate
    /// is the highest one without sequence gaps.
    #[arg(long, default_value_t = 1_200_000)]
    pub rate: u64,
    /// Send the prompt's token ids packed (`token_ids_le`, little-endian u32 bytes) instead
    /// of the varint list (`tokens`): the form a gateway should send (docs/benchmarks.md).
    #[arg(long)]
    pub packed_tokens: bool,
    /// Seconds of idle ScorePods calls first (the latency baseline).
    #[arg(long, default_value_t = 2)]
    pub baseline: u64,
    /// Ask the daemon's endpoint picker (Envoy ext_proc, e.g. `http://127.0.0.1:9002`) instead of
    /// calling ScorePods: each call is one request's ext_proc stream (FULL_DUPLEX_STREAMED, the
    /// prompt's token ids as a completions body, or a chat with `--chat-tokenizer`), timed to
    /// the pick.
    #[arg(long)]
    pub ext_proc: Option<String>,
    /// With `--ext-proc`: chat prompts instead of token ids. DIR is a HuggingFace tokenizer
    /// folder (`tokenizer.json`, `tokenizer_config.json` with the chat template), the one the
    /// daemon has for `--model`. Each prompt is a `/v1/chat/completions` body: one of 4 long
    /// system prompts (a quarter of the prompt, shared by a quarter of the documents), then
    /// user and assistant turns up to about `--prompt-blocks` blocks once rendered. The pods
    /// publish the blocks of the chat as rendered and tokenized here, with the daemon's own
    /// code (so the picker finds them). The run fails if ScorePods, asked for the first chat
    /// before the load, does not match every block its pod stored, or if no pick found a
    /// prefix.
    #[arg(long, value_name = "DIR")]
    pub chat_tokenizer: Option<std::path::PathBuf>,
    /// Make every simulated pod a real HTTP endpoint on this port: pod `p` is named and served
    /// at `127.0.0.<10+p>:PORT` (at most 240 pods), with vLLM's `/metrics` page and a short
    /// completion for any POST (header `x-served-by`), so a gateway can route to it.
    #[arg(long, value_name = "PORT")]
    pub serve_pods: Option<u16>,
    /// Send the documents as OpenAI requests to URL (a gateway, e.g. `http://127.0.0.1:8081`,
    /// or a pod straight) instead of calling ScorePods, timed to the whole response.
    #[arg(long, value_name = "URL", conflicts_with = "ext_proc")]
    pub http: Option<String>,
    /// Write the OpenAI request body (JSON) for the prompt the first pod stored, for `curl -d`.
    #[arg(long, value_name = "FILE")]
    pub dump_body: Option<std::path::PathBuf>,
    /// Keep the pods serving (`--serve-pods`) this many seconds after the run.
    #[arg(long, default_value_t = 0)]
    pub linger: u64,
    /// Serve every simulated pod's vLLM metrics page at `http://ADDR/<pod>/metrics` (loopback),
    /// for the picker's scraper (`endpointPicker.metricsUrlTemplate:
    /// "http://ADDR/{pod}/metrics"`).
    #[arg(long)]
    pub pod_metrics: Option<String>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Write a ScorePods request (grpcurl's JSON) for the prompt the first pod stored.
    #[arg(long)]
    pub dump_request: Option<std::path::PathBuf>,
    /// Soak mode: sample the daemon's memory every this many seconds during the load (0: off)
    /// and report whether anything grew after the first half (run with `--duration` of hours).
    #[arg(long, default_value_t = 0)]
    pub soak_sample: u64,
    /// Other replicas of a replicated deployment (their metrics address, host:port;
    /// repeatable): after the load, wait until each has applied what the daemon under load
    /// applied (through the shared log) and report the rate it got there at.
    #[arg(long = "replica-metrics")]
    pub replica_metrics: Vec<String>,
    /// Share of the pods (the first ones) whose engines hash differently from the daemon: they
    /// publish the same tokens under vLLM's `sha256_cbor` hashes with another seed (`--seed`
    /// followed by `-translated`), so the daemon translates them from their token ids. 0: every
    /// pod aligned.
    #[arg(long, default_value_t = 0.0)]
    pub translated_share: f64,
    /// Pods joining (each on a PUB socket of its own, storing one prompt) and leaving a second
    /// later, per second, beside the steady pods: a soak of a churning fleet (0: none).
    #[arg(long, default_value_t = 0)]
    pub churn: u32,
    /// Other replicas' gRPC addresses (repeatable): after the load, wait (up to 120 s) until
    /// each holds what the daemon under load holds, per (model, pod, rank), and report it.
    #[arg(long = "agree-with")]
    pub agree_with: Vec<String>,
}

impl LoadgenArgs {
    /// Refuses flags out of range (before anything is prepared or connected).
    pub(super) fn check(&self) -> Result<(), LoadgenError> {
        if self.pods == 0 || self.documents < 3 || self.prompt_blocks == 0 {
            return Err(LoadgenError::InvalidArgs(
                "--pods must be >= 1, --documents >= 3, --prompt-blocks >= 1",
            ));
        }
        if self.chat_tokenizer.is_some() && self.ext_proc.is_none() && self.http.is_none() {
            return Err(LoadgenError::InvalidArgs(
                "--chat-tokenizer needs --ext-proc or --http",
            ));
        }
        if self.serve_pods.is_some() && self.pods > MAX_SERVED_PODS {
            return Err(LoadgenError::InvalidArgs(
                "--serve-pods serves at most 240 pods",
            ));
        }
        if !(0.0..=1.0).contains(&self.translated_share) {
            return Err(LoadgenError::InvalidArgs(
                "--translated-share must be between 0 and 1",
            ));
        }
        Ok(())
    }

    /// Pods (the first ones) whose engines hash differently (`--translated-share`).
    pub(super) fn translated_pods(&self) -> usize {
        (self.translated_share * self.pods as f64) as usize
    }
}

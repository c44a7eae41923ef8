//! The `kv-indexer` binary: subcommands over the library.

mod cli;

/// The allocator (feature `mimalloc`, on by default): glibc's moving mmap threshold and
/// fresh-mapping faults slow the index's apply as it grows, and glibc keeps freed pages until
/// trimmed; mimalloc does neither (docs/benchmarks.md, "The allocator, and memory over time").
#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::{Parser, Subcommand};

/// kv-indexer: a global KV-cache block index for vLLM fleets.
#[derive(Debug, Parser)]
#[command(name = "kv-indexer", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the daemon: subscribe to vLLM's KV events, serve ScorePods over gRPC.
    Serve(cli::serve::ServeArgs),
    /// Validate a configuration and print the effective result.
    CheckConfig(cli::serve::ServeArgs),
    /// Print vLLM's sha256_cbor block hashes for a token list.
    Hash(cli::hash::HashArgs),
    /// Publish vLLM-shaped events at full speed and call ScorePods against a running daemon.
    #[cfg(feature = "lab")]
    Loadgen(cli::loadgen::LoadgenArgs),
    /// Ask a running daemon for pod scores (a ScorePods client).
    Score(cli::score::ScoreArgs),
    /// Replay a request trace against one block-level prefix cache (LRU, LFU, FIFO, S3-FIFO).
    #[cfg(feature = "lab")]
    Replay(cli::replay::ReplayArgs),
    /// Compare routing policies on simulated vLLM pods feeding the real index.
    #[cfg(feature = "lab")]
    Simulate(cli::simulate::SimulateArgs),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => cli::serve::serve(args),
        Command::CheckConfig(args) => cli::serve::check_config(args),
        Command::Hash(args) => cli::hash::run(args),
        #[cfg(feature = "lab")]
        Command::Loadgen(args) => cli::loadgen::run(args),
        Command::Score(args) => cli::score::run(args),
        #[cfg(feature = "lab")]
        Command::Replay(args) => cli::replay::run(args),
        #[cfg(feature = "lab")]
        Command::Simulate(args) => cli::simulate::run_cli(args),
    };
    if let Err(error) = result {
        // The cause chain on one line, no backtrace for operator-facing errors.
        eprintln!("error: {}", one_line(&error));
        std::process::exit(1);
    }
}

/// The error and its causes, `: `-joined, leaving out a cause whose text the message already
/// carries (our library errors name their source in their own message).
fn one_line(error: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in error.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

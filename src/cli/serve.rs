//! `kv-indexer serve` and `kv-indexer check-config`.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use kv_indexer::config::Config;

/// Where the configuration comes from, shared by `serve` and `check-config`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// YAML config file; without it, the embedded defaults (in-memory index, bind
    /// tcp://127.0.0.1:5557, gRPC 0.0.0.0:50051, metrics 0.0.0.0:9090).
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Overrides server.grpcAddr.
    #[arg(long)]
    pub grpc_addr: Option<String>,
    /// Overrides server.metricsAddr.
    #[arg(long)]
    pub metrics_addr: Option<String>,
    /// Overrides kvEventsConfig.zmqEndpoint (empty disables bind mode).
    #[arg(long)]
    pub zmq_endpoint: Option<String>,
    /// Log format: text or json (level from RUST_LOG, default info).
    #[arg(long, default_value = "text")]
    pub log_format: String,
}

/// The effective configuration: file (or defaults), then environment, then flags.
pub fn effective_config(args: &ServeArgs) -> anyhow::Result<Config> {
    let mut config = match &args.config {
        Some(path) => Config::load(path)?,
        None => Config::default(),
    };
    config.apply_env(|k| std::env::var(k).ok());
    if let Some(a) = &args.grpc_addr {
        config.server.grpc_addr = a.clone();
    }
    if let Some(a) = &args.metrics_addr {
        config.server.metrics_addr = a.clone();
    }
    if let Some(e) = &args.zmq_endpoint {
        config.kv_events_config.zmq_endpoint = e.clone();
    }
    config.validate()?;
    Ok(config)
}

fn init_logging(format: &str) -> anyhow::Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        "json" => builder.json().init(),
        "text" => builder.init(),
        other => anyhow::bail!("--log-format must be text or json, not {other:?}"),
    }
    Ok(())
}

/// Runs the daemon until SIGTERM or SIGINT, then shuts down gracefully.
pub fn serve(args: ServeArgs) -> anyhow::Result<()> {
    init_logging(&args.log_format)?;
    let config = effective_config(&args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("kv-indexer")
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        // Handlers first: a SIGTERM that arrives while starting must still shut down cleanly.
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("installing the SIGTERM handler")?;
        let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
            .context("installing the SIGINT handler")?;
        let daemon = kv_indexer::daemon::start(config).await?;
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        tracing::info!("shutdown requested");
        daemon.shutdown().await;
        Ok(())
    })
}

/// Validates the configuration and prints the effective result (secrets redacted).
pub fn check_config(args: ServeArgs) -> anyhow::Result<()> {
    let config = effective_config(&args)?;
    print!("{}", config.redacted().to_yaml());
    let warnings = config.warnings();
    for w in &warnings {
        eprintln!("warning: {w}");
    }
    match warnings.len() {
        0 => eprintln!("configuration is valid"),
        n => eprintln!("configuration is valid, with {n} warning(s): settings that do nothing"),
    }
    Ok(())
}

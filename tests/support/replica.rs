//! A kv-indexer replica as a process of its own (`kv-indexer serve --config FILE`), for tests
//! that kill one with SIGKILL and start it again: bind-mode ZMQ, gRPC and metrics on loopback
//! ports chosen here, replication through the Redis at `redis`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kv_proto::kvindexer_v1::{kv_indexer_client::KvIndexerClient, ListPodsRequest, PodInfo};

use super::redis::free_port;

/// A replica's ports: (ZMQ bind, gRPC, metrics).
pub type Ports = (u16, u16, u16);

/// Fresh loopback ports for a replica.
pub fn ports() -> Ports {
    (free_port(), free_port(), free_port())
}

/// Writes the config file of replica `name` (hash seed `seed`, the default when empty, blocks
/// of `block`, snapshots every second, extra YAML lines appended) into `dir`.
pub fn write_config(
    dir: &Path,
    name: &str,
    redis: &str,
    prefix: &str,
    ports: Ports,
    (seed, block): (&str, usize),
    extra: &str,
) -> PathBuf {
    let path = dir.join(format!("{name}.yaml"));
    let seed = if seed.is_empty() {
        String::new()
    } else {
        format!(", hashSeed: \"{seed}\"")
    };
    let text = format!(
        "indexerConfig:\n  tokenProcessorConfig: {{blockSize: {block}{seed}}}\n\
         kvEventsConfig: {{zmqEndpoint: \"tcp://127.0.0.1:{}\", concurrency: 2}}\n\
         server: {{grpcAddr: \"127.0.0.1:{}\", metricsAddr: \"127.0.0.1:{}\"}}\n\
         replication: {{enabled: true, redisUrl: \"{redis}\", keyPrefix: {prefix}, replicaId: {name}, snapshotInterval: 1s}}\n{extra}",
        ports.0, ports.1, ports.2
    );
    std::fs::write(&path, text).expect("config written");
    path
}

/// A running replica process (killed when dropped).
pub struct Process {
    /// The child process.
    pub child: std::process::Child,
    /// Its gRPC URL.
    pub grpc: String,
    /// Its ZMQ bind endpoint.
    pub zmq: String,
    /// Its metrics port.
    pub metrics: u16,
}

impl Process {
    /// Starts `kv-indexer serve --config config` (logs to stderr at `warn` are dropped).
    pub fn spawn(config: &Path, ports: Ports) -> Self {
        Self::spawn_with_env(config, ports, &[])
    }

    /// [`Process::spawn`] with environment variables set (e.g. `PYTHONHASHSEED`, which
    /// overrides the file's `hashSeed`); none is inherited from the test's environment.
    pub fn spawn_with_env(config: &Path, ports: Ports, env: &[(&str, &str)]) -> Self {
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_kv-indexer"))
            .args(["serve", "--config"])
            .arg(config)
            .env("RUST_LOG", "warn")
            .env_remove("PYTHONHASHSEED")
            .envs(env.iter().copied())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("kv-indexer starts");
        Self {
            child,
            grpc: format!("http://127.0.0.1:{}", ports.1),
            zmq: format!("tcp://127.0.0.1:{}", ports.0),
            metrics: ports.2,
        }
    }

    /// SIGKILL, and waits for the process to be gone.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Whether `/readyz` answers 200.
    pub async fn ready(&self) -> bool {
        super::http_get(self.metrics, "/readyz")
            .await
            .is_some_and(|(code, _)| code == 200)
    }

    /// Waits (up to `within`) until ready; returns how long it took.
    pub async fn wait_ready(&self, within: Duration) -> Duration {
        let started = Instant::now();
        while !self.ready().await {
            assert!(
                started.elapsed() < within,
                "replica {} not ready within {within:?}",
                self.grpc
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        started.elapsed()
    }

    /// The metrics page (empty when unreachable).
    pub async fn metrics_text(&self) -> String {
        super::http_get(self.metrics, "/metrics")
            .await
            .map(|(_, body)| body)
            .unwrap_or_default()
    }

    /// `ListPods` of `model` (empty when unreachable).
    pub async fn pods(&self, model: &str) -> Vec<PodInfo> {
        let Ok(mut c) = KvIndexerClient::connect(self.grpc.clone()).await else {
            return Vec::new();
        };
        match c
            .list_pods(ListPodsRequest {
                model: model.into(),
            })
            .await
        {
            Ok(r) => r.into_inner().pods,
            Err(_) => Vec::new(),
        }
    }

    /// Blocks of `tokens` that `pod` holds, by ScorePods of a prompt that continues past them
    /// (vLLM reuses at most all but a prompt's last token), 0 when unreachable.
    pub async fn matched(&self, model: &str, tokens: &[u32], pod: &str) -> u32 {
        match KvIndexerClient::connect(self.grpc.clone()).await {
            Ok(mut c) => super::matched_blocks(&mut c, model, &super::past(tokens), pod).await,
            Err(_) => 0,
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

//! `--churn N`: pods that come and go, as a fleet that scales and rolls all day does. Every
//! second, `N` new pods join, each on a PUB socket of its own (a vLLM pod's), store one prompt
//! and leave a second later (the socket closes). Their ids name addresses that never connect,
//! so the daemon learns they left from their silence (`publisherIdleTimeout`): a soak with
//! churn checks that a daemon holds the pods it has now, not every pod it ever saw.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use super::documents::Document;
use super::error::LoadgenError;
use super::publisher::Publisher;
use super::report::ChurnReport;

/// What the churning pods did.
#[derive(Debug, Default)]
pub(super) struct ChurnCounters {
    /// Pods that joined.
    pub(super) joined: AtomicU64,
    /// Blocks they stored (sent).
    pub(super) blocks: AtomicU64,
}

impl ChurnCounters {
    /// What the churning pods did over `seconds`.
    pub(super) fn report(&self, seconds: f64) -> ChurnReport {
        let joined = self.joined.load(Ordering::Relaxed);
        ChurnReport {
            joined,
            joined_per_s: joined as f64 / seconds.max(1e-9),
            blocks_sent: self.blocks.load(Ordering::Relaxed),
        }
    }
}

/// The id of churning pod `n`: an address no connection comes from (10.201/16 and up).
fn pod_id(n: u64) -> String {
    format!(
        "10.{}.{}.{}:8000",
        201 + n / 62_500,
        (n / 250) % 250,
        n % 250
    )
}

/// Runs the churn until `stop`: `per_second` pods join every second.
pub(super) async fn run(
    endpoint: String,
    model: String,
    per_second: u32,
    docs: Arc<Vec<Document>>,
    stop: Arc<AtomicBool>,
    counters: Arc<ChurnCounters>,
) -> Result<(), LoadgenError> {
    let mut next = 0u64;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut pods = tokio::task::JoinSet::new();
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        for _ in 0..per_second {
            let n = next;
            next += 1;
            let (endpoint, docs, counters) = (endpoint.clone(), docs.clone(), counters.clone());
            let topic = Bytes::from(format!("kv@{}@{model}", pod_id(n)));
            pods.spawn(async move {
                let mut publisher = Publisher::connect(&endpoint).await?;
                // The subscription reaches a new PUB after a moment (ZeroMQ's slow joiner).
                tokio::time::sleep(Duration::from_millis(300)).await;
                counters.joined.fetch_add(1, Ordering::Relaxed);
                let mut seq = 0;
                let doc = &docs[(n as usize) % docs.len()];
                for (payload, blocks) in doc.payloads(false).0 {
                    publisher.send(&topic, &mut seq, payload).await?;
                    counters.blocks.fetch_add(*blocks, Ordering::Relaxed);
                }
                // Leaves a second later: the socket closes with the task.
                tokio::time::sleep(Duration::from_secs(1)).await;
                Ok::<_, LoadgenError>(())
            });
        }
        while let Some(done) = pods.try_join_next() {
            done.map_err(|e| LoadgenError::Task(e.to_string()))??;
        }
    }
    while let Some(done) = pods.join_next().await {
        done.map_err(|e| LoadgenError::Task(e.to_string()))??;
    }
    Ok(())
}

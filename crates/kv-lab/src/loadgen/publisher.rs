//! The simulated pods' publishing over ZeroMQ: one PUB socket (as a vLLM pod's) connected to
//! the daemon's bind endpoint, carrying `[topic, seq, payload]` messages with each pod's own
//! sequence. The warm-up stores every pod's first document; then, until stopped, round `r` has
//! pod `p` store document `(p + r) % documents` and evict the one it stored two rounds before,
//! so the index stays bounded while every pod keeps churning, paced to `--rate` blocks a second.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

use super::documents::Document;
use super::error::LoadgenError;

/// The PUB socket the simulated pods publish through.
pub(super) struct Publisher {
    socket: PubSocket,
    endpoint: String,
}

impl Publisher {
    /// A PUB socket connected to the daemon's `endpoint`.
    pub(super) async fn connect(endpoint: &str) -> Result<Self, LoadgenError> {
        let mut publisher = Publisher {
            socket: PubSocket::new(),
            endpoint: endpoint.to_owned(),
        };
        publisher
            .socket
            .connect(endpoint)
            .await
            .map_err(|source| publisher.error(source))?;
        Ok(publisher)
    }

    fn error(&self, source: zeromq::ZmqError) -> LoadgenError {
        LoadgenError::Zmq {
            endpoint: self.endpoint.clone(),
            source,
        }
    }

    /// Sends `[topic, seq, payload]` and advances the publisher's sequence.
    pub(super) async fn send(
        &mut self,
        topic: &Bytes,
        seq: &mut u64,
        payload: &Bytes,
    ) -> Result<(), LoadgenError> {
        let frames = vec![
            topic.clone(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload.clone(),
        ];
        // Three frames are never empty, the only case `try_from` refuses.
        let Ok(msg) = ZmqMessage::try_from(frames) else {
            return Err(LoadgenError::Task("empty ZMQ message".into()));
        };
        *seq += 1;
        self.socket
            .send(msg)
            .await
            .map_err(|source| self.error(source))
    }
}

/// What the steady pods sent.
#[derive(Default)]
pub(super) struct Counters {
    /// Messages sent.
    pub(super) messages: AtomicU64,
    /// Blocks they carried (stores and removals).
    pub(super) blocks: AtomicU64,
}

/// The steady pods: one topic each, the first `translated_pods` publishing as an engine that
/// hashes differently, each with its next sequence number.
pub(super) struct Pods {
    /// `kv@<pod>@<model>` per pod.
    pub(super) topics: Vec<Bytes>,
    /// The next sequence number per pod.
    pub(super) seqs: Vec<u64>,
    /// Pods (the first ones) publishing the translated payloads.
    pub(super) translated_pods: usize,
}

impl Pods {
    /// The pods named `names`, publishing for `model`.
    pub(super) fn new(names: &[String], model: &str, translated_pods: usize) -> Self {
        Self {
            topics: names
                .iter()
                .map(|p| Bytes::from(format!("kv@{p}@{model}")))
                .collect(),
            seqs: vec![0; names.len()],
            translated_pods,
        }
    }
}

/// The warm-up: every pod stores its first document (pod `p`, document `p`).
pub(super) async fn warm_up(
    publisher: &mut Publisher,
    pods: &mut Pods,
    docs: &[Document],
) -> Result<(), LoadgenError> {
    for (p, topic) in pods.topics.iter().enumerate() {
        let payloads = docs[p % docs.len()].payloads(p < pods.translated_pods).0;
        for (payload, _) in payloads {
            publisher.send(topic, &mut pods.seqs[p], payload).await?;
        }
    }
    Ok(())
}

/// Publishes rounds until `stop`, paced to `rate` blocks a second, counting what it sent.
pub(super) async fn publish_rounds(
    mut publisher: Publisher,
    mut pods: Pods,
    docs: Arc<Vec<Document>>,
    rate: u64,
    stop: Arc<AtomicBool>,
    counters: Arc<Counters>,
) -> Result<(), LoadgenError> {
    let rate = rate.max(1) as f64;
    let n = docs.len();
    let mut round = 1usize;
    let start = Instant::now();
    let mut sent = 0u64;
    while !stop.load(Ordering::Relaxed) {
        for (p, topic) in pods.topics.iter().enumerate() {
            let translated = p < pods.translated_pods;
            let doc = docs[(p + round) % n].payloads(translated).0;
            let old = docs[(p + round + n - 2) % n].payloads(translated).1;
            for (payload, blocks) in doc.iter().chain(old) {
                // Pace to the target rate; yield so the PUB's writer task runs.
                let due = Duration::from_secs_f64(sent as f64 / rate);
                if let Some(wait) = due.checked_sub(start.elapsed()) {
                    tokio::time::sleep(wait).await;
                } else {
                    tokio::task::yield_now().await;
                }
                if stop.load(Ordering::Relaxed) {
                    return Ok(());
                }
                publisher.send(topic, &mut pods.seqs[p], payload).await?;
                sent += blocks;
                counters.messages.fetch_add(1, Ordering::Relaxed);
                counters.blocks.fetch_add(*blocks, Ordering::Relaxed);
            }
        }
        round += 1;
    }
    Ok(())
}

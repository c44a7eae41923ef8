//! The ZMQ side: bind-mode and connect-mode SUB sockets side by side, and the dispatch of each
//! well-formed message to its pod's worker queue.
//!
//! - bind mode ([`bind_and_receive`]): one SUB socket binds `zmqEndpoint` and vLLM pods connect
//!   to it; the pod and model come from each message's topic; a pod's link (how its leaving is
//!   noticed) is the address its id names, followed on the socket's monitor;
//! - connect mode ([`connect_and_receive`]): one SUB socket per listed (or discovered) pod
//!   endpoint, dialling with backoff in the background so a pod that is down never blocks the
//!   daemon; the link is the socket itself.

use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use zeromq::{Socket, SocketRecv, SubSocket, ZmqMessage};

use super::dispatch::{Dispatch, Shared};
use super::jobs::{GapFillRoute, Job, Message, Via};
use super::lifecycle::{self, ConnectMonitor, Link, Links};
use super::topic;
use crate::config::{ConnectEndpoint, KvEventsConfig};

/// Why the bind-mode socket could not start.
#[derive(Debug, Error)]
pub enum SocketError {
    /// The bind-mode SUB socket could not bind.
    #[error("binding {endpoint}: {source}")]
    Bind {
        /// The endpoint.
        endpoint: String,
        /// Why.
        source: zeromq::ZmqError,
    },
    /// Subscribing failed.
    #[error("subscribing on {endpoint}: {source}")]
    Subscribe {
        /// The endpoint.
        endpoint: String,
        /// Why.
        source: zeromq::ZmqError,
    },
}

/// How a receiver names the messages it gets.
#[derive(Clone)]
pub(super) struct Source {
    /// Pod from configuration (connect mode); empty = from the topic.
    pub(super) pod: Arc<str>,
    /// Model from configuration (connect mode); empty = from the topic.
    pub(super) model: Arc<str>,
    /// Where the publisher's gap-fill socket is.
    pub(super) gap_fill: GapFillRoute,
    /// The socket's endpoint, for logs.
    pub(super) label: Arc<str>,
    /// Connect mode: the link of every pod this socket brings (this socket). `None` in bind
    /// mode: each pod's link is the address its id names.
    pub(super) link: Option<Link>,
}

/// Bind mode: binds `zmqEndpoint` and subscribes; returns the bound endpoint (its port
/// resolved) and the tasks that follow the socket (its monitor, for the pods' links, and its
/// receiver).
pub(super) async fn bind_and_receive(
    config: &KvEventsConfig,
    links: Arc<Links>,
    dispatch: Arc<Dispatch>,
    shutdown: &watch::Receiver<bool>,
) -> Result<(String, Vec<JoinHandle<()>>), SocketError> {
    let endpoint = topic::bindable(&config.zmq_endpoint);
    let mut socket = SubSocket::new();
    let monitor = tokio::spawn(lifecycle::follow_bind_monitor(
        socket.monitor(),
        links,
        shutdown.clone(),
    ));
    let bound = socket
        .bind(&endpoint)
        .await
        .map_err(|source| SocketError::Bind {
            endpoint: endpoint.clone(),
            source,
        })?;
    socket
        .subscribe(&config.topic_filter)
        .await
        .map_err(|source| SocketError::Subscribe {
            endpoint: endpoint.clone(),
            source,
        })?;
    tracing::info!(endpoint = %bound, filter = %config.topic_filter, "bind mode: SUB socket bound; vLLM pods connect here");
    let gap_fill = if config.replay_endpoint_template.is_empty() {
        GapFillRoute::None
    } else {
        GapFillRoute::Template(config.replay_endpoint_template.as_str().into())
    };
    let source = Source {
        pod: "".into(),
        model: "".into(),
        gap_fill,
        label: bound.to_string().into(),
        link: None,
    };
    let receiver = tokio::spawn(receive(socket, source, None, dispatch, shutdown.clone()));
    Ok((bound.to_string(), vec![monitor, receiver]))
}

/// Connect mode: dials the pod until it answers (with backoff), then receives. `link` is
/// what tells that the pod left: this socket's endpoint for a listed pod, the pod's address
/// for a discovered one (all its ranks' sockets).
pub(super) async fn connect_and_receive(
    ep: ConnectEndpoint,
    link: Link,
    filter: String,
    dispatch: Arc<Dispatch>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut backoff = Duration::from_millis(200);
    let (socket, events) = loop {
        let mut options = zeromq::SocketOptions::default();
        options.connect_timeout(Duration::from_secs(5));
        let mut socket = SubSocket::with_options(options);
        let events = socket.monitor();
        let attempt = async {
            socket.connect(&ep.endpoint).await?;
            socket.subscribe(&filter).await?;
            Ok::<_, zeromq::ZmqError>(())
        };
        tokio::select! {
            _ = shutdown.changed() => return,
            result = attempt => match result {
                Ok(()) => break (socket, events),
                Err(e) => {
                    tracing::warn!(endpoint = %ep.endpoint, error = %e, retry_in = ?backoff, "connect mode: cannot reach the pod's publisher yet");
                    tokio::select! {
                        _ = shutdown.changed() => return,
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(10));
                }
            }
        }
    };
    tracing::info!(endpoint = %ep.endpoint, pod = %ep.pod, "connect mode: subscribed");
    let gap_fill = if ep.replay_endpoint.is_empty() {
        GapFillRoute::None
    } else {
        GapFillRoute::Fixed(ep.replay_endpoint.as_str().into())
    };
    let monitor = ConnectMonitor::connected(events, link.clone(), dispatch.shared.links.clone());
    let source = Source {
        pod: ep.pod.as_str().into(),
        model: ep.model.as_str().into(),
        gap_fill,
        label: ep.endpoint.as_str().into(),
        link: Some(link),
    };
    receive(socket, source, Some(monitor), dispatch, shutdown).await;
}

/// Receives until shutdown, routing every well-formed message to its pod's worker; in connect
/// mode, follows the socket's monitor too (the pod's link).
pub(super) async fn receive(
    mut socket: SubSocket,
    source: Source,
    mut monitor: Option<ConnectMonitor>,
    dispatch: Arc<Dispatch>,
    mut shutdown: watch::Receiver<bool>,
) {
    use futures::StreamExt;
    loop {
        tokio::select! {
            _ = shutdown.changed() => break,
            Some(event) = async {
                match monitor.as_mut() {
                    Some(m) => m.events.next().await,
                    None => std::future::pending().await,
                }
            } => {
                if let Some(m) = monitor.as_mut() {
                    m.on(event);
                }
            }
            message = socket.recv() => match message {
                Ok(message) => dispatch_message(message, &source, &dispatch),
                Err(e) => {
                    frame_error(&dispatch.shared, "recv_error", &format!("receive on {}: {e}", source.label));
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
    tracing::info!(source = %source.label, "receiver stopped");
}

fn frame_error(shared: &Shared, reason: &'static str, detail: &str) {
    shared.metrics.ingest.frame_error(reason);
    if let Some(suppressed) = shared.frame_warn.allow() {
        tracing::warn!(reason, suppressed, "dropped a ZMQ message: {detail}");
    }
}

/// Checks a message's frames, names its publisher and queues it on its pod's worker.
fn dispatch_message(message: ZmqMessage, source: &Source, dispatch: &Dispatch) {
    let shared = &dispatch.shared;
    let frames = message.into_vec();
    let [topic, seq, payload] = frames.as_slice() else {
        frame_error(
            shared,
            "bad_frame_count",
            &format!("{} frames (expected [topic, seq, payload])", frames.len()),
        );
        return;
    };
    let Ok(seq) = <[u8; 8]>::try_from(&seq[..]) else {
        frame_error(
            shared,
            "short_seq",
            &format!("a {}-byte sequence frame (expected 8)", seq.len()),
        );
        return;
    };
    let seq = u64::from_be_bytes(seq);
    let (pod, model): (Arc<str>, Arc<str>) = if !source.pod.is_empty() && !source.model.is_empty() {
        (source.pod.clone(), source.model.clone())
    } else {
        match topic::parse_topic(topic, &shared.filter) {
            Ok((pod, model)) => (
                if source.pod.is_empty() {
                    pod.into()
                } else {
                    source.pod.clone()
                },
                if source.model.is_empty() {
                    model.into()
                } else {
                    source.model.clone()
                },
            ),
            Err(e) => {
                frame_error(shared, e.reason(), &e.to_string());
                return;
            }
        }
    };
    if !shared.allowed_models.is_empty() && !shared.allowed_models.iter().any(|m| **m == *model) {
        frame_error(
            shared,
            "model_not_allowed",
            "the topic's model is not in allowedModels",
        );
        return;
    }
    if !shared.allowed_pods.is_empty()
        && !shared
            .allowed_pods
            .iter()
            .any(|p| topic::glob_match(p, &pod))
    {
        frame_error(
            shared,
            "pod_not_allowed",
            "the topic's pod matches no allowedPods pattern",
        );
        return;
    }
    shared.metrics.ingest.received(&pod);
    let link = match &source.link {
        Some(link) => Some(link.clone()),
        None => Link::of_pod_id(&pod),
    };
    let job = Job::Message(Message {
        pod: pod.clone(),
        model,
        seq,
        payload: payload.clone(),
        via: Via::Socket(source.gap_fill.clone(), link),
    });
    // Never waits on a worker: the inbox is bounded by bytes, and only a pod past its share
    // loses queued messages (its publisher is then resynchronised).
    dispatch.push(&pod, job);
}

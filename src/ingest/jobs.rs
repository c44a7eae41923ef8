//! What a worker is asked to do: a [`Job`] (a [`Message`] to sequence and apply, a pod to
//! clear or forget, a pause for a snapshot, a run of dropped messages to resynchronise), how a
//! message reached this replica ([`Via`]) and where its publisher's gap fill is
//! ([`GapFillRoute`]). Receivers, the feeder, the admin API and the sweeper make jobs; the
//! inboxes queue them; the workers carry them out.

use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot, watch};

use super::{lifecycle, topic};

/// Where a publisher's gap-fill (vLLM "replay") socket is.
#[derive(Debug, Clone)]
pub(super) enum GapFillRoute {
    /// Bind mode: from the template and the pod's address (+ DP rank).
    Template(Arc<str>),
    /// Connect mode: configured for this endpoint.
    Fixed(Arc<str>),
    /// No gap fill.
    None,
}

impl GapFillRoute {
    /// The replay socket of `pod`'s rank `rank`, if it has one.
    pub(super) fn endpoint(&self, pod: &str, rank: u32) -> Option<String> {
        match self {
            GapFillRoute::Template(t) => topic::gap_fill_endpoint(t, pod, rank),
            GapFillRoute::Fixed(e) => Some(e.to_string()),
            GapFillRoute::None => None,
        }
    }
}

/// How a message reached this replica.
#[derive(Debug, Clone)]
pub(super) enum Via {
    /// Its own socket; a gap may be filled through the route; the link (when known) tells
    /// when the pod left.
    Socket(GapFillRoute, Option<lifecycle::Link>),
    /// The shared log, appended by the named replica.
    Log(Arc<str>),
}

/// Who asked to clear a pod.
pub(super) enum ClearOrigin {
    /// Another replica, through the shared log (not appended again).
    Log,
    /// An admin request on this replica: appended to the shared log, answered with the
    /// memberships removed.
    Admin(oneshot::Sender<usize>),
}

/// One message for a worker.
pub(super) struct Message {
    pub(super) pod: Arc<str>,
    pub(super) model: Arc<str>,
    pub(super) seq: u64,
    pub(super) payload: Bytes,
    pub(super) via: Via,
}

/// What a worker is asked to do.
pub(super) enum Job {
    /// Sequence and apply a message.
    Message(Message),
    /// Forget a pod of a model: its blocks, engines, publishers and parked gap fills (an
    /// admin clear, or another replica's forgetting replayed from the log).
    ClearPod {
        /// The model.
        model: Arc<str>,
        /// The pod.
        pod: Arc<str>,
        /// Who asked.
        origin: ClearOrigin,
    },
    /// Forget a pod (every model) if it is still gone or idle (the sweeper's proposal).
    Forget {
        /// The pod.
        pod: Arc<str>,
        /// Why it was proposed.
        reason: lifecycle::ForgetReason,
    },
    /// Stop until the gate opens (a consistent snapshot of index and publishers).
    Pause(PauseGate),
    /// Socket messages of the pod dropped from its lane (it passed its share of the queue):
    /// resynchronise its publisher.
    Dropped(Dropped),
}

/// A worker's side of a pause: it says it arrived, then waits for the resume signal (or for
/// the pauser to go away).
pub(super) struct PauseGate {
    pub(super) arrived: mpsc::Sender<()>,
    pub(super) resume: watch::Receiver<bool>,
}

impl PauseGate {
    /// Says the worker arrived, then waits until the pauser resumes (or goes away).
    pub(super) async fn hold(mut self) {
        let _ = self.arrived.send(()).await;
        let _ = self.resume.wait_for(|go| *go).await;
    }
}

/// Socket messages of one pod and model dropped in a row: what the worker must resynchronise.
pub(super) struct Dropped {
    pub(super) pod: Arc<str>,
    pub(super) model: Arc<str>,
    /// The lowest and highest sequence numbers dropped.
    pub(super) seqs: (u64, u64),
    /// Messages dropped.
    pub(super) messages: u64,
    /// Where the publisher's gap fill is (from the newest dropped message).
    pub(super) route: GapFillRoute,
}

impl Dropped {
    pub(super) fn of(m: Message) -> Self {
        let route = match m.via {
            Via::Socket(route, _) => route,
            Via::Log(_) => GapFillRoute::None,
        };
        Self {
            pod: m.pod,
            model: m.model,
            seqs: (m.seq, m.seq),
            messages: 1,
            route,
        }
    }

    /// Takes in an older run of the same model.
    pub(super) fn absorb(&mut self, older: Dropped) {
        self.seqs = (self.seqs.0.min(older.seqs.0), self.seqs.1.max(older.seqs.1));
        self.messages += older.messages;
    }
}

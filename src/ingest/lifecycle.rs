//! Pods come and go: noticing that a publisher left, and forgetting it after a grace period.
//!
//! What tells this replica a pod is there is its **link**:
//! - bind mode: the pod's connections to the SUB socket. The socket's monitor reports each
//!   connection accepted and closed with the peer's address; a pod whose id is `ip:port` (what
//!   the events' topic and the gateway both use) is linked to the connections from `ip`. The
//!   pod is *gone* once the last connection from its address closed;
//! - connect mode: this replica's socket to the pod's endpoint, *gone* while that socket is
//!   disconnected (the pod failed);
//! - discovery: this replica's sockets to the pod's address (one per data-parallel rank),
//!   *gone* once none is connected: the pod failed, or it left the DNS answer and its sockets
//!   were dropped.
//!
//! A pod gone for `publisherGracePeriod` is forgotten: its blocks and engines leave the index,
//! its publishers' states are dropped (with replication, the forgetting is appended to the
//! shared log as a pod clear, so every replica forgets it too), with a metric and one log line
//! (under the [`WarnBudget`](crate::warn_budget::WarnBudget)). A reconnect within the grace period
//! keeps everything. With `publisherIdleTimeout`, a pod silent that long is forgotten too,
//! whatever its link says: the fallback for pods whose id names no address (a NAT or a mesh
//! in between, or names instead of addresses) and for pods seen only through the log.
//!
//! Invariants: the sweeper only proposes; the pod's own worker decides (again, in order with
//! the pod's messages), so a pod that reconnected or spoke in between is kept.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use parking_lot::Mutex;
use tokio::sync::watch;
use zeromq::{Endpoint, SocketEvent};

/// What tells this replica that a pod left.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Link {
    /// The pod at this address: bind-mode connections from it, and discovered sockets to it
    /// (every rank's).
    Address(IpAddr),
    /// Connect mode, a listed endpoint: this replica's socket to it.
    Endpoint(Arc<str>),
}

impl Link {
    /// The link of a pod whose messages came through the bind-mode socket: the address in
    /// its id (`ip:port`, `ip`, `[v6]:port`), when it names one.
    pub fn of_pod_id(pod: &str) -> Option<Link> {
        if let Ok(ip) = pod.parse::<IpAddr>() {
            return Some(Link::Address(ip));
        }
        if let Ok(addr) = pod.parse::<std::net::SocketAddr>() {
            return Some(Link::Address(addr.ip()));
        }
        None
    }
}

/// Whether a pod is there, as ListPods reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Presence {
    /// Its link is up and it spoke within the grace period (or it has no link and is not
    /// silent).
    Live,
    /// Its link is up (or it has none) but it has been silent since this instant.
    Idle(Instant),
    /// Its link went down at this instant.
    Gone(Instant),
}

#[derive(Debug, Default)]
struct LinkState {
    /// Connections (bind mode) or sockets (connect mode) up now.
    open: u32,
    /// When `open` last dropped to 0.
    closed_at: Option<Instant>,
}

/// The links this replica has seen and whether they are up.
#[derive(Debug, Default)]
pub struct Links {
    links: Mutex<HashMap<Link, LinkState>>,
}

impl Links {
    /// A connection or socket of `link` came up.
    pub fn opened(&self, link: Link) {
        let mut links = self.links.lock();
        let state = links.entry(link).or_default();
        state.open += 1;
        state.closed_at = None;
    }

    /// A connection or socket of `link` went down.
    pub fn closed(&self, link: &Link) {
        let mut links = self.links.lock();
        if let Some(state) = links.get_mut(link) {
            state.open = state.open.saturating_sub(1);
            if state.open == 0 {
                state.closed_at = Some(Instant::now());
            }
        }
    }

    /// Since when `link` is down; `None` while it is up, or when this replica never saw it
    /// (a pod behind a NAT: its connections come from another address).
    pub fn down_since(&self, link: &Link) -> Option<Instant> {
        self.links.lock().get(link).and_then(|s| s.closed_at)
    }

    /// Drops links down for longer than `age` with no pod left on them (memory follows the
    /// links of pods known now).
    pub(super) fn prune(&self, age: Duration, now: Instant) {
        self.links
            .lock()
            .retain(|_, s| s.open > 0 || s.closed_at.is_none_or(|t| now.duration_since(t) < age));
    }
}

/// The lifecycle settings.
#[derive(Debug, Clone, Copy)]
pub struct LifecycleSettings {
    /// How long a pod may be gone before it is forgotten.
    pub grace_period: Duration,
    /// How long a pod may be silent before it is forgotten (`None`: never for silence alone).
    pub idle_timeout: Option<Duration>,
}

impl LifecycleSettings {
    /// The presence of a pod with `link` that last spoke at `last_message`.
    pub fn presence(&self, links: &Links, link: Option<&Link>, last_message: Instant) -> Presence {
        if let Some(since) = link.and_then(|l| links.down_since(l)) {
            return Presence::Gone(since);
        }
        if last_message.elapsed() >= self.grace_period {
            return Presence::Idle(last_message);
        }
        Presence::Live
    }

    /// Why a pod with this presence is to be forgotten now, if it is.
    pub fn verdict(&self, presence: Presence, last_message: Instant) -> Option<ForgetReason> {
        match presence {
            Presence::Gone(since) if since.elapsed() >= self.grace_period => {
                Some(ForgetReason::Gone)
            }
            _ if self
                .idle_timeout
                .is_some_and(|t| last_message.elapsed() >= t) =>
            {
                Some(ForgetReason::Idle)
            }
            _ => None,
        }
    }

    /// How often the sweeper looks: a quarter of the shortest limit, between 50 ms and 5 s.
    pub(super) fn sweep_interval(&self) -> Duration {
        let shortest = self
            .idle_timeout
            .map_or(self.grace_period, |t| t.min(self.grace_period));
        (shortest / 4).clamp(Duration::from_millis(50), Duration::from_secs(5))
    }
}

/// Why a pod was forgotten (the metric's `reason` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForgetReason {
    /// Its link stayed down for the grace period.
    Gone,
    /// It stayed silent for the idle timeout.
    Idle,
}

impl ForgetReason {
    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            ForgetReason::Gone => "gone",
            ForgetReason::Idle => "idle",
        }
    }
}

/// The address of a TCP endpoint the monitor reports.
fn address_of(endpoint: &Endpoint) -> Option<IpAddr> {
    match endpoint {
        Endpoint::Tcp(host, _) => host.to_string().trim_matches(['[', ']']).parse().ok(),
        _ => None,
    }
}

/// Bind mode: follows the SUB socket's monitor, counting connections per peer address.
pub(super) async fn follow_bind_monitor(
    mut events: futures::channel::mpsc::Receiver<SocketEvent>,
    links: Arc<Links>,
    mut shutdown: watch::Receiver<bool>,
) {
    use futures::StreamExt;
    let mut peers = HashMap::new();
    loop {
        let event = tokio::select! {
            _ = shutdown.changed() => return,
            event = events.next() => match event {
                Some(event) => event,
                None => return,
            },
        };
        match event {
            SocketEvent::Accepted(endpoint, peer) => {
                if let Some(ip) = address_of(&endpoint) {
                    links.opened(Link::Address(ip));
                    peers.insert(peer, ip);
                }
            }
            SocketEvent::Disconnected(peer) => {
                if let Some(ip) = peers.remove(&peer) {
                    links.closed(&Link::Address(ip));
                }
            }
            _ => {}
        }
    }
}

/// Connect mode: one endpoint's socket monitor, followed by its receiver.
pub(super) struct ConnectMonitor {
    pub(super) events: futures::channel::mpsc::Receiver<SocketEvent>,
    pub(super) link: Link,
    pub(super) links: Arc<Links>,
    /// Whether the socket is connected now.
    pub(super) up: bool,
}

impl ConnectMonitor {
    /// Starts following a socket that just connected.
    pub(super) fn connected(
        events: futures::channel::mpsc::Receiver<SocketEvent>,
        link: Link,
        links: Arc<Links>,
    ) -> Self {
        links.opened(link.clone());
        Self {
            events,
            link,
            links,
            up: true,
        }
    }

    /// Applies one monitor event.
    pub(super) fn on(&mut self, event: SocketEvent) {
        match event {
            SocketEvent::Connected(..) if !self.up => {
                self.up = true;
                self.links.opened(self.link.clone());
            }
            SocketEvent::Disconnected(_) if self.up => {
                self.up = false;
                self.links.closed(&self.link);
            }
            _ => {}
        }
    }
}

impl Drop for ConnectMonitor {
    /// The socket is gone (shutdown, or the pod left discovery): its link is down.
    fn drop(&mut self) {
        if self.up {
            self.links.closed(&self.link);
        }
    }
}

/// Wall-clock milliseconds of an `Instant` in the past (for ListPods).
pub fn unix_ms(at: Instant) -> u64 {
    let ago = at.elapsed();
    SystemTime::now()
        .checked_sub(ago)
        .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_ids_name_their_address() {
        let v4: IpAddr = "10.0.0.7".parse().expect("ip");
        let v6: IpAddr = "fd00::7".parse().expect("ip");
        assert_eq!(Link::of_pod_id("10.0.0.7:8000"), Some(Link::Address(v4)));
        assert_eq!(Link::of_pod_id("10.0.0.7"), Some(Link::Address(v4)));
        assert_eq!(Link::of_pod_id("[fd00::7]:8000"), Some(Link::Address(v6)));
        assert_eq!(Link::of_pod_id("fd00::7"), Some(Link::Address(v6)));
        assert_eq!(Link::of_pod_id("vllm-0.vllm:8000"), None);
    }

    #[test]
    fn a_link_is_down_only_when_its_last_connection_closed() {
        let links = Links::default();
        let link = Link::Address("10.0.0.7".parse().expect("ip"));
        assert_eq!(links.down_since(&link), None, "never seen: not down");
        links.opened(link.clone());
        links.opened(link.clone());
        links.closed(&link);
        assert_eq!(links.down_since(&link), None, "one connection still up");
        links.closed(&link);
        assert!(links.down_since(&link).is_some());
        links.opened(link.clone());
        assert_eq!(links.down_since(&link), None, "reconnected");
    }

    #[test]
    fn verdicts_follow_the_grace_period_and_the_idle_timeout() {
        let settings = LifecycleSettings {
            grace_period: Duration::from_millis(600),
            idle_timeout: Some(Duration::from_millis(6_000)),
        };
        let now = Instant::now();
        let ago = |tenths: u64| {
            now.checked_sub(Duration::from_millis(tenths * 10))
                .expect("the clock started more than a minute ago")
        };
        assert_eq!(settings.verdict(Presence::Gone(ago(59)), ago(59)), None);
        assert_eq!(
            settings.verdict(Presence::Gone(ago(61)), ago(61)),
            Some(ForgetReason::Gone)
        );
        assert_eq!(settings.verdict(Presence::Idle(ago(599)), ago(599)), None);
        assert_eq!(
            settings.verdict(Presence::Idle(ago(601)), ago(601)),
            Some(ForgetReason::Idle)
        );
        let links = Links::default();
        assert_eq!(settings.presence(&links, None, ago(1)), Presence::Live);
        assert_eq!(
            settings.presence(&links, None, ago(61)),
            Presence::Idle(ago(61))
        );
    }
}

//! Connect mode by DNS: the vLLM pods behind a headless Service name, dialled as they come and
//! dropped as they go.
//!
//! Every `refreshInterval` each configured name is resolved (A and AAAA, asked separately, with
//! the system's resolver configuration or the configured servers; nothing is cached between
//! rounds). Each address is dialled as one publisher per data-parallel rank:
//! `tcp://{ip}:{publisherPort + r}`, with gap fill from `tcp://{ip}:{replayPort + r}` (vLLM adds
//! the rank to both ports). The pod's link ([`Link::Address`]) is up while any of its ranks'
//! sockets is connected.
//!
//! Invariants:
//! - only an answer changes what is dialled: addresses, or a definite "no such name" or "no
//!   records" for both families. A failure (timeout, SERVFAIL, refused, one family failing)
//!   keeps every address dialled as it was, so a DNS outage never looks like the fleet leaving;
//! - an address that leaves the answer has its sockets dropped: its link goes down, and the
//!   lifecycle ([`super::lifecycle`]) forgets the pod after `publisherGracePeriod` unless the
//!   address comes back first (a pod briefly unready keeps its blocks);
//! - at most `maxAddresses` addresses of one answer are dialled (the lowest, so replicas agree),
//!   each with `dataParallelSize` sockets: an answer cannot open unbounded sockets.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use hickory_resolver::config::{NameServerConfig, ResolverConfig};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::net::NetError;
use hickory_resolver::proto::rr::RData;
use hickory_resolver::TokioResolver;
use thiserror::Error;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::dispatch::Dispatch;
use super::lifecycle::Link;
use super::sockets;
use crate::config::{ConnectEndpoint, DiscoveredService, DiscoveryConfig};
use crate::warn_budget::WarnThrottle;

/// Why a name could not be resolved (the addresses dialled stay as they were), or why the
/// resolver could not be set up.
#[derive(Debug, Error)]
pub enum DiscoveryError {
    /// The system's resolver configuration (`/etc/resolv.conf`) could not be read.
    #[error("reading the system's DNS configuration: {0}")]
    SystemConfig(Box<NetError>),
    /// A lookup failed (not a definite "no records").
    #[error("resolving {name} ({record}): {source}")]
    Lookup {
        /// The name.
        name: String,
        /// `A` or `AAAA`.
        record: &'static str,
        /// Why.
        source: Box<NetError>,
    },
}

/// Resolves discovered services' names to the set of their addresses.
pub struct Resolver {
    inner: TokioResolver,
}

impl Resolver {
    /// The system's resolver (`/etc/resolv.conf`: servers, search domains, `ndots`), or the
    /// configured servers (names asked as written).
    pub fn new(config: &DiscoveryConfig) -> Result<Self, DiscoveryError> {
        let provider = TokioRuntimeProvider::default();
        let builder = if config.nameservers.is_empty() {
            TokioResolver::builder(provider)
                .map_err(|e| DiscoveryError::SystemConfig(Box::new(e)))?
        } else {
            let servers = config
                .nameservers
                .iter()
                .filter_map(|s| crate::config::nameserver_address(s))
                .map(|addr| {
                    let mut server = NameServerConfig::udp_and_tcp(addr.ip());
                    for connection in &mut server.connections {
                        connection.port = addr.port();
                    }
                    server
                })
                .collect();
            TokioResolver::builder_with_config(ResolverConfig::from_name_servers(servers), provider)
        };
        let inner = builder
            .build()
            .map_err(|e| DiscoveryError::SystemConfig(Box::new(e)))?;
        Ok(Self { inner })
    }

    /// Every address the name has now (A and AAAA). `Ok` with an empty set when the name
    /// definitely has none; `Err` when either family's lookup failed otherwise.
    pub async fn addresses(&self, name: &str) -> Result<BTreeSet<IpAddr>, DiscoveryError> {
        // Each round asks again: a cached answer would hide pods that came or went.
        self.inner.clear_cache();
        let (v4, v6) = tokio::join!(self.inner.ipv4_lookup(name), self.inner.ipv6_lookup(name));
        let mut out = BTreeSet::new();
        for (record, lookup) in [("A", v4), ("AAAA", v6)] {
            match lookup {
                Ok(lookup) => out.extend(lookup.answers().iter().filter_map(|r| match &r.data {
                    RData::A(a) => Some(IpAddr::V4(a.0)),
                    RData::AAAA(a) => Some(IpAddr::V6(a.0)),
                    _ => None,
                })),
                Err(e) if e.is_no_records_found() => {}
                Err(source) => {
                    return Err(DiscoveryError::Lookup {
                        name: name.to_owned(),
                        record,
                        source: Box::new(source),
                    })
                }
            }
        }
        Ok(out)
    }
}

/// What DNS discovery answered: per service name that has answered, its pods now (named as
/// the service's `pod` template names them). The endpoint picker's pool without Kubernetes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Discovered {
    /// The services configured.
    pub services: usize,
    /// Each service that has answered at least once: its pods now.
    pub answered: BTreeMap<String, BTreeSet<String>>,
}

/// `ip` as a URL host (`[v6]`).
fn host_of(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => format!("[{v6}]"),
    }
}

/// The pod at `ip`, as the service's `pod` template names it.
pub fn pod_of(service: &DiscoveredService, ip: IpAddr) -> String {
    service.pod.replace("{ip}", &host_of(ip))
}

/// The publishers of the pod at `ip`: one endpoint per data-parallel rank.
pub fn endpoints_of(service: &DiscoveredService, ip: IpAddr) -> Vec<ConnectEndpoint> {
    let host = host_of(ip);
    (0..service.data_parallel_size)
        .map(|rank| ConnectEndpoint {
            endpoint: format!("tcp://{host}:{}", service.publisher_port + rank),
            pod: pod_of(service, ip),
            model: service.model.clone(),
            replay_endpoint: if service.replay_port == 0 {
                String::new()
            } else {
                format!("tcp://{host}:{}", service.replay_port + rank)
            },
        })
        .collect()
}

/// The sockets of one dialled address (one receiver task per rank).
struct Dialled {
    receivers: Vec<JoinHandle<()>>,
}

impl Dialled {
    /// Drops the sockets: the receivers stop where they are (they hold nothing half-done
    /// between awaits), their sockets and monitors are dropped and the link goes down.
    async fn drop_sockets(self) {
        for receiver in &self.receivers {
            receiver.abort();
        }
        for receiver in self.receivers {
            let _ = receiver.await;
        }
    }
}

/// Follows one service name until shutdown: resolves it every `interval`, dials the addresses
/// that joined and drops those that left, and tells `discovered` the pods it dials.
pub(super) async fn follow(
    service: DiscoveredService,
    resolver: Arc<Resolver>,
    (interval, filter): (Duration, String),
    dispatch: Arc<Dispatch>,
    discovered: Arc<watch::Sender<Discovered>>,
    mut shutdown: watch::Receiver<bool>,
) {
    let metrics = &dispatch.shared.metrics.discovery;
    let failures = WarnThrottle::default();
    let mut dialled: HashMap<IpAddr, Dialled> = HashMap::new();
    let name = service.name.as_str();
    loop {
        match resolver.addresses(name).await {
            Ok(mut addresses) => {
                metrics.resolved(
                    name,
                    if addresses.is_empty() {
                        "no_records"
                    } else {
                        "ok"
                    },
                );
                if let Some(&first_ignored) = addresses.iter().nth(service.max_addresses) {
                    let ignored = addresses.split_off(&first_ignored);
                    metrics.ignored(name, ignored.len());
                    tracing::warn!(service = name, ignored = ignored.len(), max_addresses = service.max_addresses, "discovery: the answer has more addresses than maxAddresses; the rest are not dialled");
                }
                let removed: Vec<IpAddr> = dialled
                    .keys()
                    .filter(|ip| !addresses.contains(ip))
                    .copied()
                    .collect();
                for ip in &removed {
                    if let Some(d) = dialled.remove(ip) {
                        d.drop_sockets().await;
                    }
                }
                let added: Vec<IpAddr> = addresses
                    .iter()
                    .filter(|ip| !dialled.contains_key(ip))
                    .copied()
                    .collect();
                for &ip in &added {
                    let receivers = endpoints_of(&service, ip)
                        .into_iter()
                        .map(|endpoint| {
                            tokio::spawn(sockets::connect_and_receive(
                                endpoint,
                                Link::Address(ip),
                                filter.clone(),
                                dispatch.clone(),
                                shutdown.clone(),
                            ))
                        })
                        .collect();
                    dialled.insert(ip, Dialled { receivers });
                }
                metrics.dialled(name, dialled.len(), added.len(), removed.len());
                let pods = dialled.keys().map(|ip| pod_of(&service, *ip)).collect();
                discovered.send_modify(|d| {
                    d.answered.insert(name.to_owned(), pods);
                });
                if !added.is_empty() || !removed.is_empty() {
                    tracing::info!(
                        service = name,
                        added = %sample(&added),
                        removed = %sample(&removed),
                        addresses = dialled.len(),
                        "discovery: the service's addresses changed"
                    );
                }
            }
            Err(e) => {
                metrics.resolved(name, "error");
                if let Some(suppressed) = failures.allow() {
                    tracing::warn!(service = name, error = %e, addresses = dialled.len(), suppressed, "discovery: resolution failed; the addresses dialled stay as they were");
                }
            }
        }
        tokio::select! {
            _ = shutdown.changed() => break,
            _ = tokio::time::sleep(interval) => {}
        }
    }
    // The receivers see the shutdown themselves; waiting for them keeps the workers' queues
    // open until every receiver has stopped.
    for (_, d) in dialled {
        for receiver in d.receivers {
            let _ = receiver.await;
        }
    }
}

/// Up to 8 addresses for a log line, then how many more.
fn sample(addresses: &[IpAddr]) -> String {
    let mut out: Vec<String> = addresses.iter().take(8).map(IpAddr::to_string).collect();
    if addresses.len() > 8 {
        out.push(format!("and {} more", addresses.len() - 8));
    }
    format!("[{}]", out.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_is_a_publisher_on_port_plus_rank() {
        let service = DiscoveredService {
            name: "vllm".into(),
            publisher_port: 5557,
            replay_port: 6557,
            data_parallel_size: 3,
            pod: "{ip}:8000".into(),
            model: "m".into(),
            max_addresses: 8,
        };
        let v4 = endpoints_of(&service, "10.0.0.7".parse().expect("ip"));
        let names: Vec<(&str, &str, &str)> = v4
            .iter()
            .map(|e| {
                (
                    e.endpoint.as_str(),
                    e.replay_endpoint.as_str(),
                    e.pod.as_str(),
                )
            })
            .collect();
        assert_eq!(
            names,
            [
                (
                    "tcp://10.0.0.7:5557",
                    "tcp://10.0.0.7:6557",
                    "10.0.0.7:8000"
                ),
                (
                    "tcp://10.0.0.7:5558",
                    "tcp://10.0.0.7:6558",
                    "10.0.0.7:8000"
                ),
                (
                    "tcp://10.0.0.7:5559",
                    "tcp://10.0.0.7:6559",
                    "10.0.0.7:8000"
                ),
            ]
        );
        let v6 = endpoints_of(
            &DiscoveredService {
                replay_port: 0,
                data_parallel_size: 1,
                ..service
            },
            "fd00::7".parse().expect("ip"),
        );
        assert_eq!(v6[0].endpoint, "tcp://[fd00::7]:5557");
        assert_eq!(v6[0].pod, "[fd00::7]:8000");
        assert_eq!(v6[0].replay_endpoint, "", "replayPort 0: no gap fill");
    }
}

//! Prefill/decode disaggregation in a pick: once the decode pod is chosen, whether the
//! prompt's prefill runs on a pod of its own (kv-core's [`decide`](kv_core::decide) on the
//! prompt's tokens the decode pod will not reuse, from the exact predicted hit), and which
//! prefill pod (kv-core's pick among the candidates that prefill, on their own prefix score
//! and load). The gateway names it to the decode pod's routing sidecar in
//! [`PREFILLER_HEADER`], as llm-d's `disagg-profile-handler` does.
//!
//! Invariants: every pick is counted once by decision and reason; with `threshold: 0` nothing
//! is split; a pick is never split onto its own decode pod; the header's value is one
//! `ip:port` (IPv6 bracketed), no scheme, as Go's `net.JoinHostPort` writes it.

use std::net::SocketAddr;

use super::choose::{Chooser, Prefix};
use crate::pool::PoolEndpoint;

/// The header naming the prefill pod to the decode pod's sidecar (llm-d's
/// `PrefillEndpointHeader`).
pub const PREFILLER_HEADER: &str = "x-prefiller-host-port";

/// Why a pick was not split beyond kv-core's [`SplitReason`](kv_core::SplitReason)s: no
/// prefix was scored (nothing is known of the decode pod's hit).
const UNSCORED: &str = "unscored";
/// The split was due, but no candidate prefills.
const NO_PREFILL_CANDIDATE: &str = "no_prefill_candidate";
/// The split was due, but the best prefill pod is the decode pod itself.
const PREFILL_IS_DECODE: &str = "prefill_is_decode";

/// The prefill pod of a split pick.
pub(super) struct Prefill {
    /// The endpoint.
    pub(super) endpoint: PoolEndpoint,
    /// Its data-parallel rank, as scored.
    pub(super) rank: Option<u32>,
    /// Its `x-prefiller-host-port` value.
    pub(super) header: String,
}

/// `address` as the header carries it: `ip:port`, an IPv6 address bracketed (the address as
/// given when it is not a socket address).
pub fn host_port(address: &str) -> String {
    address
        .parse::<SocketAddr>()
        .map_or_else(|_| address.to_owned(), |a| a.to_string())
}

impl Chooser {
    /// The prefill pod (and its rank) when the prefill of a prompt whose decode pod is `decode`
    /// (predicted to reuse `cached` tokens there) is split off; counted either way.
    pub(super) fn split(
        &self,
        candidates: &[PoolEndpoint],
        prefix: &Prefix,
        decode: &PoolEndpoint,
        cached: Option<u32>,
    ) -> Option<Prefill> {
        let metrics = &self.metrics.picker;
        let decision = match (self.pd.threshold, cached) {
            (0, _) => kv_core::decide(self.pd, prefix.prompt_tokens, 0),
            (_, Some(cached)) if prefix.scored => {
                let d = kv_core::decide(self.pd, prefix.prompt_tokens, cached);
                metrics.pd_uncached(d.uncached_tokens);
                d
            }
            _ => {
                metrics.pd_decision(false, UNSCORED);
                return None;
            }
        };
        if !decision.split {
            metrics.pd_decision(false, decision.reason.label());
            return None;
        }
        let prefillers: Vec<PoolEndpoint> = candidates
            .iter()
            .filter(|c| c.role.prefills())
            .cloned()
            .collect();
        let best = match self.rank(&prefillers, prefix) {
            Ok((order, scored)) if !order.is_empty() => {
                let i = order[0];
                (prefillers[i].clone(), scored[i].1)
            }
            _ => {
                metrics.pd_decision(false, NO_PREFILL_CANDIDATE);
                return None;
            }
        };
        if best.0.pod == decode.pod {
            metrics.pd_decision(false, PREFILL_IS_DECODE);
            return None;
        }
        metrics.pd_decision(true, decision.reason.label());
        Some(Prefill {
            header: host_port(&best.0.address),
            endpoint: best.0,
            rank: best.1,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_is_one_ip_port_with_ipv6_bracketed() {
        assert_eq!(host_port("10.0.0.7:8000"), "10.0.0.7:8000");
        assert_eq!(host_port("[fd00::7]:8000"), "[fd00::7]:8000");
        // A static entry written otherwise is answered in the form the pool lists pods in.
        assert_eq!(host_port("[FD00:0::7]:8000"), "[fd00::7]:8000");
    }
}

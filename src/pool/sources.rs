//! The pool outside Kubernetes: a static list (`endpointPicker.endpoints`), or the addresses
//! connect mode's DNS discovery dials (`kvEventsConfig.discovery.services`, each address named
//! by the service's `pod` template).
//!
//! Invariant: DNS discovery changes the pool only with an answer (a failed resolution keeps the
//! addresses, as discovery keeps them dialled); the pool is synced once every configured
//! service has answered once.

use std::sync::Arc;

use tokio::sync::watch;

use super::{Member, Pool, PoolEndpoint};
use crate::config::StaticEndpoint;
use crate::ingest::Discovered;

/// The static list's members, each Ready, each with its role (validated with the config: a
/// label no llm-d filter knows is refused there, so it is neither here).
pub(super) fn static_members(endpoints: &[StaticEndpoint]) -> Vec<Member> {
    endpoints
        .iter()
        .map(|e| {
            let (role, unknown_role) = super::role_of(e.role());
            Member {
                endpoint: PoolEndpoint {
                    role,
                    ..PoolEndpoint::plain(e.address().to_owned())
                },
                ready: true,
                unknown_role,
            }
        })
        .collect()
}

/// The members DNS discovery answered; `None` until every service has answered.
fn discovered_members(d: &Discovered) -> Option<Vec<Member>> {
    if d.answered.len() < d.services {
        return None;
    }
    let mut pods: Vec<&String> = d.answered.values().flatten().collect();
    pods.sort_unstable();
    pods.dedup();
    Some(
        pods.into_iter()
            .map(|p| Member {
                endpoint: PoolEndpoint::plain(p.clone()),
                ready: true,
                unknown_role: None,
            })
            .collect(),
    )
}

/// Keeps `pool` as DNS discovery answers, until shutdown.
pub async fn follow_discovery(
    mut discovered: watch::Receiver<Discovered>,
    pool: Arc<Pool>,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        let members = discovered_members(&discovered.borrow_and_update());
        if let Some(members) = members {
            pool.set_members(members);
        }
        tokio::select! {
            changed = discovered.changed() => if changed.is_err() { return },
            _ = shutdown.changed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dns_members_wait_for_every_service() {
        let mut d = Discovered {
            services: 2,
            ..Default::default()
        };
        d.answered
            .insert("a".into(), ["10.0.0.1:8000".to_owned()].into());
        assert_eq!(discovered_members(&d), None);
        d.answered.insert(
            "b".into(),
            ["10.0.0.2:8000".to_owned(), "10.0.0.1:8000".to_owned()].into(),
        );
        let members = discovered_members(&d).expect("both answered");
        let addresses: Vec<&str> = members
            .iter()
            .map(|m| m.endpoint.address.as_str())
            .collect();
        assert_eq!(addresses, ["10.0.0.1:8000", "10.0.0.2:8000"]);
    }
}

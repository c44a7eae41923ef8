//! DNS discovery metrics: resolutions by result, the addresses each name has now, and how the
//! set changed. The `service` label is a configured name, so its values are bounded by the
//! configuration.

use prometheus::{IntCounterVec, IntGaugeVec, Registry};

use super::registry::{counter_vec, gauge_vec};

/// What connect mode's DNS discovery did.
pub struct DiscoveryMetrics {
    resolutions: IntCounterVec,
    addresses: IntGaugeVec,
    changes: IntCounterVec,
    ignored: IntCounterVec,
}

impl DiscoveryMetrics {
    pub(super) fn new(r: &Registry) -> Self {
        Self {
            resolutions: counter_vec(
                r,
                "kvindexer_discovery_resolutions_total",
                "DNS resolutions of a discovered service: answered with addresses (ok), answered with none (no_records), or failed (error: the addresses dialled stay as they were)",
                &["service", "result"],
            ),
            addresses: gauge_vec(
                r,
                "kvindexer_discovery_addresses",
                "Addresses of a discovered service dialled now (each with one socket per data-parallel rank)",
                &["service"],
            ),
            changes: counter_vec(
                r,
                "kvindexer_discovery_changes_total",
                "Addresses that joined (added) or left (removed) a discovered service's answer",
                &["service", "change"],
            ),
            ignored: counter_vec(
                r,
                "kvindexer_discovery_addresses_ignored_total",
                "Addresses beyond maxAddresses in one answer, not dialled",
                &["service"],
            ),
        }
    }

    /// One resolution's result: `ok`, `no_records` or `error`.
    pub fn resolved(&self, service: &str, result: &'static str) {
        self.resolutions.with_label_values(&[service, result]).inc();
    }

    /// After a resolution that answered: the addresses dialled now, and how many joined and
    /// left.
    pub fn dialled(&self, service: &str, addresses: usize, added: usize, removed: usize) {
        self.addresses
            .with_label_values(&[service])
            .set(addresses as i64);
        self.changes
            .with_label_values(&[service, "added"])
            .inc_by(added as u64);
        self.changes
            .with_label_values(&[service, "removed"])
            .inc_by(removed as u64);
    }

    /// Addresses an answer had beyond `maxAddresses`.
    pub fn ignored(&self, service: &str, count: usize) {
        self.ignored
            .with_label_values(&[service])
            .inc_by(count as u64);
    }
}

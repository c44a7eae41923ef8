//! The endpoint picker's bounds: how many ext_proc streams are open, how many request-body
//! bytes are held, what was refused for each bound, and how the load scraper's budget
//! stretched its interval. Every label is a fixed enum.

use prometheus::{IntCounterVec, IntGauge, IntGaugeVec, Registry};

use super::registry::{counter_vec, gauge, gauge_vec};

/// The picker's bounds and what they refused.
pub struct BoundsMetrics {
    streams: IntGauge,
    body_bytes: IntGauge,
    refused: IntCounterVec,
    scrape_targets: IntGaugeVec,
    scrape_period_ms: IntGauge,
}

impl BoundsMetrics {
    pub(super) fn new(r: &Registry) -> Self {
        let metrics = Self::register(r);
        // Every bound's series exists from the start, at 0 (a dashboard and an alert read it).
        for bound in ["streams", "body_budget", "body_size", "body_mode"] {
            metrics.refused.with_label_values(&[bound]);
        }
        metrics
    }

    fn register(r: &Registry) -> Self {
        Self {
            streams: gauge(
                r,
                "kvindexer_picker_streams",
                "ext_proc streams open now (one per HTTP request through the gateway; at most \
                 endpointPicker.maxStreams)",
            ),
            body_bytes: gauge(
                r,
                "kvindexer_picker_body_bytes",
                "Request-body bytes held now, every stream's together (at most \
                 endpointPicker.maxBufferedBodyBytes)",
            ),
            refused: counter_vec(
                r,
                "kvindexer_picker_refused_total",
                "Requests the picker refused for a bound, by bound: streams (429: \
                 maxStreams open), body_budget (429: maxBufferedBodyBytes held), body_size (413: \
                 one body over maxBodyBytes), body_mode (500: a processing mode that cannot \
                 carry the pick)",
                &["bound"],
            ),
            scrape_targets: gauge_vec(
                r,
                "kvindexer_picker_scrape_targets",
                "Endpoints whose metrics are read (scraped), and those past the scraper's \
                 cap (over_cap: scored on the pool's median load)",
                &["state"],
            ),
            scrape_period_ms: gauge(
                r,
                "kvindexer_picker_scrape_period_milliseconds",
                "How long each endpoint waits between metrics reads: metricsInterval, stretched \
                 so all endpoints together stay within metricsMaxScrapesPerSecond",
            ),
        }
    }

    /// The streams open now.
    pub fn streams(&self, open: usize) {
        self.streams.set(open as i64);
    }

    /// The body bytes held now.
    pub fn body_bytes(&self, held: usize) {
        self.body_bytes.set(held as i64);
    }

    /// A request refused for `bound`.
    pub fn refused(&self, bound: &'static str) {
        self.refused.with_label_values(&[bound]).inc();
    }

    /// The scraper reads `scraped` endpoints, `over` more are past its cap, each every
    /// `period`.
    pub fn scrape_targets(&self, scraped: usize, over: usize, period: std::time::Duration) {
        self.scrape_targets
            .with_label_values(&["scraped"])
            .set(scraped as i64);
        self.scrape_targets
            .with_label_values(&["over_cap"])
            .set(over as i64);
        self.scrape_period_ms.set(period.as_millis() as i64);
    }
}

//! The picker's memory and stream bounds, shared by every ext_proc stream: the bytes of request
//! bodies held at once (`endpointPicker.maxBufferedBodyBytes`) and the streams open at once
//! (`endpointPicker.maxStreams`).
//!
//! Invariants: a body's bytes are charged before they are kept, so what all streams hold
//! never passes the budget (a chunk that would pass it is refused, and the stream answered
//! 429); each byte is charged [`CHARGE_PER_BYTE`] times, for the copy parsing or the answer
//! makes of it; a charge is released exactly once, when its stream lets the body go or ends
//! (its guard dropped), so a client that hangs up mid-body gives its bytes back; the gauges
//! follow every change.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::metrics::Metrics;

/// How many times a held byte is charged: the body, and the one copy parsing (its JSON text
/// fields) or the answer (the body handed back to Envoy in chunks) makes of it.
pub const CHARGE_PER_BYTE: usize = 2;

/// What every stream's bodies may hold together.
pub struct BodyBudget {
    limit: usize,
    held: AtomicUsize,
    metrics: Arc<Metrics>,
}

impl BodyBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: usize, metrics: Arc<Metrics>) -> Arc<Self> {
        Arc::new(Self {
            limit,
            held: AtomicUsize::new(0),
            metrics,
        })
    }

    /// The budget in bytes.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Charges `bytes` (times [`CHARGE_PER_BYTE`]) to `charge`; `false`, charging nothing,
    /// when that would pass the budget.
    pub fn charge(self: &Arc<Self>, charge: &mut Charge, bytes: usize) -> bool {
        let cost = bytes.saturating_mul(CHARGE_PER_BYTE);
        let taken = self
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(cost).filter(|total| *total <= self.limit)
            });
        match taken {
            Ok(before) => {
                self.metrics.bounds.body_bytes(before + cost);
                charge.budget = Some(self.clone());
                charge.bytes += cost;
                true
            }
            Err(_) => false,
        }
    }

    fn release(&self, cost: usize) {
        let before = self.held.fetch_sub(cost, Ordering::AcqRel);
        self.metrics.bounds.body_bytes(before.saturating_sub(cost));
    }
}

/// What one stream holds of the budget; given back when dropped or [`Charge::release`]d.
#[derive(Default)]
pub struct Charge {
    budget: Option<Arc<BodyBudget>>,
    bytes: usize,
}

impl Charge {
    /// Gives back everything charged.
    pub fn release(&mut self) {
        if let Some(budget) = &self.budget {
            budget.release(self.bytes);
        }
        self.bytes = 0;
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.release();
    }
}

/// The streams open at once.
pub struct StreamSlots {
    limit: usize,
    open: AtomicUsize,
    metrics: Arc<Metrics>,
}

impl StreamSlots {
    /// At most `limit` streams.
    pub fn new(limit: usize, metrics: Arc<Metrics>) -> Arc<Self> {
        Arc::new(Self {
            limit,
            open: AtomicUsize::new(0),
            metrics,
        })
    }

    /// A slot for one more stream (`None`: `limit` are open).
    pub fn enter(self: &Arc<Self>) -> Option<Slot> {
        let taken = self
            .open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |open| {
                (open < self.limit).then_some(open + 1)
            });
        let before = taken.ok()?;
        self.metrics.bounds.streams(before + 1);
        Some(Slot(self.clone()))
    }
}

/// One open stream; its slot is given back when dropped.
pub struct Slot(Arc<StreamSlots>);

impl Drop for Slot {
    fn drop(&mut self) {
        let before = self.0.open.fetch_sub(1, Ordering::AcqRel);
        self.0.metrics.bounds.streams(before.saturating_sub(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_refuses_past_its_limit_and_gets_its_bytes_back() {
        let budget = BodyBudget::new(100, Metrics::new());
        let (mut a, mut b) = (Charge::default(), Charge::default());
        assert!(budget.charge(&mut a, 30));
        assert!(
            !budget.charge(&mut b, 21),
            "30 + 21 bytes, twice each, pass 100"
        );
        assert!(budget.charge(&mut b, 20));
        assert!(!budget.charge(&mut a, 1));
        drop(a);
        assert!(budget.charge(&mut b, 30));
        b.release();
        b.release();
        assert_eq!(budget.held.load(Ordering::Relaxed), 0, "released once");
    }

    #[test]
    fn slots_bound_the_streams_and_come_back() {
        let slots = StreamSlots::new(2, Metrics::new());
        let (a, _b) = (slots.enter(), slots.enter());
        assert!(a.is_some());
        assert!(slots.enter().is_none());
        drop(a);
        assert!(slots.enter().is_some());
    }
}

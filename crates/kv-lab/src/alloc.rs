//! A global allocator that counts live heap bytes, so the benchmarks measure an index's memory
//! instead of estimating it, and every backend in the peers benchmark is measured the same way.
//!
//! Install it in a benchmark binary with
//! `#[global_allocator] static GLOBAL: CountingAllocator = CountingAllocator;` and read
//! [`live_heap_bytes`] before and after building a structure.
//!
//! The one place in kv-lab allowed `unsafe`: a `GlobalAlloc` is an unsafe trait, and each
//! method forwards to the system allocator unchanged.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Counts live heap bytes around an allocator (the system's by default; a benchmark may wrap
/// another to compare allocators with the same accounting).
pub struct CountingAllocator<A = System>(pub A);

impl CountingAllocator {
    /// Counting around the system allocator.
    pub const SYSTEM: Self = CountingAllocator(System);
}

static LIVE_HEAP_BYTES: AtomicUsize = AtomicUsize::new(0);
static PEAK_HEAP_BYTES: AtomicUsize = AtomicUsize::new(0);

/// Bytes currently allocated through [`CountingAllocator`] (0 where it is not installed).
pub fn live_heap_bytes() -> usize {
    LIVE_HEAP_BYTES.load(Ordering::Relaxed)
}

/// The most bytes live at once since the last [`reset_peak_heap_bytes`]: what an operation
/// needed at its worst, not only what it kept.
pub fn peak_heap_bytes() -> usize {
    PEAK_HEAP_BYTES.load(Ordering::Relaxed)
}

/// Starts a new peak measurement from the bytes live now.
pub fn reset_peak_heap_bytes() {
    PEAK_HEAP_BYTES.store(live_heap_bytes(), Ordering::Relaxed);
}

fn grew(by: usize) {
    let live = LIVE_HEAP_BYTES.fetch_add(by, Ordering::Relaxed) + by;
    PEAK_HEAP_BYTES.fetch_max(live, Ordering::Relaxed);
}

// SAFETY: every call is forwarded unchanged to the wrapped allocator, which upholds
// `GlobalAlloc`'s contract; only a counter is added, and counting never allocates.
unsafe impl<A: GlobalAlloc> GlobalAlloc for CountingAllocator<A> {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        grew(l.size());
        // SAFETY: the caller's `l` meets `alloc`'s contract (non-zero size), passed on as is.
        unsafe { self.0.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE_HEAP_BYTES.fetch_sub(l.size(), Ordering::Relaxed);
        // SAFETY: `p` was allocated by this allocator (so by the wrapped one) with layout `l`.
        unsafe { self.0.dealloc(p, l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        grew(l.size());
        // SAFETY: as for `alloc`.
        unsafe { self.0.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        grew(new);
        LIVE_HEAP_BYTES.fetch_sub(l.size(), Ordering::Relaxed);
        // SAFETY: `p` came from the wrapped allocator with layout `l`; `new` is the caller's valid
        // new size.
        unsafe { self.0.realloc(p, l, new) }
    }
}

//! Giving freed heap back to the operating system after a burst.
//!
//! glibc's allocator keeps the pages of freed small allocations in its arenas: after Redis was
//! down and the append queue held hundreds of megabytes of entries, the process's resident
//! memory stays at that high-water mark although the queue is empty again (the one-hour soak:
//! 390 MB before the first restart, 683 MB after, never lower). [`release_free_heap`] asks the
//! allocator to return what is free (`malloc_trim(0)`); it is called once a large backlog has
//! drained, never on a hot path. Off glibc it does nothing.
//!
//! The binary's allocator is mimalloc (feature `mimalloc`, on by default; `src/main.rs`),
//! which returns freed pages by itself after a short delay; the trim then also asks it to
//! collect at once (`mi_collect(true)`), and `malloc_trim` covers what still lives on glibc's
//! heap (a build without the feature, and the library's own tests, which run on glibc).
//!
//! Steady work leaves free pages behind too (pods joining and leaving, batches decoded and
//! dropped): the soak saw RSS climb 50-70 MB in ten minutes with the index's own bytes flat,
//! all of it returned by the next trim. [`trim_periodically`] trims once a minute when resident
//! memory has grown by [`TRIM_GROWTH`] since the last trim.

use std::time::Duration;

use tokio::sync::watch;

/// Growth of resident memory since the last trim that is worth a periodic one.
const TRIM_GROWTH: u64 = 32 << 20;
/// How often [`trim_periodically`] looks.
const TRIM_EVERY: Duration = Duration::from_secs(60);

/// Returns the allocator's free pages to the OS; reports the resident memory before and after
/// (`None` where it cannot be read or the allocator has no such call).
pub(crate) fn release_free_heap() -> Option<(u64, u64)> {
    let before = crate::metrics::resident_memory_bytes()?;
    if !trim() {
        return None;
    }
    Some((before, crate::metrics::resident_memory_bytes()?))
}

/// [`release_free_heap`] on a blocking thread, off the runtime's (a trim of a large heap takes
/// milliseconds); what both triggers call.
pub(crate) async fn release_off_runtime() -> Option<(u64, u64)> {
    tokio::task::spawn_blocking(release_free_heap)
        .await
        .ok()
        .flatten()
}

/// Until shutdown: every minute, trims the heap if resident memory grew by [`TRIM_GROWTH`]
/// since the last trim (or since start).
pub(crate) async fn trim_periodically(mut shutdown: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(TRIM_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut floor = crate::metrics::resident_memory_bytes();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.changed() => return,
        }
        let (Some(now), Some(last)) = (crate::metrics::resident_memory_bytes(), floor) else {
            continue;
        };
        if now < last + TRIM_GROWTH {
            floor = Some(last.min(now));
            continue;
        }
        if let Some((before, after)) = release_off_runtime().await {
            tracing::debug!(
                resident_before_mb = before >> 20,
                resident_after_mb = after >> 20,
                "freed heap returned to the OS"
            );
            floor = Some(after);
        }
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn trim() -> bool {
    // SAFETY: malloc_trim takes no pointers and only touches the allocator's own state, under
    // its locks; any thread may call it at any time.
    unsafe { libc::malloc_trim(0) };
    collect_mimalloc();
    true
}

/// Asks mimalloc to return its free pages now (a no-op where it is linked but not the global
/// allocator).
#[cfg(feature = "mimalloc")]
#[allow(unsafe_code)]
fn collect_mimalloc() {
    // SAFETY: mi_collect takes no pointers; any thread may call it at any time.
    unsafe { libmimalloc_sys::mi_collect(true) };
}

#[cfg(not(feature = "mimalloc"))]
fn collect_mimalloc() {}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim() -> bool {
    collect_mimalloc();
    cfg!(feature = "mimalloc")
}

#[cfg(test)]
mod tests {
    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn freed_small_allocations_leave_resident_memory() {
        // 256 MiB in 4 KiB pieces (below the mmap threshold: they live in the arenas), freed
        // but for every 64th piece, which pins the top of the heap so free() cannot shrink it.
        let mut pieces: Vec<Vec<u8>> = (0..65_536).map(|i| vec![i as u8; 4096]).collect();
        let pins: Vec<Vec<u8>> = pieces.iter().step_by(64).cloned().collect();
        drop(std::mem::take(&mut pieces));
        let (before, after) = super::release_free_heap().expect("glibc on Linux");
        assert!(
            after + (128 << 20) < before,
            "malloc_trim returned too little: {before} -> {after} bytes resident"
        );
        drop(pins);
    }
}

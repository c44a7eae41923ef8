//! Giving freed heap back to the operating system after a burst, on glibc.
//!
//! glibc's allocator keeps the pages of freed small allocations in its arenas: after Redis was
//! down and the append queue held hundreds of megabytes of entries, the process's resident
//! memory stays at that high-water mark although the queue is empty again (the one-hour soak of
//! a glibc build never came back below its peak). [`release_free_heap`] asks the
//! allocator to return what is free (`malloc_trim(0)`); it is called once a large backlog has
//! drained, never on a hot path. Steady work leaves free pages behind too (pods joining and
//! leaving, batches decoded and dropped): in the soak RSS climbed with the index's own bytes
//! flat, and the next trim returned all of it. [`trim_periodically`] trims
//! once a minute when resident memory has grown by [`TRIM_GROWTH`] since the last trim.
//!
//! The binary's allocator is mimalloc (feature `mimalloc`, on by default; `src/main.rs`),
//! which returns freed pages by itself: a replica came back to the same resident memory after
//! each drained backlog with these trims and without them alike (docs/benchmarks.md, "The
//! allocator, and memory over time"). So with that feature nothing here runs
//! ([`TRIM_NEEDED`] is false); a build without it (glibc) keeps both triggers.

use std::time::Duration;

use tokio::sync::watch;

/// Whether the binary's allocator must be told to give freed memory back: glibc's must (a
/// build without the `mimalloc` feature); mimalloc returns it by itself.
pub(crate) const TRIM_NEEDED: bool = cfg!(all(
    target_os = "linux",
    target_env = "gnu",
    not(feature = "mimalloc")
));

/// Growth of resident memory since the last trim that is worth a periodic one.
const TRIM_GROWTH: u64 = 32 << 20;
/// How often [`trim_periodically`] looks.
const TRIM_EVERY: Duration = Duration::from_secs(60);

/// Returns the allocator's free pages to the OS; reports the resident memory before and after
/// (`None` where it cannot be read). Called through [`release_off_runtime`], which checks
/// [`TRIM_NEEDED`].
fn release_free_heap() -> Option<(u64, u64)> {
    let before = crate::metrics::resident_memory_bytes()?;
    if !trim() {
        return None;
    }
    Some((before, crate::metrics::resident_memory_bytes()?))
}

/// [`release_free_heap`] on a blocking thread, off the runtime's (a trim of a large heap takes
/// milliseconds); what both triggers call.
pub(crate) async fn release_off_runtime() -> Option<(u64, u64)> {
    if !TRIM_NEEDED {
        return None;
    }
    tokio::task::spawn_blocking(release_free_heap)
        .await
        .ok()
        .flatten()
}

/// Until shutdown: every minute, trims the heap if resident memory grew by [`TRIM_GROWTH`]
/// since the last trim (or since start). Spawned only where [`TRIM_NEEDED`].
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

/// `malloc_trim(0)`: glibc returns the free pages of its arenas.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn trim() -> bool {
    // SAFETY: malloc_trim takes no pointers and only touches the allocator's own state, under
    // its locks; any thread may call it at any time.
    unsafe { libc::malloc_trim(0) };
    true
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim() -> bool {
    false
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
        // `trim` itself: the library's tests run on glibc whatever the binary's allocator.
        let before = crate::metrics::resident_memory_bytes().expect("procfs");
        assert!(super::trim(), "glibc on Linux");
        let after = crate::metrics::resident_memory_bytes().expect("procfs");
        assert!(
            after + (128 << 20) < before,
            "malloc_trim returned too little: {before} -> {after} bytes resident"
        );
        drop(pins);
    }
}

//! Giving freed heap back to the operating system after a burst.
//!
//! glibc's allocator keeps the pages of freed small allocations in its arenas: after Redis was
//! down and the append queue held hundreds of megabytes of entries, the process's resident
//! memory stays at that high-water mark although the queue is empty again (the one-hour soak:
//! 390 MB before the first restart, 683 MB after, never lower). [`release_free_heap`] asks the
//! allocator to return what is free (`malloc_trim(0)`); it is called once a large backlog has
//! drained, never on a hot path. Off glibc it does nothing.

/// Returns the allocator's free pages to the OS; reports the resident memory before and after
/// (`None` where it cannot be read or the allocator has no such call).
pub(crate) fn release_free_heap() -> Option<(u64, u64)> {
    let before = crate::metrics::resident_memory_bytes()?;
    if !trim() {
        return None;
    }
    Some((before, crate::metrics::resident_memory_bytes()?))
}

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
        let (before, after) = super::release_free_heap().expect("glibc on Linux");
        assert!(
            after + (128 << 20) < before,
            "malloc_trim returned too little: {before} -> {after} bytes resident"
        );
        drop(pins);
    }
}

//! The ingest runtime: the threads that receive, decode and apply events, apart from the
//! threads that answer reads.
//!
//! Every request's time to first token includes a ScorePods call (or a pick), so a read must
//! never wait behind a batch being applied. Ingestion therefore runs on a Tokio runtime of its
//! own: a read is never queued behind an ingest task on a runtime thread, and the kernel
//! time-slices the two sets of threads. `kvEventsConfig.ingestNice` can also lower the ingest
//! threads' priority (a nice increment) so that reads go first when both want the CPU; it is
//! 0 by default, because on a two-core machine shared with its load generator nice 5 lowered
//! no read latency against 0 and let ingestion fall behind when the CPU was contended
//! (docs/benchmarks.md, "Reads under ingest"). Lower priority is a weight, not a starvation,
//! and nothing is dropped that the inbox would not have dropped anyway (its budget and
//! counters are unchanged).
//!
//! Invariants:
//! - everything ingestion spawns (receivers, the ZMQ library's connection tasks, workers, gap
//!   fills) runs here, because it is spawned from tasks already on this runtime;
//! - dropping the runtime never blocks an async caller: it is shut down in the background
//!   (after the ingest handle's `join` has let the workers finish, nothing is left to stop).

use std::io;

/// The ingest runtime; shut down in the background when dropped.
pub(super) struct IngestRuntime {
    runtime: Option<tokio::runtime::Runtime>,
}

impl IngestRuntime {
    /// A multi-threaded runtime with `threads` workers named `kv-ingest`, each lowered by
    /// `nice` (0-19) as it starts.
    pub(super) fn new(threads: usize, nice: i32) -> io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads.max(1))
            .thread_name("kv-ingest")
            .on_thread_start(move || lower_priority(nice))
            .enable_all()
            .build()?;
        Ok(Self {
            runtime: Some(runtime),
        })
    }

    /// Where ingestion's tasks are spawned.
    pub(super) fn handle(&self) -> &tokio::runtime::Handle {
        match &self.runtime {
            Some(rt) => rt.handle(),
            // `runtime` is only taken in `drop`.
            None => unreachable!("the ingest runtime is used after it was dropped"),
        }
    }
}

impl Drop for IngestRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// Lowers the calling thread's scheduling priority by `nice`. On Linux a nice value
/// is per thread; raising it needs no privilege. A failure leaves the thread at the serving
/// threads' priority, which is what the daemon did before (logged, not fatal).
#[allow(unsafe_code)]
fn lower_priority(nice: i32) {
    if nice == 0 {
        return;
    }
    #[cfg(target_os = "linux")]
    {
        // SAFETY: gettid, getpriority and setpriority have no memory-safety preconditions.
        let rc = unsafe {
            let tid = libc::gettid() as libc::id_t;
            // Relative to the process's own nice value (a daemon started niced stays below).
            let now = libc::getpriority(libc::PRIO_PROCESS, tid);
            libc::setpriority(libc::PRIO_PROCESS, tid, (now + nice).min(19))
        };
        if rc != 0 {
            tracing::warn!(
                error = %io::Error::last_os_error(),
                "could not lower an ingest thread's priority; reads may wait behind ingestion"
            );
        }
    }
}

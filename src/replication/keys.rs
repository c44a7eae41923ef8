//! The names of a deployment's Redis keys (`<keyPrefix>:log`, `:snapshot`, its chunks and its
//! lock): one place spells them, the store and the snapshotter read them here.

/// The names of this deployment's keys.
#[derive(Debug, Clone)]
pub(super) struct Keys {
    /// The log stream.
    pub(super) log: String,
    /// The snapshot's meta.
    pub(super) snapshot: String,
    /// The snapshot lock.
    pub(super) lock: String,
}

impl Keys {
    /// The keys under `prefix` (`keyPrefix`).
    pub(super) fn new(prefix: &str) -> Self {
        Self {
            log: format!("{prefix}:log"),
            snapshot: format!("{prefix}:snapshot"),
            lock: format!("{prefix}:snapshot:lock"),
        }
    }

    /// The key of chunk `i` of snapshot `generation`.
    pub(super) fn chunk(&self, generation: &str, i: usize) -> String {
        format!("{}:{generation}:{i}", self.snapshot)
    }
}

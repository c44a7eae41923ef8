//! Prompts in: tokenizers per model, a pool of tokenizer threads, and the prefix store.
//!
//! - `model`: find and load a model's tokenizer (explicit path, local cache, HuggingFace Hub)
//!   and encode exactly as vLLM does ([`LoadedTokenizer`]);
//! - `chat`: render chat templates as HuggingFace does ([`ChatInput`]);
//! - `prefix`: the [`PrefixStore`], which reuses earlier tokenizations of shared prefixes;
//! - here: the [`TokenizerService`] (loading, the worker pool, the store), reporting through a
//!   [`TokenizeObserver`].
//!
//! The public surface is what this file re-exports.
//!
//! Invariants: a tokenizer loads once however many requests ask for it at once (single-flight),
//! and at most [`MAX_LOADED`] stay loaded; a failed load is reported to every caller for
//! [`FAILURE_TTL`] and then retried; tokenization runs on `workersCount` dedicated threads (never
//! on the async runtime) behind a bounded queue: a full queue is refused at once (overload), a
//! request whose deadline passed while queued is dropped unstarted.

mod chat;
mod hub;
mod model;
mod prefix;

pub use chat::{ChatError, ChatInput, ChatMessage, ChatTemplate};
pub use model::{Encoded, LoadError, LoadedTokenizer, SourceSettings};
pub use prefix::PrefixStore;

use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use thiserror::Error;

/// Tokenizers kept loaded at most (least recently used beyond).
pub const MAX_LOADED: u64 = 32;
/// How long a failed load is reported before it is tried again.
pub const FAILURE_TTL: Duration = Duration::from_secs(30);

/// Why a prompt could not be tokenized.
#[derive(Debug, Error)]
pub enum TokenizeError {
    /// The tokenizer could not be found or loaded.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// The chat could not be rendered.
    #[error(transparent)]
    Chat(#[from] ChatError),
    /// The tokenizer rejected the text.
    #[error("tokenizing for {model}: {detail}")]
    Encode {
        /// The model.
        model: String,
        /// The tokenizer's message.
        detail: String,
    },
    /// The queue is full.
    #[error("the tokenizer pool is overloaded ({0} requests queued)")]
    Overloaded(usize),
    /// The deadline passed before the work ran.
    #[error("deadline exceeded before tokenization")]
    DeadlineExceeded,
}

/// Pool and store settings (the `tokenizersPoolConfig` and `prefixStoreConfig` sections).
#[derive(Debug, Clone)]
pub struct TokenizerSettings {
    /// Where tokenizers come from.
    pub sources: SourceSettings,
    /// Tokenizer threads.
    pub workers: usize,
    /// Requests that may wait.
    pub queue_size: usize,
    /// Prompts longer than this (bytes) run in the large-prompt lane: an eighth of the threads
    /// (at least one) and a quarter of the queue, so a few huge prompts cannot hold up the
    /// short ones, nor take every core.
    pub large_prompt_bytes: usize,
    /// Prefix-store capacity, in text blocks.
    pub prefix_cache_size: u64,
    /// Prefix-store capacity, in bytes (a block weighs its token ids plus 64 bytes).
    pub prefix_store_bytes: u64,
    /// Characters per prefix-store block.
    pub prefix_block_chars: usize,
    /// Share of a prompt the prefix store must cover for its tokens to be used as they are.
    pub min_prefix_overlap_ratio: f64,
}

/// The result of tokenizing one prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tokenized {
    /// Token ids.
    pub ids: Vec<u32>,
    /// Whether they came from the prefix store (the tail past the cached prefix is omitted).
    pub from_prefix_store: bool,
}

type Job = Box<dyn FnOnce() + Send>;

/// Dedicated threads pulling from one bounded queue.
struct Pool {
    tx: SyncSender<Job>,
    capacity: usize,
    _threads: Vec<std::thread::JoinHandle<()>>,
}

impl Pool {
    fn new(name: &str, workers: usize, capacity: usize) -> Self {
        let (tx, rx) = sync_channel::<Job>(capacity);
        let rx = Arc::new(Mutex::new(rx));
        let threads = (0..workers.max(1))
            .map(|i| {
                let rx: Arc<Mutex<Receiver<Job>>> = rx.clone();
                std::thread::Builder::new()
                    .name(format!("{name}-{i}"))
                    .spawn(move || loop {
                        let job = rx.lock().recv();
                        match job {
                            Ok(job) => job(),
                            Err(_) => return,
                        }
                    })
                    .expect("spawning a tokenizer thread")
            })
            .collect();
        Self {
            tx,
            capacity,
            _threads: threads,
        }
    }

    /// Runs `f` on a pool thread unless the queue is full or `deadline` passes first.
    async fn run<T: Send + 'static>(
        &self,
        deadline: Instant,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, TokenizeError> {
        let (done, result) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move || {
            if Instant::now() > deadline {
                let _ = done.send(None);
                return;
            }
            let _ = done.send(Some(f()));
        });
        match self.tx.try_send(job) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => return Err(TokenizeError::Overloaded(self.capacity)),
            Err(TrySendError::Disconnected(_)) => return Err(TokenizeError::DeadlineExceeded),
        }
        match tokio::time::timeout_at(deadline.into(), result).await {
            Ok(Ok(Some(v))) => Ok(v),
            _ => Err(TokenizeError::DeadlineExceeded),
        }
    }
}

/// What the service reports as it works; the embedding program turns it into metrics (the
/// daemon's Prometheus counters), so this crate never sees a metrics registry.
pub trait TokenizeObserver: Send + Sync {
    /// A prefix-store lookup: `hit` when earlier tokenizations covered the prompt.
    fn prefix_lookup(&self, hit: bool);
    /// `tokens` were produced for a request; `tokenize_time` is the tokenizer's time on a
    /// prefix-store miss (`None` on a hit).
    fn tokenized(&self, tokens: usize, tokenize_time: Option<Duration>);
}

/// An observer that records nothing (benchmarks, tools).
#[derive(Debug, Default, Clone, Copy)]
pub struct NoObserver;

impl TokenizeObserver for NoObserver {
    fn prefix_lookup(&self, _hit: bool) {}
    fn tokenized(&self, _tokens: usize, _tokenize_time: Option<Duration>) {}
}

/// Tokenizes prompts for any model: loads tokenizers on demand, runs the work on the pool,
/// consults and fills the prefix store.
pub struct TokenizerService {
    settings: TokenizerSettings,
    loaded: moka::future::Cache<String, Arc<LoadedTokenizer>>,
    failures: moka::sync::Cache<String, LoadError>,
    /// Prompts up to `large_prompt_bytes`.
    pool: Pool,
    /// Longer prompts, isolated from the short ones.
    large_pool: Pool,
    store: Arc<PrefixStore>,
    observer: Arc<dyn TokenizeObserver>,
}

impl TokenizerService {
    /// A service with its threads started.
    pub fn new(settings: TokenizerSettings, observer: Arc<dyn TokenizeObserver>) -> Arc<Self> {
        Arc::new(Self {
            loaded: moka::future::Cache::builder()
                .max_capacity(MAX_LOADED)
                .build(),
            failures: moka::sync::Cache::builder()
                .max_capacity(1024)
                .time_to_live(FAILURE_TTL)
                .build(),
            pool: Pool::new("tokenizer", settings.workers, settings.queue_size),
            large_pool: Pool::new(
                "tokenizer-large",
                (settings.workers / 8).max(1),
                (settings.queue_size / 4).max(1),
            ),
            store: Arc::new(PrefixStore::new(
                settings.prefix_cache_size,
                settings.prefix_store_bytes,
                settings.prefix_block_chars,
                settings.min_prefix_overlap_ratio,
            )),
            observer,
            settings,
        })
    }

    /// The pool for a prompt of `bytes`.
    fn lane(&self, bytes: usize) -> &Pool {
        if bytes > self.settings.large_prompt_bytes {
            &self.large_pool
        } else {
            &self.pool
        }
    }

    /// The prefix store (for stats).
    pub fn prefix_store(&self) -> &PrefixStore {
        &self.store
    }

    /// The model's tokenizer, loading it (once, however many callers) if needed.
    pub async fn tokenizer(&self, model: &str) -> Result<Arc<LoadedTokenizer>, LoadError> {
        if let Some(t) = self.loaded.get(model).await {
            return Ok(t);
        }
        if let Some(e) = self.failures.get(model) {
            return Err(e);
        }
        let sources = self.settings.sources.clone();
        let name = model.to_owned();
        let result = self
            .loaded
            .try_get_with(model.to_owned(), async move {
                load(&sources, &name).await.map(Arc::new)
            })
            .await;
        match result {
            Ok(t) => {
                tracing::info!(model, source = %t.source, "tokenizer loaded");
                Ok(t)
            }
            Err(e) => {
                let e = (*e).clone();
                tracing::warn!(model, error = %e, "tokenizer unavailable; retrying after {FAILURE_TTL:?}");
                self.failures.insert(model.to_owned(), e.clone());
                Err(e)
            }
        }
    }

    /// Tokenizes a completion prompt (special tokens added, as vLLM's completions endpoint).
    pub async fn encode_prompt(
        &self,
        model: &str,
        text: String,
        deadline: Instant,
    ) -> Result<Tokenized, TokenizeError> {
        let tokenizer = self.tokenizer(model).await?;
        let scope = prefix::scope(model, "prompt");
        if let Some(stored) = self.stored(scope, &text) {
            return Ok(stored);
        }
        let store = self.store.clone();
        let observer = self.observer.clone();
        self.lane(text.len())
            .run(deadline, move || {
                tokenize_and_store(&store, &*observer, scope, &text, |t| {
                    tokenizer.encode_prompt(t)
                })
            })
            .await?
            .map_err(|detail| TokenizeError::Encode {
                model: model.to_owned(),
                detail,
            })
    }

    /// Renders and tokenizes a chat (as vLLM's chat endpoint). A chat of at most
    /// [`INLINE_RENDER_BYTES`] is rendered, and looked up in the prefix store, on the caller's
    /// thread; only a miss goes to a tokenizer thread.
    pub async fn encode_chat(
        &self,
        model: &str,
        chat: ChatInput,
        deadline: Instant,
    ) -> Result<Tokenized, TokenizeError> {
        let tokenizer = self.tokenizer(model).await?;
        let scope = prefix::scope(model, "chat");
        let bytes = chat.text_bytes();
        let rendered = match bytes <= INLINE_RENDER_BYTES {
            true => {
                let text = tokenizer.render_chat(&chat).map_err(TokenizeError::Chat)?;
                if let Some(mut stored) = self.stored(scope, &text) {
                    chat.trim_cut(&mut stored.ids);
                    return Ok(stored);
                }
                Some(text)
            }
            false => None,
        };
        let store = self.store.clone();
        let observer = self.observer.clone();
        self.lane(bytes)
            .run(deadline, move || {
                let text = match rendered {
                    Some(text) => text,
                    None => tokenizer.render_chat(&chat)?,
                };
                let tokenize = |t: &str| tokenizer.encode(t, false);
                let mut tokens = match store.lookup(scope, &text) {
                    Some(ids) => stored_tokens(&*observer, ids),
                    None => tokenize_and_store(&store, &*observer, scope, &text, tokenize)
                        .map_err(ChatError::Template)?,
                };
                chat.trim_cut(&mut tokens.ids);
                Ok(tokens)
            })
            .await?
            .map_err(TokenizeError::Chat)
    }

    /// The prompt's tokens when the prefix store covers it, looked up on the caller's thread:
    /// a hit costs the lookup alone, not a hand-off to a tokenizer thread (which, on busy
    /// cores, waits longer than the lookup takes).
    fn stored(&self, scope: u64, text: &str) -> Option<Tokenized> {
        let ids = self.store.lookup(scope, text)?;
        Some(stored_tokens(&*self.observer, ids))
    }
}

/// Chats of at most this many bytes of text are rendered on the caller's thread (tens of
/// microseconds), so a prefix-store hit needs no tokenizer thread.
pub const INLINE_RENDER_BYTES: usize = 256 << 10;

/// Tokens the prefix store returned, reported as a hit.
fn stored_tokens(observer: &dyn TokenizeObserver, ids: Vec<u32>) -> Tokenized {
    observer.prefix_lookup(true);
    observer.tokenized(ids.len(), None);
    Tokenized {
        ids,
        from_prefix_store: true,
    }
}

/// Tokenizes a prompt the prefix store missed (counted as a miss) and stores its blocks.
fn tokenize_and_store(
    store: &PrefixStore,
    observer: &dyn TokenizeObserver,
    scope: u64,
    text: &str,
    encode: impl FnOnce(&str) -> Result<model::Encoded, String>,
) -> Result<Tokenized, String> {
    let started = Instant::now();
    observer.prefix_lookup(false);
    let encoded = encode(text)?;
    store.insert(scope, text, &encoded.ids, &encoded.offsets);
    observer.tokenized(encoded.ids.len(), Some(started.elapsed()));
    Ok(Tokenized {
        ids: encoded.ids,
        from_prefix_store: false,
    })
}

/// Finds (downloading if allowed) and parses `model`'s tokenizer.
async fn load(sources: &SourceSettings, model: &str) -> Result<LoadedTokenizer, LoadError> {
    let spec = sources.explicit.get(model).cloned();
    let local = match &spec {
        Some(s) => model::local_file(std::path::Path::new(s)),
        None => None,
    };
    let repo = spec
        .as_deref()
        .filter(|_| local.is_none())
        .unwrap_or(model)
        .to_owned();
    let path = match local.or_else(|| model::cached_file(&sources.cache_dir, &repo)) {
        Some(p) => p,
        None if sources.offline => {
            return Err(LoadError::NotFound {
                model: model.to_owned(),
                detail: format!(
                    "offline, and {repo} is neither configured nor in {}",
                    sources.cache_dir.display()
                ),
            })
        }
        None => model::download(sources, &repo).await?,
    };
    let name = model.to_owned();
    tokio::task::spawn_blocking(move || LoadedTokenizer::from_files(&name, &path))
        .await
        .map_err(|e| LoadError::Parse {
            model: model.to_owned(),
            path: String::new(),
            detail: e.to_string(),
        })?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_queue_is_refused_and_late_work_is_not_started() {
        let pool = Arc::new(Pool::new("test", 1, 1));
        let far = Instant::now() + Duration::from_secs(10);
        let (release, wait) = std::sync::mpsc::channel::<()>();
        let p = pool.clone();
        let first = tokio::spawn(async move {
            p.run(far, move || {
                let _ = wait.recv();
                1
            })
            .await
        });
        tokio::time::sleep(Duration::from_millis(50)).await; // the worker holds job 1
        let started = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = started.clone();
        let p = pool.clone();
        let second = tokio::spawn(async move {
            p.run(Instant::now() + Duration::from_millis(100), move || {
                flag.store(true, std::sync::atomic::Ordering::SeqCst);
                2
            })
            .await
        });
        tokio::time::sleep(Duration::from_millis(20)).await; // job 2 fills the queue
        assert!(matches!(
            pool.run(far, || 3).await,
            Err(TokenizeError::Overloaded(1))
        ));
        assert!(matches!(
            second.await.expect("task"),
            Err(TokenizeError::DeadlineExceeded)
        ));
        release.send(()).expect("release");
        assert_eq!(first.await.expect("task").expect("ran"), 1);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !started.load(std::sync::atomic::Ordering::SeqCst),
            "a job whose deadline passed in the queue is dropped unstarted"
        );
    }
}

//! Tokenizer loading from a HuggingFace Hub: a fake hub on loopback answers
//! `GET /{repo}/resolve/{rev}/{file}` with `ETag`, `X-Repo-Commit` and `Range` support, as the
//! real one does; it proves the download, the cache layout and its reuse, a 401 for a bad
//! token (reported without the token), offline mode, and loading once under concurrent callers.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use kv_tokenize::SourceSettings;
use kv_tokenize::{TokenizeError, TokenizerService, TokenizerSettings};

const REPO: &str = "acme/tiny-model";
const TOKEN: &str = "hf_right_token";
const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

#[derive(Clone)]
struct Hub {
    dir: std::path::PathBuf,
    requests: Arc<AtomicUsize>,
}

async fn resolve(
    State(hub): State<Hub>,
    Path((org, name, _rev, file)): Path<(String, String, String, String)>,
    headers: HeaderMap,
) -> Response {
    hub.requests.fetch_add(1, Ordering::Relaxed);
    if headers.get("authorization").and_then(|v| v.to_str().ok())
        != Some(&format!("Bearer {TOKEN}"))
    {
        return (StatusCode::UNAUTHORIZED, "Invalid credentials").into_response();
    }
    if format!("{org}/{name}") != REPO {
        return (StatusCode::NOT_FOUND, "Repository not found").into_response();
    }
    let Ok(body) = std::fs::read(hub.dir.join(&file)) else {
        return (StatusCode::NOT_FOUND, "Entry not found").into_response();
    };
    let etag = format!("\"{:016x}\"", body.len() as u64 * 2654435761);
    let range = headers
        .get("range")
        .and_then(|v| v.to_str().ok())
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.split_once('-'))
        .and_then(|(a, b)| Some((a.parse::<usize>().ok()?, b.parse::<usize>().ok()?)));
    let mut response = match range {
        Some((start, end)) => {
            let end = end.min(body.len() - 1);
            let mut r = (StatusCode::PARTIAL_CONTENT, body[start..=end].to_vec()).into_response();
            r.headers_mut().insert(
                "content-range",
                format!("bytes {start}-{end}/{}", body.len())
                    .parse()
                    .expect("header"),
            );
            r
        }
        None => (StatusCode::OK, body).into_response(),
    };
    response
        .headers_mut()
        .insert("etag", etag.parse().expect("header"));
    response
        .headers_mut()
        .insert("x-repo-commit", COMMIT.parse().expect("header"));
    response
}

async fn start_hub() -> (String, Arc<AtomicUsize>) {
    let dir = support::temp_dir("hub-files");
    support::tiny_tokenizer(&dir);
    let requests = Arc::new(AtomicUsize::new(0));
    let app = axum::Router::new()
        .route("/{org}/{name}/resolve/{rev}/{file}", get(resolve))
        .with_state(Hub {
            dir,
            requests: requests.clone(),
        });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (format!("http://{addr}"), requests)
}

fn service(
    endpoint: &str,
    cache: &std::path::Path,
    token: &str,
    offline: bool,
) -> Arc<TokenizerService> {
    TokenizerService::new(
        TokenizerSettings {
            sources: SourceSettings {
                explicit: Default::default(),
                cache_dir: cache.to_owned(),
                hf_token: Some(token.to_owned()),
                hf_endpoint: Some(endpoint.to_owned()),
                offline,
            },
            workers: 2,
            queue_size: 16,
            prefix_cache_size: 1000,
            prefix_store_bytes: u64::MAX,
            large_prompt_bytes: 32 << 10,
            prefix_block_chars: 16,
            min_prefix_overlap_ratio: 0.8,
        },
        Arc::new(kv_tokenize::NoObserver),
    )
}

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn download_cache_reuse_and_offline() {
    let (endpoint, requests) = start_hub().await;
    let cache = support::temp_dir("hub-cache");
    let svc = service(&endpoint, &cache, TOKEN, false);
    // Eight concurrent first requests: one download.
    let calls: Vec<_> = (0..8)
        .map(|_| {
            let svc = svc.clone();
            tokio::spawn(async move {
                svc.encode_prompt(REPO, "the quick brown fox".into(), deadline())
                    .await
            })
        })
        .collect();
    let mut full = 0;
    for c in calls {
        let t = c.await.expect("task").expect("tokenizes");
        assert_eq!(t.ids.first(), Some(&1), "BOS from the post-processor");
        if t.from_prefix_store {
            // 16 of 19 characters cached: "the quick brown " -> BOS + 3 words, tail omitted.
            assert_eq!(t.ids.len(), 4);
        } else {
            assert_eq!(t.ids.len(), 5);
            full += 1;
        }
    }
    assert!(full >= 1, "the first call tokenized fully");
    let after_download = requests.load(Ordering::Relaxed);
    assert!(
        after_download >= 2,
        "metadata + data requests: {after_download}"
    );
    let cached = cache
        .join("models--acme--tiny-model")
        .join("snapshots")
        .join(COMMIT)
        .join("tokenizer.json");
    assert!(cached.exists(), "HF cache layout: {}", cached.display());
    assert!(cache.join("models--acme--tiny-model/refs/main").exists());

    // A new process (new service), offline, reuses the cache: no request reaches the hub.
    let offline = service(&endpoint, &cache, TOKEN, true);
    let t = offline
        .encode_prompt(REPO, "the lazy dog".into(), deadline())
        .await
        .expect("from cache");
    assert_eq!(t.ids.len(), 4);
    assert_eq!(
        requests.load(Ordering::Relaxed),
        after_download,
        "offline: no hub traffic"
    );

    // Offline with an empty cache: a clear error naming the model.
    let empty = support::temp_dir("hub-empty");
    let e = service(&endpoint, &empty, TOKEN, true)
        .encode_prompt(REPO, "x".into(), deadline())
        .await
        .expect_err("nothing cached");
    assert!(matches!(e, TokenizeError::Load(_)), "{e}");
    assert!(
        e.to_string().contains(REPO) && e.to_string().contains("offline"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_token_is_a_clear_error_without_the_token() {
    let (endpoint, _) = start_hub().await;
    let cache = support::temp_dir("hub-401");
    let svc = service(&endpoint, &cache, "hf_wrong_secret", false);
    let e = svc
        .encode_prompt(REPO, "the fox".into(), deadline())
        .await
        .expect_err("401");
    let msg = e.to_string();
    assert!(msg.contains(REPO), "{msg}");
    assert!(msg.contains("401"), "{msg}");
    assert!(
        !msg.contains("hf_wrong_secret"),
        "the token must not leak: {msg}"
    );
    // The failure is remembered for a while (no hammering the hub), then retried.
    let again = svc
        .encode_prompt(REPO, "the fox".into(), deadline())
        .await
        .expect_err("still failing");
    assert_eq!(again.to_string(), msg);
}

/// A hub that redirects every file to a CDN on another origin (another port), as the real Hub
/// sends LFS files to its CDN; the CDN records whether it saw the token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_is_not_forwarded_to_a_redirect_on_another_host() {
    let dir = support::temp_dir("hub-cdn-files");
    support::tiny_tokenizer(&dir);
    let leaked = Arc::new(AtomicUsize::new(0));
    let served = Arc::new(AtomicUsize::new(0));
    let cdn = {
        let (leaked, served, dir) = (leaked.clone(), served.clone(), dir.clone());
        axum::Router::new().route(
            "/files/{file}",
            get(
                move |Path(file): Path<String>, headers: HeaderMap| async move {
                    if headers.contains_key("authorization") {
                        leaked.fetch_add(1, Ordering::Relaxed);
                    }
                    served.fetch_add(1, Ordering::Relaxed);
                    match std::fs::read(dir.join(&file)) {
                        Ok(body) => (StatusCode::OK, body).into_response(),
                        Err(_) => (StatusCode::NOT_FOUND, "no such file").into_response(),
                    }
                },
            ),
        )
    };
    let cdn_listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    // The same host name on another port is another origin.
    let cdn_origin = format!(
        "http://localhost:{}",
        cdn_listener.local_addr().expect("addr").port()
    );
    tokio::spawn(async move {
        let _ = axum::serve(cdn_listener, cdn).await;
    });
    let hub = axum::Router::new().route(
        "/{org}/{name}/resolve/{rev}/{file}",
        get(
            move |Path((_, _, _, file)): Path<(String, String, String, String)>,
                  headers: HeaderMap| {
                let cdn_origin = cdn_origin.clone();
                async move {
                    if headers.get("authorization").and_then(|v| v.to_str().ok())
                        != Some(&format!("Bearer {TOKEN}"))
                    {
                        return (StatusCode::UNAUTHORIZED, "Invalid credentials").into_response();
                    }
                    let mut r = StatusCode::FOUND.into_response();
                    r.headers_mut().insert(
                        "location",
                        format!("{cdn_origin}/files/{file}")
                            .parse()
                            .expect("header"),
                    );
                    r.headers_mut()
                        .insert("x-repo-commit", COMMIT.parse().expect("header"));
                    r
                }
            },
        ),
    );
    let hub_listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let endpoint = format!(
        "http://127.0.0.1:{}",
        hub_listener.local_addr().expect("addr").port()
    );
    tokio::spawn(async move {
        let _ = axum::serve(hub_listener, hub).await;
    });
    let cache = support::temp_dir("hub-cdn-cache");
    let t = service(&endpoint, &cache, TOKEN, false)
        .encode_prompt(REPO, "the quick brown fox".into(), deadline())
        .await
        .expect("downloads through the redirect");
    assert_eq!(t.ids.len(), 5);
    assert!(
        served.load(Ordering::Relaxed) >= 1,
        "the CDN served the files"
    );
    assert_eq!(
        leaked.load(Ordering::Relaxed),
        0,
        "the HF token reached another host"
    );
}

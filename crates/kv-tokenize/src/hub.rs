//! Tokenizer files from a HuggingFace Hub (or a mirror at `HF_ENDPOINT`), into the HuggingFace
//! cache layout: `models--Org--Name/snapshots/<commit>/<file>` and `models--Org--Name/refs/main`.
//!
//! Invariants:
//! - the token goes only to the Hub's own host: a redirect to another scheme, host or port (the
//!   Hub sends file bodies to a CDN) is followed **without** the `Authorization` header, and at
//!   most [`MAX_REDIRECTS`] redirects are followed;
//! - a body larger than [`MAX_FILE_BYTES`] is refused (a hostile mirror cannot fill memory);
//! - a file appears in the cache complete or not at all (written to a temporary name, then
//!   renamed);
//! - error messages never carry the token.

use std::path::{Path, PathBuf};

use reqwest::header::{HeaderMap, HeaderValue, AUTHORIZATION, LOCATION, USER_AGENT};
use reqwest::{redirect, StatusCode, Url};

/// Redirects followed at most for one file.
pub const MAX_REDIRECTS: usize = 10;
/// The largest tokenizer file accepted (big vocabularies are ~10-30 MB).
pub const MAX_FILE_BYTES: u64 = 256 << 20;
/// The Hub used when no endpoint is configured.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Why a file could not be fetched.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    /// The repository or file does not exist (404).
    #[error("{0} not found on the Hub (404)")]
    NotFound(String),
    /// The Hub refused the credentials (401/403).
    #[error("the Hub refused access to {what} ({status}): check HF_TOKEN")]
    Denied {
        /// Repository and file.
        what: String,
        /// HTTP status.
        status: u16,
    },
    /// Any other HTTP status.
    #[error("the Hub answered {status} for {what}")]
    Status {
        /// Repository and file.
        what: String,
        /// HTTP status.
        status: u16,
    },
    /// Too many redirects, or one without a usable `Location`.
    #[error("bad redirect for {0}")]
    Redirect(String),
    /// The body exceeds [`MAX_FILE_BYTES`].
    #[error("{what} is larger than {MAX_FILE_BYTES} bytes")]
    TooLarge {
        /// Repository and file.
        what: String,
    },
    /// The endpoint is not a URL, or the token not a header value.
    #[error("bad Hub settings: {0}")]
    Settings(String),
    /// Connecting or reading failed.
    #[error("fetching {what}: {detail}")]
    Transport {
        /// Repository and file.
        what: String,
        /// Why (never the token: reqwest errors carry URLs, which carry no token).
        detail: String,
    },
    /// The cache could not be written.
    #[error("writing {path}: {source}")]
    Cache {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
}

/// A Hub client for one set of settings.
pub struct Hub {
    endpoint: Url,
    token: Option<String>,
    client: reqwest::Client,
}

/// True when `next` is on the same scheme, host and port as `origin` (the token may follow).
fn same_origin(origin: &Url, next: &Url) -> bool {
    origin.scheme() == next.scheme()
        && origin.host_str() == next.host_str()
        && origin.port_or_known_default() == next.port_or_known_default()
}

impl Hub {
    /// A client for `endpoint` (default: huggingface.co) with an optional token.
    pub fn new(endpoint: Option<&str>, token: Option<&str>) -> Result<Self, HubError> {
        let endpoint = Url::parse(endpoint.unwrap_or(DEFAULT_ENDPOINT).trim_end_matches('/'))
            .map_err(|e| HubError::Settings(format!("endpoint: {e}")))?;
        let mut headers = HeaderMap::new();
        headers.insert(
            USER_AGENT,
            HeaderValue::from_static(concat!("kv-indexer/", env!("CARGO_PKG_VERSION"))),
        );
        let client = reqwest::Client::builder()
            .default_headers(headers)
            // Redirects are followed by hand, so the token can be dropped across origins.
            .redirect(redirect::Policy::none())
            .connect_timeout(std::time::Duration::from_secs(10))
            .timeout(std::time::Duration::from_secs(120))
            .build()
            .map_err(|e| HubError::Settings(e.to_string()))?;
        Ok(Self {
            endpoint,
            token: token.filter(|t| !t.is_empty()).map(str::to_owned),
            client,
        })
    }

    /// Fetches `file` of `repo` at `main`; `(commit, bytes)`, the commit from `X-Repo-Commit`.
    pub async fn fetch(&self, repo: &str, file: &str) -> Result<(String, Vec<u8>), HubError> {
        let what = format!("{repo}/{file}");
        let mut url = self
            .endpoint
            .join(&format!(
                "{}/{repo}/resolve/main/{file}",
                self.endpoint.path().trim_end_matches('/')
            ))
            .map_err(|e| HubError::Settings(e.to_string()))?;
        let mut commit = None;
        let transport = |e: reqwest::Error| HubError::Transport {
            what: what.clone(),
            detail: e.without_url().to_string(),
        };
        for _ in 0..=MAX_REDIRECTS {
            let mut request = self.client.get(url.clone());
            if let Some(token) = &self.token {
                if same_origin(&self.endpoint, &url) {
                    let value =
                        HeaderValue::from_str(&format!("Bearer {token}")).map_err(|_| {
                            HubError::Settings("the token is not a header value".into())
                        })?;
                    request = request.header(AUTHORIZATION, value);
                }
            }
            let response = request.send().await.map_err(transport)?;
            if commit.is_none() {
                commit = response
                    .headers()
                    .get("x-repo-commit")
                    .and_then(|v| v.to_str().ok())
                    .filter(|c| c.bytes().all(|b| b.is_ascii_alphanumeric()))
                    .map(str::to_owned);
            }
            let status = response.status();
            if status.is_redirection() {
                let next = response
                    .headers()
                    .get(LOCATION)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|l| url.join(l).ok())
                    .ok_or_else(|| HubError::Redirect(what.clone()))?;
                url = next;
                continue;
            }
            match status {
                StatusCode::OK => {}
                StatusCode::NOT_FOUND => return Err(HubError::NotFound(what)),
                StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => {
                    return Err(HubError::Denied {
                        what,
                        status: status.as_u16(),
                    })
                }
                other => {
                    return Err(HubError::Status {
                        what,
                        status: other.as_u16(),
                    })
                }
            }
            if response
                .content_length()
                .is_some_and(|n| n > MAX_FILE_BYTES)
            {
                return Err(HubError::TooLarge { what });
            }
            let mut body = Vec::new();
            let mut response = response;
            while let Some(chunk) = response.chunk().await.map_err(transport)? {
                if body.len() as u64 + chunk.len() as u64 > MAX_FILE_BYTES {
                    return Err(HubError::TooLarge { what });
                }
                body.extend_from_slice(&chunk);
            }
            return Ok((commit.unwrap_or_else(|| "main".to_owned()), body));
        }
        Err(HubError::Redirect(what))
    }
}

/// The cache folder of `repo`: `models--Org--Name`.
pub fn repo_dir(cache_dir: &Path, repo: &str) -> PathBuf {
    cache_dir.join(format!("models--{}", repo.replace('/', "--")))
}

/// Writes `bytes` as `file` of `repo` at `commit` in the cache (atomically) and records the
/// commit in `refs/main`. Returns the file's path.
pub fn store(
    cache_dir: &Path,
    repo: &str,
    commit: &str,
    file: &str,
    bytes: &[u8],
) -> Result<PathBuf, HubError> {
    let root = repo_dir(cache_dir, repo);
    let snapshot = root.join("snapshots").join(commit);
    let io = |path: &Path| {
        let path = path.display().to_string();
        move |source| HubError::Cache { path, source }
    };
    std::fs::create_dir_all(&snapshot).map_err(io(&snapshot))?;
    let path = snapshot.join(file);
    let tmp = snapshot.join(format!(".{file}.{}.part", std::process::id()));
    std::fs::write(&tmp, bytes).map_err(io(&tmp))?;
    std::fs::rename(&tmp, &path).map_err(io(&path))?;
    let refs = root.join("refs");
    std::fs::create_dir_all(&refs).map_err(io(&refs))?;
    std::fs::write(refs.join("main"), commit).map_err(io(&refs))?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_follows_only_the_same_origin() {
        let hub = Url::parse("https://huggingface.co").expect("url");
        for (next, same) in [
            ("https://huggingface.co/x/resolve/main/f", true),
            ("https://huggingface.co:443/x", true),
            ("http://huggingface.co/x", false),
            ("https://cdn-lfs.huggingface.co/x", false),
            ("https://huggingface.co:8443/x", false),
            ("https://evil.example/x", false),
        ] {
            let next = Url::parse(next).expect("url");
            assert_eq!(same_origin(&hub, &next), same, "{next}");
        }
    }
}

//! The daemon's `/metrics` page, read over plain HTTP/1.1 (before and after the load, in soak
//! mode every sample, and the other replicas'), and the sums the report takes from it.

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::error::LoadgenError;

/// The response to `GET path` from `addr` (host:port), headers and body.
pub(super) async fn http_get(addr: &str, path: &str) -> Result<String, LoadgenError> {
    let failed = |source| LoadgenError::Metrics {
        addr: addr.to_owned(),
        source,
    };
    let mut s = tokio::net::TcpStream::connect(addr).await.map_err(failed)?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .map_err(failed)?;
    let mut body = String::new();
    s.read_to_string(&mut body).await.map_err(failed)?;
    Ok(body)
}

/// Sum of every sample of `name` (all label sets).
pub(super) fn metric_sum(page: &str, name: &str) -> f64 {
    page.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
        .sum()
}

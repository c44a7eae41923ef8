//! Request traces, read once for the whole lab: Mooncake JSONL (FAST'25: `timestamp`,
//! `input_length`, `output_length`, `hash_ids` of chained 512-token blocks) and token-id JSONL
//! (`token_ids`, hashed with vLLM's token processor by the caller).
//!
//! Invariant: every line is parsed or the load fails with the file and 1-based line number;
//! blank lines are skipped.

use std::io::BufRead;
use std::path::Path;

use serde::de::DeserializeOwned;
use serde::Deserialize;
use thiserror::Error;

/// One request of a Mooncake trace.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct MooncakeRequest {
    /// Arrival, ms from the trace start.
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: u64,
    /// Generated tokens.
    pub output_length: u64,
    /// Chained ids of the prompt's 512-token blocks (the last may be partial).
    pub hash_ids: Vec<u64>,
}

/// One request of a token-id trace.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct TokenRequest {
    /// The prompt's token ids.
    pub token_ids: Vec<u32>,
}

/// Which kind of trace a file holds, told by its first request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceKind {
    /// Lines with `hash_ids`.
    Mooncake,
    /// Lines with `token_ids`.
    Tokens,
}

/// Why a trace could not be read.
#[derive(Debug, Error)]
pub enum TraceError {
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Io {
        /// The trace file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A line is not a valid request.
    #[error("{path}:{line}: {source}")]
    Parse {
        /// The trace file.
        path: String,
        /// 1-based line number.
        line: usize,
        /// Why.
        source: serde_json::Error,
    },
    /// The first request is neither kind.
    #[error("{path}: lines need hash_ids (Mooncake) or token_ids")]
    UnknownKind {
        /// The trace file.
        path: String,
    },
}

/// Reads every non-blank line of a JSONL file as a `T`.
fn read_jsonl<T: DeserializeOwned>(path: &Path) -> Result<Vec<T>, TraceError> {
    let shown = path.display().to_string();
    let io = |source| TraceError::Io {
        path: shown.clone(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let mut out = Vec::new();
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(io)?;
        if line.trim().is_empty() {
            continue;
        }
        out.push(
            serde_json::from_str(&line).map_err(|source| TraceError::Parse {
                path: shown.clone(),
                line: i + 1,
                source,
            })?,
        );
    }
    Ok(out)
}

/// Loads a Mooncake JSONL trace.
pub fn load_mooncake(path: &Path) -> Result<Vec<MooncakeRequest>, TraceError> {
    read_jsonl(path)
}

/// Loads a token-id JSONL trace.
pub fn load_tokens(path: &Path) -> Result<Vec<TokenRequest>, TraceError> {
    read_jsonl(path)
}

/// Tells the trace's kind from its first non-blank line.
pub fn detect(path: &Path) -> Result<TraceKind, TraceError> {
    let shown = path.display().to_string();
    let file = std::fs::File::open(path).map_err(|source| TraceError::Io {
        path: shown.clone(),
        source,
    })?;
    let first = std::io::BufReader::new(file)
        .lines()
        .map_while(Result::ok)
        .enumerate()
        .find(|(_, l)| !l.trim().is_empty());
    let Some((i, line)) = first else {
        return Err(TraceError::UnknownKind { path: shown });
    };
    let probe: serde_json::Value =
        serde_json::from_str(&line).map_err(|source| TraceError::Parse {
            path: shown.clone(),
            line: i + 1,
            source,
        })?;
    if probe.get("hash_ids").is_some() {
        Ok(TraceKind::Mooncake)
    } else if probe.get("token_ids").is_some() {
        Ok(TraceKind::Tokens)
    } else {
        Err(TraceError::UnknownKind { path: shown })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(name: &str, text: &str) -> std::path::PathBuf {
        let path = std::env::temp_dir().join(format!("kv-lab-trace-{}-{name}", std::process::id()));
        std::fs::write(&path, text).expect("write trace");
        path
    }

    #[test]
    fn both_kinds_load_and_are_told_apart() {
        let m = write(
            "m.jsonl",
            "{\"timestamp\":0,\"input_length\":600,\"output_length\":1,\"hash_ids\":[1,2]}\n\n",
        );
        assert_eq!(detect(&m).expect("kind"), TraceKind::Mooncake);
        assert_eq!(load_mooncake(&m).expect("load")[0].hash_ids, vec![1, 2]);
        let t = write("t.jsonl", "\n{\"token_ids\":[5,6,7]}\n");
        assert_eq!(detect(&t).expect("kind"), TraceKind::Tokens);
        assert_eq!(load_tokens(&t).expect("load")[0].token_ids, vec![5, 6, 7]);
        let bad = write("b.jsonl", "{\"x\":1}\n");
        assert!(matches!(detect(&bad), Err(TraceError::UnknownKind { .. })));
        let broken = write("p.jsonl", "{\"token_ids\":[1]}\n{oops\n");
        let e = load_tokens(&broken).expect_err("line 2 is not JSON");
        assert!(e.to_string().contains(":2:"), "{e}");
    }
}

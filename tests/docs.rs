//! The reference docs cover what the code has: every configuration field in
//! `docs/configuration.md`, every metric in `docs/metrics.md`; and the files the README and the
//! architecture, benchmark and testing pages name exist.

use kv_indexer::config::Config;

fn read(rel: &str) -> String {
    std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(rel))
        .unwrap_or_else(|e| panic!("{rel}: {e}"))
}

fn keys(v: &serde_json::Value, prefix: &str, out: &mut Vec<String>) {
    if let serde_json::Value::Object(m) = v {
        for (k, v) in m {
            let path = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            out.push(path.clone());
            keys(v, &path, out);
        }
    }
    // A list's entries: their fields are named `list[].field`.
    if let serde_json::Value::Array(items) = v {
        for item in items {
            keys(item, &format!("{prefix}[]"), out);
        }
    }
}

#[test]
fn every_config_field_is_documented() {
    let doc = read("docs/configuration.md");
    let mut c = Config::default();
    c.indexer_config.token_processor_config.hash_seed = Some("x".into());
    c.indexer_config.token_processor_config.hash_block_size = Some(16);
    // One entry of each list of settings, so their fields are checked too.
    c.kv_events_config
        .discovery
        .services
        .push(kv_indexer::config::DiscoveredService::default());
    let v = serde_json::to_value(&c).expect("serializes");
    let mut all = Vec::new();
    keys(&v, "", &mut all);
    assert!(all.len() > 40, "{all:?}");
    let missing: Vec<_> = all
        .iter()
        .filter(|p| {
            let last = p.rsplit('.').next().unwrap_or(p);
            ![
                format!("`{last}`"),
                format!(".{last}`"),
                format!("`{last}."),
                format!(".{last}."),
            ]
            .iter()
            .any(|form| doc.contains(form))
        })
        .collect();
    assert!(
        missing.is_empty(),
        "undocumented config fields: {missing:?}"
    );
}

#[test]
fn every_metric_is_documented() {
    let doc = read("docs/metrics.md");
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/metrics");
    let mut src = String::new();
    for entry in std::fs::read_dir(&dir).expect("src/metrics") {
        let path = entry.expect("entry").path();
        src.push_str(&std::fs::read_to_string(&path).expect("metrics source"));
    }
    let names: Vec<&str> = src
        .split('"')
        .filter(|s| (s.starts_with("kvcache_") || s.starts_with("kvindexer_")) && !s.contains(' '))
        .collect();
    assert!(names.len() >= 25, "{names:?}");
    let missing: Vec<_> = names
        .iter()
        .filter(|n| !doc.contains(&format!("`{n}`")))
        .collect();
    assert!(missing.is_empty(), "undocumented metrics: {missing:?}");
}

/// Repository paths named in backticks in `text` (words starting with a top-level folder),
/// that do not exist under `root`.
fn missing_paths(root: &std::path::Path, text: &str) -> Vec<String> {
    const ROOTS: [&str; 7] = [
        "src/", "crates/", "tests/", "docs/", "benches/", "deploy/", "fuzz/",
    ];
    let mut missing = Vec::new();
    for quoted in text.split('`').skip(1).step_by(2) {
        for word in quoted.split_whitespace() {
            let path = word.trim_end_matches([',', ';', ':', ')', '.']);
            // Patterns, and what a build makes, are not files of the repository.
            let pattern = path.contains(['{', '*', '<']) || path.contains("/target/");
            if ROOTS.iter().any(|r| path.starts_with(r)) && !pattern && !root.join(path).exists() {
                missing.push(path.to_owned());
            }
        }
    }
    missing
}

/// The README and the architecture, benchmark and testing pages name files a reader opens:
/// each exists.
#[test]
fn every_path_the_reference_pages_name_exists() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    for page in [
        "README.md",
        "docs/architecture.md",
        "docs/benchmarks.md",
        "docs/testing.md",
    ] {
        let text = read(page);
        let named = text
            .split('`')
            .skip(1)
            .step_by(2)
            .filter(|q| q.starts_with("src/"))
            .count();
        assert!(
            page != "docs/architecture.md" || named > 20,
            "{page} names the files: {named}"
        );
        let missing = missing_paths(root, &text);
        assert!(
            missing.is_empty(),
            "{page} names paths that do not exist: {missing:?}"
        );
    }
    // Negative control: a moved file is found.
    let moved = "the walk starts in `src/ingest/sockets.rs`, then `src/ingest/socket.rs`.";
    assert_eq!(missing_paths(root, moved), ["src/ingest/socket.rs"]);
}

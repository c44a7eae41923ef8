//! The reference docs cover what the code has: every configuration field in
//! `docs/configuration.md`, every metric in `docs/metrics.md`.

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

//! The monitoring kit in `deploy/monitoring/` (the Helm chart ships the same files):
//! - the Grafana dashboard has what Grafana needs to load it (schema version, unique panel
//!   ids, a datasource variable every query panel uses, the namespace and model variables),
//!   its rows in the order operators ask, and queries that name only exported metrics, each
//!   filtered by the variables;
//! - every alert has a summary, a description and a runbook anchor that exists in
//!   docs/operations.md, names only exported metrics, and has unit tests that fire and resolve
//!   it; `promtool` checks the rules and runs those tests;
//! - end to end (`monitoring/end_to_end.rs`): a real Prometheus scraping daemons driven into
//!   each condition one machine can reach sees each alert go pending or firing, and every
//!   dashboard query return series.
//!
//! `promtool` and `prometheus` come from Debian's `prometheus` package; without them the tests
//! that need them print `SKIPPED` (they fail under `CI=true`).

#[path = "monitoring/end_to_end.rs"]
mod end_to_end;
mod support;

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::{Path, PathBuf};

use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

fn dashboard() -> Value {
    serde_json::from_str(&read("deploy/monitoring/kv-indexer-dashboard.json"))
        .expect("the dashboard is JSON")
}

fn yaml(rel: &str) -> Value {
    serde_yaml::from_str(&read(rel)).unwrap_or_else(|e| panic!("{rel} is not YAML: {e}"))
}

/// The alerting rules of the shipped rules file.
fn alert_rules() -> Vec<Value> {
    let file = yaml("deploy/monitoring/kv-indexer-rules.yaml");
    file["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
        .collect()
}

/// Every panel, rows and the panels of collapsed rows included, in order.
fn panels(d: &Value) -> Vec<Value> {
    let mut out = Vec::new();
    for p in d["panels"].as_array().expect("panels") {
        out.push(p.clone());
        out.extend(p["panels"].as_array().cloned().unwrap_or_default());
    }
    out
}

/// Every query of the dashboard: (panel title, expression).
fn queries(d: &Value) -> Vec<(String, String)> {
    panels(d)
        .iter()
        .flat_map(|p| {
            let title = p["title"].as_str().unwrap_or_default().to_owned();
            p["targets"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .map(move |t| (title.clone(), t["expr"].as_str().unwrap_or("").to_owned()))
        })
        .collect()
}

/// The metric names the daemon registers (`src/metrics`), as docs.rs collects them.
fn exported() -> BTreeSet<String> {
    let mut src = String::new();
    for entry in std::fs::read_dir(root().join("src/metrics")).expect("src/metrics") {
        src.push_str(&std::fs::read_to_string(entry.expect("entry").path()).expect("source"));
    }
    src.split('"')
        .filter(|s| (s.starts_with("kvcache_") || s.starts_with("kvindexer_")) && !s.contains(' '))
        .map(str::to_owned)
        .collect()
}

/// The labels docs/metrics.md gives `name` (its table's third column).
fn documented_labels(doc: &str, name: &str) -> Option<String> {
    let row = doc
        .lines()
        .find(|l| l.starts_with(&format!("| `{name}` |")))?;
    row.split(" | ").nth(2).map(str::to_owned)
}

/// Each metric an expression names, with its selector (`None` when it has none).
fn selectors(expr: &str) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b':';
        if !ident(bytes[i]) {
            i += 1;
            continue;
        }
        let start = i;
        while i < bytes.len() && ident(bytes[i]) {
            i += 1;
        }
        let word = &expr[start..i];
        if !(word.starts_with("kvindexer_") || word.starts_with("kvcache_")) {
            continue;
        }
        let selector = (bytes.get(i) == Some(&b'{')).then(|| {
            let end = expr[i..].find('}').expect("a selector ends") + i;
            let s = expr[i + 1..end].to_owned();
            i = end + 1;
            s
        });
        out.push((word.to_owned(), selector));
    }
    out
}

/// The exported family `name` belongs to (a histogram's `_bucket`, `_sum`, `_count` series
/// belong to the histogram); `None` when the daemon exports no such metric.
fn family(name: &str, exported: &BTreeSet<String>) -> Option<String> {
    if exported.contains(name) {
        return Some(name.to_owned());
    }
    ["_bucket", "_sum", "_count"]
        .iter()
        .filter_map(|s| name.strip_suffix(s))
        .find(|base| exported.contains(*base))
        .map(str::to_owned)
}

/// GitHub's anchor for a Markdown heading.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

const ROWS: [&str; 6] = [
    "Is routing precise?",
    "Is ingest healthy?",
    "Is the index healthy?",
    "Are replicas in step?",
    "How fast are reads?",
    "The endpoint picker's picks",
];

#[test]
fn the_dashboard_has_what_grafana_needs_to_load_it() {
    let d = dashboard();
    assert!(
        d["schemaVersion"].as_u64().is_some_and(|v| v >= 36),
        "schemaVersion"
    );
    for key in ["uid", "title"] {
        assert!(d[key].as_str().is_some_and(|s| !s.is_empty()), "{key}");
    }
    let vars = d["templating"]["list"].as_array().expect("templating.list");
    let names: Vec<&str> = vars.iter().filter_map(|v| v["name"].as_str()).collect();
    assert_eq!(names, ["datasource", "namespace", "model"]);
    assert_eq!(vars[0]["type"], "datasource");
    assert_eq!(vars[0]["query"], "prometheus");
    for v in &vars[1..] {
        assert_eq!(v["type"], "query", "{v}");
        assert_eq!(v["datasource"]["uid"], "${datasource}", "{v}");
        assert_eq!(
            (&v["includeAll"], &v["allValue"]),
            (&Value::Bool(true), &".*".into())
        );
        let q = v["query"]["query"].as_str().expect("a query");
        assert!(
            q.starts_with("label_values(") && q == v["definition"],
            "{v}"
        );
    }

    let all = panels(&d);
    let mut ids = HashSet::new();
    let mut rows = Vec::new();
    let mut last_y = 0;
    for p in &all {
        let id = p["id"].as_u64().expect("every panel has an id");
        assert!(ids.insert(id), "panel id {id} used twice");
        let g = &p["gridPos"];
        let [h, w, x, y] = ["h", "w", "x", "y"].map(|k| g[k].as_u64().expect("gridPos"));
        assert!(
            h >= 1 && (1..=24).contains(&w) && x + w <= 24,
            "{}: {g}",
            p["title"]
        );
        assert!(
            y >= last_y,
            "{}: panels are laid out top to bottom",
            p["title"]
        );
        last_y = y;
        let kind = p["type"].as_str().expect("type");
        assert!(
            ["row", "timeseries", "stat", "text"].contains(&kind),
            "{kind}"
        );
        if kind == "row" {
            rows.push((p["title"].as_str().expect("title").to_owned(), Vec::new()));
            continue;
        }
        rows.last_mut().expect("a row first").1.push(p.clone());
        let Some(targets) = p["targets"].as_array() else {
            assert_eq!(kind, "text", "{}: a chart without queries", p["title"]);
            continue;
        };
        assert!(!targets.is_empty(), "{}", p["title"]);
        assert_eq!(p["datasource"]["type"], "prometheus", "{}", p["title"]);
        assert_eq!(p["datasource"]["uid"], "${datasource}", "{}", p["title"]);
        let mut refs = HashSet::new();
        for t in targets {
            assert_eq!(t["datasource"]["uid"], "${datasource}", "{}", p["title"]);
            assert!(
                refs.insert(t["refId"].as_str().expect("refId")),
                "{}",
                p["title"]
            );
            assert!(t["expr"].as_str().is_some_and(|e| !e.is_empty()));
        }
    }
    let titles: Vec<&str> = rows.iter().map(|(t, _)| t.as_str()).collect();
    assert_eq!(titles, ROWS, "the rows, in the order the issue asks");
    for (title, members) in &rows {
        assert!(
            members.iter().filter(|p| p["targets"].is_array()).count() >= 4,
            "{title}: its charts"
        );
    }
    // The picker's row charts its pool: who is a candidate, and why endpoints left.
    let (_, picker) = rows.last().expect("the picker's row");
    let charted: String = picker.iter().map(|p| p["targets"].to_string()).collect();
    for metric in [
        "kvindexer_picker_picks_total",
        "kvindexer_pool_endpoints",
        "kvindexer_pool_left_total",
        "kvindexer_pool_publishers_outside",
    ] {
        assert!(charted.contains(metric), "{metric} is not charted");
    }
}

#[test]
fn every_dashboard_query_names_exported_metrics_filtered_by_the_variables() {
    let d = dashboard();
    let doc = read("docs/metrics.md");
    let exported = exported();
    let mut charted = BTreeSet::new();
    for (title, expr) in queries(&d) {
        let named = selectors(&expr);
        assert!(!named.is_empty(), "{title}: {expr}");
        for (name, selector) in named {
            let family = family(&name, &exported)
                .unwrap_or_else(|| panic!("{title}: {name} is not a metric the daemon exports"));
            let labels = documented_labels(&doc, &family)
                .unwrap_or_else(|| panic!("{family} is not in docs/metrics.md"));
            let selector = selector.unwrap_or_else(|| panic!("{title}: {name} unfiltered"));
            assert!(
                selector.contains(r#"namespace=~"$namespace""#),
                "{title}: {name} without the namespace variable"
            );
            assert_eq!(
                selector.contains(r#"model=~"$model""#),
                labels.contains("`model`"),
                "{title}: {name} must use the model variable exactly when it has a model label"
            );
            charted.insert(family);
        }
    }
    // What an alert watches, the dashboard charts.
    for rule in alert_rules() {
        for (name, _) in selectors(rule["expr"].as_str().expect("expr")) {
            let family = family(&name, &exported).expect("exported");
            assert!(
                charted.contains(&family),
                "{family} alerts but is not charted"
            );
        }
    }
}

/// The alerts the issue asks for, by the metric each watches.
const WATCHED: [&str; 12] = [
    r#"kvindexer_hash_checks_total{result="mismatch"}"#,
    r#"kvindexer_engines{key_mode="refused"}"#,
    "kvindexer_messages_lost_total",
    "kvindexer_sequence_gaps_total",
    "kvindexer_messages_shed_total",
    "kvindexer_blocks_dropped_total",
    "kvindexer_rank_errors_total",
    "kvindexer_replication_lag_seconds",
    "kvindexer_replication_redis_errors_total",
    "kvindexer_replication_snapshot_age_seconds",
    r#"kvindexer_index_capacity_drops{reason="size"}"#,
    "kvindexer_score_latency_seconds_bucket",
];

#[test]
fn every_alert_has_a_summary_a_description_and_a_runbook_in_operations_md() {
    let ops = read("docs/operations.md");
    let section = ops
        .split_once("\n## Monitoring: dashboard and alerts\n")
        .expect("docs/operations.md has the monitoring section")
        .1;
    let section = section.split("\n## ").next().expect("its text");
    let anchors: BTreeSet<String> = section
        .lines()
        .filter_map(|l| l.strip_prefix("### "))
        .map(slug)
        .collect();
    let exported = exported();
    let rules = alert_rules();
    let mut names = BTreeSet::new();
    for rule in &rules {
        let name = rule["alert"].as_str().expect("alerting rules only");
        assert!(names.insert(name.to_owned()), "{name} twice");
        let expr = rule["expr"].as_str().expect("expr");
        for (metric, _) in selectors(expr) {
            assert!(family(&metric, &exported).is_some(), "{name}: {metric}");
        }
        let severity = rule["labels"]["severity"].as_str().unwrap_or_default();
        assert!(
            ["critical", "warning", "info"].contains(&severity),
            "{name}"
        );
        assert!(rule["for"].as_str().is_some(), "{name}: a for: duration");
        let a = &rule["annotations"];
        for key in ["summary", "description"] {
            assert!(
                a[key].as_str().is_some_and(|s| s.len() > 20),
                "{name}: {key}"
            );
        }
        let runbook = a["runbook_url"].as_str().unwrap_or_default();
        let anchor = runbook
            .strip_prefix("docs/operations.md#")
            .unwrap_or_else(|| panic!("{name}: runbook_url {runbook:?}"));
        assert_eq!(
            anchor,
            name.to_lowercase(),
            "{name}: anchor named after the alert"
        );
        assert!(
            anchors.contains(anchor),
            "{name}: no `### {name}` in the section"
        );
    }
    let exprs: Vec<&str> = rules.iter().filter_map(|r| r["expr"].as_str()).collect();
    for watched in WATCHED {
        assert!(
            exprs.iter().any(|e| e.contains(watched)),
            "no alert on {watched}"
        );
    }
}

/// Each alert of the unit tests file: the eval times where it is expected firing and silent.
fn unit_tests() -> BTreeMap<String, (Vec<u64>, Vec<u64>)> {
    let tests = yaml("deploy/monitoring/kv-indexer-rules.test.yaml");
    let mut out: BTreeMap<String, (Vec<u64>, Vec<u64>)> = BTreeMap::new();
    for case in tests["tests"].as_array().expect("tests") {
        for t in case["alert_rule_test"].as_array().into_iter().flatten() {
            let name = t["alertname"].as_str().expect("alertname").to_owned();
            let minutes = t["eval_time"].as_str().and_then(|s| s.strip_suffix('m'));
            let at = minutes
                .and_then(|m| m.parse().ok())
                .expect("eval_time in minutes");
            let entry = out.entry(name).or_default();
            match t["exp_alerts"].as_array().is_some_and(|a| !a.is_empty()) {
                true => entry.0.push(at),
                false => entry.1.push(at),
            }
        }
    }
    out
}

#[test]
fn the_unit_tests_fire_and_resolve_every_alert() {
    let tests = unit_tests();
    for rule in alert_rules() {
        let name = rule["alert"].as_str().expect("alert");
        let (firing, silent) = tests
            .get(name)
            .unwrap_or_else(|| panic!("{name}: no tests"));
        let first = firing
            .iter()
            .min()
            .unwrap_or_else(|| panic!("{name} never fires"));
        assert!(
            silent.iter().any(|t| t < first),
            "{name}: silent before its for:"
        );
        assert!(silent.iter().any(|t| t > first), "{name}: never resolves");
    }
}

#[test]
fn promtool_checks_the_rules_and_runs_their_unit_tests() {
    if !support::prometheus::available("promtool_checks_the_rules_and_runs_their_unit_tests") {
        return;
    }
    let dir: &Path = &root().join("deploy/monitoring");
    let checked = support::prometheus::promtool(dir, &["check", "rules", "kv-indexer-rules.yaml"])
        .unwrap_or_else(|e| panic!("promtool check rules:\n{e}"));
    let count = format!("SUCCESS: {} rules found", alert_rules().len());
    assert!(checked.contains(&count), "{checked}");
    let tested =
        support::prometheus::promtool(dir, &["test", "rules", "kv-indexer-rules.test.yaml"])
            .unwrap_or_else(|e| panic!("promtool test rules:\n{e}"));
    assert!(tested.contains("SUCCESS"), "{tested}");
    // The tests can fail: with one alert's threshold out of reach, promtool reports it.
    let tmp = support::temp_dir("promtool-mutant");
    let rules = read("deploy/monitoring/kv-indexer-rules.yaml");
    let mutant = rules.replace(
        "[10m])) > 0\n        for: 5m",
        "[10m])) > 1e9\n        for: 5m",
    );
    assert_ne!(mutant, rules);
    std::fs::write(tmp.join("kv-indexer-rules.yaml"), mutant).expect("write");
    std::fs::copy(
        dir.join("kv-indexer-rules.test.yaml"),
        tmp.join("kv-indexer-rules.test.yaml"),
    )
    .expect("copy");
    let failed =
        support::prometheus::promtool(&tmp, &["test", "rules", "kv-indexer-rules.test.yaml"]);
    let _ = std::fs::remove_dir_all(&tmp);
    let output = failed.expect_err("a rule that cannot fire fails its unit test");
    assert!(output.contains("KvIndexerHashMismatch"), "{output}");
}

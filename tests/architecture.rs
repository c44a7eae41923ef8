//! The code's shape, checked on every run so it stays as the docs describe it:
//! - the daemon's rooms (the top-level modules of `src/`) import each other without a cycle
//!   (ingestion defines the port replication implements; config owns the limits it checks);
//! - no non-test source file is over 700 lines (issue 9's bound), in the daemon and every
//!   workspace crate.
//!
//! The import graph is read from the source: every `crate::<module>` path (in `use` lines, in
//! code and in doc links; plain comments excluded), by the top-level module of the file it
//! appears in.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const MAX_LINES: usize = 700;

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a file of `src/` belongs to (`None` for the crate root files).
fn room_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).ok()?;
    let first = rel.components().next()?.as_os_str().to_str()?;
    let room = first.strip_suffix(".rs").unwrap_or(first);
    (!matches!(room, "lib" | "main")).then(|| room.to_owned())
}

/// The modules named by `crate::<name>` and `crate::{<name>, ...}` in `line`: in code, and in
/// doc comments (an intra-doc link is a dependency too); plain `//` comments are skipped.
fn crate_paths(line: &str, out: &mut BTreeSet<String>) {
    let trimmed = line.trim_start();
    let code = if trimmed.starts_with("///") || trimmed.starts_with("//!") {
        trimmed
    } else {
        line.split("//").next().unwrap_or("")
    };
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        let after = &rest[at + "crate::".len()..];
        if let Some(group) = after.strip_prefix('{') {
            let inner = group.split('}').next().unwrap_or("");
            for item in inner.split(',') {
                let name: String = item
                    .trim()
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() {
                    out.insert(name);
                }
            }
        } else {
            let name: String = after
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                out.insert(name);
            }
        }
        rest = after;
    }
}

/// The first cycle found in `graph`, as the path of rooms around it.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|n| n == node) {
            let mut cycle = path[i..].to_vec();
            cycle.push(node.to_owned());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    for node in graph.keys() {
        if let Some(cycle) = visit(node, graph, &mut Vec::new(), &mut done) {
            return Some(cycle);
        }
    }
    None
}

#[test]
fn the_daemons_modules_import_each_other_without_a_cycle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let src = root.join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        let Some(room) = room_of(&src, file) else {
            continue;
        };
        let text = std::fs::read_to_string(file).expect("readable source");
        let mut named = BTreeSet::new();
        for line in text.lines() {
            crate_paths(line, &mut named);
        }
        let edges = graph.entry(room.clone()).or_default();
        edges.extend(named.into_iter().filter(|n| *n != room));
    }
    // The reading works: these edges exist and must be seen.
    assert!(graph["replication"].contains("ingest"), "{graph:?}");
    assert!(graph["daemon"].contains("server"), "{graph:?}");
    assert!(
        !graph["ingest"].contains("replication"),
        "ingestion imports replication: it must only define the port (ingest::shared_log)"
    );
    assert!(
        !graph["config"].contains("ingest"),
        "config validation reaches into ingestion: config owns the limits it checks"
    );
    if let Some(cycle) = find_cycle(&graph) {
        panic!(
            "import cycle between the daemon's modules: {}",
            cycle.join(" -> ")
        );
    }
}

#[test]
fn the_cycle_check_finds_a_cycle_when_there_is_one() {
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    graph.entry("a".into()).or_default().insert("b".into());
    graph.entry("b".into()).or_default().insert("c".into());
    graph.entry("c".into()).or_default().insert("a".into());
    assert_eq!(
        find_cycle(&graph).map(|c| c.join(" -> ")),
        Some("a -> b -> c -> a".to_owned())
    );
    graph.entry("c".into()).or_default().remove("a");
    assert_eq!(find_cycle(&graph), None);
    let mut named = BTreeSet::new();
    crate_paths(
        "use crate::{config::X, metrics}; let x = crate::ingest::y(); // crate::nope",
        &mut named,
    );
    crate_paths("    /// see [`crate::server`]", &mut named);
    assert_eq!(
        named.into_iter().collect::<Vec<_>>(),
        ["config", "ingest", "metrics", "server"]
    );
}

#[test]
fn no_source_file_is_over_700_lines() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in ["src", "crates", "benches"] {
        rust_files(&root.join(dir), &mut files);
    }
    let mut over = Vec::new();
    for file in &files {
        let rel = file.strip_prefix(root).unwrap_or(file);
        let is_test = rel.components().any(|c| c.as_os_str() == "tests")
            || rel.file_name().is_some_and(|n| n == "tests.rs");
        if is_test || rel.components().any(|c| c.as_os_str() == "target") {
            continue;
        }
        let lines = std::fs::read_to_string(file)
            .expect("readable source")
            .lines()
            .count();
        if lines > MAX_LINES {
            over.push(format!("{} ({lines})", rel.display()));
        }
    }
    assert!(files.len() > 50, "found the sources ({})", files.len());
    assert!(
        over.is_empty(),
        "source files over {MAX_LINES} lines: {}",
        over.join(", ")
    );
}

//! The code's shape, checked on every run so it stays as the docs describe it:
//! - the daemon's rooms (the top-level modules of `src/`) import each other without a cycle
//!   (ingestion defines the port replication implements; config owns the limits it checks);
//! - no non-test source file is over 700 lines (issue 9's bound), in the daemon and every
//!   workspace crate;
//! - no function outside tests is over 100 lines (issue 55's bound), in `src/` and
//!   `crates/*/src` (`architecture/functions.rs` reads them, strings and comments aside);
//! - in the daemon, kv-core, kv-lab and kv-tokenize, the files (and subfolders) of each module
//!   folder, the crate root's included, import each other without a cycle (the folder's own
//!   `mod.rs` left out; no file of `src/ingest` or of kv-lab's `loadgen` imports from its
//!   `mod.rs`, which only wires).
//!
//! The import graph is read from the source (the folders' in `architecture/folders.rs`):
//! every `crate::<module>` path (in `use` lines, in code and in doc links; plain comments
//! excluded), by the top-level module of the file it appears in. Inside a folder, paths are
//! resolved to the file they land in (`crate::`, `super::`, `self::`, a `mod.rs`'s own
//! children, and names a `mod.rs` re-exports with `pub use`), so a negative control on a
//! synthetic crate shows each form is seen.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

#[path = "architecture/folders.rs"]
mod folders;
#[path = "architecture/functions.rs"]
mod functions;

use folders::{folder_cycles, folder_graphs, ModPath};

const MAX_LINES: usize = 700;

/// Lines a function may take, `fn` line to closing brace (issue 55's bound).
const MAX_FUNCTION_LINES: usize = 100;

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

/// The non-test sources under `root`'s `dirs`, each with its path relative to `root`: test
/// files (`tests/` folders, `tests.rs`, `*_tests.rs`) and anything under `target` left out.
fn non_test_sources(root: &Path, dirs: &[&str]) -> Vec<(PathBuf, String)> {
    let mut files = Vec::new();
    for dir in dirs {
        rust_files(&root.join(dir), &mut files);
    }
    let mut out = Vec::new();
    for file in files {
        let rel = file.strip_prefix(root).unwrap_or(&file).to_path_buf();
        let name = rel.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let skipped = rel
            .components()
            .any(|c| c.as_os_str() == "tests" || c.as_os_str() == "target");
        if skipped || name == "tests.rs" || name.ends_with("_tests.rs") {
            continue;
        }
        let text = std::fs::read_to_string(&file).expect("readable source");
        out.push((rel, text));
    }
    out
}

/// The files over [`MAX_LINES`] among the non-test sources under `root`'s `dirs`.
fn long_files(root: &Path, dirs: &[&str]) -> Vec<String> {
    non_test_sources(root, dirs)
        .into_iter()
        .filter_map(|(rel, text)| {
            let lines = text.lines().count();
            (lines > MAX_LINES).then(|| format!("{} ({lines})", rel.display()))
        })
        .collect()
}

#[test]
fn no_source_file_is_over_700_lines() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dirs = ["src", "crates", "benches"];
    let found = non_test_sources(root, &dirs).len();
    assert!(found > 50, "found the sources ({found})");
    let over = long_files(root, &dirs);
    assert!(
        over.is_empty(),
        "source files over {MAX_LINES} lines: {}",
        over.join(", ")
    );
}

#[test]
fn the_file_check_finds_a_long_file_when_there_is_one() {
    let lines = |n: usize| "// a line\n".repeat(n);
    let (long, fits) = (lines(MAX_LINES + 1), lines(MAX_LINES));
    let files = [
        ("src/lib.rs", fits.as_str()),
        ("src/a.rs", long.as_str()),
        ("src/tests.rs", long.as_str()),
        ("src/b/tests/c.rs", long.as_str()),
    ];
    let dir = synthetic_crate("files", &files);
    assert_eq!(
        long_files(&dir, &["src"]),
        vec!["src/a.rs (701)".to_owned()]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The functions over [`MAX_FUNCTION_LINES`] among the non-test sources under `root`'s
/// `dirs` (`#[cfg(test)]` items left out too): `path:line name (lines)`.
fn long_functions(root: &Path, dirs: &[&str]) -> Vec<String> {
    let mut over = Vec::new();
    for (rel, text) in non_test_sources(root, dirs) {
        for (fn_name, line, lines) in functions::function_lengths(&text) {
            if lines > MAX_FUNCTION_LINES {
                over.push(format!("{}:{line} {fn_name} ({lines})", rel.display()));
            }
        }
    }
    over
}

#[test]
fn no_function_is_over_100_lines() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut sources = vec!["src".to_owned()];
    for entry in std::fs::read_dir(root.join("crates"))
        .expect("crates/")
        .flatten()
    {
        sources.push(format!(
            "crates/{}/src",
            entry.file_name().to_string_lossy()
        ));
    }
    assert!(sources.len() >= 5, "found the crates: {sources:?}");
    let sources: Vec<&str> = sources.iter().map(String::as_str).collect();
    let over = long_functions(root, &sources);
    assert!(
        over.is_empty(),
        "functions over {MAX_FUNCTION_LINES} lines (cut them along their stages):\n{}",
        over.join("\n")
    );
}

#[test]
fn the_function_check_finds_a_long_function_when_there_is_one() {
    let lines = |n: usize| "    step();\n".repeat(n);
    // 101 lines with its `fn` line and closing brace: over; 100: not.
    let long = format!("pub fn long() {{\n{}}}\n", lines(99));
    let fits = format!("pub fn fits() {{\n{}}}\n", lines(98));
    let test_module = format!(
        "#[cfg(test)]\nmod tests {{\n    fn long_test() {{\n{}    }}\n}}\n",
        lines(200)
    );
    let files = [
        ("src/lib.rs", format!("mod a;\n{fits}{test_module}")),
        ("src/a.rs", long.clone()),
        ("src/a_tests.rs", long.clone()),
        ("src/tests/b.rs", long.clone()),
    ];
    let files: Vec<(&str, &str)> = files.iter().map(|(p, t)| (*p, t.as_str())).collect();
    let dir = synthetic_crate("functions", &files);
    assert_eq!(
        long_functions(&dir, &["src"]),
        vec!["src/a.rs:1 long (101)".to_owned()]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The source folders of the daemon and of the workspace crates whose folders are checked,
/// each with the module folders it has at least (the crate root counts: that the reading
/// finds them). kv-proto is generated code and one decoder.
const CRATE_SOURCES: [(&str, usize); 4] = [
    ("src", 8),
    ("crates/kv-core/src", 6),
    ("crates/kv-lab/src", 4),
    ("crates/kv-tokenize/src", 1),
];

/// Folders whose files still import each other in a circle, with why (none: keep it so).
const FOLDERS_WITH_KNOWN_CYCLES: &[(&str, &str)] = &[];

#[test]
fn the_files_of_each_module_folder_import_each_other_without_a_cycle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut cycles = Vec::new();
    for (src, folders) in CRATE_SOURCES {
        let graphs = folder_graphs(&root.join(src));
        assert!(graphs.len() >= folders, "found the folders of {src}");
        assert!(
            graphs[&ModPath::new()].len() >= 4,
            "found the modules of {src}"
        );
        for (dir, cycle) in folder_cycles(&root.join(src)) {
            let dir = dir.join("/");
            if !FOLDERS_WITH_KNOWN_CYCLES.contains(&(src, dir.as_str())) {
                cycles.push(format!("{src}/{dir}: {cycle}"));
            }
        }
    }
    assert!(
        cycles.is_empty(),
        "import cycles between files of one module folder:\n{}",
        cycles.join("\n")
    );
    // Ingestion's and loadgen's mod.rs only wire: no file of the folder imports from them.
    for (src, folder, seen) in [
        ("src", "ingest", ("workers", "dispatch")),
        ("crates/kv-lab/src", "loadgen", ("run", "publisher")),
    ] {
        let graph = &folder_graphs(&root.join(src))[&vec![folder.to_owned()]];
        assert!(graph[seen.0].contains(seen.1), "{graph:?}");
        for (file, edges) in graph {
            assert!(
                !edges.contains("mod"),
                "{src}/{folder}/{file} imports from {src}/{folder}/mod.rs, which only wires"
            );
        }
    }
}

/// Writes `files` (path, text) under a fresh folder and returns it.
fn synthetic_crate(name: &str, files: &[(&str, &str)]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("architecture-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for (path, text) in files {
        let path = dir.join(path);
        std::fs::create_dir_all(path.parent().expect("a parent")).expect("folder");
        std::fs::write(path, text).expect("written");
    }
    dir
}

#[test]
fn the_folder_check_finds_a_cycle_between_files_when_there_is_one() {
    let base = [
        ("lib.rs", "mod a;\n"),
        (
            "a/mod.rs",
            "mod x;\nmod y;\nmod z;\npub use z::Z;\nfn wire() { x::run(); }\n",
        ),
        ("a/z.rs", "/// Uses nothing.\npub struct Z;\n"),
    ];
    let mut files = base.to_vec();
    // x -> y directly, y -> x through the crate path: a cycle.
    files.push(("a/x.rs", "use super::y::Y;\npub struct X;\n"));
    files.push(("a/y.rs", "pub struct Y(crate::a::x::X);\n"));
    let dir = synthetic_crate("direct", &files);
    let cycles = folder_cycles(&dir);
    assert_eq!(cycles.len(), 1, "{cycles:?}");
    assert_eq!(cycles[0].0, vec!["a".to_owned()]);
    assert!(
        cycles[0].1 == "x -> y -> x" || cycles[0].1 == "y -> x -> y",
        "{cycles:?}"
    );
    // Through a re-export of the folder's mod.rs, in a multi-line group, and a doc link.
    let mut files = base.to_vec();
    files.push(("a/x.rs", "use super::{\n    y::Y,\n};\npub struct X;\n"));
    files.push(("a/y.rs", "/// See [`super::Z`].\npub struct Y;\n"));
    files.push(("a/z.rs", "pub struct Z(super::x::X);\n"));
    files.remove(2);
    let dir = synthetic_crate("reexport", &files);
    assert_eq!(folder_cycles(&dir).len(), 1, "{:?}", folder_graphs(&dir));
    // Without the edge back: no cycle; a test module's `super` and a plain comment count
    // for nothing.
    let mut files = base.to_vec();
    files.push(("a/x.rs", "use super::y::Y;\npub struct X;\n"));
    files.push((
        "a/y.rs",
        "pub struct Y; // crate::a::x\n#[cfg(test)]\nmod tests {\n    use super::super::x::X;\n}\n",
    ));
    let dir = synthetic_crate("none", &files);
    assert_eq!(folder_cycles(&dir), vec![]);
    let graphs = folder_graphs(&dir);
    assert!(
        graphs[&vec!["a".to_owned()]]["x"].contains("y"),
        "{graphs:?}"
    );
    let _ = std::fs::remove_dir_all(
        std::env::temp_dir().join(format!("architecture-direct-{}", std::process::id())),
    );
}

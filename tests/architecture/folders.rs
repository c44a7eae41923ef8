//! The files of each module folder and the imports between them, read from the source: each
//! file's module path, its code (plain comments and inline test modules removed), and every
//! path in it resolved to the file of the folder it lands in (`crate::`, `super::`, `self::`,
//! a `mod.rs`'s own children and its `pub use` re-exports).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use super::{find_cycle, rust_files};

/// A module path inside one crate (`["ingest", "workers"]`; the crate root is empty).
pub type ModPath = Vec<String>;

/// The node a file or a module is at the level of folder `dir`: the child of `dir` it lies
/// under, or `mod` for `dir`'s own file (`mod.rs`, `lib.rs`, `main.rs`); `None` outside `dir`.
fn node_at(dir: &[String], module: &[String]) -> Option<String> {
    if !module.starts_with(dir) {
        return None;
    }
    Some(
        module
            .get(dir.len())
            .cloned()
            .unwrap_or_else(|| "mod".to_owned()),
    )
}

/// One source file of a crate: its module, whether it is a folder's own file, its code (plain
/// comments removed, doc comments kept, lines joined) without its inline test module.
struct SourceFile {
    module: ModPath,
    is_mod_file: bool,
    code: String,
}

/// The files of the crate rooted at `src` (test files and `tests/` folders left out).
fn crate_files(src: &Path) -> Vec<SourceFile> {
    let mut paths = Vec::new();
    rust_files(src, &mut paths);
    let mut out = Vec::new();
    for path in paths {
        let rel = path.strip_prefix(src).expect("under src");
        let mut module: ModPath = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        let file = module.pop().expect("a file name");
        if module.iter().any(|m| m == "tests") || file == "tests.rs" || file.ends_with("_tests.rs")
        {
            continue;
        }
        let stem = file.trim_end_matches(".rs");
        let is_mod_file = matches!(stem, "mod" | "lib" | "main");
        if !is_mod_file {
            module.push(stem.to_owned());
        }
        let text = std::fs::read_to_string(&path).expect("readable source");
        out.push(SourceFile {
            module,
            is_mod_file,
            code: code_of(&text),
        });
    }
    out
}

/// `text` without plain comments (doc comments stay: an intra-doc link is a dependency too)
/// and without an inline `#[cfg(test)] mod tests { .. }` (conventionally last).
fn code_of(text: &str) -> String {
    let mut code = String::new();
    let mut test_attr = false;
    for line in text.lines() {
        let trimmed = line.trim_start();
        if test_attr && trimmed.starts_with("mod ") && trimmed.ends_with('{') {
            break;
        }
        test_attr = trimmed.starts_with("#[cfg(test)]");
        if trimmed.starts_with("///") || trimmed.starts_with("//!") {
            code.push_str(trimmed);
        } else {
            code.push_str(line.split("//").next().unwrap_or(""));
        }
        code.push('\n');
    }
    code
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// The paths written in `code` that start with `crate`, `super` or `self`, or (in a folder's
/// own file) with one of `children`: each as its segments, a `{..}` group expanded into one
/// path per item (nested groups by their first segments). Inside an inline `mod x { .. }`,
/// `super` is the file's own module: such paths get one `super` fewer.
fn paths_in(code: &str, children: &BTreeSet<String>) -> Vec<Vec<String>> {
    let chars: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut depth = 0usize;
    let mut inline_mods: Vec<usize> = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '"' {
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            continue;
        }
        if c == '\'' && chars.get(i + 2) == Some(&'\'') {
            i += 3;
            continue;
        }
        if c == '{' {
            depth += 1;
        } else if c == '}' {
            depth = depth.saturating_sub(1);
            if inline_mods.last() == Some(&depth) {
                inline_mods.pop();
            }
        }
        let boundary = i == 0 || !(is_ident(chars[i - 1]) || chars[i - 1] == ':');
        if !boundary || !is_ident(c) {
            i += 1;
            continue;
        }
        let word: String = chars[i..].iter().take_while(|c| is_ident(**c)).collect();
        let end = i + word.chars().count();
        if word == "mod" {
            let rest: String = chars[end..].iter().take(80).collect();
            let rest = rest.trim_start();
            let name: String = rest.chars().take_while(|c| is_ident(*c)).collect();
            if !name.is_empty() && rest[name.len()..].trim_start().starts_with('{') {
                inline_mods.push(depth);
            }
        }
        let rooted =
            matches!(word.as_str(), "crate" | "super" | "self") || children.contains(&word);
        if rooted && chars.get(end) == Some(&':') && chars.get(end + 1) == Some(&':') {
            let mut tail = String::new();
            let mut j = end;
            let mut group = 0usize;
            while j < chars.len() {
                let d = chars[j];
                if d == '{' {
                    group += 1;
                } else if d == '}' {
                    if group == 0 {
                        break;
                    }
                    group -= 1;
                } else if group == 0 && !(is_ident(d) || d == ':') {
                    break;
                }
                tail.push(d);
                j += 1;
            }
            for mut path in expand(&format!("{word}{tail}")) {
                if !inline_mods.is_empty() && path.first().is_some_and(|s| s == "super") {
                    path.remove(0);
                    path.insert(0, "self".to_owned());
                }
                out.push(path);
            }
            i = j;
            continue;
        }
        i = end;
    }
    out
}

/// `a::b::{c, d::{e}}` as `[a, b, c]` and `[a, b, d, e]`.
fn expand(path: &str) -> Vec<Vec<String>> {
    let Some(open) = path.find('{') else {
        return vec![path
            .split("::")
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()];
    };
    let head: Vec<String> = path[..open]
        .split("::")
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect();
    let inner = &path[open + 1..path.rfind('}').unwrap_or(path.len())];
    let mut items = Vec::new();
    let (mut level, mut start) = (0usize, 0usize);
    for (k, ch) in inner.char_indices() {
        match ch {
            '{' => level += 1,
            '}' => level = level.saturating_sub(1),
            ',' if level == 0 => {
                items.push(&inner[start..k]);
                start = k + 1;
            }
            _ => {}
        }
    }
    items.push(&inner[start..]);
    let mut out = Vec::new();
    for item in items.into_iter().map(str::trim).filter(|s| !s.is_empty()) {
        let item: String = item.split(" as ").next().unwrap_or(item).to_owned();
        for tail in expand(&item) {
            let mut full = head.clone();
            full.extend(tail.into_iter().filter(|s| s != "self"));
            out.push(full);
        }
    }
    out
}

/// `path`, written in the file of `module`, as an absolute module path (segments after the
/// module are items or submodules, resolved by the caller).
fn absolute(module: &[String], is_mod_file: bool, path: &[String]) -> Option<ModPath> {
    let mut at: ModPath = module.to_vec();
    let mut rest = path;
    match rest.first().map(String::as_str) {
        Some("crate") => {
            at.clear();
            rest = &rest[1..];
        }
        Some("self") => rest = &rest[1..],
        Some("super") => {
            while rest.first().is_some_and(|s| s == "super") {
                at.pop()?;
                rest = &rest[1..];
            }
        }
        _ if is_mod_file => {}
        _ => return None,
    }
    at.extend(rest.iter().cloned());
    Some(at)
}

/// The module `path` lands in: its longest prefix that is a module, then (when the next
/// segment is a name that module re-exports with `pub use`) the module it comes from.
fn landing(
    path: &[String],
    modules: &BTreeSet<ModPath>,
    reexports: &BTreeMap<ModPath, BTreeMap<String, ModPath>>,
) -> ModPath {
    let mut len = path.len();
    while len > 0 && !modules.contains(&path[..len].to_vec()) {
        len -= 1;
    }
    let module = path[..len].to_vec();
    if let Some(next) = path.get(len) {
        if let Some(source) = reexports.get(&module).and_then(|r| r.get(next)) {
            if source != &module && source.starts_with(&module) {
                return source.clone();
            }
        }
    }
    module
}

/// Every folder of the crate at `src` with its graph: which of its nodes (child modules, and
/// `mod`, its own file) import which.
pub fn folder_graphs(src: &Path) -> BTreeMap<ModPath, BTreeMap<String, BTreeSet<String>>> {
    let files = crate_files(src);
    let modules: BTreeSet<ModPath> = files.iter().map(|f| f.module.clone()).collect();
    let children_of = |m: &ModPath| -> BTreeSet<String> {
        modules
            .iter()
            .filter(|c| c.len() == m.len() + 1 && c.starts_with(m))
            .map(|c| c[m.len()].clone())
            .collect()
    };
    let mut resolved: Vec<(&SourceFile, Vec<ModPath>)> = Vec::new();
    let mut reexports: BTreeMap<ModPath, BTreeMap<String, ModPath>> = BTreeMap::new();
    for file in &files {
        let children = if file.is_mod_file {
            children_of(&file.module)
        } else {
            BTreeSet::new()
        };
        let paths: Vec<ModPath> = paths_in(&file.code, &children)
            .iter()
            .filter_map(|p| absolute(&file.module, file.is_mod_file, p))
            .collect();
        if file.is_mod_file {
            for line in file.code.split(';') {
                let line = line.trim();
                let Some(used) = line
                    .strip_prefix("pub use ")
                    .or_else(|| line.strip_prefix("pub(crate) use "))
                    .or_else(|| line.strip_prefix("pub(super) use "))
                else {
                    continue;
                };
                for p in expand(used) {
                    let Some(name) = p.last().cloned() else {
                        continue;
                    };
                    if let Some(abs) = absolute(&file.module, true, &p) {
                        let mut source = abs;
                        source.pop();
                        reexports
                            .entry(file.module.clone())
                            .or_default()
                            .insert(name, source);
                    }
                }
            }
        }
        resolved.push((file, paths));
    }
    let mut graphs: BTreeMap<ModPath, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for dir in modules.iter().filter(|m| !children_of(m).is_empty()) {
        let graph = graphs.entry(dir.clone()).or_default();
        for (file, paths) in &resolved {
            let Some(from) = node_at(dir, &file.module) else {
                continue;
            };
            let edges = graph.entry(from.clone()).or_default();
            for path in paths {
                let target = landing(path, &modules, &reexports);
                if let Some(to) = node_at(dir, &target) {
                    if to != from {
                        edges.insert(to);
                    }
                }
            }
        }
    }
    graphs
}

/// The cycles between the files (and subfolders) of each folder of the crate at `src`, one
/// per folder that has one. A folder's own file (`mod.rs`) is left out: it declares and wires
/// its children, and the types it holds for them are checked by hand where it matters.
pub fn folder_cycles(src: &Path) -> Vec<(ModPath, String)> {
    folder_graphs(src)
        .into_iter()
        .filter_map(|(dir, mut graph)| {
            graph.remove("mod");
            for edges in graph.values_mut() {
                edges.remove("mod");
            }
            find_cycle(&graph).map(|c| (dir, c.join(" -> ")))
        })
        .collect()
}

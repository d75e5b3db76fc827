//! Imports run one way: every module of the workspace's crates has a layer in the table
//! of `docs/architecture.md` ("The layers"), and a module imports only from lower layers.
//!
//! The test reads every `crate::…`, `super::…` and `self::…` path in the sources (`use`
//! trees expanded, inline paths too, test modules included), resolves it to the module
//! that defines it (through the crate root's `pub use` re-exports), and fails on an import
//! that is not downward, on a module the table does not place, and on a table entry that
//! names no module. Needs no root.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module path inside its crate, `""` for the crate root (`a::b` for `src/a/b.rs`).
type Module = String;

/// What `imports` finds for `use crate::*` and `use crate as …`: imports of no one module,
/// which the test cannot place, so it refuses them.
const GLOB_OF_ROOT: &str = "crate::*";
const ALIAS_OF_ROOT: &str = "crate as";

#[test]
fn imports_run_one_way_in_every_crate() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let doc = std::fs::read_to_string(workspace.join("docs/architecture.md")).unwrap();
    let tables = layer_tables(&doc);
    let mut problems = Vec::new();
    for krate in ["uswap-core", "uswap-cli", "uswap-preload"] {
        let Some(layers) = tables.get(krate) else {
            problems.push(format!(
                "docs/architecture.md has no layer table for {krate}"
            ));
            continue;
        };
        problems.extend(check_crate(
            &workspace.join("crates").join(krate),
            krate,
            layers,
        ));
    }
    assert!(
        problems.is_empty(),
        "the layers do not hold:\n  {}",
        problems.join("\n  ")
    );
}

/// A tree with an upward import (which also makes its directories import in a cycle), a
/// module in no layer, a table entry with no module, an import hidden behind forms a
/// simple reader could miss, and globs of the crate root is refused, each with its own
/// problem: the check can fail.
#[test]
fn an_upward_import_a_cycle_an_unplaced_module_and_a_stale_entry_are_each_found() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir_all(src.join("low")).unwrap();
    std::fs::write(
        src.join("lib.rs"),
        "mod low;\nmod high;\nmod stray;\npub use high::Thing;\npub use low::*;\n",
    )
    .unwrap();
    std::fs::write(
        src.join("high.rs"),
        "use crate::low::{leaf::Leaf, Low};\npub struct Thing;\n",
    )
    .unwrap();
    std::fs::write(
        src.join("low/mod.rs"),
        "pub mod leaf;\npub mod other;\npub struct Low;\n",
    )
    .unwrap();
    // Forms that must not hide an import: a raw identifier, a block comment holding a
    // quote, a module compiled outside tests, a glob of the crate root.
    std::fs::write(
        src.join("low/other.rs"),
        "fn f(r#type: u8) -> u8 { r#type }\n/* \" */\n#[cfg(not(test))]\nmod real { use crate::high::Thing; }\nuse crate::*;\n",
    )
    .unwrap();
    std::fs::write(
        src.join("low/leaf.rs"),
        "pub struct Leaf;\nfn f() { let _ = crate::Thing; }\n#[cfg(test)]\nmod tests { use crate::high::Thing; }\n",
    )
    .unwrap();
    std::fs::write(src.join("stray.rs"), "").unwrap();
    let doc = "```layers uswap-test\n2 top: high gone\n1 bottom: low low::leaf low::other\n```\n";
    let tables = layer_tables(doc);
    let problems = check_crate(dir.path(), "uswap-test", &tables["uswap-test"]);
    let has = |needle: &str| problems.iter().any(|p| p.contains(needle));
    assert!(
        has("low::leaf (layer 1) imports high (layer 2)"),
        "{problems:?}"
    );
    assert!(has("stray is in no layer"), "{problems:?}");
    assert!(has("gone names no module"), "{problems:?}");
    assert!(has("in a cycle: high -> low -> high"), "{problems:?}");
    assert!(
        has("low::other (layer 1) imports high (layer 2)"),
        "{problems:?}"
    );
    assert!(has("low::other uses `crate::*`"), "{problems:?}");
    assert!(has("re-exports `low::*`"), "{problems:?}");
    assert_eq!(
        problems.len(),
        7,
        "nothing else (a test module may import anything): {problems:?}"
    );
}

/// The layer tables: fenced blocks opened by "```layers CRATE", one line per layer,
/// "RANK NAME: MODULE MODULE …".
fn layer_tables(doc: &str) -> BTreeMap<String, BTreeMap<Module, u32>> {
    let mut tables = BTreeMap::new();
    let mut current: Option<(String, BTreeMap<Module, u32>)> = None;
    for line in doc.lines() {
        if let Some(krate) = line.strip_prefix("```layers ") {
            current = Some((krate.trim().to_string(), BTreeMap::new()));
        } else if line.starts_with("```") {
            if let Some((krate, table)) = current.take() {
                tables.insert(krate, table);
            }
        } else if let Some((_, table)) = current.as_mut() {
            let Some((head, modules)) = line.split_once(':') else {
                continue;
            };
            let rank: u32 = head.split_whitespace().next().unwrap().parse().unwrap();
            for m in modules.split_whitespace() {
                table.insert(m.to_string(), rank);
            }
        }
    }
    tables
}

fn check_crate(dir: &Path, krate: &str, layers: &BTreeMap<Module, u32>) -> Vec<String> {
    let files = sources(&dir.join("src"));
    let modules: BTreeSet<Module> = files.keys().filter(|m| !m.is_empty()).cloned().collect();
    let root_file = files.get("").expect("a crate root");
    let reexports = reexports(root_file, &modules);
    let mut problems = Vec::new();
    if let Some(from) = reexports.get("*") {
        problems.push(format!(
            "{krate}: the crate root re-exports `{from}::*`: name what it re-exports, so \
             that an import of it can be placed"
        ));
    }
    for m in &modules {
        if !layers.contains_key(m) {
            problems.push(format!("{krate}: module {m} is in no layer"));
        }
    }
    for m in layers.keys() {
        if !modules.contains(m) {
            problems.push(format!("{krate}: the layer table's {m} names no module"));
        }
    }
    let mut tops: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (module, path) in &files {
        let text = std::fs::read_to_string(path).unwrap();
        let targets = imports(module, &text, &modules, &reexports);
        for target in &targets {
            let (from, to) = (top(module), top(target));
            if from != to && !from.is_empty() {
                tops.entry(from.into()).or_default().insert(to.into());
            }
        }
        let Some(&rank) = layers.get(module) else {
            continue;
        };
        for target in targets {
            if target == GLOB_OF_ROOT || target == ALIAS_OF_ROOT {
                problems.push(format!(
                    "{krate}: {module} uses `{target}`: name the modules it imports from"
                ));
                continue;
            }
            match layers.get(&target) {
                Some(&to) if to < rank => {}
                Some(&to) => problems.push(format!(
                    "{krate}: {module} (layer {rank}) imports {target} (layer {to}): \
                     imports run down only"
                )),
                None => {}
            }
        }
    }
    if let Some(cycle) = find_cycle(&tops) {
        problems.push(format!(
            "{krate}: the top-level modules import in a cycle: {}",
            cycle.join(" -> ")
        ));
    }
    problems
}

/// The top-level module (its directory, for a module in one) that holds `module`.
fn top(module: &str) -> &str {
    module.split("::").next().unwrap_or_default()
}

/// A cycle in `graph`, from a node back to itself, if it has one.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_string());
            return Some(cycle);
        }
        if !done.insert(node.to_string()) {
            return None;
        }
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|n| visit(n, graph, &mut Vec::new(), &mut done))
}

/// Every source file of a crate, by module path.
fn sources(src: &Path) -> BTreeMap<Module, PathBuf> {
    let mut found = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let rel = path.strip_prefix(src).unwrap().with_extension("");
                let mut parts: Vec<String> = rel
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy().into_owned())
                    .collect();
                if matches!(
                    parts.last().map(String::as_str),
                    Some("mod" | "lib" | "main")
                ) {
                    parts.pop();
                }
                found.insert(parts.join("::"), path);
            }
        }
    }
    found
}

/// Names the crate root re-exports (`pub use module::Name;`), with the module each
/// comes from.
fn reexports(root: &Path, modules: &BTreeSet<Module>) -> BTreeMap<String, Module> {
    let text = std::fs::read_to_string(root).unwrap();
    let tokens = tokenize(&text);
    let mut names = BTreeMap::new();
    let mut i = 0;
    while i + 2 < tokens.len() {
        if tokens[i] == "pub" && tokens[i + 1] == "use" {
            let (paths, next) = use_tree(&tokens, i + 2, Vec::new());
            for (path, name) in paths {
                names.insert(name, deepest_module(&path, modules));
            }
            i = next;
        } else {
            i += 1;
        }
    }
    names
}

/// The modules `module` reaches through paths in `text` (itself excluded).
fn imports(
    module: &str,
    text: &str,
    modules: &BTreeSet<Module>,
    reexports: &BTreeMap<String, Module>,
) -> BTreeSet<Module> {
    let tokens = tokenize(text);
    let here: Vec<String> = match module {
        "" => Vec::new(),
        m => m.split("::").map(String::from).collect(),
    };
    let mut found = BTreeSet::new();
    // Brace depths at which inline modules (`mod tests { … }`) opened.
    let mut inline: Vec<usize> = Vec::new();
    // The depth at which a test-only module opened, while inside one.
    let mut tests_at: Option<usize> = None;
    let mut depth = 0;
    let mut i = 0;
    while i < tokens.len() {
        match tokens[i].as_str() {
            "{" => depth += 1,
            "}" => {
                depth -= 1;
                if inline.last() == Some(&depth) {
                    inline.pop();
                }
                if tests_at == Some(depth) {
                    tests_at = None;
                }
            }
            // Test modules may use what they test from anywhere.
            _ if tests_at.is_some() => {}
            "mod" if tokens.get(i + 2).is_some_and(|t| t == "{") => {
                inline.push(depth);
                if test_only(&tokens[i.saturating_sub(16)..i]) && tests_at.is_none() {
                    tests_at = Some(depth);
                }
            }
            "crate" | "super" | "self"
                if tokens.get(i + 1).is_some_and(|t| t == "::")
                    && (i == 0 || tokens[i - 1] != "::") =>
            {
                let (paths, next) = use_tree(&tokens, i, Vec::new());
                for (path, name) in paths {
                    if let Some(absolute) = absolute(&path, &here, inline.len()) {
                        if absolute.is_empty() && name == "*" {
                            found.insert(GLOB_OF_ROOT.into());
                            continue;
                        }
                        let target = match absolute.first() {
                            Some(first) if !modules.contains(first.as_str()) => {
                                reexports.get(first).cloned().unwrap_or_default()
                            }
                            _ => deepest_module(&absolute, modules),
                        };
                        if !target.is_empty() && target != module {
                            found.insert(target);
                        }
                    }
                }
                i = next;
                continue;
            }
            "crate" if tokens.get(i + 1).is_some_and(|t| t == "as") => {
                found.insert(ALIAS_OF_ROOT.into());
            }
            // A path from a child module of this one (`use cluster::SlotId`).
            word if tokens.get(i + 1).is_some_and(|t| t == "::")
                && (i == 0 || tokens[i - 1] != "::")
                && modules.contains(&child(module, word)) =>
            {
                found.insert(child(module, word));
            }
            _ => {}
        }
        i += 1;
    }
    found
}

/// Whether the attributes before a `mod` (`#[cfg(test)]`, `#[cfg(all(test, loom))]`)
/// compile it only for tests: `test` is required, not negated (`cfg(not(test))`).
fn test_only(before: &[String]) -> bool {
    let start = before
        .iter()
        .rposition(|t| t == ";" || t == "}")
        .map_or(0, |p| p + 1);
    let attrs = &before[start..];
    // The predicates `test` sits inside, innermost last.
    let mut inside: Vec<&str> = Vec::new();
    let mut required = false;
    for (i, t) in attrs.iter().enumerate() {
        match t.as_str() {
            "(" => inside.push(if i > 0 { attrs[i - 1].as_str() } else { "" }),
            ")" => {
                inside.pop();
            }
            "test" if inside.first() == Some(&"cfg") && !inside.contains(&"not") => {
                required = !inside.contains(&"any");
            }
            _ => {}
        }
    }
    required
}

fn child(module: &str, name: &str) -> Module {
    match module {
        "" => name.to_string(),
        m => format!("{m}::{name}"),
    }
}

/// A path made absolute (segments from the crate root), `inline` inline modules deep
/// inside the file's module `here`.
fn absolute(path: &[String], here: &[String], inline: usize) -> Option<Vec<String>> {
    let mut at: Vec<String> = here.to_vec();
    let mut rest = path;
    match rest.first().map(String::as_str) {
        Some("crate") => {
            at.clear();
            rest = &rest[1..];
        }
        Some("self") => rest = &rest[1..],
        Some("super") => {
            let ups = rest.iter().take_while(|s| *s == "super").count();
            // The first `inline` steps up leave inline modules, inside the same file.
            for _ in 0..ups.saturating_sub(inline) {
                at.pop()?;
            }
            rest = &rest[ups..];
        }
        _ => return None,
    }
    at.extend(rest.iter().cloned());
    Some(at)
}

/// The longest prefix of `path` that is a module ("" when none is).
fn deepest_module(path: &[String], modules: &BTreeSet<Module>) -> Module {
    (1..=path.len())
        .rev()
        .map(|n| path[..n].join("::"))
        .find(|m| modules.contains(m))
        .unwrap_or_default()
}

/// Expands the path tree starting at `tokens[i]` (`a::b::{c, d::e as f, g::*}`), each path
/// with the name it brings in; returns them and the index after the tree.
fn use_tree(
    tokens: &[String],
    mut i: usize,
    prefix: Vec<String>,
) -> (Vec<(Vec<String>, String)>, usize) {
    let mut path = prefix;
    let mut out = Vec::new();
    loop {
        match tokens.get(i).map(String::as_str) {
            Some("{") => {
                i += 1;
                loop {
                    if tokens.get(i).is_some_and(|t| t == "}") {
                        return (out, i + 1);
                    }
                    let (inner, next) = use_tree(tokens, i, path.clone());
                    out.extend(inner);
                    i = next;
                    match tokens.get(i).map(String::as_str) {
                        Some(",") => i += 1,
                        Some("}") => return (out, i + 1),
                        _ => return (out, i),
                    }
                }
            }
            Some("*") => {
                out.push((path.clone(), "*".into()));
                return (out, i + 1);
            }
            Some(t) if is_ident(t) => {
                path.push(t.to_string());
                i += 1;
                if tokens.get(i).is_some_and(|t| t == "::") {
                    i += 1;
                    continue;
                }
                let mut name = t.to_string();
                if tokens.get(i).is_some_and(|t| t == "as") {
                    name = tokens.get(i + 1).cloned().unwrap_or_default();
                    i += 2;
                }
                out.push((path, name));
                return (out, i);
            }
            _ => return (out, i),
        }
    }
}

fn is_ident(t: &str) -> bool {
    t.chars()
        .next()
        .is_some_and(|c| c.is_alphabetic() || c == '_')
}

/// Identifiers, `::` and single punctuation; string and character literals dropped.
fn tokenize(text: &str) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut tokens = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_alphanumeric() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let hashes = chars[i..].iter().take_while(|&&c| c == '#').count();
            let raw_string = chars.get(i + hashes) == Some(&'"');
            if (word == "r" || word == "br") && raw_string {
                i = after_raw_string(&chars, i);
            } else if word == "r" && hashes == 1 {
                // A raw identifier (`r#type`): the identifier follows.
                i += 1;
            } else {
                tokens.push(word);
            }
        } else if c == '\'' {
            // A character literal ('x', '\n'), or a lifetime, which is skipped as a quote.
            i += match (chars.get(i + 1), chars.get(i + 2)) {
                (Some('\\'), _) => {
                    1 + chars[i + 1..].iter().position(|&c| c == '\'').unwrap_or(0) + 1
                }
                (Some(_), Some('\'')) => 3,
                _ => 1,
            };
        } else if c == '/' && chars.get(i + 1) == Some(&'/') {
            // A comment, doc comments included (their paths are links, not imports).
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && chars.get(i + 1) == Some(&'*') {
            i = after_block_comment(&chars, i);
        } else if c == ':' && chars.get(i + 1) == Some(&':') {
            tokens.push("::".into());
            i += 2;
        } else if c == '"' {
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else {
            tokens.push(c.to_string());
            i += 1;
        }
    }
    tokens
}

/// The index after the raw string whose hashes or quote start at `i`.
fn after_raw_string(chars: &[char], mut i: usize) -> usize {
    let hashes = chars[i..].iter().take_while(|&&c| c == '#').count();
    i += hashes + 1;
    while i < chars.len() {
        if chars[i] == '"'
            && chars[i + 1..]
                .iter()
                .take(hashes)
                .filter(|&&c| c == '#')
                .count()
                == hashes
        {
            return i + 1 + hashes;
        }
        i += 1;
    }
    i
}

/// The index after the block comment (nested ones included) that starts at `i`.
fn after_block_comment(chars: &[char], mut i: usize) -> usize {
    let mut depth = 0;
    while i < chars.len() {
        match (chars[i], chars.get(i + 1)) {
            ('/', Some('*')) => {
                depth += 1;
                i += 2;
            }
            ('*', Some('/')) => {
                depth -= 1;
                i += 2;
                if depth == 0 {
                    return i;
                }
            }
            _ => i += 1,
        }
    }
    i
}

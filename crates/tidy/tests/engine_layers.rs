//! Goal (issue 21): the engine is a DAG of owners. Each file of
//! `crates/thin-pool/src/engine` refers (by `crate::engine::X` or `super::X`, test modules
//! aside) only to files of lower layers, in the order below (the module doc of
//! `engine/mod.rs` explains it); `impl Pool` is written only in `pool.rs`; the metadata
//! owner (`meta.rs`) has no `pub(crate)` field. A new engine file must be given a layer here.

use std::collections::BTreeMap;
use std::path::Path;

/// The engine's files, lowest layer first; a file may use files of lower layers only.
const LAYERS: &[&[&str]] = &[
    &["directory"],
    &[
        "options",
        "layout",
        "index",
        "gate",
        "grace",
        "data_device",
        "catalog",
        "stats",
        "queue",
        "written",
    ],
    &["limits", "health", "catalog_dir"],
    &["block_device"],
    &["space"],
    &["volumes"],
    &["load"],
    &["recovery"],
    &["meta_state"],
    &["meta"],
    &["provision"],
    &["volume"],
    &[
        "manage", "adopt", "grow", "revert", "usage", "diff", "trim", "listing", "receive",
    ],
    &["receive_partial"],
    &["committer", "autoextend"],
    &["open"],
    &["pool"],
];

fn engine_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../thin-pool/src/engine")
}

/// Every engine file's text without its `#[cfg(test)] mod tests` and line comments, by the
/// top-level module it belongs to (`block_device/data.rs` belongs to `block_device`).
fn sources() -> BTreeMap<String, Vec<(String, String)>> {
    let mut out: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
    let mut stack = vec![engine_dir()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let relative = path.strip_prefix(engine_dir()).unwrap().to_path_buf();
            let first = relative.components().next().unwrap();
            let module = first.as_os_str().to_str().unwrap().trim_end_matches(".rs");
            let mut text = std::fs::read_to_string(&path).unwrap();
            if let Some(cut) = text.find("#[cfg(test)]\nmod tests") {
                text.truncate(cut);
            }
            let text: String = text
                .lines()
                .map(|line| line.split("//").next().unwrap_or(""))
                .collect::<Vec<_>>()
                .join("\n");
            out.entry(module.to_string())
                .or_default()
                .push((relative.display().to_string(), text));
        }
    }
    out
}

/// The engine modules `text` names through `prefix` (`crate::engine::` or `super::`),
/// including those inside a `prefix{...}` group.
fn references(text: &str, prefix: &str, modules: &BTreeMap<String, usize>) -> Vec<String> {
    let mut found = Vec::new();
    for (at, _) in text.match_indices(prefix) {
        let rest = &text[at + prefix.len()..];
        let names: Vec<&str> = if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            group[..end]
                .split(',')
                .map(|item| item.trim().split("::").next().unwrap_or("").trim())
                .collect()
        } else {
            let end = rest
                .find(|c: char| !(c.is_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            vec![&rest[..end]]
        };
        found.extend(
            names
                .into_iter()
                .filter(|name| modules.contains_key(*name))
                .map(str::to_string),
        );
    }
    found
}

#[test]
fn engine_files_use_only_lower_layers() {
    let layer: BTreeMap<String, usize> = LAYERS
        .iter()
        .enumerate()
        .flat_map(|(i, names)| names.iter().map(move |n| (n.to_string(), i)))
        .collect();
    let sources = sources();
    let mut problems = Vec::new();
    for (module, files) in &sources {
        if module == "mod" {
            continue;
        }
        let Some(&own) = layer.get(module) else {
            problems.push(format!("engine/{module}: not in LAYERS (give it a layer)"));
            continue;
        };
        for (file, text) in files {
            let mut used = references(text, "crate::engine::", &layer);
            // `super::` from a top-level file names a sibling; from a submodule, its parent.
            if !file.contains('/') {
                used.extend(references(text, "super::", &layer));
            }
            for other in used {
                if other != *module && layer[&other] >= own {
                    problems.push(format!(
                        "engine/{file} (layer {own}) uses {other} (layer {})",
                        layer[&other]
                    ));
                }
            }
        }
    }
    for name in layer.keys() {
        if !sources.contains_key(name) {
            problems.push(format!("LAYERS names {name}, which is not an engine file"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn impl_pool_is_written_only_in_pool_rs_and_the_metadata_owner_keeps_its_fields() {
    for (module, files) in sources() {
        for (file, text) in files {
            let writes_impl_pool = text
                .lines()
                .any(|line| line.trim_start().starts_with("impl Pool {"));
            assert!(
                !writes_impl_pool || file == "pool.rs",
                "engine/{file} ({module}) writes `impl Pool`: only pool.rs may"
            );
            if file == "meta.rs" {
                assert!(
                    text.contains("struct Meta {") && !struct_fields_public(&text, "Meta"),
                    "engine/meta.rs: `Meta` is gone or has a field with a visibility"
                );
            }
        }
    }
}

/// Whether `struct NAME { ... }` in `text` has a field with a visibility.
fn struct_fields_public(text: &str, name: &str) -> bool {
    let Some(start) = text.find(&format!("struct {name} {{")) else {
        return false;
    };
    let body = &text[start..];
    let end = body.find("\n}").unwrap_or(body.len());
    body[..end]
        .lines()
        .skip(1)
        .any(|line| line.trim_start().starts_with("pub"))
}

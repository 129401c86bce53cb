//! The thin_dump XML fixtures of `crates/persistent-data/tests/fixtures/` (see the README
//! there): where they are, and the generated ones made on demand.
//!
//! Small fixtures are committed. Large ones are produced by `scripts/gen-fixture-xml` into
//! `<workspace>/target/fixtures/` the first time a test process asks for them (the script is
//! deterministic, so the bytes are always the same). Metadata is never committed: tests make
//! it with the real `thin_restore` ([`crate::ThinTools::restore`]).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

/// Fixtures kept in the repository, by name (file `<name>.xml`).
pub const COMMITTED: [&str; 4] = [
    "devices-snapshot",
    "split-leaves",
    "two-bitmaps-overflow",
    "empty-pool",
];
/// Fixtures generated at test time, by name.
pub const GENERATED: [&str; 1] = ["large-three-devices"];

/// Every fixture name, committed first.
pub fn all() -> impl Iterator<Item = &'static str> {
    COMMITTED.into_iter().chain(GENERATED)
}

/// The workspace root (the directory holding `scripts/gen-fixture-xml`).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .find(|dir| dir.join("scripts/gen-fixture-xml").exists())
        .expect("testkit lives inside the thinpool workspace")
        .to_path_buf()
}

/// `crates/persistent-data/tests/fixtures`.
pub fn dir() -> PathBuf {
    workspace_root().join("crates/persistent-data/tests/fixtures")
}

/// Path of the XML for fixture `name`, generating it first if it is not committed. Panics
/// on an unknown name or if generation fails.
pub fn xml(name: &str) -> PathBuf {
    if COMMITTED.contains(&name) {
        return dir().join(format!("{name}.xml"));
    }
    assert!(GENERATED.contains(&name), "unknown fixture {name:?}");
    // Generate once per process; the script replaces the file atomically, so other test
    // processes doing the same at once are harmless.
    static DONE: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    let mut done = DONE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let root = workspace_root();
    let path = root.join("target/fixtures").join(format!("{name}.xml"));
    if !done.iter().any(|n| n == name) {
        std::fs::create_dir_all(path.parent().expect("has a parent"))
            .unwrap_or_else(|e| panic!("cannot create target/fixtures: {e}"));
        let status = Command::new(root.join("scripts/gen-fixture-xml"))
            .arg(name)
            .arg(&path)
            .status()
            .unwrap_or_else(|e| panic!("cannot run scripts/gen-fixture-xml (needs python3): {e}"));
        assert!(
            status.success(),
            "scripts/gen-fixture-xml {name} failed: {status}"
        );
        done.push(name.to_owned());
    }
    path
}

/// `text` (a thin_dump XML dump) with the names of `<def>`s and `<ref>`s renamed `d0`, `d1`,
/// ... in order of first appearance: thin_dump names them by block number, which differs
/// between two writers of the same mappings.
pub fn canonical_def_names(text: &str) -> String {
    let mut names: HashMap<String, String> = HashMap::new();
    let mut out = String::with_capacity(text.len());
    for line in text.split_inclusive('\n') {
        let trimmed = line.trim_start();
        let prefix = ["<def name=\"", "<ref name=\""]
            .into_iter()
            .find(|p| trimmed.starts_with(p));
        let Some(prefix) = prefix else {
            out.push_str(line);
            continue;
        };
        let rest = &trimmed[prefix.len()..];
        let end = rest.find('"').expect("a quoted name");
        let next = names.len();
        let name = names
            .entry(rest[..end].to_string())
            .or_insert_with(|| format!("d{next}"));
        let indent = &line[..line.len() - trimmed.len()];
        write!(out, "{indent}{prefix}{name}{}", &rest[end..]).expect("writing to a String");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn def_names_are_renamed_in_order_of_appearance() {
        let text = "<def name=\"77\">\n  <ref name=\"12\"/>\n<def name=\"12\">\n<x/>\n";
        assert_eq!(
            canonical_def_names(text),
            "<def name=\"d0\">\n  <ref name=\"d1\"/>\n<def name=\"d1\">\n<x/>\n"
        );
    }
}

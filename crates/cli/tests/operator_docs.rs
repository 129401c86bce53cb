//! Goal (issue 25, item 8): the docs an operator follows say what is true.
//!
//! - Every repository path README.md, ARCHITECTURE.md and docs/*.md name (in backticks, or
//!   as a link) exists: the README's TLS pointer named a file that was not there.
//! - README's first-time setup states what the workspace needs: the Rust version of
//!   `rust-version` in Cargo.toml, a C compiler, root for `scripts/test`, and that it
//!   installs Debian packages.
//! - The notes operators missed are there: freeze a mounted file system around a snapshot
//!   (`fsfreeze -f`/`-u`), clients keep their size after a resize until they reconnect,
//!   restarting `serve` ends every connection (qemu's `reconnect-delay`, `nbd-client
//!   -persist`), and docs/lvm.md says that `import` rewrites metadata blocks.
//! - What those notes say holds: a connected NBD client keeps the size it negotiated after
//!   `volume resize` (a new connection gets the new one), and a restarted `serve` has ended
//!   the old connection.
//!
//! Method: the documents are read from the repository; the behaviour is shown on a served
//! scratch pool with testkit's raw NBD client.

mod e2e_support;

use e2e_support::*;
use std::path::{Path, PathBuf};

fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read(name: &str) -> String {
    std::fs::read_to_string(repository().join(name)).unwrap()
}

/// The documents checked: README.md, ARCHITECTURE.md, docs/*.md.
fn documents() -> Vec<String> {
    let mut names = vec!["README.md".to_string(), "ARCHITECTURE.md".to_string()];
    for entry in std::fs::read_dir(repository().join("docs")).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        if name.ends_with(".md") {
            names.push(format!("docs/{name}"));
        }
    }
    names.sort();
    names
}

/// The top directories of the repository a path in a document starts with.
const ROOTS: [&str; 4] = ["crates/", "docs/", "scripts/", "contrib/"];

/// Repository paths `text` names: backticked words starting with one of [`ROOTS`], and
/// relative link targets (resolved against `dir`, the document's directory). Patterns and
/// placeholders (`crates/*/tests`, `NAME`) are left out.
fn named_paths(text: &str, dir: &Path) -> Vec<PathBuf> {
    let mut paths = Vec::new();
    for (index, part) in text.split('`').enumerate() {
        if index % 2 == 0 {
            continue;
        }
        let word = part.split_whitespace().next().unwrap_or("");
        if ROOTS.iter().any(|root| word.starts_with(root)) {
            paths.push(repository().join(word));
        }
    }
    for link in text.split("](").skip(1) {
        let Some(target) = link.split(')').next() else {
            continue;
        };
        let target = target.split('#').next().unwrap_or("");
        if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
            continue;
        }
        paths.push(dir.join(target));
    }
    paths.retain(|path| !is_placeholder(&path.to_string_lossy()));
    paths
}

/// A pattern or a name to fill in (`crates/*/tests`, `tests/NAME.rs`), not a path.
fn is_placeholder(path: &str) -> bool {
    let capitals = |part: &str| {
        let stem = part.split('.').next().unwrap_or("");
        stem.len() > 1
            && stem.chars().all(|c| c.is_ascii_uppercase() || c == '_')
            && !["README", "ARCHITECTURE", "CONTRIBUTING"].contains(&stem)
    };
    path.chars().any(|c| "*{}<>…$".contains(c))
        || path.contains("...")
        || path.split('/').any(capitals)
}

#[test]
fn every_repository_path_the_docs_name_exists() {
    let mut missing = Vec::new();
    let mut checked = 0;
    for name in documents() {
        let dir = repository().join(&name).parent().unwrap().to_path_buf();
        for path in named_paths(&read(&name), &dir) {
            checked += 1;
            // A path may end in punctuation of the sentence around it.
            let trimmed = PathBuf::from(
                path.to_string_lossy()
                    .trim_end_matches(['.', ',', ':', ';']),
            );
            if !path.exists() && !trimmed.exists() {
                missing.push(format!("{name}: {}", path.display()));
            }
        }
    }
    assert!(
        checked > 50,
        "only {checked} paths found: the parser is broken"
    );
    assert!(
        missing.is_empty(),
        "named but missing:\n{}",
        missing.join("\n")
    );
}

#[test]
fn the_readme_states_the_first_time_setup() {
    let manifest = read("Cargo.toml");
    let version = manifest
        .lines()
        .find_map(|line| line.strip_prefix("rust-version = "))
        .expect("rust-version in Cargo.toml")
        .trim_matches('"');
    let readme = read("README.md");
    let setup = &readme[..readme.find("<!-- runnable -->").expect("the quick start")];
    for fact in [
        format!("Rust {version}"),
        "C compiler".to_string(),
        "`scripts/test` runs as root".to_string(),
        "apt-get".to_string(),
    ] {
        assert!(setup.contains(&fact), "the first-time setup lacks {fact:?}");
    }
}

#[test]
fn the_notes_operators_missed_are_there() {
    let words = |text: String| text.split_whitespace().collect::<Vec<_>>().join(" ");
    let readme = words(read("README.md"));
    for note in [
        "fsfreeze -f",
        "fsfreeze -u",
        "recovery required",
        "keeps the size it negotiated until it reconnects",
        "Restarting `serve` ends every client's connection",
        "reconnect-delay",
        "nbd-client -persist",
    ] {
        assert!(readme.contains(note), "README lacks {note:?}");
    }
    let lvm = words(read("docs/lvm.md"));
    assert!(lvm.contains("rewrites metadata blocks"), "docs/lvm.md");
    assert!(
        !lvm.contains("writes nothing"),
        "docs/lvm.md still says import writes nothing"
    );
    // The snapshot's own help shows the freeze.
    let help = thinpool_ok(&["volume", "snapshot", "--help"]);
    assert!(
        help.contains("fsfreeze -f") && help.contains("fsfreeze -u"),
        "{help}"
    );
}

#[test]
fn a_client_keeps_its_size_after_a_resize_and_a_restart_ends_its_connection() {
    let scratch = ScratchDir::new("operator-docs");
    let pool = scratch.join("pool");
    let p = pool.to_str().unwrap();
    create_pool(&pool, &["--data-size", "64M"]);
    create_volume(&pool, "vm", "8M");
    let served = serve(&pool, &["--quiet"]);
    let (mut old, old_size, _, _) = Client::negotiate(&served.socket, "vm", Mode::Simple, false);
    assert_eq!(old_size, 8 * MIB);
    old.write(0, &pattern(1, 65536));
    old.flush();
    thinpool_ok(&["volume", "resize", "vm", "--size", "16M", "--pool", p]);
    let (new, new_size, _, _) = Client::negotiate(&served.socket, "vm", Mode::Simple, false);
    assert_eq!(new_size, 16 * MIB, "a new connection gets the new size");
    new.disconnect();
    // The old connection goes on, with the size it negotiated (NBD tells it nothing).
    assert_eq!(old.read(0, 65536), pattern(1, 65536));

    assert!(served.stop().success());
    assert!(old.is_closed(), "the connection outlived its server");
    let served = serve(&pool, &["--quiet"]);
    let (mut again, size, _, _) = Client::negotiate(&served.socket, "vm", Mode::Simple, false);
    assert_eq!(size, 16 * MIB);
    assert_eq!(again.read(0, 65536), pattern(1, 65536));
    again.disconnect();
    assert!(served.stop().success());
}

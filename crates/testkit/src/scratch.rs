//! Per-test scratch directories under the system temporary directory.
//!
//! A [`ScratchDir`] is removed when dropped, except when the test is failing: then it is kept
//! and its path printed, so the metadata images a failing test produced can be inspected.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

static NEXT_INDEX: AtomicU64 = AtomicU64::new(0);

/// A fresh, empty directory, unique to this process and call.
#[derive(Debug)]
pub struct ScratchDir {
    path: PathBuf,
}

impl ScratchDir {
    /// Create `<tmp>/thinpool-<label>-<pid>-<n>`; `label` names the test for humans.
    pub fn new(label: &str) -> ScratchDir {
        let label: String = label
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let index = NEXT_INDEX.fetch_add(1, Ordering::Relaxed);
        let path =
            std::env::temp_dir().join(format!("thinpool-{label}-{}-{index}", std::process::id()));
        if path.exists() {
            std::fs::remove_dir_all(&path)
                .unwrap_or_else(|e| panic!("cannot clear stale {}: {e}", path.display()));
        }
        std::fs::create_dir_all(&path)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", path.display()));
        ScratchDir { path }
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A path inside the directory.
    pub fn join(&self, name: impl AsRef<Path>) -> PathBuf {
        self.path.join(name)
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("keeping scratch directory {}", self.path.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scratch_dir_is_unique_and_removed_on_drop() {
        let a = ScratchDir::new("unit test");
        let b = ScratchDir::new("unit test");
        assert_ne!(a.path(), b.path());
        std::fs::write(a.join("file"), b"x").unwrap();
        let path = a.path().to_path_buf();
        drop(a);
        assert!(!path.exists());
    }
}

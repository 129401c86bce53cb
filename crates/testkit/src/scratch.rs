//! Per-test scratch directories under the system temporary directory.
//!
//! A [`ScratchDir`] is removed when dropped, except when the test is failing: then it is kept
//! and its path printed, so the metadata images a failing test produced can be inspected.
//! [`sized_file`] makes (or grows) the sparse files tests use as devices and images.

use std::fs::{File, OpenOptions};
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
        ScratchDir::new_in(&std::env::temp_dir(), label)
    }

    /// [`ScratchDir::new`] under `parent` instead of the temporary directory (a test that
    /// needs another file system, e.g. tmpfs at `/dev/shm`).
    pub fn new_in(parent: &Path, label: &str) -> ScratchDir {
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
        let path = parent.join(format!("thinpool-{label}-{}-{index}", std::process::id()));
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

/// Creates `path` if it does not exist and sets its length to `size_bytes` (sparse: the new
/// space reads as zeros), then syncs it, so a process started next (a tool, a server) sees
/// the final size. Returns the file, open for reading and writing. Panics on any error.
pub fn sized_file(path: &Path, size_bytes: u64) -> File {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .unwrap_or_else(|e| panic!("cannot open {}: {e}", path.display()));
    file.set_len(size_bytes)
        .unwrap_or_else(|e| panic!("cannot size {} to {size_bytes}: {e}", path.display()));
    file.sync_all()
        .unwrap_or_else(|e| panic!("cannot sync {}: {e}", path.display()));
    file
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

    #[test]
    fn sized_file_creates_and_grows_keeping_contents() {
        let dir = ScratchDir::new("sized-file");
        let path = dir.join("device");
        drop(sized_file(&path, 4096));
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 4096);
        std::fs::write(&path, b"kept").unwrap();
        drop(sized_file(&path, 1 << 20));
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(bytes.len(), 1 << 20);
        assert_eq!(&bytes[..4], b"kept");
        assert!(bytes[4..].iter().all(|&b| b == 0));
    }
}

//! [`Made`]: what `PoolDir::create_private` made, so that a refused `create` or `import`
//! leaves nothing behind (issue 25: refused runs left empty pool directories).

use std::path::{Path, PathBuf};

/// What [`PoolDir::create_private`](super::PoolDir::create_private) found, to undo a refused create or import: the
/// directory it made (the topmost one, if it made parents too), or the entries of the
/// directory that was there before.
#[derive(Debug)]
#[must_use = "a refused create must undo what it made"]
pub struct Made {
    dir: PathBuf,
    /// The topmost directory that did not exist (the pool directory or a parent).
    pub(super) created: Option<PathBuf>,
    /// The names in the directory before, when it existed.
    existing: Vec<std::ffi::OsString>,
}

impl Made {
    pub(super) fn before(dir: &Path) -> Made {
        let created = dir
            .ancestors()
            .take_while(|path| !path.as_os_str().is_empty() && !path.exists())
            .last()
            .map(Path::to_path_buf);
        let existing = match created {
            Some(_) => Vec::new(),
            None => std::fs::read_dir(dir)
                .map(|entries| entries.flatten().map(|e| e.file_name()).collect())
                .unwrap_or_default(),
        };
        Made {
            dir: dir.to_path_buf(),
            created,
            existing,
        }
    }

    /// Leaves things as they were: the directory made (with its parents made) is removed
    /// with what was written in it; in a directory that was there, the files that were not
    /// are removed.
    pub fn undo(self) {
        match &self.created {
            Some(top) => {
                let _ = std::fs::remove_dir_all(&self.dir);
                remove_empty_parents(&self.dir, top);
            }
            None => {
                let Ok(entries) = std::fs::read_dir(&self.dir) else {
                    return;
                };
                for entry in entries.flatten() {
                    let is_file = entry.file_type().is_ok_and(|t| !t.is_dir());
                    if is_file && !self.existing.contains(&entry.file_name()) {
                        let _ = std::fs::remove_file(entry.path());
                    }
                }
            }
        }
    }
}

/// Removes the (empty) parents of `dir` that were made with it, up to and including `top`.
pub(super) fn remove_empty_parents(dir: &Path, top: &Path) {
    for parent in dir.ancestors().skip(1) {
        if !parent.starts_with(top) {
            break;
        }
        if std::fs::remove_dir(parent).is_err() {
            break;
        }
    }
}

//! A pool directory opened once ([`PoolDirectory`]): every later open, create, rename and
//! removal of the pool's own files is relative to that descriptor, so a directory renamed
//! away, or a link flipped in the path, after the open does not send the pool's writes
//! elsewhere (issue 20, finding 6). Names are single path components, never followed when
//! they are links.
//!
//! The open itself follows the path as given: the caller checks beforehand that nobody but
//! it and root can change that path (the daemon's `pool_dir::check_safe`).

use rustix::fs::{AtFlags, Mode, OFlags};
use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

/// A directory held open by descriptor (see the module documentation).
#[derive(Debug)]
pub struct PoolDirectory {
    fd: OwnedFd,
    /// The path it was opened by, for messages only.
    path: PathBuf,
}

impl PoolDirectory {
    /// Open the directory at `path` (which must be a directory).
    pub fn open(path: &Path) -> io::Result<PoolDirectory> {
        let fd = rustix::fs::open(
            path,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        Ok(PoolDirectory {
            fd,
            path: path.to_path_buf(),
        })
    }

    /// The path it was opened by (it may lead elsewhere now).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `name` in the directory, for messages.
    pub fn shown(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    /// Open `name` (never through a link) for reading, or reading and writing.
    pub fn open_file(&self, name: &str, writable: bool) -> io::Result<File> {
        let access = if writable {
            OFlags::RDWR
        } else {
            OFlags::RDONLY
        };
        self.open_at(name, access, Mode::empty())
    }

    fn open_at(&self, name: &str, flags: OFlags, mode: Mode) -> io::Result<File> {
        check_name(name)?;
        let fd = rustix::fs::openat(
            &self.fd,
            name,
            flags | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            mode,
        )?;
        Ok(File::from(fd))
    }

    /// The contents of `name` as text (never through a link).
    pub fn read_to_string(&self, name: &str) -> io::Result<String> {
        use std::io::Read;
        let mut text = String::new();
        self.open_file(name, false)?.read_to_string(&mut text)?;
        Ok(text)
    }

    /// Create `name` afresh, private to its owner (mode 0600): a stale file or link left
    /// there (by a crash, or planted) is removed first, and creation fails rather than
    /// follow or reuse anything that appears in between.
    pub fn create_private(&self, name: &str) -> io::Result<File> {
        match self.remove(name) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        self.open_at(
            name,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL,
            Mode::from_raw_mode(0o600),
        )
    }

    /// Rename `from` to `to`, both in this directory.
    pub fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        check_name(from)?;
        check_name(to)?;
        Ok(rustix::fs::renameat(&self.fd, from, &self.fd, to)?)
    }

    /// Remove `name` (a link is removed, not followed).
    pub fn remove(&self, name: &str) -> io::Result<()> {
        check_name(name)?;
        Ok(rustix::fs::unlinkat(&self.fd, name, AtFlags::empty())?)
    }

    /// Make the directory's entries durable (after a create or rename).
    pub fn sync(&self) -> io::Result<()> {
        Ok(rustix::fs::fsync(&self.fd)?)
    }

    /// The names in the directory that are valid UTF-8 (others are not the pool's).
    pub fn names(&self) -> io::Result<Vec<String>> {
        let mut names = Vec::new();
        for entry in rustix::fs::Dir::read_from(&self.fd)? {
            let entry = entry?;
            if let Ok(name) = entry.file_name().to_str() {
                if name != "." && name != ".." {
                    names.push(name.to_string());
                }
            }
        }
        Ok(names)
    }
}

/// A name of the directory is one path component: no `/`, not empty, not `.` or `..`.
fn check_name(name: &str) -> io::Result<()> {
    if name.is_empty() || name == "." || name == ".." || name.contains('/') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{name:?} is not a file name of the pool directory"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_stay_in_the_directory_opened_after_it_is_renamed_and_replaced() {
        let root = std::env::temp_dir().join(format!("thinpool-directory-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let (pool, moved, other) = (root.join("pool"), root.join("moved"), root.join("other"));
        std::fs::create_dir_all(&pool).unwrap();
        std::fs::create_dir_all(&other).unwrap();
        let dir = PoolDirectory::open(&pool).unwrap();
        std::fs::rename(&pool, &moved).unwrap();
        std::os::unix::fs::symlink(&other, &pool).unwrap();
        use std::io::Write;
        dir.create_private("a.tmp")
            .unwrap()
            .write_all(b"x")
            .unwrap();
        dir.rename("a.tmp", "a").unwrap();
        dir.sync().unwrap();
        assert_eq!(std::fs::read(moved.join("a")).unwrap(), b"x");
        assert!(!other.join("a").exists());
        assert_eq!(dir.names().unwrap(), vec!["a".to_string()]);
        assert!(dir.open_file("../other", false).is_err());
        std::os::unix::fs::symlink(other.join("a"), moved.join("link")).unwrap();
        assert!(
            dir.read_to_string("link").is_err(),
            "a link is not followed"
        );
        std::fs::remove_dir_all(&root).unwrap();
    }
}

//! The pool directory as the management commands see it: where it is (`--pool DIR`, else
//! `$THINPOOL_POOL`, else `./thinpool-pool`), the files the binary keeps beside the engine's
//! (`pool.json` with the options chosen at create, `nbd.sock`, `control.sock`). Size parsing
//! and the text formatting the commands share are in `crate::text`, re-exported here.
//!
//! Layout of a pool directory (the engine owns `metadata`, `data` and the catalogs):
//!
//! ```text
//!   DIR/metadata           pool metadata (dm-thin format)      engine
//!   DIR/data               data blocks                          engine
//!   DIR/catalog-N.json     volume names and sizes               engine
//!   DIR/pool.json          options chosen at create             this module
//!   DIR/devices.json       a pool on block devices: their paths engine (instead of
//!                          metadata and data; see engine::block_device)
//!   DIR/nbd.sock           NBD Unix socket while serving        serve
//!   DIR/control.sock       control socket while serving         serve
//!   DIR/replication.json   `thinpool replicate`'s state (.lock) crate::replication
//! ```
//!
//! Whoever can write to the directory can replace any of these with a link to another file
//! (which the pool would then truncate, overwrite or serve) or with a socket of their own.
//! So a pool directory must belong to the caller and be writable by nobody else, and no
//! parent may let others rename it ([`PoolDir::check_safe`]); `thinpool create` makes it
//! 0700. Files in it are created 0600, never through a link, and the management commands
//! refuse links in place of the pool's files and make older, readable files private
//! ([`PoolDir::check_files`]). `--allow-shared-dir` skips the directory checks for those who
//! accept the risk. See `docs/security.md`.

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use thin_pool::PoolOptions;

pub use crate::text::{format_size, parse_size, parse_size_nonzero, percent, table};
pub use made::Made;

mod made;
mod missing;

/// Environment variable naming the pool directory when `--pool` is not given.
pub const POOL_VARIABLE: &str = "THINPOOL_POOL";
/// Pool directory when neither `--pool` nor `$THINPOOL_POOL` names one.
pub const DEFAULT_POOL_DIR: &str = "thinpool-pool";
/// The options file inside a pool directory.
pub const OPTIONS_FILE: &str = "pool.json";
/// Default NBD Unix socket inside a pool directory.
pub const NBD_SOCKET_FILE: &str = "nbd.sock";
/// Control socket inside a pool directory.
pub const CONTROL_SOCKET_FILE: &str = "control.sock";
/// Mode of a pool directory thinpool creates.
pub const DIR_MODE: u32 = 0o700;
/// Mode of every file thinpool creates in a pool directory.
pub const FILE_MODE: u32 = 0o600;
/// Permission bits that let users other than the owner write (group, other).
const OTHERS_WRITE: u32 = 0o022;
/// The sticky bit: in a directory, only an entry's owner may rename or remove it.
const STICKY: u32 = 0o1000;

/// The `--pool DIR` argument every management command takes.
#[derive(clap::Args, Debug, Clone)]
pub struct PoolArg {
    /// Pool directory [default: $THINPOOL_POOL, else ./thinpool-pool].
    #[arg(long = "pool", value_name = "DIR")]
    pub pool: Option<PathBuf>,
    /// Use the pool directory even if other users can write to it or it is not yours
    /// (they can then swap the pool's files and sockets for their own).
    #[arg(long = "allow-shared-dir")]
    pub allow_shared_dir: bool,
}

/// Where the pool directory is and how it was chosen.
#[derive(Clone, Debug)]
pub struct PoolDir {
    /// The directory.
    pub path: PathBuf,
    /// Neither `--pool` nor `$THINPOOL_POOL` named it.
    pub is_default: bool,
    /// `--allow-shared-dir`: skip the ownership and permission checks of the directory.
    pub allow_shared: bool,
}

impl PoolArg {
    /// Resolves the directory: `--pool`, else `$THINPOOL_POOL`, else `./thinpool-pool`.
    pub fn resolve(&self) -> PoolDir {
        let (path, is_default) = match (&self.pool, std::env::var_os(POOL_VARIABLE)) {
            (Some(path), _) => (path.clone(), false),
            (None, Some(value)) if !value.is_empty() => (PathBuf::from(value), false),
            (None, _) => (PathBuf::from(DEFAULT_POOL_DIR), true),
        };
        PoolDir {
            path,
            is_default,
            allow_shared: self.allow_shared_dir,
        }
    }
}

impl PoolDir {
    /// The options file.
    pub fn options_path(&self) -> PathBuf {
        self.path.join(OPTIONS_FILE)
    }

    /// The control socket.
    pub fn control_socket(&self) -> PathBuf {
        self.path.join(CONTROL_SOCKET_FILE)
    }

    /// The default NBD socket.
    pub fn nbd_socket(&self) -> PathBuf {
        self.path.join(NBD_SOCKET_FILE)
    }

    /// Fails with a hint unless the directory holds a pool, saying which of these it is: no
    /// pool named at all (neither `--pool` nor `$THINPOOL_POOL`, and no `./thinpool-pool`),
    /// no such directory, not a directory, permission denied, or a directory without a pool
    /// ([`PoolDir::explain_missing_pool`]); then checks that the directory and the pool's
    /// files are safe to use ([`PoolDir::check_safe`], [`PoolDir::check_files`]).
    pub fn require_pool(&self) -> anyhow::Result<()> {
        if !thin_pool::Pool::exists(&self.path) {
            self.explain_missing_pool()?;
        }
        self.check_safe()?;
        self.check_files()
    }

    /// Creates the directory (and missing parents) with mode 0700 unless it exists, then
    /// checks it as [`PoolDir::check_safe`] does: a directory someone else made in its place
    /// first is refused, not used. The answer undoes it ([`Made::undo`]) for a create or an
    /// import that is refused later.
    pub fn create_private(&self) -> anyhow::Result<Made> {
        let made = Made::before(&self.path);
        let created = std::fs::DirBuilder::new()
            .recursive(true)
            .mode(DIR_MODE)
            .create(&self.path)
            .with_context(|| format!("cannot create {}", self.path.display()));
        let checked = created
            .and_then(|()| self.check_safe())
            .and_then(|()| self.check_files());
        if let Err(error) = checked {
            // Only what this call made: a directory refused as unsafe is not ours to empty.
            if let Some(top) = &made.created {
                let _ = std::fs::remove_dir(&self.path);
                made::remove_empty_parents(&self.path, top);
            }
            return Err(error);
        }
        Ok(made)
    }

    /// Refuses a directory that other users could change: not owned by the caller, writable
    /// by group or others, or under a parent that lets others rename it (writable by others
    /// and not sticky). Skipped with `--allow-shared-dir`.
    pub fn check_safe(&self) -> anyhow::Result<()> {
        if self.allow_shared {
            return Ok(());
        }
        let shown = self.path.display();
        check_path_components(&self.path)?;
        let real = std::fs::canonicalize(&self.path)
            .with_context(|| format!("cannot resolve pool directory {shown}"))?;
        let metadata = std::fs::metadata(&real)
            .with_context(|| format!("cannot examine pool directory {shown}"))?;
        if !metadata.is_dir() {
            bail!("{shown} is not a directory");
        }
        let me = current_uid();
        let mode = metadata.mode() & 0o7777;
        let skip = "--allow-shared-dir skips this check, at that risk";
        if metadata.uid() != me {
            bail!(
                "refusing pool directory {shown}: it belongs to uid {}, not to you (uid {me}), \
                 and its owner could replace the pool's files with links to files of yours or \
                 its sockets with their own. Use a directory of your own (`thinpool create` \
                 makes one with mode 0700) or `chown {me} {shown}`; {skip}",
                metadata.uid()
            );
        }
        if mode & OTHERS_WRITE != 0 {
            let fix = if mode & STICKY != 0 {
                format!(
                    "use a directory of its own inside it, e.g. --pool {}, which thinpool \
                     creates with mode 0700",
                    self.path.join(DEFAULT_POOL_DIR).display()
                )
            } else {
                format!("make it private with `chmod 700 {shown}`")
            };
            bail!(
                "refusing pool directory {shown}: other users can write to it (mode {mode:04o}), \
                 so they could replace the pool's files with links to files of yours or its \
                 sockets with their own. To fix it, {fix}; {skip}"
            );
        }
        for parent in real.ancestors().skip(1) {
            let metadata = std::fs::metadata(parent)
                .with_context(|| format!("cannot examine {}", parent.display()))?;
            let mode = metadata.mode() & 0o7777;
            if mode & OTHERS_WRITE != 0 && mode & STICKY == 0 {
                bail!(
                    "refusing pool directory {shown}: its parent {} is writable by other users \
                     and not sticky (mode {mode:04o}), so they could rename the pool directory \
                     and put one of their own in its place. Run `chmod go-w {}` (or `chmod +t`), \
                     or keep the pool elsewhere; {skip}",
                    parent.display(),
                    parent.display()
                );
            }
        }
        Ok(())
    }

    /// Checks the files the pool keeps in the directory (`metadata`, `data`, the catalogs,
    /// `pool.json`): a symbolic link in place of one is refused (the pool would write
    /// through it), a file of another user too (unless `--allow-shared-dir`), and a file
    /// other users may read (made by an older version) is made private (0600), with a note.
    pub fn check_files(&self) -> anyhow::Result<()> {
        let me = current_uid();
        for name in self.pool_file_names()? {
            let path = self.path.join(&name);
            // Not following a link, and not blocking on a FIFO someone left there.
            let file = match OpenOptions::new()
                .read(true)
                .custom_flags(no_follow() | rustix::fs::OFlags::NONBLOCK.bits() as i32)
                .open(&path)
            {
                Ok(file) => file,
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => continue,
                Err(error)
                    if error.raw_os_error() == Some(rustix::io::Errno::LOOP.raw_os_error()) =>
                {
                    bail!(
                    "refusing pool file {}: it is a symbolic link, which thinpool never follows \
                     in a pool directory (someone could point it at a file of yours); \
                     remove it or put the file itself there",
                    path.display()
                )
                }
                Err(error) => {
                    return Err(error).with_context(|| format!("cannot open {}", path.display()))
                }
            };
            self.check_file(&file, &path, me)?;
        }
        Ok(())
    }

    /// The files the pool keeps here: the fixed ones and every `catalog-N.json`.
    fn pool_file_names(&self) -> anyhow::Result<Vec<std::ffi::OsString>> {
        let mut names: Vec<std::ffi::OsString> = [
            thin_pool::METADATA_FILE,
            thin_pool::DATA_FILE,
            OPTIONS_FILE,
            thin_pool::block_device::DEVICES_FILE,
        ]
        .iter()
        .map(|name| name.into())
        .collect();
        let entries = std::fs::read_dir(&self.path)
            .with_context(|| format!("cannot list {}", self.path.display()))?;
        for entry in entries {
            let name = entry
                .with_context(|| format!("cannot list {}", self.path.display()))?
                .file_name();
            if name
                .to_str()
                .is_some_and(|n| n.starts_with("catalog-") && n.ends_with(".json"))
            {
                names.push(name);
            }
        }
        Ok(names)
    }

    /// One pool file, open: refused if another user's (unless `--allow-shared-dir`), made
    /// private if ours and readable by others.
    fn check_file(&self, file: &File, path: &Path, me: u32) -> anyhow::Result<()> {
        let metadata = file
            .metadata()
            .with_context(|| format!("cannot examine {}", path.display()))?;
        if metadata.uid() != me && !self.allow_shared {
            bail!(
                "refusing pool file {}: it belongs to uid {}, not to you (uid {me}); \
                 --allow-shared-dir skips this check, at that risk",
                path.display(),
                metadata.uid()
            );
        }
        let mode = metadata.mode() & 0o7777;
        if metadata.is_file() && metadata.uid() == me && mode & 0o077 != 0 {
            file.set_permissions(std::fs::Permissions::from_mode(FILE_MODE))
                .with_context(|| format!("cannot make {} private", path.display()))?;
            eprintln!(
                "thinpool: {} was open to other users (mode {mode:04o}); made it private (0600)",
                path.display()
            );
        }
        Ok(())
    }
}

/// Most symbolic links followed while checking a path (as Linux's `MAXSYMLINKS`).
const SYMLINKS_MAX: usize = 40;

/// Refuses a path to a pool directory that goes through an entry someone else could
/// change: every directory it passes (the working directory's too, for a relative path, and
/// those a symbolic link leads through) must be one only the caller or root can write, or
/// a sticky one owned by the caller or root (as `/tmp`), and then the entry taken from it
/// (a directory or a symbolic link) must be the caller's or root's, since in a sticky
/// directory an entry's owner may still replace it. A link owned by another user in `/tmp`
/// is refused: its owner could point it elsewhere between this check and a later open
/// (issue 20, finding 6: root's catalog went into that user's directory). What passes
/// cannot change under the caller, so going through the path again later finds the same
/// directory. A part of the path that does not exist yet ends the walk (`create` makes it).
fn check_path_components(path: &Path) -> anyhow::Result<()> {
    use std::collections::VecDeque;
    use std::path::Component;
    let shown = path.display();
    let me = current_uid();
    let absolute = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .context("cannot read the working directory")?
            .join(path)
    };
    let mut pending: VecDeque<std::ffi::OsString> = VecDeque::new();
    let push_front = |pending: &mut VecDeque<std::ffi::OsString>, target: &Path| {
        for component in target.components().rev() {
            match component {
                Component::RootDir => pending.push_front("/".into()),
                Component::Normal(name) => pending.push_front(name.to_os_string()),
                Component::ParentDir => pending.push_front("..".into()),
                Component::CurDir | Component::Prefix(_) => {}
            }
        }
    };
    push_front(&mut pending, &absolute);
    let mut current = PathBuf::from("/");
    let mut links = 0;
    while let Some(name) = pending.pop_front() {
        if name == "/" {
            current = PathBuf::from("/");
            continue;
        }
        if name == ".." {
            current.pop();
            continue;
        }
        let parent = std::fs::metadata(&current)
            .with_context(|| format!("cannot examine {}", current.display()))?;
        let entry_path = current.join(&name);
        let entry = match std::fs::symlink_metadata(&entry_path) {
            Ok(entry) => entry,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(error) => {
                return Err(error)
                    .with_context(|| format!("cannot examine {}", entry_path.display()))
            }
        };
        check_entry_of_parent(&shown, &current, &parent, &entry_path, &entry, me)?;
        if entry.file_type().is_symlink() {
            links += 1;
            if links > SYMLINKS_MAX {
                bail!("refusing pool directory {shown}: too many symbolic links");
            }
            let target = std::fs::read_link(&entry_path)
                .with_context(|| format!("cannot read link {}", entry_path.display()))?;
            push_front(&mut pending, &target);
        } else {
            current = entry_path;
        }
    }
    Ok(())
}

/// One step of [`check_path_components`]: `entry` (at `entry_path`), taken from directory
/// `current` (`parent` its metadata), may be changed by nobody but the caller (`me`) and
/// root: `current` is writable only by them, or sticky and theirs with `entry` theirs.
fn check_entry_of_parent(
    shown: &std::path::Display<'_>,
    current: &Path,
    parent: &std::fs::Metadata,
    entry_path: &Path,
    entry: &std::fs::Metadata,
    me: u32,
) -> anyhow::Result<()> {
    let trusted = |uid: u32| uid == me || uid == 0;
    let mode = parent.mode() & 0o7777;
    let others_write = mode & OTHERS_WRITE != 0 || (!trusted(parent.uid()) && mode & 0o200 != 0);
    if others_write {
        let skip = "--allow-shared-dir skips this check, at that risk";
        if mode & STICKY == 0 || !trusted(parent.uid()) {
            let why = if mode & STICKY == 0 {
                "not sticky"
            } else {
                "sticky but not yours or root's"
            };
            bail!(
                "refusing pool directory {shown}: its parent {} is writable by other users \
                 and {why} (mode {mode:04o}, owner uid {}), so they could replace {} with a \
                 link to a directory of theirs. Give a path that only you or root can \
                 change (`chmod go-w {}`, or keep the pool elsewhere); {skip}",
                current.display(),
                parent.uid(),
                entry_path.display(),
                current.display()
            );
        }
        if !trusted(entry.uid()) {
            bail!(
                "refusing pool directory {shown}: the path goes through {}, which belongs \
                 to uid {} in the shared directory {}, so its owner could point it \
                 elsewhere (e.g. at a directory of theirs). Give the pool directory's own \
                 path; {skip}",
                entry_path.display(),
                entry.uid(),
                current.display()
            );
        }
    }
    Ok(())
}

/// The caller's effective user id.
pub fn current_uid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// `O_NOFOLLOW` for [`OpenOptionsExt::custom_flags`].
fn no_follow() -> i32 {
    rustix::fs::OFlags::NOFOLLOW.bits() as i32
}

/// Creates `path` afresh with mode 0600: a stale file or link there is removed first, and
/// the creation fails rather than follow or reuse anything that appears in between.
pub(crate) fn create_private_file(path: &Path) -> std::io::Result<File> {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => return Err(error),
    }
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(FILE_MODE)
        .custom_flags(no_follow())
        .open(path)
}

/// Pool options chosen at create that every later open must use, kept in `pool.json`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredOptions {
    /// Format version of this file.
    pub version: u32,
    /// Zero the unwritten part of a newly provisioned block (off with `--no-zero`).
    pub zero_new_blocks: bool,
    /// Fail writes at once when out of data space instead of queueing them.
    pub error_if_no_space: bool,
    /// Space alerts, autoextend, the no-space timeout and passdown (absent in files written
    /// before they existed: the defaults).
    #[serde(flatten)]
    pub space: SpaceOptions,
}

/// The space settings of `pool.json` (`--low-water`, `--autoextend-*`,
/// `--no-space-timeout`, `--no-discard-passdown`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct SpaceOptions {
    /// Used share of the data and of the metadata, in percent, that raises the low-water
    /// alert.
    pub low_water_percent: u32,
    /// Automatic growth, if on.
    pub autoextend: Option<StoredAutoextend>,
    /// How long a write waits for space when out of it (0: forever).
    pub no_space_timeout_seconds: u64,
    /// Give freed data blocks back to the host (punch holes in the data file).
    pub discard_passdown: bool,
}

impl Default for SpaceOptions {
    fn default() -> Self {
        SpaceOptions {
            low_water_percent: thin_pool::LOW_WATER_PERCENT_DEFAULT,
            autoextend: None,
            no_space_timeout_seconds: 60,
            discard_passdown: true,
        }
    }
}

/// Autoextend as `pool.json` keeps it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredAutoextend {
    /// Used share, in percent, that triggers a growth.
    pub threshold_percent: u32,
    /// Growth step: a share of the current size, in percent...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by_percent: Option<u32>,
    /// ...or a size in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by_bytes: Option<u64>,
    /// Largest data size autoextend grows to.
    pub max_bytes: u64,
}

impl StoredAutoextend {
    /// The engine's form.
    pub fn engine(&self) -> thin_pool::Autoextend {
        thin_pool::Autoextend {
            threshold_percent: self.threshold_percent,
            by: match (self.by_percent, self.by_bytes) {
                (_, Some(bytes)) => thin_pool::ExtendBy::Bytes(bytes),
                (percent, None) => thin_pool::ExtendBy::Percent(percent.unwrap_or(20)),
            },
            max_bytes: self.max_bytes,
        }
    }
}

impl Default for StoredOptions {
    fn default() -> Self {
        StoredOptions {
            version: 1,
            zero_new_blocks: true,
            error_if_no_space: false,
            space: SpaceOptions::default(),
        }
    }
}

impl StoredOptions {
    /// Reads `pool.json`; a pool without one (made by an older binary or by hand) gets the
    /// defaults.
    pub fn load(dir: &PoolDir) -> anyhow::Result<StoredOptions> {
        let path = dir.options_path();
        let read = || -> std::io::Result<String> {
            let mut text = String::new();
            OpenOptions::new()
                .read(true)
                .custom_flags(no_follow())
                .open(&path)?
                .read_to_string(&mut text)?;
            Ok(text)
        };
        let text = match read() {
            Ok(text) => text,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                return Ok(StoredOptions::default())
            }
            Err(error) => {
                return Err(error).with_context(|| format!("cannot read {}", path.display()))
            }
        };
        let options: StoredOptions = serde_json::from_str(&text)
            .with_context(|| format!("{} is not a valid options file", path.display()))?;
        if options.version != 1 {
            bail!(
                "{}: options version {} is not supported (expected 1)",
                path.display(),
                options.version
            );
        }
        Ok(options)
    }

    /// Writes `pool.json` durably (temporary file, fsync, rename, fsync of the directory).
    pub fn store(&self, dir: &PoolDir) -> anyhow::Result<()> {
        let path = dir.options_path();
        let temporary = dir.path.join(format!("{OPTIONS_FILE}.tmp"));
        let text = serde_json::to_string_pretty(self).context("cannot encode pool options")?;
        let write = || -> std::io::Result<()> {
            let mut file = create_private_file(&temporary)?;
            file.write_all(text.as_bytes())?;
            file.write_all(b"\n")?;
            file.sync_all()?;
            std::fs::rename(&temporary, &path)?;
            File::open(&dir.path)?.sync_all()
        };
        write().with_context(|| format!("cannot write {}", path.display()))
    }

    /// The engine options for an open.
    pub fn pool_options(&self) -> PoolOptions {
        PoolOptions {
            zero_new_blocks: self.zero_new_blocks,
            error_if_no_space: self.error_if_no_space,
            low_water_percent: self.space.low_water_percent,
            autoextend: self.space.autoextend.as_ref().map(StoredAutoextend::engine),
            no_space_timeout: std::time::Duration::from_secs(self.space.no_space_timeout_seconds),
            discard_passdown: self.space.discard_passdown,
            ..PoolOptions::default()
        }
    }
}

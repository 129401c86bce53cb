//! The benchmark's scratch directory and its Ctrl-C handling.
//!
//! Every pool the benchmark builds lives in one fresh directory, `thinpool-bench-<pid>`,
//! made inside `--dir` (or `/dev/shm`). [`BenchDir`] removes it when dropped, so a normal
//! end and an error both clean up. A signal thread turns the first SIGINT or SIGTERM into a
//! flag that the benchmark polls between steps ([`BenchDir::check_interrupted`]), so it stops
//! with an error and the drop cleans up; a second signal removes the directory from the
//! signal thread and exits with status 130 at once.

use anyhow::{bail, Context};
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Where the default scratch directory goes: memory, so the device is never the bottleneck.
const DEFAULT_PARENT: &str = "/dev/shm";

/// The scratch directory; removed on drop.
#[derive(Debug)]
pub struct BenchDir {
    path: PathBuf,
    /// `--dir` itself, when the benchmark created it (removed too, if left empty).
    created_parent: Option<PathBuf>,
    interrupted: Arc<AtomicBool>,
    /// `--metadata-device`/`--data-device`: the pools go on these block devices.
    pub devices: Option<thin_pool::block_device::DevicePaths>,
}

impl BenchDir {
    /// Make a fresh directory inside `parent` (default `/dev/shm`) and catch Ctrl-C.
    pub fn create(parent: Option<&Path>) -> anyhow::Result<BenchDir> {
        let parent = parent.unwrap_or(Path::new(DEFAULT_PARENT)).to_path_buf();
        let created_parent = if parent.exists() {
            None
        } else {
            std::fs::create_dir_all(&parent)
                .with_context(|| format!("creating {}", parent.display()))?;
            Some(parent.clone())
        };
        let path = parent.join(format!("thinpool-bench-{}", std::process::id()));
        if path.exists() {
            bail!("{} exists: remove it or pick another --dir", path.display());
        }
        std::fs::create_dir(&path).with_context(|| format!("creating {}", path.display()))?;
        let interrupted = Arc::new(AtomicBool::new(false));
        let dir = BenchDir {
            path,
            created_parent,
            interrupted,
            devices: None,
        };
        dir.catch_signals()?;
        Ok(dir)
    }

    fn catch_signals(&self) -> anyhow::Result<()> {
        let mut signals =
            Signals::new([SIGINT, SIGTERM]).context("installing the Ctrl-C handler")?;
        let interrupted = self.interrupted.clone();
        let path = self.path.clone();
        let created_parent = self.created_parent.clone();
        std::thread::Builder::new()
            .name("bench-signals".to_string())
            .spawn(move || {
                for _ in signals.forever() {
                    if interrupted.swap(true, Ordering::AcqRel) {
                        eprintln!(
                            "thinpool-bench: interrupted again, removing {}",
                            path.display()
                        );
                        remove(&path, created_parent.as_deref());
                        std::process::exit(130);
                    }
                    eprintln!("thinpool-bench: interrupted, stopping after this step");
                }
            })
            .context("starting the signal thread")?;
        Ok(())
    }

    /// The directory's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A path for one pool inside the directory.
    pub fn pool_path(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    /// An error once Ctrl-C was pressed.
    pub fn check_interrupted(&self) -> anyhow::Result<()> {
        if self.interrupted.load(Ordering::Acquire) {
            bail!("interrupted");
        }
        Ok(())
    }

    /// Remove one pool directory (each section frees its RAM before the next one).
    pub fn remove_pool(&self, name: &str) -> anyhow::Result<()> {
        let path = self.pool_path(name);
        std::fs::remove_dir_all(&path).with_context(|| format!("removing {}", path.display()))
    }
}

fn remove(path: &Path, created_parent: Option<&Path>) {
    let _ = std::fs::remove_dir_all(path);
    if let Some(parent) = created_parent {
        // Only if empty: anything else there is not ours.
        let _ = std::fs::remove_dir(parent);
    }
}

impl Drop for BenchDir {
    fn drop(&mut self) {
        remove(&self.path, self.created_parent.as_deref());
    }
}

//! Making a pool in a directory: what `thinpool create` does, and `serve` on first use.

use anyhow::{bail, Context};
use thin_pool::BLOCK_SIZE_DEFAULT_BYTES;
use thin_pool::{CreateOptions, Pool};

use crate::control::{self, Outcome, Request};
use crate::pool_dir::{parse_size, PoolDir, StoredOptions};

/// Data size of a pool made without `--data-size` (a sparse file).
pub const DATA_SIZE_DEFAULT: &str = "16G";

/// Creates a pool and its options file in a private directory (see
/// [`PoolDir::create_private`]); returns its status. Used by `serve` too, for the default
/// pool on first use.
pub fn create_pool(
    dir: &PoolDir,
    create: &CreateOptions,
    stored: StoredOptions,
) -> anyhow::Result<control::StatusRecord> {
    let options = stored.pool_options();
    create_pool_with(dir, stored, |path| {
        Pool::create(path, create, options)
            .with_context(|| format!("cannot create a pool in {}", path.display()))
    })
}

/// What every pool creation does around `make` (which creates the pool's metadata and data
/// in the directory it is given): the directory made 0700 if missing (refused if others
/// could change it), refused if it already holds a pool, the options file stored, and, if
/// anything is refused, the directory left as it was (removed, if this made it). Returns the
/// new pool's status, after closing it.
pub fn create_pool_with(
    dir: &PoolDir,
    stored: StoredOptions,
    make: impl FnOnce(&std::path::Path) -> anyhow::Result<Pool>,
) -> anyhow::Result<control::StatusRecord> {
    let made = dir.create_private()?;
    if Pool::exists(&dir.path) {
        bail!("{} already holds a pool", dir.path.display());
    }
    let created = make(&dir.path).and_then(|pool| stored.store(dir).map(|()| pool));
    let pool = match created {
        Ok(pool) => pool,
        Err(error) => {
            made.undo();
            return Err(error);
        }
    };
    let target = control::Target {
        pool,
        options: stored,
        reserved_names: Vec::new(),
        served: None,
    };
    let status = match target.execute(&Request::Status) {
        Ok(Outcome::Status(status)) => status,
        other => bail!("unexpected status answer: {other:?}"),
    };
    target.pool.close().context("cannot close the new pool")?;
    Ok(status)
}

/// Default options for a pool created without `thinpool create`.
pub fn default_create_options() -> CreateOptions {
    CreateOptions {
        data_size_bytes: parse_size(DATA_SIZE_DEFAULT).expect("default size parses"),
        block_size_bytes: BLOCK_SIZE_DEFAULT_BYTES,
        metadata_size_bytes: None,
    }
}

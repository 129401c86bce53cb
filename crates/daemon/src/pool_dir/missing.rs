//! Why a directory holds no pool: the distinct messages of `PoolDir::require_pool` (no pool
//! named, no such directory, not a directory, permission denied, a directory without a
//! pool).

use anyhow::{bail, Context};

use super::{PoolDir, DEFAULT_POOL_DIR, POOL_VARIABLE};

impl PoolDir {
    /// Why the directory holds no pool, as an error (Ok if it does hold one after all).
    pub fn explain_missing_pool(&self) -> anyhow::Result<()> {
        let shown = self.path.display();
        let create = format!("`thinpool create --pool {shown}` makes one");
        let denied = |error: &std::io::Error| {
            anyhow::anyhow!(
                "cannot use pool directory {shown}: permission denied ({error}); run as the \
                 user who owns the pool, or give that user access to the directory and its parents"
            )
        };
        match std::fs::metadata(&self.path) {
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                if self.is_default {
                    bail!(
                        "no pool given: pass --pool DIR or set {POOL_VARIABLE}=DIR (the default, \
                         ./{DEFAULT_POOL_DIR}, does not exist here; `thinpool create` makes it)"
                    );
                }
                bail!("no pool in {shown}: there is no such directory ({create})");
            }
            Err(error) if error.kind() == std::io::ErrorKind::PermissionDenied => {
                return Err(denied(&error))
            }
            Err(error) => {
                return Err(error).with_context(|| format!("cannot examine pool directory {shown}"))
            }
            Ok(metadata) if !metadata.is_dir() => bail!(
                "{shown} is not a directory: --pool (and {POOL_VARIABLE}) name the pool's \
                 directory, the one `thinpool create` made, not a file in it"
            ),
            Ok(_) => {}
        }
        for name in [
            thin_pool::METADATA_FILE,
            thin_pool::block_device::DEVICES_FILE,
        ] {
            match std::fs::symlink_metadata(self.path.join(name)) {
                Ok(_) => return Ok(()),
                Err(error) if error.kind() == std::io::ErrorKind::PermissionDenied => {
                    return Err(denied(&error))
                }
                Err(_) => {}
            }
        }
        bail!(
            "no pool in {shown}: the directory holds neither `{}` nor `{}` ({create})",
            thin_pool::METADATA_FILE,
            thin_pool::block_device::DEVICES_FILE
        )
    }
}

//! [`Target`]: the pool a management request is carried out on, and the operations.

use thin_pool::progress::Progress;
use thin_pool::{Pool, Shrink};

use super::{OpError, OrphanedRecord, Outcome, Request, ServedRecord, StatusRecord, VolumeRecord};
use crate::pool_dir::{format_size, StoredOptions};

/// A pool and what the binary knows about it: the options it was opened with and the names
/// raw exports took.
pub struct Target {
    /// The open pool.
    pub pool: Pool,
    /// Options from `pool.json`.
    pub options: StoredOptions,
    /// Names volumes may not take (raw exports).
    pub reserved_names: Vec<String>,
    /// The server holding the pool, if one does: `status` reports who serves it and its
    /// connections ([`ServedRecord`]); a resize tells it.
    pub served: Option<Served>,
}

/// The server holding a pool, as its management operations see it.
#[derive(Clone)]
pub struct Served {
    /// What `status` asks the server about itself.
    pub probe: ServedProbe,
    /// Told the name of each volume a resize changed (after it committed), so that the
    /// server's front ends can tell their clients: vhost-user-blk sends the capacity-change
    /// message. Called on the control connection's thread: it must not block.
    pub resized: ResizeHook,
}

/// What `status` asks a server about itself.
pub type ServedProbe = std::sync::Arc<dyn Fn() -> ServedRecord + Send + Sync>;

/// What a resize tells a server: the volume's name.
pub type ResizeHook = std::sync::Arc<dyn Fn(&str) + Send + Sync>;

impl Target {
    /// Carries out one request; a change (anything but list, status and diff) is logged with
    /// its result, one line, at info.
    pub fn execute(&self, request: &Request) -> Result<Outcome, OpError> {
        if matches!(
            request,
            Request::List | Request::Status | Request::Diff { .. } | Request::PartialReceives
        ) {
            return self.perform(request);
        }
        let result = self
            .refuse_if_read_only()
            .and_then(|()| self.perform(request));
        super::log::management(request, &result);
        result
    }

    /// [`Request::Trim`] (as [`Target::execute`] carries it out), counting the data blocks
    /// looked at in `progress`.
    pub fn trim(&self, progress: &thin_pool::progress::Progress) -> Result<Outcome, OpError> {
        let result = self
            .refuse_if_read_only()
            .and_then(|()| Ok(Outcome::Trimmed(self.pool.trim_with_progress(progress)?)));
        super::log::management(&Request::Trim { progress: true }, &result);
        result
    }

    /// A [`Request::Diff`], counting the virtual blocks compared in `progress` (a `list_same`
    /// one is answered without counting).
    pub fn diff(&self, request: &Request, progress: &Progress) -> Result<Outcome, OpError> {
        match request {
            Request::Diff {
                base,
                target,
                list_same: false,
                ..
            } => super::diff::execute(&self.pool, base, target, false, Some(progress)),
            other => self.execute(other),
        }
    }

    /// A pool opened read-only (`serve --read-only`) takes no management operation: say so
    /// before the engine refuses it less clearly.
    pub(super) fn refuse_if_read_only(&self) -> Result<(), OpError> {
        let status = self.pool.status();
        if status.mode == thin_pool::PoolMode::ReadOnly && !status.needs_check {
            return Err(OpError::new(
                libc::EROFS,
                "the pool is opened read-only (serve --read-only): management operations are refused".to_string(),
            ));
        }
        Ok(())
    }

    fn perform(&self, request: &Request) -> Result<Outcome, OpError> {
        let pool = &self.pool;
        match request {
            Request::CreateVolume { name, size_bytes } => {
                self.check_name_free(name)?;
                let info = pool.create_volume(name, *size_bytes)?;
                Ok(Outcome::Volume(VolumeRecord::from(&info)))
            }
            Request::Snapshot {
                origin,
                name,
                read_only,
            } => {
                self.check_name_free(name)?;
                let info = pool.snapshot(origin, name, *read_only)?;
                Ok(Outcome::Volume(VolumeRecord::from(&info)))
            }
            Request::DeleteVolume { name } => delete_volume(pool, name),
            Request::ResizeVolume {
                name,
                size_bytes,
                force,
            } => self.resize(name, *size_bytes, *force),
            Request::RevertVolume {
                name,
                snapshot,
                delete_snapshot,
            } => {
                let info = pool.revert_volume(name, snapshot, *delete_snapshot)?;
                Ok(Outcome::Volume(VolumeRecord::from(&info)))
            }
            Request::RenameVolume { name, new_name } => {
                self.check_name_free(new_name)?;
                let info = pool.rename_volume(name, new_name)?;
                Ok(Outcome::Volume(VolumeRecord::from(&info)))
            }
            Request::AdoptVolume { .. } | Request::ForgetVolume { .. } => {
                self.adopt_or_forget(request)
            }
            Request::GrowData { size_bytes } => self.grow_data(*size_bytes),
            Request::GrowMetadata { size_bytes } => self.grow_metadata(*size_bytes),
            Request::List => Ok(Outcome::Volumes(super::listing::volumes(pool))),
            Request::ReserveMetadataSnap => {
                pool.reserve_metadata_snap()?;
                Ok(self.status_outcome())
            }
            Request::ReleaseMetadataSnap => {
                pool.release_metadata_snap()?;
                Ok(self.status_outcome())
            }
            Request::Trim { .. } => Ok(Outcome::Trimmed(pool.trim()?)),
            Request::SendStream { .. } | Request::ReceiveStream { .. } => Err(OpError::new(
                libc::EINVAL,
                "a stream request is carried out on its own connection (control/stream.rs)",
            )),
            Request::PartialReceives | Request::AbortReceive { .. } => {
                super::stream::partial(pool, request)
            }
            Request::Status => Ok(self.full_status()),
            Request::Diff {
                base,
                target,
                list_same,
                ..
            } => super::diff::execute(pool, base, target, *list_same, None),
        }
    }

    /// A resize; then the server holding the pool is told, so that its front ends announce
    /// the new size (a refused resize changed nothing and tells nobody).
    fn resize(&self, name: &str, size_bytes: u64, force: bool) -> Result<Outcome, OpError> {
        let outcome = resize_volume(&self.pool, name, size_bytes, force)?;
        if let Some(served) = &self.served {
            (served.resized)(name);
        }
        Ok(outcome)
    }

    /// `status`: the pool's, with the catalog's disagreements, who serves it and the
    /// volumes' sizes against the data.
    fn full_status(&self) -> Outcome {
        let pool = &self.pool;
        let mut status =
            StatusRecord::with_disagreements(&pool.status(), &self.options, &pool.disagreements());
        status.served = self.served.as_ref().map(|served| (served.probe)());
        status.set_provisioned(&pool.list());
        Outcome::Status(status)
    }

    /// Grows the metadata (to the device's size without `size_bytes`); answers the status.
    fn grow_metadata(&self, size_bytes: Option<u64>) -> Result<Outcome, OpError> {
        self.pool.grow_metadata(size_bytes)?;
        Ok(self.status_outcome())
    }

    /// The pool's status as an answer: every answer with a status has the whole of it.
    fn status_outcome(&self) -> Outcome {
        self.full_status()
    }

    /// Adopts a thin id the catalog lacks, or forgets an entry whose thin id is gone.
    fn adopt_or_forget(&self, request: &Request) -> Result<Outcome, OpError> {
        let pool = &self.pool;
        match request {
            Request::AdoptVolume {
                id,
                name,
                size_bytes,
                origin,
            } => {
                self.check_name_free(name)?;
                let id = thin_pool::VolumeId::new(*id);
                let info = pool.adopt_volume(id, name, *size_bytes, origin.as_deref())?;
                Ok(Outcome::Volume(VolumeRecord::from(&info)))
            }
            Request::ForgetVolume { name } => {
                let entry = pool
                    .disagreements()
                    .orphaned
                    .iter()
                    .find(|volume| volume.name == *name)
                    .map(|volume| OrphanedRecord {
                        name: volume.name.clone(),
                        id: u64::from(volume.id.get()),
                        size_bytes: volume.size_bytes,
                    });
                pool.forget_volume(name)?;
                let entry = entry.ok_or_else(|| {
                    OpError::with_kind(
                        crate::json::ErrorKind::Internal,
                        libc::EIO,
                        format!("forgot {name:?}, which was not listed as orphaned"),
                    )
                })?;
                Ok(Outcome::Forgotten(entry))
            }
            other => unreachable!("{other:?} is not an adopt or a forget"),
        }
    }

    /// Grows the data device to `size_bytes` (never shrinks it); answers the new status.
    fn grow_data(&self, size_bytes: u64) -> Result<Outcome, OpError> {
        let pool = &self.pool;
        let block_size = pool.block_size_bytes();
        let wanted_blocks = size_bytes / block_size;
        let before = pool.status().data_total_blocks;
        if wanted_blocks < before {
            return Err(OpError::new(
                libc::EINVAL,
                format!(
                    "data holds {before} blocks; {size_bytes} bytes is {wanted_blocks}: it cannot shrink"
                ),
            ));
        }
        // The engine checks the grow, then extends a regular data file (a block device must
        // already be large enough).
        pool.grow_data(size_bytes)?;
        let status = pool.status();
        if status.data_total_blocks < wanted_blocks {
            return Err(OpError::new(
                libc::ENOSPC,
                format!(
                    "the data device holds {} blocks, not the {wanted_blocks} asked for",
                    status.data_total_blocks
                ),
            ));
        }
        Ok(self.full_status())
    }

    pub(super) fn check_name_free(&self, name: &str) -> Result<(), OpError> {
        if self.reserved_names.iter().any(|reserved| reserved == name) {
            return Err(OpError::new(
                libc::EEXIST,
                format!("{name:?} is the name of a raw export"),
            ));
        }
        Ok(())
    }
}

/// `delete`: answered with the volume as it was (management is serialized by the engine; a
/// refused delete answers the refusal).
fn delete_volume(pool: &Pool, name: &str) -> Result<Outcome, OpError> {
    let mut record = VolumeRecord::from(&pool.info(name)?);
    pool.delete_volume(name)?;
    record.open_count = 0;
    Ok(Outcome::Volume(record))
}

/// A resize, its shrink policy from `force`. A shrink refused for the mapped data it would
/// unmap says how much, in sizes for people, and how to drop it.
fn resize_volume(
    pool: &Pool,
    name: &str,
    size_bytes: u64,
    force: bool,
) -> Result<Outcome, OpError> {
    let shrink = if force {
        Shrink::DropData
    } else {
        Shrink::KeepData
    };
    let resized = pool
        .resize_volume(name, size_bytes, shrink)
        .map_err(|error| {
            let thin_pool::Error::ShrinkWouldUnmap {
                size_bytes: from,
                new_size_bytes: to,
                mapped_bytes,
                ..
            } = &error
            else {
                return OpError::from(error);
            };
            let message = format!(
            "shrinking {name} from {} to {} would unmap {} of mapped data; pass --force to drop it",
            format_size(*from),
            format_size(*to),
            format_size(*mapped_bytes)
        );
            OpError::new(error.errno(), message)
        })?;
    let mut record = VolumeRecord::from(&resized.volume);
    record.unmapped_bytes = Some(resized.unmapped_bytes);
    Ok(Outcome::Volume(record))
}

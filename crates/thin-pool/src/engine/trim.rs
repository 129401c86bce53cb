//! Trim: give every free data block back to the data device (a hole punched in a data file,
//! a discard on a block device), as `thin_trim` does for an inactive pool, here while the
//! pool serves.
//!
//! ```text
//!   commit (frees become held, then released and passed down)
//!   for each chunk of TRIM_CHUNK_BLOCKS:   metadata lock ─ free runs ─ discard them ─ unlock
//! ```
//!
//! A block is free when its count is zero in the space map and it is neither reserved for a
//! write in flight, nor freed by the transaction under way (the committed metadata may still
//! map it), nor held in its grace period (pinned I/O may still reach it). Reservations are
//! made under the metadata lock, and each chunk is discarded under it, so a block reserved
//! after its chunk was read is never punched under the data its write puts there. The lock
//! is released between chunks, so writes wait for one chunk at most.

use crate::engine::data_device::DataDevice;
use crate::engine::meta::Meta;
use crate::engine::space::SpaceWatch;
use crate::error::{Error, Result};
use crate::progress::Progress;

/// Data blocks looked at per hold of the metadata lock.
const TRIM_CHUNK_BLOCKS: u64 = 4096;

/// Discard every free data block on the data device. Returns the bytes given back that
/// had not been since they were freed (passdown or an earlier trim gave back the rest:
/// they are discarded again, not counted again). `progress` counts data blocks looked at,
/// out of the data device's, once per chunk.
pub(crate) fn trim(
    meta: &Meta,
    data: &dyn DataDevice,
    watch: &SpaceWatch,
    progress: &Progress,
) -> Result<u64> {
    // Frees queued so far become free blocks (or, in their grace period, pass down when it
    // ends).
    meta.commit()?;
    let block_size = meta.block_size_bytes();
    let mut trimmed = 0;
    let mut begin = 0;
    loop {
        meta.check_changes_allowed()?;
        let chunk = meta.read(|view| -> Result<Option<u64>> {
            let md = view.md()?;
            let total = md.data_space_map().block_count();
            if begin >= total {
                return Ok(None);
            }
            let end = (begin + TRIM_CHUNK_BLOCKS).min(total);
            for (first, count) in md.free_data_runs(begin, end) {
                assert!(
                    first >= begin && first + count <= end,
                    "a run inside its chunk"
                );
                let (offset, len) = (first * block_size, count * block_size);
                data.discard(offset, len).map_err(|source| Error::Io {
                    what: format!("discarding data blocks {first}..{} (trim)", first + count),
                    source,
                })?;
                trimmed += watch.given_back(first, count) * block_size;
            }
            progress.set(end, total);
            Ok(Some(end))
        })?;
        match chunk {
            Some(end) => begin = end,
            None => break,
        }
    }
    watch.passed_down(trimmed);
    Ok(trimmed)
}

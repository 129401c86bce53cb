//! The `list` answer: every volume with its space accounting (mapped, exclusive and shared
//! bytes as of the last commit, see `thin_pool::Pool::usage`). Every figure of a volume is
//! from that one view: `mapped_blocks` and `mapped_percent` too (the pool's live counts
//! run ahead of the commit, and mixing the two showed `MAPPED% 0.00` beside `MAPPED
//! 8.00MiB`). A volume made since the last commit, or a pool whose metadata cannot be
//! walked, has no committed figures: its live counts are shown, without the bytes.

use thin_pool::Pool;

use super::VolumeRecord;

/// Every volume, in name order, with its space. A pool whose metadata cannot be walked (a
/// failed pool) is still listed, without the space fields.
pub(super) fn volumes(pool: &Pool) -> Vec<VolumeRecord> {
    let spaces = pool.usage().unwrap_or_default();
    let spaces: std::collections::HashMap<&str, &thin_pool::VolumeSpace> = spaces
        .iter()
        .map(|space| (space.name.as_str(), space))
        .collect();
    pool.list()
        .iter()
        .map(|info| {
            let mut record = VolumeRecord::from(info);
            record.content_id = pool.content_id(&info.name).ok().flatten();
            // By name and thin id: a volume created or deleted since the last commit has
            // no figures rather than another volume's.
            if let Some(space) = spaces
                .get(info.name.as_str())
                .filter(|space| space.id == info.id)
            {
                record.mapped_blocks = space.mapped_bytes / info.block_size_bytes.max(1);
                record.mapped_percent =
                    crate::pool_dir::percent(space.mapped_bytes, info.size_bytes);
                record.mapped_bytes = Some(space.mapped_bytes);
                record.exclusive_bytes = Some(space.exclusive_bytes);
                record.shared_bytes = Some(space.shared_bytes);
            }
            record
        })
        .collect()
}

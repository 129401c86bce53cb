//! The `list` answer: every volume with its space accounting (mapped, exclusive and shared
//! bytes as of the last commit, see `thin_pool::Pool::usage`).

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
            // By name and thin id: a volume created or deleted since the last commit has
            // no figures rather than another volume's.
            if let Some(space) = spaces
                .get(info.name.as_str())
                .filter(|space| space.id == info.id)
            {
                record.mapped_bytes = Some(space.mapped_bytes);
                record.exclusive_bytes = Some(space.exclusive_bytes);
                record.shared_bytes = Some(space.shared_bytes);
            }
            record
        })
        .collect()
}

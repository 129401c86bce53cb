//! What opening a pool reads from disk, and the checks it passes before the engine uses it:
//! the catalog against the metadata's volumes, the metadata checker before a read-write open
//! (as LVM runs thin_check before activation), and every volume's mappings checked: bounded
//! by the volume's size and the data device, with no block a volume would write in place
//! while another mapping shares it. No index is built at activation: a volume's index is
//! built from its tree on first use ([`build_index`], called by `Shared::index`), so an open
//! pool holds indexes only for the volumes in use.

use crate::engine::catalog::Catalog;
use crate::engine::index::Index;
use crate::engine::manage::VOLUME_SIZE_MAX_BYTES;
use crate::engine::shared::VolumeState;
use crate::error::{Error, Result};
use crate::format::metadata::PoolMetadata;
use crate::ids::{BlockTime, Time, VirtualBlock, VolumeId};
use persistent_data::BlockDevice;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// The catalog must list exactly the metadata's volumes.
pub(super) fn check_catalog(md: &PoolMetadata, catalog: &Catalog) -> Result<()> {
    let md_ids = md.volumes();
    let mut names = std::collections::HashSet::new();
    let mut ids = std::collections::HashSet::new();
    for v in &catalog.volumes {
        if !names.insert(v.name.as_str()) || !ids.insert(v.id) {
            return Err(Error::Corrupt(format!(
                "volume {:?} (id {}) is in the catalog twice",
                v.name, v.id
            )));
        }
        if v.size_bytes == 0
            || !v.size_bytes.is_multiple_of(512)
            || v.size_bytes > VOLUME_SIZE_MAX_BYTES
        {
            return Err(Error::Corrupt(format!(
                "volume {:?} has size {} bytes in the catalog: not a positive multiple of 512 up to {VOLUME_SIZE_MAX_BYTES}",
                v.name, v.size_bytes
            )));
        }
    }
    for v in &catalog.volumes {
        if !md.has_volume(v.id) {
            return Err(Error::Corrupt(format!(
                "volume {:?} (id {}) is in the catalog but not in the metadata",
                v.name, v.id
            )));
        }
    }
    for id in &md_ids {
        if !catalog.volumes.iter().any(|v| v.id == *id) {
            return Err(Error::Corrupt(format!(
                "metadata volume id {id} is missing from the catalog"
            )));
        }
    }
    Ok(())
}

/// Which data blocks the volumes map, and which of them a volume would write in place
/// (two bits a data block; built only for a pool opened read-write, whose data space map
/// is no larger than the data device: `open_parts` refuses one that is).
struct Sharing {
    seen: Vec<u64>,
    in_place: Vec<u64>,
}

impl Sharing {
    fn new(data_blocks: u64) -> Sharing {
        let words = usize::try_from(data_blocks.div_ceil(64)).unwrap_or(0);
        Sharing {
            seen: vec![0; words],
            in_place: vec![0; words],
        }
    }

    /// One more mapping of `block` (below the data space map's size); false if it is
    /// mapped twice and either mapping would write it in place.
    fn claim(&mut self, block: u64, in_place: bool) -> bool {
        let (word, bit) = ((block / 64) as usize, 1u64 << (block % 64));
        let (Some(seen), Some(exclusive)) = (self.seen.get_mut(word), self.in_place.get_mut(word))
        else {
            return false;
        };
        let conflict = *seen & bit != 0 && (in_place || *exclusive & bit != 0);
        *seen |= bit;
        if in_place {
            *exclusive |= bit;
        }
        !conflict
    }
}

/// Problems of a failed check quoted in the error.
const CHECK_PROBLEMS_SHOWN: usize = 10;

/// Check the metadata before opening it read-write, as LVM runs thin_check before it
/// activates a pool: metadata that breaks a rule could make one volume's writes land on
/// another's data (a data block counted free while mapped), so it is not opened
/// (`PoolOptions::skip_check` to take that risk). The error lists what the check found.
pub(super) fn check_before_writing(metadata: &Arc<dyn BlockDevice>, data_bytes: u64) -> Result<()> {
    let report = crate::format::check::check_before_open(metadata.clone(), data_bytes);
    if report.passes(true) {
        return Ok(());
    }
    let mut findings = String::new();
    for problem in report.problems.iter().take(CHECK_PROBLEMS_SHOWN) {
        findings.push_str(&format!("\n  {problem}"));
    }
    let more = report
        .fatal_count
        .saturating_sub(CHECK_PROBLEMS_SHOWN as u64);
    if more > 0 {
        findings.push_str(&format!("\n  ... and {more} more"));
    }
    Err(Error::Corrupt(format!(
        "the metadata fails its check ({} fatal problems), so the pool is not opened for writing (`thinpool check` gives the full report):{findings}",
        report.fatal_count
    )))
}

/// Build every volume's state, its index left unbuilt (`Shared::index` builds it on first
/// use). Every mapping tree is still walked once, keeping nothing: each mapping bounded
/// (its data block inside the data space map, its virtual block inside the volume), the
/// count the details give, and, read-write, no data block that a volume would write in
/// place while another mapping shares it (a rule across volumes, so checked here, where
/// every tree is read).
pub(super) fn load_volumes(
    md: &PoolMetadata,
    catalog: &Catalog,
    block_size_bytes: u64,
    writable: bool,
) -> Result<BTreeMap<String, Arc<VolumeState>>> {
    let mut volumes = BTreeMap::new();
    let data_blocks = md.data_space_map().block_count();
    let mut sharing = writable.then(|| Sharing::new(data_blocks));
    for v in &catalog.volumes {
        let details = md.details(v.id)?;
        let snapshotted_time = Time::new(details.snapshotted_time).ok_or_else(|| {
            Error::Corrupt(format!(
                "volume {:?}: snapshot time {} does not fit in 24 bits",
                v.name, details.snapshotted_time
            ))
        })?;
        let mut claim = |data_block: u64, in_place: bool| {
            sharing
                .as_mut()
                .is_none_or(|sharing| sharing.claim(data_block, in_place))
        };
        walk_volume(
            md,
            &v.name,
            v.id,
            v.size_bytes,
            block_size_bytes,
            writable,
            &mut claim,
            &mut |_, _| {},
        )?;
        volumes.insert(
            v.name.clone(),
            Arc::new(VolumeState::new(v, None, snapshotted_time)),
        );
    }
    Ok(volumes)
}

/// The index of `volume`, from its mapping tree in the current transaction (uncommitted
/// changes included), checked as at activation but for the rule across volumes
/// (`load_volumes`). The caller holds the metadata mutex, so no commit or management
/// change runs meanwhile.
pub(crate) fn build_index(
    md: &PoolMetadata,
    volume: &VolumeState,
    block_size_bytes: u64,
    writable: bool,
) -> Result<Index> {
    let size_bytes = volume.size_bytes.load(Ordering::Acquire);
    let index = Index::new(size_bytes.div_ceil(block_size_bytes));
    walk_volume(
        md,
        &volume.name,
        volume.id,
        size_bytes,
        block_size_bytes,
        writable,
        &mut |_, _| true,
        &mut |block, mapping| index.set(block, mapping),
    )?;
    Ok(index)
}

/// Walk one volume's mappings, each bounded before `visit` sees it: its data block inside
/// the data space map, its block inside the volume's `size_bytes`; the count the details
/// give. With `writable`, a mapping the volume would write in place (not older than its
/// last snapshot) must be its data block's only reference, and `claim` (the data block,
/// whether in place) must agree.
#[allow(clippy::too_many_arguments)]
fn walk_volume(
    md: &PoolMetadata,
    name: &str,
    id: VolumeId,
    size_bytes: u64,
    block_size_bytes: u64,
    writable: bool,
    claim: &mut dyn FnMut(u64, bool) -> bool,
    visit: &mut dyn FnMut(VirtualBlock, BlockTime),
) -> Result<()> {
    let details = md.details(id)?;
    if size_bytes > VOLUME_SIZE_MAX_BYTES {
        return Err(Error::Corrupt(format!(
            "volume {name:?} has a size of {size_bytes} bytes, beyond the largest volume ({VOLUME_SIZE_MAX_BYTES})"
        )));
    }
    let data_blocks = md.data_space_map().block_count();
    let block_count = size_bytes.div_ceil(block_size_bytes);
    let mut mapped = 0u64;
    md.walk_mappings(id, &mut |block, mapping| {
        let data_block = mapping.data_block().get();
        if data_block >= data_blocks {
            return Err(Error::Corrupt(format!(
                "volume {name:?} maps block {block} to data block {data_block}, beyond the data space map's {data_blocks} blocks"
            )));
        }
        if block.get() >= block_count {
            return Err(Error::Corrupt(format!(
                "volume {name:?} maps block {block} beyond its size of {size_bytes} bytes"
            )));
        }
        if writable {
            // Written in place unless older than the volume's last snapshot: such a
            // block must be this volume's alone.
            let in_place = mapping.time().get() >= details.snapshotted_time;
            let references = md.data_space_map().count(data_block);
            if !claim(data_block, in_place) || (in_place && references > 1) {
                return Err(Error::Corrupt(format!(
                    "volume {name:?} maps block {block} to data block {data_block} at time {}, not before its snapshot time {}, so it would write it in place, but another mapping shares that block ({references} references)",
                    mapping.time().get(),
                    details.snapshotted_time
                )));
            }
        }
        visit(block, mapping);
        mapped += 1;
        Ok(())
    })?;
    if mapped != details.mapped_blocks {
        return Err(Error::Corrupt(format!(
            "volume {name:?} (id {id}): its details say {} mapped blocks, its tree holds {mapped}",
            details.mapped_blocks
        )));
    }
    Ok(())
}

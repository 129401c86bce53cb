//! What opening a pool reads from disk, and the checks it passes before the engine uses it:
//! the catalog's own rules (where it and the metadata disagree on thin ids, the rest is
//! served: see [`check_catalog`]), the metadata checker before a read-write open
//! (as LVM runs thin_check before activation), and every volume's mappings checked: bounded
//! by the volume's size and the data device, with no block a volume would write in place
//! while another mapping shares it. No index is built at activation: a volume's index is
//! built from its tree on first use ([`build_index`], called by `Meta::index`), so an open
//! pool holds indexes only for the volumes in use.
//!
//! Building an index ([`build_index`]) runs under the commit lock and reads the tree without
//! the metadata mutex: 17 ms for 1M mappings, 0.36 s for 10M. A snapshot or revert leaves the
//! new state without an index too. Besides the indexes (their size is in `index.rs`), an open
//! pool keeps up to 64 MiB of metadata blocks in its block cache (`thinpool-bench --only
//! scale`: 42 bytes per mapped block at 1M mappings, 15 at 10M).
//!
//! The checker ([`crate::format::check::check_before_open`]) can be skipped at one's own risk
//! (`PoolOptions::skip_check`, `serve --skip-check`). A read-only open (`PoolOptions::read_only`,
//! `serve --read-only`) writes nothing at all: no check, commit, commit thread or catalog
//! clean-up, and the metadata file is opened read-only. Every count read from disk is bounded
//! by the devices present before it sizes anything (the data space map's `nr_blocks` by the
//! metadata its bitmaps need and, when known, the data device; the checker's per-block counts
//! go sparse beyond that), and the open bounds every mapping (data block inside the data space
//! map, `mapped_blocks` equal to the tree, the catalog's sizes and ids).
//! `tests/pool_corruption.rs` damages real metadata with valid checksums and holds every reader
//! to an error or a read-only pool.

use crate::engine::catalog::Catalog;
use crate::engine::index::Index;
use crate::engine::limits::VOLUME_SIZE_MAX_BYTES;
use crate::engine::volumes::VolumeState;
use crate::error::{Error, Result};
use crate::format::details::DeviceDetails;
use crate::format::metadata::PoolMetadata;
use crate::ids::{BlockTime, Time, VirtualBlock, VolumeId};
use persistent_data::block_manager::BlockManager;
use persistent_data::btree;
use persistent_data::{BlockDevice, MetadataBlock};
use std::collections::BTreeMap;
use std::sync::Arc;

/// The catalog's own rules: each name and thin id once, every size a positive multiple of
/// 512 up to the largest volume. The catalog and the metadata may disagree on which thin
/// ids exist (the kernel's `create_snap` or `delete` ran on the pool): an id only the
/// metadata holds is unadopted, an entry whose id the metadata lacks is orphaned; neither
/// is served and both are named at open (`Catalog::unadopted`, `Catalog::orphaned`).
pub(crate) fn check_catalog(catalog: &Catalog) -> Result<()> {
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
pub(crate) fn check_before_writing(metadata: &Arc<dyn BlockDevice>, data_bytes: u64) -> Result<()> {
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

/// Build every volume's state, its index left unbuilt (`Meta::index` builds it on first
/// use). Every mapping tree is still walked once, keeping nothing: each mapping bounded
/// (its data block inside the data space map, its virtual block inside the volume), the
/// count the details give, and, read-write, no data block that a volume would write in
/// place while another mapping shares it (a rule across volumes, so checked here, where
/// every tree is read).
pub(crate) fn load_volumes(
    md: &PoolMetadata,
    catalog: &Catalog,
    block_size_bytes: u64,
    writable: bool,
) -> Result<BTreeMap<String, Arc<VolumeState>>> {
    let mut volumes = BTreeMap::new();
    let data_blocks = md.data_space_map().block_count();
    let mut sharing = writable.then(|| Sharing::new(data_blocks));
    // Orphaned entries (no thin id in the metadata) are not served.
    for v in catalog.volumes.iter().filter(|v| md.has_volume(v.id)) {
        let details = md.details(v.id)?;
        let snapshotted_time = snapshot_time(&v.name, &details)?;
        check_volume(
            md,
            &v.name,
            v.id,
            &details,
            v.size_bytes,
            block_size_bytes,
            sharing.as_mut(),
        )?;
        volumes.insert(
            v.name.clone(),
            Arc::new(VolumeState::new(v, None, snapshotted_time)),
        );
    }
    // Unadopted thin ids are not served, but their mappings are bounded and claimed: a
    // served volume must not write in place a block one of them maps.
    // So are those of partial receives (hidden thin ids).
    let partial = catalog.partial.iter().filter(|p| md.has_volume(p.id));
    let hidden = catalog
        .unadopted(&md.volumes())
        .into_iter()
        .map(|id| (id, false));
    for (id, is_partial) in hidden.chain(partial.map(|p| (p.id, true))) {
        let details = md.details(id)?;
        let name = match is_partial {
            true => format!("partial receive thin id {id}"),
            false => format!("unadopted thin id {id}"),
        };
        check_volume(
            md,
            &name,
            id,
            &details,
            VOLUME_SIZE_MAX_BYTES,
            block_size_bytes,
            sharing.as_mut(),
        )?;
    }
    Ok(volumes)
}

/// A volume's snapshot time from its details, which must fit in 24 bits.
pub(crate) fn snapshot_time(name: &str, details: &DeviceDetails) -> Result<Time> {
    Time::new(details.snapshotted_time).ok_or_else(|| {
        Error::Corrupt(format!(
            "volume {name:?}: snapshot time {} does not fit in 24 bits",
            details.snapshotted_time
        ))
    })
}

/// Check the mappings of thin id `id` before it is adopted as `name` of `size_bytes`: each
/// inside the data space map and the size, and none it would write in place shared (its
/// tree is checked alone; the reference counts show sharing with any other tree).
pub(crate) fn check_adopted(
    md: &PoolMetadata,
    name: &str,
    id: VolumeId,
    size_bytes: u64,
    block_size_bytes: u64,
) -> Result<Time> {
    let details = md.details(id)?;
    let mut sharing = Sharing::new(md.data_space_map().block_count());
    check_volume(
        md,
        name,
        id,
        &details,
        size_bytes,
        block_size_bytes,
        Some(&mut sharing),
    )?;
    snapshot_time(name, &details)
}

/// What [`build_index`] needs of the metadata, taken under the metadata mutex.
pub(crate) struct TreeToIndex {
    source: Arc<BlockManager>,
    root: MetadataBlock,
    size_bytes: u64,
    mapped_blocks: u64,
    data_blocks: u64,
}

impl TreeToIndex {
    /// `volume`'s tree in the current transaction.
    pub(crate) fn of(md: &PoolMetadata, volume: &VolumeState) -> Result<TreeToIndex> {
        Ok(TreeToIndex {
            source: md.transaction_manager().block_manager().clone(),
            root: md.volume_root(volume.id())?,
            size_bytes: volume.size_bytes(),
            mapped_blocks: md.details(volume.id())?.mapped_blocks,
            data_blocks: md.data_space_map().block_count(),
        })
    }
}

/// The index of `volume`, from its mapping tree (`tree`), read through the block manager
/// without the metadata mutex. The caller holds the commit lock and the volume has no
/// index, so the tree is its committed one (blocks never written in place) and no commit
/// or management change runs meanwhile. Each mapping is bounded again and the count is the
/// details'; the rule on blocks written in place was checked at activation for every tree
/// (`load_volumes`) and the engine's own changes keep it.
pub(crate) fn build_index(
    tree: &TreeToIndex,
    volume: &VolumeState,
    block_size_bytes: u64,
) -> Result<Index> {
    let name = volume.name();
    let size_bytes = tree.size_bytes;
    let block_count = check_size(name, size_bytes, block_size_bytes)?;
    let index = Index::new(block_count);
    let mut mapped = 0u64;
    let mut inner_error = None;
    let walked = btree::walk::<u64, _>(&*tree.source, tree.root, &mut |key, value| {
        let (block, mapping) = (VirtualBlock::new(key), BlockTime::unpack(value));
        check_mapping(
            name,
            size_bytes,
            block_count,
            tree.data_blocks,
            block,
            mapping,
        )
        .map_err(|e| {
            inner_error = Some(e);
            persistent_data::Error::Invalid("walk stopped".to_string())
        })?;
        index.set(block, mapping);
        mapped += 1;
        Ok(())
    });
    match (walked, inner_error) {
        (_, Some(e)) => return Err(e),
        (Err(e), None) => return Err(e.into()),
        (Ok(()), None) => {}
    }
    check_mapped_count(name, volume.id(), tree.mapped_blocks, mapped)?;
    Ok(index)
}

/// The blocks of a volume of `size_bytes`, which must be within the largest volume.
fn check_size(name: &str, size_bytes: u64, block_size_bytes: u64) -> Result<u64> {
    if size_bytes > VOLUME_SIZE_MAX_BYTES {
        return Err(Error::Corrupt(format!(
            "volume {name:?} has a size of {size_bytes} bytes, beyond the largest volume ({VOLUME_SIZE_MAX_BYTES})"
        )));
    }
    Ok(size_bytes.div_ceil(block_size_bytes))
}

/// A mapping read from disk, bounded: its data block inside the data space map, its block
/// inside the volume.
fn check_mapping(
    name: &str,
    size_bytes: u64,
    block_count: u64,
    data_blocks: u64,
    block: VirtualBlock,
    mapping: BlockTime,
) -> Result<()> {
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
    Ok(())
}

/// The tree holds as many mappings as the details say.
fn check_mapped_count(name: &str, id: VolumeId, details: u64, mapped: u64) -> Result<()> {
    if mapped != details {
        return Err(Error::Corrupt(format!(
            "volume {name:?} (id {id}): its details say {details} mapped blocks, its tree holds {mapped}"
        )));
    }
    Ok(())
}

/// Check one volume's mappings at activation: each bounded (`check_mapping`), the count
/// the details give. With `sharing` (a read-write open), a mapping the volume would write in
/// place (not older than its last snapshot) must be its data block's only reference (a held
/// metadata snapshot's references aside), and no other volume's mapping checked so far may
/// share it.
fn check_volume(
    md: &PoolMetadata,
    name: &str,
    id: VolumeId,
    details: &DeviceDetails,
    size_bytes: u64,
    block_size_bytes: u64,
    mut sharing: Option<&mut Sharing>,
) -> Result<()> {
    let block_count = check_size(name, size_bytes, block_size_bytes)?;
    let data_blocks = md.data_space_map().block_count();
    // A held metadata snapshot keeps the old copies of the leaves shadowed since it was
    // taken, and each copy holds a reference to its data blocks: those references are the
    // snapshot's, not sharing (dm-thin writes such a block in place, a metadata snapshot
    // keeps metadata, not data). Sharing between live mappings is still found by `claim`.
    let snapshot_held = md.metadata_snap().is_some();
    let mut mapped = 0u64;
    md.walk_mappings(id, &mut |block, mapping| {
        check_mapping(name, size_bytes, block_count, data_blocks, block, mapping)?;
        let data_block = mapping.data_block().get();
        if let Some(sharing) = sharing.as_mut() {
            // Written in place unless older than the volume's last snapshot: such a
            // block must be this volume's alone.
            let in_place = mapping.time().get() >= details.snapshotted_time;
            let references = md.data_space_map().count(data_block);
            let counted_shared = in_place && references > 1 && !snapshot_held;
            if !sharing.claim(data_block, in_place) || counted_shared {
                return Err(Error::Corrupt(format!(
                    "volume {name:?} maps block {block} to data block {data_block} at time {}, not before its snapshot time {}, so it would write it in place, but another mapping shares that block ({references} references)",
                    mapping.time().get(),
                    details.snapshotted_time
                )));
            }
        }
        mapped += 1;
        Ok(())
    })?;
    check_mapped_count(name, id, details.mapped_blocks, mapped)?;
    Ok(())
}

//! The volume indexes against the metadata: made equal again after the metadata was
//! reopened ([`resync_indexes`]), checked in debug builds after a commit freed blocks
//! ([`assert_unreferenced`]) and in tests ([`verify_indexes`]). Functions of the registry
//! and a metadata the caller (the metadata owner, under its mutex) holds.

use crate::engine::volumes::Volumes;
use crate::error::{Error, Result};
use crate::format::metadata::PoolMetadata;
use crate::ids::{BlockTime, DataBlock, VirtualBlock};
use std::collections::BTreeMap;

/// After the metadata was reopened: make every volume's index equal its mapping tree
/// again. The abandoned ops' mappings leave the index (their blocks are free in the
/// reopened metadata and may be reserved again), and mappings whose removal was abandoned
/// come back. Provisioning cannot race this: it needs a reservation of the current
/// generation, and the caller holds the metadata lock. Returns the data blocks of the
/// mappings dropped from an index. A volume without an index needs nothing: it is built
/// from the reopened metadata when first used.
pub(crate) fn resync_indexes(volumes: &Volumes, md: &PoolMetadata) -> Result<Vec<DataBlock>> {
    let mut unmapped = Vec::new();
    for volume in volumes.all().values() {
        if !md.has_volume(volume.id()) {
            continue;
        }
        let Some(index) = volume.loaded_index() else {
            continue;
        };
        let tree = tree_of(md, volume.id())?;
        let mut stale = Vec::new();
        index.for_each_in(
            VirtualBlock::new(0),
            VirtualBlock::new(u64::MAX),
            &mut |block, mapping| {
                if tree.get(&block) != Some(&mapping) {
                    stale.push(block);
                    unmapped.push(mapping.data_block());
                }
            },
        );
        for block in stale {
            index.clear(block);
        }
        for (block, mapping) in tree {
            if block.get() < index.block_count() && index.lookup(block) != Some(mapping) {
                index.set(block, mapping);
            }
        }
    }
    Ok(unmapped)
}

/// Debug builds: a data block a commit freed is referenced by no volume's index (the
/// index equals the trees plus the queued ops, and a queued op only maps reserved
/// blocks). A volume without an index is skipped: its only mappings are in its tree,
/// and a block no tree references is what a commit frees. O(mapped blocks).
#[cfg(debug_assertions)]
pub(crate) fn assert_unreferenced(volumes: &Volumes, freed: &[DataBlock]) {
    if freed.is_empty() {
        return;
    }
    let freed: std::collections::HashSet<DataBlock> = freed.iter().copied().collect();
    for volume in volumes.all().values() {
        let Some(index) = volume.loaded_index() else {
            continue;
        };
        index.for_each_in(
            VirtualBlock::new(0),
            VirtualBlock::new(u64::MAX),
            &mut |block, mapping| {
                assert!(
                    !freed.contains(&mapping.data_block()),
                    "volume {:?} block {block} maps data block {}, which a commit freed",
                    volume.name(),
                    mapping.data_block()
                );
            },
        );
    }
}

/// Debug builds: no block in the grace-period limbo is referenced by a volume's index (a
/// block enters the limbo only after it was unmapped from every index). O(mapped blocks).
#[cfg(debug_assertions)]
pub(crate) fn assert_not_in_limbo(volumes: &Volumes, limbo: impl Iterator<Item = DataBlock>) {
    let held: Vec<DataBlock> = limbo.collect();
    assert_unreferenced(volumes, &held);
}

/// Every built index equals its volume's mapping tree (tests, after a commit).
pub(crate) fn verify_indexes(volumes: &Volumes, md: &PoolMetadata) -> Result<()> {
    for v in volumes.all().values() {
        let Some(index) = v.loaded_index() else {
            continue;
        };
        let from_tree = tree_of(md, v.id())?;
        let mut from_index = BTreeMap::new();
        index.for_each_in(
            VirtualBlock::new(0),
            VirtualBlock::new(u64::MAX),
            &mut |block, mapping| {
                from_index.insert(block, mapping);
            },
        );
        if from_tree != from_index {
            return Err(Error::Internal(format!(
                "volume {:?}: index and mapping tree differ",
                v.name()
            )));
        }
    }
    Ok(())
}

fn tree_of(
    md: &PoolMetadata,
    id: crate::ids::VolumeId,
) -> Result<BTreeMap<VirtualBlock, BlockTime>> {
    let mut tree = BTreeMap::new();
    md.walk_mappings(id, &mut |block, mapping| {
        tree.insert(block, mapping);
        Ok(())
    })?;
    Ok(tree)
}

//! Space accounting of an open pool (`thinpool list`'s MAPPED, EXCLUSIVE and SHARED), with
//! thin_ls's meaning (see `format::metadata::usage`), computed without stalling I/O.
//!
//! The walk reads the mapping trees of the last committed transaction through the block
//! manager, without the metadata lock: the metadata lock is held twice, for a moment each,
//! to take the committed top-level root, the catalog that goes with it and a token
//! (metadata generation, commits started), and to check the token afterwards. Committed
//! blocks are never written in place, and a block a transaction frees is reused only by a
//! later transaction, whose commit is the first to write it: so if at most one commit
//! started during the walk (and the metadata was not reopened), every block the walk read
//! was the committed one. Otherwise the walk is repeated; after `OPTIMISTIC_TRIES` (3) the
//! last try holds the commit lock (never the metadata lock), which only delays commits (a
//! flush waits for the walk, about 0.1 s per million mappings; reads and writes go on).
//!
//! The figures are those of the last commit (at most one commit interval behind what
//! clients wrote), as `thin_ls` would print on the metadata at that moment.

use crate::engine::meta::Meta;
use crate::error::{Error, Result};
use crate::format::metadata::usage::{volume_usage, VolumeUsage};
use crate::ids::VolumeId;
use std::collections::BTreeMap;

/// Walks tried without any lock before one holds the commit lock.
const OPTIMISTIC_TRIES: usize = 3;

/// One volume's space, as of the last commit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeSpace {
    /// Name.
    pub name: String,
    /// Thin id.
    pub id: VolumeId,
    /// Bytes mapped (mapped blocks × block size; thin_ls's MAPPED_BYTES).
    pub mapped_bytes: u64,
    /// Bytes in data blocks no other mapping refers to: freed if the volume is deleted
    /// (EXCLUSIVE_BYTES).
    pub exclusive_bytes: u64,
    /// Bytes in data blocks other mappings refer to too (SHARED_BYTES).
    pub shared_bytes: u64,
}

/// The space of every volume as of the last commit, in catalog order. Holds the metadata
/// lock only to take and check a token (see the module doc).
pub(crate) fn usage(meta: &Meta) -> Result<Vec<VolumeSpace>> {
    for _ in 0..OPTIMISTIC_TRIES {
        if let Some(space) = usage_try(meta)? {
            return Ok(space);
        }
    }
    let _turn = meta.turn();
    usage_try(meta)?
        .ok_or_else(|| Error::Internal("the metadata changed under the commit lock".to_string()))
}

/// One walk; None if commits may have reused a block it read.
fn usage_try(meta: &Meta) -> Result<Option<Vec<VolumeSpace>>> {
    let (block_manager, root, names, token) = meta.read(|view| -> Result<_> {
        let md = view.md()?;
        let names: Vec<(String, VolumeId)> = view
            .catalog
            .volumes
            .iter()
            .map(|v| (v.name.clone(), v.id))
            .collect();
        Ok((
            md.transaction_manager().block_manager().clone(),
            md.superblock().data_mapping_root,
            names,
            (view.generation, md.commits_started()),
        ))
    })?;
    let walked = volume_usage(&*block_manager, root);
    let valid = meta.read(|view| {
        view.generation == token.0
            && view
                .md
                .is_some_and(|md| md.commits_started() <= token.1 + 1)
    });
    if !valid {
        return Ok(None);
    }
    Ok(Some(spaces(&walked?, &names, meta.block_size_bytes())))
}

fn spaces(
    usage: &BTreeMap<VolumeId, VolumeUsage>,
    names: &[(String, VolumeId)],
    block_size_bytes: u64,
) -> Vec<VolumeSpace> {
    names
        .iter()
        .filter_map(|(name, id)| {
            let usage = usage.get(id)?;
            Some(VolumeSpace {
                name: name.clone(),
                id: *id,
                mapped_bytes: usage.mapped_blocks.saturating_mul(block_size_bytes),
                exclusive_bytes: usage.exclusive_blocks.saturating_mul(block_size_bytes),
                shared_bytes: usage.shared_blocks.saturating_mul(block_size_bytes),
            })
        })
        .collect()
}

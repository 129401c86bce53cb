//! What the pool tells about itself without changing anything: the volume list
//! ([`infos`]), the status ([`status`]) and, for tests, the index check ([`verify_index`]).
//! Free functions over the owners.

use crate::engine::health::Health;
use crate::engine::meta::Meta;
use crate::engine::options::{PoolMode, PoolOptions, PoolStatus, VolumeInfo};
use crate::engine::recovery::verify_indexes;
use crate::engine::space::SpaceWatch;
use crate::engine::volumes::{VolumeState, Volumes};
use crate::error::Result;
use crate::ids::VolumeId;
use std::collections::HashMap;

/// Every volume (`only`: one), in name order. A volume's mapped blocks come from its index
/// when it has one (every mapping, committed or queued), else from its details in the
/// metadata (it has no queued mapping then): listing builds no index.
pub(crate) fn infos(meta: &Meta, volumes: &Volumes, only: Option<&str>) -> Vec<VolumeInfo> {
    let wanted = |v: &VolumeState| only.is_none_or(|name| v.name() == name);
    let needs_details = volumes
        .all()
        .values()
        .any(|v| wanted(v) && v.loaded_index().is_none());
    // Read under the lock that publishes volumes and sets indexes, so a volume without an
    // index then is counted from its tree's details, and one built since from its index
    // (after the lock is released: counting an index takes no lock). With no metadata
    // (fail mode) a volume without an index lists 0 mapped blocks.
    let from_md = |view: Option<&crate::engine::meta_state::View<'_>>| {
        let published = volumes.all();
        let from_details: HashMap<VolumeId, u64> = view
            .and_then(|view| view.md)
            .map(|md| {
                published
                    .values()
                    .filter(|v| wanted(v) && v.loaded_index().is_none())
                    .filter_map(|v| Some((v.id(), md.details(v.id()).ok()?.mapped_blocks)))
                    .collect()
            })
            .unwrap_or_default();
        (published, from_details)
    };
    let (published, from_details) = if needs_details {
        meta.read(|view| from_md(Some(view)))
    } else {
        from_md(None)
    };
    let mapped_blocks = |v: &VolumeState| match from_details.get(&v.id()) {
        Some(&mapped) => mapped,
        None => v.loaded_index().map_or(0, |index| index.mapped_count()),
    };
    let names: HashMap<VolumeId, &str> = published.values().map(|v| (v.id(), v.name())).collect();
    published
        .values()
        .filter(|v| wanted(v))
        .map(|v| VolumeInfo {
            name: v.name().to_string(),
            id: v.id(),
            size_bytes: v.size_bytes(),
            mapped_blocks: mapped_blocks(v),
            block_size_bytes: meta.block_size_bytes(),
            origin: v
                .origin()
                .and_then(|id| names.get(&id))
                .map(|name| name.to_string()),
            origin_id: v.origin().filter(|id| names.contains_key(id)),
            read_only: v.read_only(),
            open_count: v.open_count(),
        })
        .collect()
}

/// The owners [`status`] reads.
pub(crate) struct StatusSources<'a> {
    pub(crate) meta: &'a Meta,
    pub(crate) volumes: &'a Volumes,
    pub(crate) health: &'a Health,
    pub(crate) watch: &'a SpaceWatch,
    pub(crate) options: &'a PoolOptions,
}

/// The pool's status (commits nothing).
pub(crate) fn status(sources: &StatusSources<'_>) -> PoolStatus {
    let StatusSources {
        meta,
        volumes,
        health,
        watch,
        options,
    } = *sources;
    let volume_count = volumes.count();
    let (usage, transaction_id, snap, needs_check, mode) = meta.read(|view| {
        let (usage, transaction_id, snap, needs_check) = match view.md {
            Some(md) => (
                Some(md.usage()),
                md.transaction_id().get(),
                md.metadata_snap().map(|b| b.get()),
                md.needs_check(),
            ),
            None => (None, view.catalog.transaction_id, None, true),
        };
        (usage, transaction_id, snap, needs_check, health.mode())
    });
    PoolStatus {
        transaction_id,
        metadata_used_blocks: usage.map_or(0, |u| u.metadata_used_blocks),
        metadata_total_blocks: usage.map_or(0, |u| u.metadata_total_blocks),
        data_used_blocks: usage.map_or(0, |u| u.data_used_blocks),
        data_total_blocks: usage.map_or(0, |u| u.data_total_blocks),
        block_size_bytes: meta.block_size_bytes(),
        metadata_snap: snap,
        mode,
        fail_reason: health.fail_reason(),
        needs_check: needs_check || (mode == PoolMode::ReadOnly && !options.read_only),
        discard_passdown: options.discard_passdown,
        error_if_no_space: options.error_if_no_space,
        low_water_reached: watch.data_low_water(),
        metadata_low_water_reached: watch.metadata_low_water(),
        low_water_percent: options.low_water_percent,
        autoextend: options.autoextend,
        no_space_timeout: options.no_space_timeout,
        data_bytes_passed_down: watch.passed_down_bytes(),
        volume_count,
    }
}

/// A consistency check of the engine's in-memory state against the metadata (tests):
/// after a commit, every built index equals its volume's mapping tree (a volume without
/// one is read from its tree anyway).
pub(crate) fn verify_index(meta: &Meta, volumes: &Volumes) -> Result<()> {
    meta.commit()?;
    meta.read(|view| verify_indexes(volumes, view.md()?))
}

//! The I/O engine: a pool open for I/O and management on a metadata device, a data device
//! and the volume catalog.
//!
//! It uses `crate::format::metadata::PoolMetadata` as its one metadata writer and never
//! touches on-disk structures directly. Files, one owner or one job each, in layers: a
//! file uses only files of lower layers (checked by the import-graph script in
//! ARCHITECTURE.md's engine section):
//!
//! 0. `directory`: the pool directory held open (every file opened relative to it);
//! 1. leaves: `options`, `limits`, `layout`, `health` (mode, fail reason, events),
//!    `index`, `gate`, `grace`, `data_device`, `catalog`, `stats`, `queue` (the op queue),
//!    `block_device`, `written` (block 0 as the pool last wrote it: the foreign-write check);
//!    then `catalog_dir` (the catalog's files, in the directory held open);
//! 2. `space`: the low-water marks and growth requests (`SpaceWatch`);
//! 3. `volumes`: the volume registry (`Volumes`, `VolumeState`, `Lookup`);
//! 4. `load`: what opening reads and checks, index builds from a tree;
//! 5. `recovery`: indexes against the metadata (resync, debug checks);
//! 6. `meta_state`, then `meta`: the metadata owner (`Meta`: the metadata mutex, the
//!    commit lock, reserve, queue, commit, changes, fail);
//! 7. `provision`: what volume I/O needs from the pool (`Provisioner`);
//! 8. `volume`: volume I/O on the caller's thread (`Volume`);
//! 9. management, free functions over the owners: `manage`, `adopt` (thin ids the
//!    catalog and the metadata disagree on), `grow`, `revert`, `usage`, `diff`, `trim`,
//!    `listing`, `receive` (a received volume staged, then made in one transaction);
//! 10. workers, started by the pool with handles to the owners: `committer`, `autoextend`;
//! 11. `open`: creating, opening and assembling a pool (`Owners`);
//! 12. `pool`: the façade, the only `impl Pool`.

pub(crate) mod adopt;
mod autoextend;
pub(crate) mod block_device;
pub(crate) mod catalog;
pub(crate) mod catalog_dir;
mod committer;
pub(crate) mod data_device;
pub(crate) mod diff;
pub(crate) mod directory;
mod gate;
mod grace;
pub(crate) mod grow;
mod health;
mod index;
pub(crate) mod layout;
pub(crate) mod limits;
mod listing;
mod load;
mod manage;
mod meta;
mod meta_state;
pub(crate) mod open;
pub(crate) mod options;
pub(crate) mod pool;
mod provision;
mod queue;
pub(crate) mod receive;
pub(crate) mod receive_partial;
mod recovery;
mod revert;
pub(crate) mod space;
pub(crate) mod stats;
mod trim;
pub(crate) mod usage;
pub(crate) mod volume;
pub(crate) mod volumes;
mod written;

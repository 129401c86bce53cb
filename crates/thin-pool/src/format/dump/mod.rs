//! Dump formats: the streaming description of a pool's metadata that `thin_dump` prints and
//! `thin_restore` reads, independent of how the metadata itself is read or written.
//!
//! This module owns:
//!
//! - [`DumpVisitor`], the event interface every dump producer drives and every consumer
//!   implements: one superblock, then shared-leaf definitions (`<def>`, 1.x only), then
//!   devices in ascending id order, each holding mapping runs in ascending virtual block order
//!   and (1.x only) references to definitions;
//! - [`RunBuilder`], which turns single mappings into the maximal runs a dump prints;
//! - the writers [`XmlWriter`] (XML of `thin_dump` 1.1.0, or of 0.9.0) and [`HumanWriter`]
//!   (`thin_dump --format human_readable`), byte for byte;
//! - [`xml::parse`], a streaming parser for both XML forms that drives a visitor;
//! - [`Error`], the one error type of the module.
//!
//! Event order, as a grammar (writers assert it, the parser guarantees it):
//!
//! ```text
//! superblock_begin (def_begin mapping* def_end)* (device_begin (mapping | reference)* device_end)* superblock_end
//! ```
//!
//! The metadata reader (which walks the btrees) calls a visitor; `thin restore` implements one.
//! Formats are observed from the real tools (thin-provisioning-tools 0.9.0 and 1.1.0); see
//! `docs/dm-thin-format.md` §9.

mod error;
pub mod expand;
mod gather;
mod human;
pub mod metadata;
mod run;
pub mod xml;

pub use error::{Error, ParseProblem};
pub use human::HumanWriter;
pub use run::RunBuilder;
pub use xml::XmlWriter;

/// Which `thin_dump` version's output the writers reproduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Flavour {
    /// thin-provisioning-tools 1.x (checked against 1.1.0). XML: `flags="1"` only when
    /// needs-check is set, `<def>`/`<ref>`, no final newline. Human-readable: flags as 0/1,
    /// every run as a range.
    #[default]
    V1,
    /// thin-provisioning-tools 0.9.0. XML: raw `flags` always, final newline, no
    /// `<def>`/`<ref>`. Human-readable: raw flags, a run of one as `vb -> db, time`.
    V0_9,
}

/// Bit 0 of the superblock flags: the pool needs `thin_check` before it is used again.
pub use crate::format::superblock::NEEDS_CHECK_FLAG;

/// The superblock line of a dump (`<superblock ...>`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SuperblockInfo {
    /// Free-form identifier; the real dumps always print `""`.
    pub uuid: String,
    /// Snapshot epoch (superblock `time`).
    pub time: u32,
    /// User transaction id (superblock `trans_id`).
    pub transaction: u64,
    /// Raw superblock flags (see [`NEEDS_CHECK_FLAG`]). 1.x prints only the needs-check bit.
    pub flags: u32,
    /// Metadata format version.
    pub version: u32,
    /// Data block size in 512-byte sectors.
    pub data_block_size_sectors: u32,
    /// Number of blocks on the data device (`nr_data_blocks`); 0 in a metadata-snapshot dump.
    pub data_block_count: u64,
    /// Location of the metadata-snapshot superblock, when the XML gives one. Neither
    /// `thin_dump` version prints it, so the writers ignore it.
    pub metadata_snap: Option<u64>,
}

impl SuperblockInfo {
    /// Whether the needs-check flag is set.
    pub fn needs_check(&self) -> bool {
        self.flags & NEEDS_CHECK_FLAG != 0
    }
}

/// The header of one thin device (volume) in a dump (`<device ...>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DeviceInfo {
    /// Thin device id.
    pub dev_id: u32,
    /// Number of mapped blocks as recorded in the device details (`mapped_blocks`).
    pub mapped_block_count: u64,
    /// Pool transaction id when the device was created.
    pub transaction: u64,
    /// Pool time when the device was created.
    pub creation_time: u32,
    /// Pool time when the device was last snapshotted (or created).
    pub snap_time: u32,
}

/// A run of mappings: `length` consecutive virtual blocks from `virtual_begin` mapped to
/// consecutive data blocks from `data_begin`, all with the same `time`.
///
/// Invariant: `length >= 1`. A run of one prints as `single_mapping`, longer ones as
/// `range_mapping`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapping {
    /// First virtual block (`origin_block` / `origin_begin`).
    pub virtual_begin: u64,
    /// First data block (`data_block` / `data_begin`).
    pub data_begin: u64,
    /// Number of blocks in the run, at least 1.
    pub length: u64,
    /// Time stamp of every mapping in the run (24 bits on disk).
    pub time: u32,
}

impl Mapping {
    /// A run of one block.
    pub fn single(virtual_block: u64, data_block: u64, time: u32) -> Mapping {
        Mapping {
            virtual_begin: virtual_block,
            data_begin: data_block,
            length: 1,
            time,
        }
    }

    /// The last virtual block of the run (inclusive).
    pub fn virtual_last(&self) -> u64 {
        assert!(self.length >= 1, "empty mapping run");
        self.virtual_begin + (self.length - 1)
    }

    /// The last data block of the run (inclusive).
    pub fn data_last(&self) -> u64 {
        assert!(self.length >= 1, "empty mapping run");
        self.data_begin + (self.length - 1)
    }
}

/// Receives a dump as a stream of events, in the order given in the module docs.
///
/// Producers (the metadata reader, [`xml::parse`]) call the methods in that order; an error
/// returned by any method stops the producer, which returns it unchanged. Names passed to
/// [`def_begin`](DumpVisitor::def_begin) and [`reference`](DumpVisitor::reference) are opaque
/// labels (1.x uses the block number of the shared leaf); every reference names a definition
/// that came earlier in the same dump.
pub trait DumpVisitor {
    /// Starts the dump.
    fn superblock_begin(&mut self, superblock: &SuperblockInfo) -> Result<(), Error>;
    /// Ends the dump; nothing follows.
    fn superblock_end(&mut self) -> Result<(), Error>;
    /// Starts a shared run of mappings (a shared leaf) named `name` (1.x only).
    fn def_begin(&mut self, name: &str) -> Result<(), Error>;
    /// Ends the current definition.
    fn def_end(&mut self) -> Result<(), Error>;
    /// Starts a device; its mappings and references follow.
    fn device_begin(&mut self, device: &DeviceInfo) -> Result<(), Error>;
    /// Ends the current device.
    fn device_end(&mut self) -> Result<(), Error>;
    /// One run of mappings, inside a definition or a device, in ascending virtual order.
    fn mapping(&mut self, mapping: &Mapping) -> Result<(), Error>;
    /// Inside a device: the mappings of definition `name` belong to this device too (1.x).
    fn reference(&mut self, name: &str) -> Result<(), Error>;
}

/// Where the writers are in the event grammar (module docs); both writers advance it on
/// every event, so the order is asserted in one place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Position {
    BeforeSuperblock,
    InSuperblock,
    InDef,
    InDevice,
    Done,
}

/// One event of [`DumpVisitor`], for [`Position::advance`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    SuperblockBegin,
    SuperblockEnd,
    DefBegin,
    DefEnd,
    DeviceBegin,
    DeviceEnd,
    Mapping,
    Reference,
}

impl Position {
    /// Asserts that `event` may come now (the grammar of the module docs), and moves to the
    /// position after it.
    fn advance(&mut self, event: Event) {
        use Position::{BeforeSuperblock, Done, InDef, InDevice, InSuperblock};
        *self = match (*self, event) {
            (BeforeSuperblock, Event::SuperblockBegin) => InSuperblock,
            (InSuperblock, Event::SuperblockEnd) => Done,
            (InSuperblock, Event::DefBegin) => InDef,
            (InDef, Event::DefEnd) => InSuperblock,
            (InSuperblock, Event::DeviceBegin) => InDevice,
            (InDevice, Event::DeviceEnd) => InSuperblock,
            (at @ (InDef | InDevice), Event::Mapping) => at,
            (InDevice, Event::Reference) => InDevice,
            (at, event) => panic!("dump event {event:?} out of order: writer is at {at:?}"),
        };
    }
}

#[cfg(test)]
mod tests;

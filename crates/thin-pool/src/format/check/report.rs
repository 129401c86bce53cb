//! What the checker found: a list of [`Problem`]s, each naming the structure, the volume,
//! the block and the broken [`Rule`], and a [`Summary`] of the metadata.
//!
//! Severities follow thin_check: a fatal problem makes the metadata unusable; a non-fatal
//! one (a metadata or data leak) still gives a non-zero exit unless `--ignore-non-fatal-errors`;
//! a warning (our stricter checks, e.g. an unknown superblock version, which the tools accept)
//! never changes the outcome.

use crate::ids::VolumeId;
use persistent_data::checksum::BlockKind;
use std::fmt;

/// Problems kept in a report; more are counted but not stored, so a badly broken device
/// cannot make the report grow without bound.
pub const PROBLEMS_MAX: usize = 10_000;

/// How bad a problem is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Severity {
    /// The metadata breaks a rule the kernel or thin_check relies on.
    Fatal,
    /// Non-fatal, but thin_check exits non-zero for it (e.g. leaked metadata blocks).
    NonFatal,
    /// Only our stricter checks object; thin_check accepts it.
    Warning,
}

impl fmt::Display for Severity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Severity::Fatal => "error",
            Severity::NonFatal => "non-fatal error",
            Severity::Warning => "warning",
        })
    }
}

/// The on-disk rule a problem breaks (spec §11).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Rule {
    /// §11.1: the superblock checksum.
    SuperblockChecksum,
    /// A superblock field thin_check does not validate but the kernel does: a wrong magic
    /// (fatal: no thin pool superblock), version, blocknr or flags (warnings).
    SuperblockField,
    /// §11.2: the metadata snapshot superblock (checksum, location).
    MetadataSnapshot,
    /// The metadata device could not be read.
    Io,
    /// A reference to a block beyond the metadata space map.
    BlockOutOfRange,
    /// §11.3: a block's checksum does not match its expected kind.
    Checksum(BlockKind),
    /// §11.4: a block's `blocknr` is not its location.
    Location(BlockKind),
    /// §11.9: node flags neither internal nor leaf.
    NodeFlags,
    /// §11.5: a node's value size is wrong for its tree.
    ValueSize,
    /// §11.6: `max_entries` does not fit a block or is not a multiple of 3.
    MaxEntries,
    /// §11.7: `nr_entries > max_entries`, or an internal node with no entries.
    EntryCount,
    /// §11.7: a non-root node less than a third full.
    Occupancy,
    /// §11.8: keys not strictly increasing within a node.
    KeyOrder,
    /// §11.8: a key outside the range its parent gives (parent key > child's first key, or
    /// not below the parent's next key).
    ParentKey,
    /// Leaves at different depths, or a tree deeper than the limit (a cycle).
    LeafDepth,
    /// §11.10: details-tree keys differ from top-level keys.
    DetailsMismatch,
    /// §11.11: `mapped_blocks` differs from the mappings found.
    MappedBlocks,
    /// §11.12: a mapping to a data block beyond the data space map.
    DataBlockOutOfRange,
    /// Space-map index: entries missing, duplicated or out of range.
    SpaceMapIndex,
    /// A bitmap entry beyond the space map's `nr_blocks` is in use.
    BitmapTail,
    /// §11.13: an overflow entry without a bitmap entry of 3, a bitmap entry of 3 without an
    /// overflow entry, or an overflow count below 3.
    OverflowMismatch,
    /// §11.13: an unreferenced metadata block has a stored count (a leak: non-fatal).
    MetadataLeak,
    /// §11.13: a referenced metadata block's stored count is higher than its references
    /// (fatal in thin_check 1.x; 0.9.0 calls it non-fatal).
    MetadataOverCount,
    /// §11.13: a metadata block's stored count is lower than its references.
    MetadataUnderCount,
    /// §11.14: a data block's stored count differs from the leaves referencing it (fatal),
    /// a block with references included.
    DataCount,
    /// §11.14: a data block no leaf references has a stored count (a leak: non-fatal, as
    /// thin_check 1.x says; `--auto-repair` frees it).
    DataLeak,
    /// The data space map's `nr_blocks` is more than its bitmaps could be (each is a
    /// metadata block) or, when the data device is known, more than it holds.
    DataDeviceSize,
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rule::SuperblockChecksum => f.write_str("superblock checksum"),
            Rule::SuperblockField => f.write_str("superblock field"),
            Rule::MetadataSnapshot => f.write_str("metadata snapshot superblock"),
            Rule::Io => f.write_str("i/o"),
            Rule::BlockOutOfRange => f.write_str("block beyond the metadata space map"),
            Rule::Checksum(kind) => write!(f, "{kind} checksum"),
            Rule::Location(kind) => write!(f, "{kind} location (blocknr)"),
            Rule::NodeFlags => f.write_str("node flags"),
            Rule::ValueSize => f.write_str("node value size"),
            Rule::MaxEntries => f.write_str("node max_entries"),
            Rule::EntryCount => f.write_str("node nr_entries"),
            Rule::Occupancy => f.write_str("node occupancy"),
            Rule::KeyOrder => f.write_str("key order"),
            Rule::ParentKey => f.write_str("parent key"),
            Rule::LeafDepth => f.write_str("leaf depth"),
            Rule::DetailsMismatch => f.write_str("details tree vs mapping tree"),
            Rule::MappedBlocks => f.write_str("mapped_blocks"),
            Rule::DataBlockOutOfRange => f.write_str("data block beyond the data space map"),
            Rule::SpaceMapIndex => f.write_str("space-map index"),
            Rule::BitmapTail => f.write_str("bitmap tail"),
            Rule::OverflowMismatch => f.write_str("overflow tree vs bitmap"),
            Rule::MetadataLeak => f.write_str("metadata leak"),
            Rule::MetadataOverCount => f.write_str("metadata reference count too high"),
            Rule::MetadataUnderCount => f.write_str("metadata reference count too low"),
            Rule::DataCount => f.write_str("data reference count"),
            Rule::DataLeak => f.write_str("data leak"),
            Rule::DataDeviceSize => f.write_str("data space map size"),
        }
    }
}

/// The structure a problem was found in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Structure {
    /// The live superblock.
    Superblock,
    /// The metadata snapshot's superblock.
    MetadataSnapshot,
    /// The device-details tree.
    DetailsTree,
    /// The top level of the mapping tree.
    MappingTopLevel,
    /// A volume's bottom-level mapping tree.
    Mappings,
    /// The data space map (index tree, bitmaps, overflow tree, counts).
    DataSpaceMap,
    /// The metadata space map (index block, bitmaps, overflow tree, counts).
    MetadataSpaceMap,
}

impl fmt::Display for Structure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Structure::Superblock => "superblock",
            Structure::MetadataSnapshot => "metadata snapshot",
            Structure::DetailsTree => "device details tree",
            Structure::MappingTopLevel => "mapping tree top level",
            Structure::Mappings => "mapping tree",
            Structure::DataSpaceMap => "data space map",
            Structure::MetadataSpaceMap => "metadata space map",
        })
    }
}

/// One broken rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// How bad it is.
    pub severity: Severity,
    /// Where it was found.
    pub structure: Structure,
    /// The volume whose tree holds the block, if any.
    pub volume: Option<VolumeId>,
    /// The metadata block involved (for count problems of the data space map: the data
    /// block is in `data_block`).
    pub block: Option<u64>,
    /// The data block involved, for data-space-map and mapping problems.
    pub data_block: Option<u64>,
    /// The rule.
    pub rule: Rule,
    /// The numbers: what was found and what was expected.
    pub detail: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.severity, self.structure)?;
        if let Some(volume) = self.volume {
            write!(f, " of volume {volume}")?;
        }
        if let Some(block) = self.block {
            write!(f, ", block {block}")?;
        }
        if let Some(data_block) = self.data_block {
            write!(f, ", data block {data_block}")?;
        }
        write!(f, ": {} [{}]", self.detail, self.rule)
    }
}

/// Figures about the metadata, filled in as far as the check got.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    /// Superblock `trans_id`.
    pub transaction_id: u64,
    /// Superblock `time`.
    pub time: u32,
    /// Superblock flags (bit 0: needs_check).
    pub flags: u32,
    /// Location of the metadata snapshot, if one is held.
    pub metadata_snap: Option<u64>,
    /// Metadata blocks managed (metadata space map `nr_blocks`).
    pub metadata_block_count: u64,
    /// Metadata space map `nr_blocks − nr_allocated` (what thin_check prints).
    pub metadata_free_blocks: u64,
    /// Data blocks (data space map `nr_blocks`).
    pub data_block_count: u64,
    /// Data space map `nr_blocks − nr_allocated`.
    pub data_free_blocks: u64,
    /// Volumes in the details tree.
    pub volume_count: u64,
    /// Mappings over all volumes of the live superblock (a shared leaf counts per volume).
    pub mapping_count: u64,
    /// Distinct btree nodes read.
    pub node_count: u64,
    /// Metadata blocks whose stored count exceeds their references.
    pub metadata_leaked_blocks: u64,
    /// Data blocks whose stored count differs from their references (leaks included).
    pub data_bad_count_blocks: u64,
    /// Of those, blocks no leaf references (leaks).
    pub data_leaked_blocks: u64,
}

/// The result of a check.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// Figures about the metadata.
    pub summary: Summary,
    /// The problems found, in the order found (at most [`PROBLEMS_MAX`]).
    pub problems: Vec<Problem>,
    /// Problems found but not stored (beyond [`PROBLEMS_MAX`]).
    pub problems_omitted: u64,
    /// Fatal problems found (stored or not).
    pub fatal_count: u64,
    /// Non-fatal problems found (stored or not).
    pub non_fatal_count: u64,
    /// Warnings found (stored or not).
    pub warning_count: u64,
}

impl Report {
    /// Record a problem.
    pub fn push(&mut self, problem: Problem) {
        match problem.severity {
            Severity::Fatal => self.fatal_count += 1,
            Severity::NonFatal => self.non_fatal_count += 1,
            Severity::Warning => self.warning_count += 1,
        }
        if self.problems.len() < PROBLEMS_MAX {
            self.problems.push(problem);
        } else {
            self.problems_omitted += 1;
        }
    }

    /// Whether no fatal or non-fatal problem was found (warnings allowed).
    pub fn is_clean(&self) -> bool {
        self.fatal_count == 0 && self.non_fatal_count == 0
    }

    /// Whether the check passes as thin_check's exit code would say: no fatal problem, and
    /// no non-fatal one unless `ignore_non_fatal`.
    pub fn passes(&self, ignore_non_fatal: bool) -> bool {
        self.fatal_count == 0 && (ignore_non_fatal || self.non_fatal_count == 0)
    }

    /// Whether some stored problem breaks `rule`.
    pub fn has(&self, rule: Rule) -> bool {
        self.problems.iter().any(|p| p.rule == rule)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for problem in &self.problems {
            writeln!(f, "{problem}")?;
        }
        if self.problems_omitted > 0 {
            writeln!(f, "... and {} more problems", self.problems_omitted)?;
        }
        Ok(())
    }
}

//! The thin superblock at metadata block 0 (spec §4), and metadata-snapshot superblocks: the
//! one codec every reader and writer of the format uses (the metadata writer, restore, dump
//! and check).
//!
//! ```text
//!   0 csum u32 | 4 flags u32 | 8 blocknr u64 | 16 uuid [16] | 32 magic u64 | 40 version u32
//!  44 time u32 | 48 trans_id u64 | 56 metadata_snap u64
//!  64 data space-map root [128] | 192 metadata space-map root [128]
//! 320 data_mapping_root u64 | 328 device_details_root u64 | 336 data_block_size u32 (sectors)
//! 340 metadata_block_size u32 (= 8) | 344 metadata_nr_blocks u64 | 352 compat u32
//! 356 compat_ro u32 | 360 incompat u32 | 364.. zero
//! ```
//!
//! Decoding is in two steps, so that a caller can tell "this is not a superblock" from "this
//! superblock holds a value we refuse":
//!
//! 1. [`Unchecked::decode`] reads the fixed fields (bytes 0..364, nothing else) and judges
//!    none of them; the checksum and the location are the block manager's concern (or the
//!    checker's, which reads block 0 raw).
//! 2. [`Unchecked::flaws`] lists every broken field rule ([`Flaw`]), in a fixed order; the
//!    checker reports each one. [`Unchecked::validate`] refuses the first flaw the kernel
//!    refuses too, then bounds every block number and count by the device.
//!
//! [`Superblock::read`] does both over a block manager (checksum and location included).

use crate::ids::DATA_BLOCK_MAX;
use persistent_data::block_manager::BlockManager;
use persistent_data::checksum::{self, BlockKind};
use persistent_data::space_map::SpaceMapRoot;
use persistent_data::{Block, Error as PdError, MetadataBlock, BLOCK_SIZE};
use std::fmt;

/// `magic` of a thin superblock.
pub const MAGIC: u64 = 27_022_010;
/// The version we write (the kernel's).
pub const VERSION: u32 = 2;
/// Flag bit: the metadata must be checked before the pool is used read-write.
pub const NEEDS_CHECK_FLAG: u32 = 1;
/// Metadata block size in sectors (fixed).
pub const METADATA_BLOCK_SIZE_SECTORS: u32 = 8;
/// Smallest data block: 64 KiB.
pub const DATA_BLOCK_SIZE_MIN_SECTORS: u32 = 128;
/// Largest data block: 1 GiB.
pub const DATA_BLOCK_SIZE_MAX_SECTORS: u32 = 2_097_152;

/// Bytes of the block the superblock uses; the rest is zero.
const ENCODED_SIZE: usize = 364;
const _: () = assert!(ENCODED_SIZE <= BLOCK_SIZE);

/// A decoded superblock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Superblock {
    /// Flag bits (bit 0: needs_check).
    pub flags: u32,
    /// Where this superblock lives.
    pub blocknr: MetadataBlock,
    /// Unused by dm-thin; preserved.
    pub uuid: [u8; 16],
    /// On-disk version (1 or 2).
    pub version: u32,
    /// Snapshot epoch.
    pub time: u32,
    /// User transaction id.
    pub transaction_id: u64,
    /// The metadata snapshot's superblock, if one is held (0 on disk for none).
    pub metadata_snap: Option<MetadataBlock>,
    /// Data space map root (all zero in a metadata snapshot).
    pub data_space_map: SpaceMapRoot,
    /// Metadata space map root (all zero in a metadata snapshot).
    pub metadata_space_map: SpaceMapRoot,
    /// Top level of the mapping tree.
    pub data_mapping_root: MetadataBlock,
    /// Device-details tree.
    pub device_details_root: MetadataBlock,
    /// Data block size in 512-byte sectors.
    pub data_block_size_sectors: u32,
    /// Metadata device size in blocks when formatted.
    pub metadata_block_count: u64,
    /// Feature flags (we know none).
    pub compat_flags: u32,
    /// Read-only-compatible feature flags (we know none).
    pub compat_ro_flags: u32,
    /// Incompatible feature flags (we know none).
    pub incompat_flags: u32,
}

fn u32_at(b: &Block, at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &Block, at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Whether `size` is a valid data block size (64 KiB to 1 GiB, a multiple of 64 KiB).
pub fn valid_data_block_size(sectors: u32) -> bool {
    (DATA_BLOCK_SIZE_MIN_SECTORS..=DATA_BLOCK_SIZE_MAX_SECTORS).contains(&sectors)
        && sectors.is_multiple_of(DATA_BLOCK_SIZE_MIN_SECTORS)
}

/// A superblock field that breaks a rule of the format. The `Display` text names the field
/// and the numbers, without the word "superblock" (callers add where it was found).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flaw {
    /// `magic` is not [`MAGIC`].
    Magic {
        /// The stored magic.
        found: u64,
    },
    /// `blocknr` is not where the superblock was read from.
    Location {
        /// The stored `blocknr`.
        found: u64,
        /// Where it was read from.
        expected: MetadataBlock,
    },
    /// A version other than 1 or 2.
    Version {
        /// The stored version.
        found: u32,
    },
    /// Feature flags we do not know: the kernel refuses unknown incompatible ones, and
    /// opens with unknown read-only-compatible ones only for reading.
    FeatureFlags {
        /// The stored `incompat` flags.
        incompat: u32,
        /// The stored `compat_ro` flags.
        compat_ro: u32,
    },
    /// Flag bits other than needs_check.
    UnknownFlags {
        /// The stored flags.
        flags: u32,
    },
    /// A data block size that is not a multiple of 64 KiB from 64 KiB to 1 GiB.
    DataBlockSize {
        /// The stored size in sectors.
        sectors: u32,
    },
}

impl Flaw {
    /// Whether the kernel refuses to open metadata with this flaw (the others it ignores).
    pub fn refuses_open(&self) -> bool {
        match self {
            Flaw::Magic { .. }
            | Flaw::Location { .. }
            | Flaw::Version { .. }
            | Flaw::DataBlockSize { .. } => true,
            Flaw::FeatureFlags { incompat, .. } => *incompat != 0,
            Flaw::UnknownFlags { .. } => false,
        }
    }
}

impl fmt::Display for Flaw {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Flaw::Magic { found } => write!(f, "magic is {found}, expected {MAGIC}"),
            Flaw::Location { found, expected } => {
                write!(f, "blocknr is {found}, expected {expected}")
            }
            Flaw::Version { found } => write!(f, "version {found} is not 1 or 2"),
            Flaw::FeatureFlags {
                incompat,
                compat_ro,
            } => write!(
                f,
                "unknown feature flags: incompat {incompat:#x}, compat_ro {compat_ro:#x}"
            ),
            Flaw::UnknownFlags { flags } => write!(f, "unknown flag bits {flags:#x}"),
            Flaw::DataBlockSize { sectors } => write!(
                f,
                "data block size {sectors} sectors is not a multiple of 128 in 128..=2097152"
            ),
        }
    }
}

/// A block decoded as a superblock, no field judged yet (module docs, step 1).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unchecked {
    /// The stored magic (a [`Superblock`] always has [`MAGIC`]).
    pub magic: u64,
    /// Every other field as stored (block numbers not yet bounded by the device).
    pub superblock: Superblock,
}

impl Unchecked {
    /// Read the fields of `b` (bytes 0..364); no value is judged, the checksum neither.
    pub fn decode(b: &Block) -> Unchecked {
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&b[16..32]);
        let block = |at: usize| MetadataBlock::new(u64_at(b, at));
        let superblock = Superblock {
            flags: u32_at(b, 4),
            blocknr: block(8),
            uuid,
            version: u32_at(b, 40),
            time: u32_at(b, 44),
            transaction_id: u64_at(b, 48),
            metadata_snap: Some(block(56)).filter(|snap| snap.get() != 0),
            data_space_map: SpaceMapRoot::decode(&b[64..96]),
            metadata_space_map: SpaceMapRoot::decode(&b[192..224]),
            data_mapping_root: block(320),
            device_details_root: block(328),
            data_block_size_sectors: u32_at(b, 336),
            metadata_block_count: u64_at(b, 344),
            compat_flags: u32_at(b, 352),
            compat_ro_flags: u32_at(b, 356),
            incompat_flags: u32_at(b, 360),
        };
        Unchecked {
            magic: u64_at(b, 32),
            superblock,
        }
    }

    /// Every broken field rule for a superblock read from `location`, in the order: magic,
    /// location, version, feature flags, flag bits, data block size.
    pub fn flaws(&self, location: MetadataBlock) -> Vec<Flaw> {
        let sb = &self.superblock;
        let mut flaws = Vec::new();
        if self.magic != MAGIC {
            flaws.push(Flaw::Magic { found: self.magic });
        }
        if sb.blocknr != location {
            flaws.push(Flaw::Location {
                found: sb.blocknr.get(),
                expected: location,
            });
        }
        if !(1..=2).contains(&sb.version) {
            flaws.push(Flaw::Version { found: sb.version });
        }
        if sb.incompat_flags != 0 || sb.compat_ro_flags != 0 {
            flaws.push(Flaw::FeatureFlags {
                incompat: sb.incompat_flags,
                compat_ro: sb.compat_ro_flags,
            });
        }
        if sb.flags & !NEEDS_CHECK_FLAG != 0 {
            flaws.push(Flaw::UnknownFlags { flags: sb.flags });
        }
        if !valid_data_block_size(sb.data_block_size_sectors) {
            flaws.push(Flaw::DataBlockSize {
                sectors: sb.data_block_size_sectors,
            });
        }
        flaws
    }

    /// The superblock, if it has no flaw the kernel refuses and every block number and
    /// count in it fits a metadata device of `device_block_count` blocks (and the format's
    /// data-block limit).
    pub fn validate(
        self,
        location: MetadataBlock,
        device_block_count: u64,
    ) -> Result<Superblock, PdError> {
        if let Some(flaw) = self.flaws(location).iter().find(|f| f.refuses_open()) {
            return Err(PdError::corrupt(location, format!("superblock {flaw}")));
        }
        let sb = self.superblock;
        let out_of_range = |what: &str, value: u64, limit: u64| {
            PdError::corrupt(
                location,
                format!("superblock {what} is {value}, beyond the device's {limit} blocks"),
            )
        };
        let blocks = [
            ("data_mapping_root", Some(sb.data_mapping_root)),
            ("device_details_root", Some(sb.device_details_root)),
            ("metadata_snap", sb.metadata_snap),
            ("metadata space map's index", metadata_index(&sb)),
        ];
        for (what, block) in blocks {
            if let Some(block) = block.filter(|b| b.get() >= device_block_count) {
                return Err(out_of_range(what, block.get(), device_block_count));
            }
        }
        let metadata_blocks = sb.metadata_space_map.block_count;
        if metadata_blocks > device_block_count {
            return Err(out_of_range(
                "metadata space map's size",
                metadata_blocks,
                device_block_count,
            ));
        }
        let data_blocks = sb.data_space_map.block_count;
        if data_blocks > DATA_BLOCK_MAX + 1 {
            return Err(PdError::corrupt(
                location,
                format!("superblock data space map has {data_blocks} blocks, beyond 2^40"),
            ));
        }
        Ok(sb)
    }
}

/// The metadata space map's index block, when the superblock has a metadata space map.
fn metadata_index(sb: &Superblock) -> Option<MetadataBlock> {
    (!sb.metadata_space_map.is_empty())
        .then_some(MetadataBlock::new(sb.metadata_space_map.bitmap_root))
}

impl Superblock {
    /// A version-2 superblock at block 0 for a new pool: no flags, no metadata snapshot, no
    /// features; the roots and space maps are set at commit.
    pub fn new(
        data_block_size_sectors: u32,
        metadata_block_count: u64,
        time: u32,
        transaction_id: u64,
    ) -> Superblock {
        Superblock {
            flags: 0,
            blocknr: MetadataBlock::SUPERBLOCK,
            uuid: [0; 16],
            version: VERSION,
            time,
            transaction_id,
            metadata_snap: None,
            data_space_map: SpaceMapRoot::default(),
            metadata_space_map: SpaceMapRoot::default(),
            data_mapping_root: MetadataBlock::new(0),
            device_details_root: MetadataBlock::new(0),
            data_block_size_sectors,
            metadata_block_count,
            compat_flags: 0,
            compat_ro_flags: 0,
            incompat_flags: 0,
        }
    }

    /// Read the superblock at `location` (block 0, or a metadata snapshot's) through `bm`,
    /// which checks the checksum and the location; then decode and validate it against the
    /// device's size.
    pub fn read(bm: &BlockManager, location: MetadataBlock) -> Result<Superblock, PdError> {
        let data = bm.read(location, BlockKind::Superblock)?;
        Superblock::decode(location, &data, bm.block_count())
    }

    /// Decode and validate a superblock read (checksum already verified) from `location` on
    /// a metadata device of `device_block_count` blocks.
    pub fn decode(
        location: MetadataBlock,
        b: &Block,
        device_block_count: u64,
    ) -> Result<Superblock, PdError> {
        Unchecked::decode(b).validate(location, device_block_count)
    }

    /// Encode (checksum left for the commit to stamp).
    pub fn encode(&self) -> Box<Block> {
        let mut b = persistent_data::block::zeroed_block();
        b[4..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..16].copy_from_slice(&self.blocknr.get().to_le_bytes());
        b[16..32].copy_from_slice(&self.uuid);
        b[32..40].copy_from_slice(&MAGIC.to_le_bytes());
        b[40..44].copy_from_slice(&self.version.to_le_bytes());
        b[44..48].copy_from_slice(&self.time.to_le_bytes());
        b[48..56].copy_from_slice(&self.transaction_id.to_le_bytes());
        let snap = self.metadata_snap.map_or(0, |snap| snap.get());
        b[56..64].copy_from_slice(&snap.to_le_bytes());
        self.data_space_map.encode(&mut b[64..96]);
        self.metadata_space_map.encode(&mut b[192..224]);
        b[320..328].copy_from_slice(&self.data_mapping_root.get().to_le_bytes());
        b[328..336].copy_from_slice(&self.device_details_root.get().to_le_bytes());
        b[336..340].copy_from_slice(&self.data_block_size_sectors.to_le_bytes());
        b[340..344].copy_from_slice(&METADATA_BLOCK_SIZE_SECTORS.to_le_bytes());
        b[344..352].copy_from_slice(&self.metadata_block_count.to_le_bytes());
        b[352..356].copy_from_slice(&self.compat_flags.to_le_bytes());
        b[356..360].copy_from_slice(&self.compat_ro_flags.to_le_bytes());
        b[360..ENCODED_SIZE].copy_from_slice(&self.incompat_flags.to_le_bytes());
        b
    }

    /// The superblock of a metadata snapshot of this one, to be stored at `location`: the
    /// same trees, time and ids; no space maps and no snapshot of its own (spec §4.1).
    pub fn metadata_snapshot(&self, location: MetadataBlock) -> Superblock {
        Superblock {
            blocknr: location,
            metadata_snap: None,
            data_space_map: SpaceMapRoot::default(),
            metadata_space_map: SpaceMapRoot::default(),
            ..self.clone()
        }
    }

    /// Whether the needs_check flag is set.
    pub fn needs_check(&self) -> bool {
        self.flags & NEEDS_CHECK_FLAG != 0
    }
}

/// Set the needs_check flag in an encoded superblock and stamp its checksum again, leaving
/// every other byte as it is (the kernel's way of flagging metadata after a failure, without
/// a commit).
pub fn set_needs_check(b: &mut Block) {
    let flags = u32_at(b, 4) | NEEDS_CHECK_FLAG;
    b[4..8].copy_from_slice(&flags.to_le_bytes());
    checksum::stamp(b, BlockKind::Superblock);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Superblock {
        let mut sb = Superblock::new(128, 1000, 3, 9);
        sb.data_mapping_root = MetadataBlock::new(5);
        sb.device_details_root = MetadataBlock::new(6);
        sb.metadata_snap = Some(MetadataBlock::new(7));
        sb
    }

    #[test]
    fn encode_then_decode_gives_the_same_superblock() {
        let sb = sample();
        let decoded = Superblock::decode(MetadataBlock::new(0), &sb.encode(), 1000).unwrap();
        assert_eq!(decoded, sb);
        let snap = sb.metadata_snapshot(MetadataBlock::new(7));
        let decoded = Superblock::decode(MetadataBlock::new(7), &snap.encode(), 1000).unwrap();
        assert_eq!(decoded.metadata_snap, None);
        assert_eq!(decoded.blocknr, MetadataBlock::new(7));
        assert_eq!(decoded.data_mapping_root, MetadataBlock::new(5));
    }

    #[test]
    fn flaws_are_listed_field_by_field() {
        let mut b = sample().encode();
        b[32] ^= 1;
        b[40..44].copy_from_slice(&3u32.to_le_bytes());
        b[4..8].copy_from_slice(&6u32.to_le_bytes());
        let unchecked = Unchecked::decode(&b);
        let flaws = unchecked.flaws(MetadataBlock::new(0));
        assert_eq!(
            flaws,
            vec![
                Flaw::Magic { found: MAGIC ^ 1 },
                Flaw::Version { found: 3 },
                Flaw::UnknownFlags { flags: 6 },
            ]
        );
        let error = unchecked.validate(MetadataBlock::new(0), 1000).unwrap_err();
        assert!(error.to_string().contains("magic"), "{error}");
    }

    #[test]
    fn unknown_flag_bits_and_compat_ro_flags_do_not_refuse_open() {
        let mut sb = sample();
        sb.flags = 6;
        sb.compat_ro_flags = 1;
        assert!(Superblock::decode(MetadataBlock::new(0), &sb.encode(), 1000).is_ok());
        sb.incompat_flags = 1;
        assert!(Superblock::decode(MetadataBlock::new(0), &sb.encode(), 1000).is_err());
    }

    #[test]
    fn blocks_beyond_the_device_are_refused() {
        let sb = sample();
        assert!(Superblock::decode(MetadataBlock::new(0), &sb.encode(), 7).is_err());
        assert!(Superblock::decode(MetadataBlock::new(0), &sb.encode(), 8).is_ok());
        let mut sb = sample();
        sb.data_mapping_root = MetadataBlock::new(u64::MAX);
        let error = Superblock::decode(MetadataBlock::new(0), &sb.encode(), 1000).unwrap_err();
        assert!(error.to_string().contains("data_mapping_root"), "{error}");
    }

    #[test]
    fn set_needs_check_keeps_the_checksum_valid() {
        let mut b = sample().encode();
        set_needs_check(&mut b);
        assert!(checksum::matches(&b, BlockKind::Superblock));
        let sb = Superblock::decode(MetadataBlock::new(0), &b, 1000).unwrap();
        assert!(sb.needs_check());
    }
}

//! The thin superblock at metadata block 0 (spec §4), and metadata-snapshot superblocks.
//!
//! ```text
//!   0 csum u32 | 4 flags u32 | 8 blocknr u64 | 16 uuid [16] | 32 magic u64 | 40 version u32
//!  44 time u32 | 48 trans_id u64 | 56 metadata_snap u64
//!  64 data space-map root [128] | 192 metadata space-map root [128]
//! 320 data_mapping_root u64 | 328 device_details_root u64 | 336 data_block_size u32 (sectors)
//! 340 metadata_block_size u32 (= 8) | 344 metadata_nr_blocks u64 | 352 compat u32
//! 356 compat_ro u32 | 360 incompat u32 | 364.. zero
//! ```

use persistent_data::space_map::SpaceMapRoot;
use persistent_data::{Block, Error as PdError, MetadataBlock};

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

/// A decoded superblock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Superblock {
    /// Flag bits (bit 0: needs_check).
    pub flags: u32,
    /// Where this superblock lives.
    pub blocknr: u64,
    /// Unused by dm-thin; preserved.
    pub uuid: [u8; 16],
    /// On-disk version (1 or 2).
    pub version: u32,
    /// Snapshot epoch.
    pub time: u32,
    /// User transaction id.
    pub transaction_id: u64,
    /// Block of the metadata snapshot's superblock, 0 for none.
    pub metadata_snap: u64,
    /// Data space map root (all zero in a metadata snapshot).
    pub data_space_map: SpaceMapRoot,
    /// Metadata space map root (all zero in a metadata snapshot).
    pub metadata_space_map: SpaceMapRoot,
    /// Top level of the mapping tree.
    pub data_mapping_root: u64,
    /// Device-details tree.
    pub device_details_root: u64,
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

impl Superblock {
    /// Decode a superblock read (checksum already verified) from `location`. Checks what the
    /// kernel checks: magic, location, no unknown incompatible features; and a sane block size.
    pub fn decode(location: MetadataBlock, b: &Block) -> Result<Superblock, PdError> {
        let magic = u64_at(b, 32);
        if magic != MAGIC {
            return Err(PdError::corrupt(
                location,
                format!("superblock magic is {magic}, expected {MAGIC}"),
            ));
        }
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&b[16..32]);
        let sb = Superblock {
            flags: u32_at(b, 4),
            blocknr: u64_at(b, 8),
            uuid,
            version: u32_at(b, 40),
            time: u32_at(b, 44),
            transaction_id: u64_at(b, 48),
            metadata_snap: u64_at(b, 56),
            data_space_map: SpaceMapRoot::decode(&b[64..96]),
            metadata_space_map: SpaceMapRoot::decode(&b[192..224]),
            data_mapping_root: u64_at(b, 320),
            device_details_root: u64_at(b, 328),
            data_block_size_sectors: u32_at(b, 336),
            metadata_block_count: u64_at(b, 344),
            compat_flags: u32_at(b, 352),
            compat_ro_flags: u32_at(b, 356),
            incompat_flags: u32_at(b, 360),
        };
        if sb.blocknr != location.0 {
            return Err(PdError::corrupt(
                location,
                format!("superblock says it lives at block {}", sb.blocknr),
            ));
        }
        if sb.incompat_flags != 0 {
            return Err(PdError::corrupt(
                location,
                format!(
                    "unknown incompatible feature flags {:#x}",
                    sb.incompat_flags
                ),
            ));
        }
        if !(1..=2).contains(&sb.version) {
            return Err(PdError::corrupt(
                location,
                format!("unsupported metadata version {}", sb.version),
            ));
        }
        if !valid_data_block_size(sb.data_block_size_sectors) {
            return Err(PdError::corrupt(
                location,
                format!(
                    "data block size {} sectors is not a multiple of 128 in 128..=2097152",
                    sb.data_block_size_sectors
                ),
            ));
        }
        Ok(sb)
    }

    /// Encode (checksum left for the commit to stamp).
    pub fn encode(&self) -> Box<Block> {
        let mut b = persistent_data::block::zeroed_block();
        b[4..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..16].copy_from_slice(&self.blocknr.to_le_bytes());
        b[16..32].copy_from_slice(&self.uuid);
        b[32..40].copy_from_slice(&MAGIC.to_le_bytes());
        b[40..44].copy_from_slice(&self.version.to_le_bytes());
        b[44..48].copy_from_slice(&self.time.to_le_bytes());
        b[48..56].copy_from_slice(&self.transaction_id.to_le_bytes());
        b[56..64].copy_from_slice(&self.metadata_snap.to_le_bytes());
        self.data_space_map.encode(&mut b[64..96]);
        self.metadata_space_map.encode(&mut b[192..224]);
        b[320..328].copy_from_slice(&self.data_mapping_root.to_le_bytes());
        b[328..336].copy_from_slice(&self.device_details_root.to_le_bytes());
        b[336..340].copy_from_slice(&self.data_block_size_sectors.to_le_bytes());
        b[340..344].copy_from_slice(&METADATA_BLOCK_SIZE_SECTORS.to_le_bytes());
        b[344..352].copy_from_slice(&self.metadata_block_count.to_le_bytes());
        b[352..356].copy_from_slice(&self.compat_flags.to_le_bytes());
        b[356..360].copy_from_slice(&self.compat_ro_flags.to_le_bytes());
        b[360..364].copy_from_slice(&self.incompat_flags.to_le_bytes());
        b
    }

    /// Whether the needs_check flag is set.
    pub fn needs_check(&self) -> bool {
        self.flags & NEEDS_CHECK_FLAG != 0
    }
}

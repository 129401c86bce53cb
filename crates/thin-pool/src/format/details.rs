//! Per-volume details, the values of the device-details tree (spec §6.2, 24 bytes):
//! `mapped_blocks u64 | transaction_id u64 | creation_time u32 | snapshotted_time u32`.

use persistent_data::btree::Value;

/// What the metadata records about one volume.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct DeviceDetails {
    /// Mappings in the volume's tree.
    pub mapped_blocks: u64,
    /// Pool transaction id when the volume was created.
    pub transaction_id: u64,
    /// Pool time when created.
    pub creation_time: u32,
    /// Pool time when last snapshotted (or created).
    pub snapshotted_time: u32,
}

impl Value for DeviceDetails {
    const SIZE: usize = 24;
    fn unpack(b: &[u8]) -> DeviceDetails {
        DeviceDetails {
            mapped_blocks: u64::from_le_bytes(b[0..8].try_into().expect("8 bytes")),
            transaction_id: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
            creation_time: u32::from_le_bytes(b[16..20].try_into().expect("4 bytes")),
            snapshotted_time: u32::from_le_bytes(b[20..24].try_into().expect("4 bytes")),
        }
    }
    fn pack(&self, out: &mut [u8]) {
        out[0..8].copy_from_slice(&self.mapped_blocks.to_le_bytes());
        out[8..16].copy_from_slice(&self.transaction_id.to_le_bytes());
        out[16..20].copy_from_slice(&self.creation_time.to_le_bytes());
        out[20..24].copy_from_slice(&self.snapshotted_time.to_le_bytes());
    }
}

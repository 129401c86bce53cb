//! What the device offers: virtio feature bits, the limits, and the `virtio_blk_config`
//! space (virtio 1.2, "Block Device": little-endian fields at fixed offsets), read live from
//! the target's [`Geometry`] at every GET_CONFIG so a grown volume shows its new capacity.

use thinpool_frontend::{Geometry, SECTOR_BYTES};
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_BLK_SIZE, VIRTIO_BLK_F_DISCARD, VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_MQ,
    VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_SIZE_MAX, VIRTIO_BLK_F_TOPOLOGY,
    VIRTIO_BLK_F_WRITE_ZEROES,
};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

/// Descriptors in each virtqueue, at most (the front end may choose fewer).
pub const QUEUE_SIZE_MAX: u16 = 1024;

/// Largest number of queues a device offers.
pub const QUEUES_MAX: u16 = 64;

/// Largest data segment (one descriptor) the driver may send (`size_max`).
pub const SIZE_MAX_BYTES: u32 = 1 << 20;

/// Most data segments in one request (`seg_max`): a chain also holds the header and the
/// status, and a direct chain is at most a queue long.
pub const SEG_MAX: u32 = 126;

/// Most segments in one DISCARD or WRITE_ZEROES request.
pub const DISCARD_SEG_MAX: u32 = 32;

/// Largest DISCARD or WRITE_ZEROES segment, in sectors (1 GiB), before rounding down to the
/// block size.
const ZERO_SECTORS_MAX: u64 = (1 << 30) / SECTOR_BYTES;

/// Length of the config space we fill (up to and including `write_zeroes_may_unmap` and its
/// padding).
pub const CONFIG_LEN: usize = 60;

/// Length of GET_ID's answer.
pub const ID_BYTES: usize = 20;

const fn bit(feature: u32) -> u64 {
    1 << feature
}

/// The virtio features offered for a device with `geometry` and `queues` queues.
pub fn features(geometry: &Geometry, queues: u16) -> u64 {
    let mut features = bit(VIRTIO_F_VERSION_1)
        | bit(VIRTIO_RING_F_EVENT_IDX)
        | bit(VIRTIO_RING_F_INDIRECT_DESC)
        | bit(VIRTIO_BLK_F_SIZE_MAX)
        | bit(VIRTIO_BLK_F_SEG_MAX)
        | bit(VIRTIO_BLK_F_BLK_SIZE)
        | bit(VIRTIO_BLK_F_TOPOLOGY)
        | bit(VIRTIO_BLK_F_FLUSH)
        | vhost::vhost_user::message::VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
    if queues > 1 {
        features |= bit(VIRTIO_BLK_F_MQ);
    }
    if geometry.read_only {
        features |= bit(VIRTIO_BLK_F_RO);
    } else {
        features |= bit(VIRTIO_BLK_F_WRITE_ZEROES);
        if geometry.can_discard {
            features |= bit(VIRTIO_BLK_F_DISCARD);
        }
    }
    features
}

/// Whether `feature` (a `VIRTIO_*_F_*` bit number) is in `features`.
pub fn has(features: u64, feature: u32) -> bool {
    features & bit(feature) != 0
}

/// Largest DISCARD or WRITE_ZEROES segment in sectors: 1 GiB rounded down to whole blocks
/// (at least one block).
pub fn zero_sectors_max(geometry: &Geometry) -> u64 {
    let block_sectors = (geometry.block_size_bytes / SECTOR_BYTES).max(1);
    (ZERO_SECTORS_MAX / block_sectors).max(1) * block_sectors
}

/// The `virtio_blk_config` bytes for `geometry` with `queues` queues.
pub fn config_space(geometry: &Geometry, queues: u16) -> [u8; CONFIG_LEN] {
    let mut space = [0u8; CONFIG_LEN];
    let mut put = |offset: usize, bytes: &[u8]| {
        space[offset..offset + bytes.len()].copy_from_slice(bytes);
    };
    let block_sectors = (geometry.block_size_bytes / SECTOR_BYTES).max(1);
    let clamp = |value: u64| u32::try_from(value).unwrap_or(u32::MAX);
    put(0, &(geometry.size_bytes / SECTOR_BYTES).to_le_bytes()); // capacity
    put(8, &SIZE_MAX_BYTES.to_le_bytes()); // size_max
    put(12, &SEG_MAX.to_le_bytes()); // seg_max
    put(20, &(SECTOR_BYTES as u32).to_le_bytes()); // blk_size: logical blocks stay 512 bytes
    put(24, &[3]); // physical_block_exp: 4 KiB physical blocks (2^3 logical)
    put(26, &8u16.to_le_bytes()); // min_io_size: 4 KiB, in logical blocks
    put(28, &clamp(block_sectors).to_le_bytes()); // opt_io_size: a data block
    put(34, &queues.to_le_bytes()); // num_queues
    let zero_max = clamp(zero_sectors_max(geometry));
    put(36, &zero_max.to_le_bytes()); // max_discard_sectors
    put(40, &DISCARD_SEG_MAX.to_le_bytes()); // max_discard_seg
    put(44, &clamp(block_sectors).to_le_bytes()); // discard_sector_alignment
    put(48, &zero_max.to_le_bytes()); // max_write_zeroes_sectors
    put(52, &DISCARD_SEG_MAX.to_le_bytes()); // max_write_zeroes_seg
    put(56, &[1]); // write_zeroes_may_unmap
    space
}

/// The part of the config space a GET_CONFIG asks for; bytes past what we fill read as
/// zero, a range past any sane config space gets nothing.
pub fn config_slice(space: &[u8; CONFIG_LEN], offset: u32, size: u32) -> Vec<u8> {
    const SPACE_MAX: u64 = 256;
    let (offset, size) = (u64::from(offset), u64::from(size));
    if offset.saturating_add(size) > SPACE_MAX {
        return Vec::new();
    }
    (offset..offset + size)
        .map(|i| space.get(i as usize).copied().unwrap_or(0))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_space_has_the_fields_at_their_spec_offsets() {
        let geometry = Geometry {
            size_bytes: 1 << 30,
            block_size_bytes: 64 << 10,
            read_only: false,
            can_discard: true,
        };
        let space = config_space(&geometry, 2);
        let u32_at = |o: usize| u32::from_le_bytes(space[o..o + 4].try_into().unwrap());
        assert_eq!(u64::from_le_bytes(space[0..8].try_into().unwrap()), 1 << 21);
        assert_eq!(u32_at(12), SEG_MAX);
        assert_eq!(u32_at(20), 512);
        assert_eq!(u16::from_le_bytes([space[34], space[35]]), 2);
        assert_eq!(
            u32_at(44),
            128,
            "discard alignment is the block, in sectors"
        );
        assert_eq!(u32_at(36) % 128, 0);
        assert_eq!(config_slice(&space, 34, 2), vec![2, 0]);
        assert_eq!(config_slice(&space, 58, 4), vec![0; 4]);
        assert!(config_slice(&space, u32::MAX, 8).is_empty());
        let features = features(&geometry, 2);
        assert!(has(features, VIRTIO_BLK_F_MQ) && has(features, VIRTIO_BLK_F_DISCARD));
        assert!(!has(features, VIRTIO_BLK_F_RO));
    }
}

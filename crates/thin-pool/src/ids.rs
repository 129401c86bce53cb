//! One newtype per address space, so that mixing them up does not compile.

use std::fmt;

/// A thin volume's id in the pool metadata (dm's "thin device id"): 0 ..= 2^24 − 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct VolumeId(u32);

impl VolumeId {
    /// The largest id the kernel accepts.
    pub const MAX: VolumeId = VolumeId((1 << 24) - 1);
}

/// A block of a volume's virtual address space, in data-block units.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct VirtualBlock(u64);

/// A block of the data device, in data-block units.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DataBlock(u64);

/// The user-set transaction id of the pool (`set_transaction_id`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct TransactionId(u64);

/// The largest data block a mapping can hold (40 bits).
pub const DATA_BLOCK_MAX: u64 = (1 << 40) - 1;

macro_rules! display_inner {
    ($($t:ty),*) => {$(
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}", self.0)
            }
        }
    )*};
}
display_inner!(VolumeId, VirtualBlock, DataBlock, TransactionId);

impl VolumeId {
    /// The id `value` (any u32; the metadata layer checks it against [`VolumeId::MAX`]).
    pub const fn new(value: u32) -> VolumeId {
        VolumeId(value)
    }

    /// The raw id, for encoding.
    pub const fn get(self) -> u32 {
        self.0
    }
}

impl VirtualBlock {
    /// Virtual block `value`.
    pub const fn new(value: u64) -> VirtualBlock {
        VirtualBlock(value)
    }

    /// The raw block number, for encoding and byte offsets.
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl DataBlock {
    /// Data block `value`.
    pub const fn new(value: u64) -> DataBlock {
        DataBlock(value)
    }

    /// The raw block number, for encoding and byte offsets.
    pub const fn get(self) -> u64 {
        self.0
    }

    /// The byte offset of this block on a data device of `block_size_bytes` blocks.
    pub const fn offset_bytes(self, block_size_bytes: u64) -> u64 {
        self.0 * block_size_bytes
    }
}

impl TransactionId {
    /// Transaction id `value`.
    pub const fn new(value: u64) -> TransactionId {
        TransactionId(value)
    }

    /// The raw id, for encoding.
    pub const fn get(self) -> u64 {
        self.0
    }

    /// The next id (`set_transaction_id(T, T + 1)` of a management change).
    pub const fn next(self) -> TransactionId {
        TransactionId(self.0 + 1)
    }
}

/// The pool's snapshot epoch as a mapping stores it: 24 bits (spec §6.3). A mapping made at
/// a time older than a volume's `snapshotted_time` may be shared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Time(u32);

impl Time {
    /// The largest time a mapping can hold.
    pub const MAX: Time = Time((1 << 24) - 1);

    /// Time `value`, or None when it does not fit in 24 bits.
    pub const fn new(value: u32) -> Option<Time> {
        if value <= Time::MAX.0 {
            Some(Time(value))
        } else {
            None
        }
    }

    /// The raw value, for encoding.
    pub const fn get(self) -> u32 {
        self.0
    }
}

/// A mapping tree leaf value (spec §6.3): a data block (40 bits) and the time the mapping
/// was made (24 bits), packed as `data_block << 24 | time`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockTime {
    data_block: DataBlock,
    time: Time,
}

impl BlockTime {
    /// A mapping value. Panics if `data_block` exceeds `DATA_BLOCK_MAX`: callers bound data
    /// blocks by the data device, which the format limits to 2^40 blocks.
    pub fn new(data_block: DataBlock, time: Time) -> BlockTime {
        assert!(
            data_block.0 <= DATA_BLOCK_MAX,
            "data block {} beyond the format's 40 bits",
            data_block.0
        );
        BlockTime { data_block, time }
    }

    /// The data block.
    pub const fn data_block(self) -> DataBlock {
        self.data_block
    }

    /// The time the mapping was made.
    pub const fn time(self) -> Time {
        self.time
    }

    /// The on-disk value.
    pub const fn pack(self) -> u64 {
        (self.data_block.0 << 24) | self.time.0 as u64
    }

    /// Decode an on-disk value (every u64 decodes: 40 + 24 bits).
    pub const fn unpack(value: u64) -> BlockTime {
        BlockTime {
            data_block: DataBlock(value >> 24),
            time: Time((value & 0x00FF_FFFF) as u32),
        }
    }
}

impl fmt::Display for Time {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_time_packs_as_the_format_says() {
        let value = BlockTime::new(DataBlock::new(DATA_BLOCK_MAX), Time::MAX);
        assert_eq!(value.pack(), u64::MAX);
        assert_eq!(BlockTime::unpack(u64::MAX), value);
        let value = BlockTime::new(DataBlock::new(5), Time::new(7).unwrap());
        assert_eq!(value.pack(), (5 << 24) | 7);
        assert_eq!(BlockTime::unpack((5 << 24) | 7), value);
        assert_eq!(Time::new(1 << 24), None);
    }
}

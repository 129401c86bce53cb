//! One newtype per address space, so that mixing them up does not compile.

use std::fmt;

/// A thin volume's id in the pool metadata (dm's "thin device id"): 0 ..= 2^24 − 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct VolumeId(pub u32);

impl VolumeId {
    /// The largest id the kernel accepts.
    pub const MAX: VolumeId = VolumeId((1 << 24) - 1);
}

/// A block of a volume's virtual address space, in data-block units.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct VirtualBlock(pub u64);

/// A block of the data device, in data-block units.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DataBlock(pub u64);

/// The user-set transaction id of the pool (`set_transaction_id`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct TransactionId(pub u64);

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

//! Btree node format (spec §5): a 32-byte header, then `max_entries` u64 keys, then
//! `max_entries` values of `value_size` bytes.
//!
//! ```text
//!   0  csum         u32  (salt 121107)
//!   4  flags        u32  1 = internal, 2 = leaf
//!   8  blocknr      u64
//!  16  nr_entries   u32
//!  20  max_entries  u32  3 × ⌊⌊4064 / (8 + value_size)⌋ / 3⌋
//!  24  value_size   u32  8 in every internal node
//!  28  padding      u32
//!  32  keys[max_entries]      u64
//!  32 + 8·max_entries  values[max_entries]
//! ```

use crate::block::{zeroed_block, Block, MetadataBlock, BLOCK_SIZE};
use crate::error::{Error, Result};

/// Size of the node header.
pub const HEADER_SIZE: usize = 32;
/// `flags` of an internal node.
pub const INTERNAL_FLAG: u32 = 1;
/// `flags` of a leaf.
pub const LEAF_FLAG: u32 = 2;

/// Capacity of a node whose values are `value_size` bytes.
pub const fn max_entries(value_size: usize) -> usize {
    3 * (((BLOCK_SIZE - HEADER_SIZE) / (8 + value_size)) / 3)
}

const _: () = assert!(max_entries(8) == 252);
const _: () = assert!(max_entries(24) == 126);
const _: () = assert!(max_entries(16) == 168);
const _: () = assert!(max_entries(4) == 336);
const _: () = assert!(HEADER_SIZE + max_entries(1) * 9 <= BLOCK_SIZE);

fn read_u32(data: &Block, at: usize) -> u32 {
    u32::from_le_bytes(data[at..at + 4].try_into().expect("4 bytes"))
}

#[inline]
fn read_u64(data: &Block, at: usize) -> u64 {
    u64::from_le_bytes(data[at..at + 8].try_into().expect("8 bytes"))
}

/// Read-only view of a node. Construct with [`Node::parse`], which checks the layout rules
/// so that every accessor stays inside the block.
#[derive(Clone, Copy)]
pub struct Node<'a> {
    data: &'a Block,
    leaf: bool,
    nr_entries: usize,
    max_entries: usize,
    value_size: usize,
}

impl<'a> Node<'a> {
    /// Check the header of a node at `block` whose leaves hold `leaf_value_size`-byte values,
    /// and return a view of it. Errors name the block and the broken rule (spec §11 rules
    /// 5, 6, 7 (capacity part) and 9); checksum and location were checked on read.
    pub fn parse(
        block: MetadataBlock,
        data: &'a Block,
        leaf_value_size: usize,
    ) -> Result<Node<'a>> {
        let flags = read_u32(data, 4);
        let leaf = match flags {
            INTERNAL_FLAG => false,
            LEAF_FLAG => true,
            other => {
                return Err(Error::corrupt(
                    block,
                    format!("btree node flags {other:#x} are neither internal (1) nor leaf (2)"),
                ))
            }
        };
        let nr_entries = read_u32(data, 16) as usize;
        let max = read_u32(data, 20) as usize;
        let value_size = read_u32(data, 24) as usize;
        let expected_value_size = if leaf { leaf_value_size } else { 8 };
        if value_size != expected_value_size {
            return Err(Error::corrupt(
                block,
                format!(
                    "btree {} value size is {value_size}, expected {expected_value_size}",
                    if leaf { "leaf" } else { "internal node" }
                ),
            ));
        }
        if max == 0 || HEADER_SIZE + max * (8 + value_size) > BLOCK_SIZE {
            return Err(Error::corrupt(block, format!("btree node max_entries {max} does not fit a block with {value_size}-byte values")));
        }
        if !max.is_multiple_of(3) {
            return Err(Error::corrupt(
                block,
                format!("btree node max_entries {max} is not a multiple of 3"),
            ));
        }
        if nr_entries > max {
            return Err(Error::corrupt(
                block,
                format!("btree node has {nr_entries} entries, more than its max_entries {max}"),
            ));
        }
        Ok(Node {
            data,
            leaf,
            nr_entries,
            max_entries: max,
            value_size,
        })
    }

    /// Whether this is a leaf.
    pub fn is_leaf(&self) -> bool {
        self.leaf
    }

    /// Entries in use.
    pub fn len(&self) -> usize {
        self.nr_entries
    }

    /// Whether the node has no entries.
    pub fn is_empty(&self) -> bool {
        self.nr_entries == 0
    }

    /// Capacity.
    pub fn max_entries(&self) -> usize {
        self.max_entries
    }

    /// Key `i`.
    #[inline]
    pub fn key(&self, i: usize) -> u64 {
        debug_assert!(i < self.nr_entries);
        read_u64(self.data, HEADER_SIZE + 8 * i)
    }

    /// Value `i` as bytes.
    #[inline]
    pub fn value_bytes(&self, i: usize) -> &'a [u8] {
        debug_assert!(i < self.nr_entries);
        let at = HEADER_SIZE + 8 * self.max_entries + self.value_size * i;
        &self.data[at..at + self.value_size]
    }

    /// Child `i` of an internal node.
    pub fn child(&self, i: usize) -> MetadataBlock {
        debug_assert!(!self.leaf);
        MetadataBlock::new(u64::from_le_bytes(
            self.value_bytes(i).try_into().expect("8 bytes"),
        ))
    }

    /// Index of the first key >= `key` (== len() if none).
    pub fn lower_bound(&self, key: u64) -> usize {
        let (mut lo, mut hi) = (0, self.nr_entries);
        while lo < hi {
            let mid = (lo + hi) / 2;
            if self.key(mid) < key {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// Index of the last key <= `key`, if any.
    pub fn last_at_or_below(&self, key: u64) -> Option<usize> {
        let upper = {
            let (mut lo, mut hi) = (0, self.nr_entries);
            while lo < hi {
                let mid = (lo + hi) / 2;
                if self.key(mid) <= key {
                    lo = mid + 1;
                } else {
                    hi = mid;
                }
            }
            lo
        };
        upper.checked_sub(1)
    }
}

/// Writable node contents: the entries of one node held in vectors, built from a block and
/// encoded back into one. Modifications happen here; `encode` lays them out.
#[derive(Clone, Debug)]
pub struct NodeBuf {
    /// Whether this is a leaf.
    pub leaf: bool,
    /// Value size of this node (8 for internal nodes).
    pub value_size: usize,
    /// Keys, strictly increasing.
    pub keys: Vec<u64>,
    /// Values, `value_size` bytes each, concatenated.
    pub values: Vec<u8>,
}

impl NodeBuf {
    /// An empty node.
    pub fn new(leaf: bool, value_size: usize) -> NodeBuf {
        NodeBuf {
            leaf,
            value_size,
            keys: Vec::new(),
            values: Vec::new(),
        }
    }

    /// Copy out a parsed node.
    pub fn from_node(node: &Node<'_>) -> NodeBuf {
        let n = node.len();
        let mut keys = Vec::with_capacity(n);
        for i in 0..n {
            keys.push(node.key(i));
        }
        let at = HEADER_SIZE + 8 * node.max_entries;
        NodeBuf {
            leaf: node.leaf,
            value_size: node.value_size,
            keys,
            values: node.data[at..at + n * node.value_size].to_vec(),
        }
    }

    /// Capacity of this node kind.
    pub fn max_entries(&self) -> usize {
        max_entries(self.value_size)
    }

    /// Entries in use.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether the node has no entries.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Value `i` as bytes.
    pub fn value(&self, i: usize) -> &[u8] {
        &self.values[i * self.value_size..(i + 1) * self.value_size]
    }

    /// Replace value `i`.
    pub fn set_value(&mut self, i: usize, bytes: &[u8]) {
        assert_eq!(bytes.len(), self.value_size);
        self.values[i * self.value_size..(i + 1) * self.value_size].copy_from_slice(bytes);
    }

    /// Child `i` of an internal node.
    pub fn child(&self, i: usize) -> MetadataBlock {
        assert!(!self.leaf);
        MetadataBlock::new(u64::from_le_bytes(
            self.value(i).try_into().expect("8 bytes"),
        ))
    }

    /// Point entry `i` of an internal node at `child`.
    pub fn set_child(&mut self, i: usize, child: MetadataBlock) {
        self.set_value(i, &child.get().to_le_bytes());
    }

    /// Insert an entry at position `i`.
    pub fn insert(&mut self, i: usize, key: u64, value: &[u8]) {
        assert_eq!(value.len(), self.value_size);
        assert!(self.len() < self.max_entries(), "insert into a full node");
        self.keys.insert(i, key);
        let at = i * self.value_size;
        self.values.splice(at..at, value.iter().copied());
    }

    /// Remove entry `i`.
    pub fn remove(&mut self, i: usize) {
        self.keys.remove(i);
        let at = i * self.value_size;
        self.values.drain(at..at + self.value_size);
    }

    /// Split off the entries from `at` on into a new node.
    pub fn split_off(&mut self, at: usize) -> NodeBuf {
        NodeBuf {
            leaf: self.leaf,
            value_size: self.value_size,
            keys: self.keys.split_off(at),
            values: self.values.split_off(at * self.value_size),
        }
    }

    /// Append all of `other`'s entries.
    pub fn append(&mut self, other: &mut NodeBuf) {
        assert_eq!(self.leaf, other.leaf);
        assert_eq!(self.value_size, other.value_size);
        if let (Some(&last), Some(&first)) = (self.keys.last(), other.keys.first()) {
            assert!(last < first, "appended keys must follow");
        }
        self.keys.append(&mut other.keys);
        self.values.append(&mut other.values);
    }

    /// Lay the node out in a block located at `block` (checksum left for the commit).
    /// Asserts the layout invariants: a node we write must parse.
    pub fn encode(&self, block: MetadataBlock) -> Box<Block> {
        let max = self.max_entries();
        let n = self.len();
        assert!(n <= max, "node of {n} entries exceeds {max}");
        assert_eq!(self.values.len(), n * self.value_size);
        assert!(
            self.keys.windows(2).all(|w| w[0] < w[1]),
            "keys strictly increase"
        );
        let mut data = zeroed_block();
        data[4..8]
            .copy_from_slice(&(if self.leaf { LEAF_FLAG } else { INTERNAL_FLAG }).to_le_bytes());
        data[8..16].copy_from_slice(&block.get().to_le_bytes());
        data[16..20].copy_from_slice(&(n as u32).to_le_bytes());
        data[20..24].copy_from_slice(&(max as u32).to_le_bytes());
        data[24..28].copy_from_slice(&(self.value_size as u32).to_le_bytes());
        for (i, key) in self.keys.iter().enumerate() {
            let at = HEADER_SIZE + 8 * i;
            data[at..at + 8].copy_from_slice(&key.to_le_bytes());
        }
        let at = HEADER_SIZE + 8 * max;
        data[at..at + self.values.len()].copy_from_slice(&self.values);
        data
    }
}

//! [`MemoryExport`]: a sparse memory disk with a real allocation map, used by the tests.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use super::{Capabilities, Export, Extent, MetaContext, StatusExtent, ZeroOptions};
use crate::error::{Error, ErrorKind, Result};
use crate::protocol::BLOCK_SIZE_MIN;
use crate::sync;

/// State of one allocation block of a [`MemoryExport`].
enum Block {
    /// Not allocated; reads as zeroes.
    Unmapped,
    /// Allocated and known to be zero; costs no memory.
    Zeroed,
    /// Allocated with contents.
    Data(Box<[u8]>),
}

/// A sparse memory disk. The allocation map has one entry per block of `block_size_bytes`,
/// each behind its own lock, so requests on different blocks run in parallel. WRITE allocates
/// blocks; TRIM unmaps whole blocks; WRITE_ZEROES unmaps whole blocks (or marks them
/// allocated-zero with NO_HOLE) and zeroes partial ones; BLOCK_STATUS reports the map.
pub struct MemoryExport {
    name: String,
    description: String,
    size_bytes: u64,
    block_size_bytes: u64,
    read_only: bool,
    test_contexts: bool,
    blocks: Arc<Vec<RwLock<Block>>>,
    fault_set: AtomicBool,
    fault: Mutex<Option<ErrorKind>>,
    flush_count: AtomicU64,
}

impl MemoryExport {
    /// Block size of the allocation map unless [`MemoryExport::with_block_size`] changes it.
    pub const BLOCK_SIZE_DEFAULT: u64 = 64 * 1024;

    /// An all-hole export of `size_bytes` (a multiple of 512).
    pub fn new(name: impl Into<String>, size_bytes: u64) -> Self {
        assert_eq!(
            size_bytes % u64::from(BLOCK_SIZE_MIN),
            0,
            "size {size_bytes} is not a multiple of 512"
        );
        let mut export = MemoryExport {
            name: name.into(),
            description: String::new(),
            size_bytes,
            block_size_bytes: Self::BLOCK_SIZE_DEFAULT,
            read_only: false,
            test_contexts: false,
            blocks: Arc::new(Vec::new()),
            fault_set: AtomicBool::new(false),
            fault: Mutex::new(None),
            flush_count: AtomicU64::new(0),
        };
        export.reset_blocks();
        export
    }

    /// Sets the allocation block size (a power of two, at least 512).
    pub fn with_block_size(mut self, block_size_bytes: u64) -> Self {
        assert!(block_size_bytes.is_power_of_two());
        assert!(block_size_bytes >= u64::from(BLOCK_SIZE_MIN));
        self.block_size_bytes = block_size_bytes;
        self.reset_blocks();
        self
    }

    /// Sets the description.
    pub fn with_description(mut self, description: impl Into<String>) -> Self {
        self.description = description.into();
        self
    }

    /// Makes the export read-only.
    pub fn with_read_only(mut self, read_only: bool) -> Self {
        self.read_only = read_only;
        self
    }

    /// Offers the test metadata contexts ([`MemoryExport::TEST_CONTEXTS`]):
    /// `x-memory:data` (flag 1 where a block holds written data), `x-memory:zeroed` (flag 1
    /// where a block is allocated and known zero) and `x-memory:failing` (every request
    /// fails with an I/O error).
    pub fn with_test_contexts(mut self) -> Self {
        self.test_contexts = true;
        self
    }

    /// Names of the contexts [`MemoryExport::with_test_contexts`] offers.
    pub const TEST_CONTEXTS: [&'static str; 3] =
        ["x-memory:data", "x-memory:zeroed", "x-memory:failing"];

    fn reset_blocks(&mut self) {
        let count = self.size_bytes.div_ceil(self.block_size_bytes);
        self.blocks = Arc::new((0..count).map(|_| RwLock::new(Block::Unmapped)).collect());
    }

    /// Makes every later data operation fail with `kind` (or stop failing, with `None`).
    pub fn set_fault(&self, kind: Option<ErrorKind>) {
        *sync::lock(&self.fault) = kind;
        self.fault_set.store(kind.is_some(), Ordering::SeqCst);
    }

    /// How many times [`Export::flush`] has been called.
    pub fn flush_count(&self) -> u64 {
        self.flush_count.load(Ordering::SeqCst)
    }

    /// Number of allocation blocks that are allocated (with data or known zero).
    pub fn allocated_block_count(&self) -> usize {
        self.blocks
            .iter()
            .filter(|block| !matches!(*sync::read(block), Block::Unmapped))
            .count()
    }

    fn check_fault(&self, what: &str) -> Result<()> {
        if !self.fault_set.load(Ordering::SeqCst) {
            return Ok(());
        }
        match *sync::lock(&self.fault) {
            Some(kind) => Err(Error::export(kind, format!("injected fault during {what}"))),
            None => Ok(()),
        }
    }

    fn check_range(&self, what: &str, offset: u64, length: u64) -> Result<()> {
        match offset.checked_add(length) {
            Some(end) if end <= self.size_bytes => Ok(()),
            _ => Err(Error::export(
                ErrorKind::InvalidArgument,
                format!(
                    "{what} at {offset} length {length} is outside the export of {} bytes",
                    self.size_bytes
                ),
            )),
        }
    }

    fn check_writable(&self, what: &str) -> Result<()> {
        if self.read_only {
            return Err(Error::export(
                ErrorKind::PermissionDenied,
                format!("{what} on read-only export {}", self.name),
            ));
        }
        Ok(())
    }

    fn block_length(&self, index: usize) -> usize {
        let start = index as u64 * self.block_size_bytes;
        (self.size_bytes - start).min(self.block_size_bytes) as usize
    }

    /// Splits `[offset, offset + length)` into per-block pieces:
    /// (block index, offset inside the block, piece length, offset inside the range).
    fn pieces(&self, offset: u64, length: u64) -> impl Iterator<Item = (usize, usize, usize, u64)> {
        let block_size = self.block_size_bytes;
        let end = offset + length;
        let mut position = offset;
        std::iter::from_fn(move || {
            if position >= end {
                return None;
            }
            let index = (position / block_size) as usize;
            let within = (position % block_size) as usize;
            let piece = (block_size - within as u64).min(end - position) as usize;
            let item = (index, within, piece, position - offset);
            position += piece as u64;
            Some(item)
        })
    }
}

impl Export for MemoryExport {
    fn name(&self) -> &str {
        &self.name
    }

    fn description(&self) -> &str {
        &self.description
    }

    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            read_only: self.read_only,
            trim: true,
            fast_zero: true,
            multi_conn: true,
            ..Capabilities::default()
        }
    }

    fn read_at(&self, offset: u64, buffer: &mut [u8]) -> Result<()> {
        self.check_fault("read")?;
        self.check_range("read", offset, buffer.len() as u64)?;
        for (index, within, piece, at) in self.pieces(offset, buffer.len() as u64) {
            let target = &mut buffer[at as usize..at as usize + piece];
            match &*sync::read(&self.blocks[index]) {
                Block::Unmapped | Block::Zeroed => target.fill(0),
                Block::Data(data) => target.copy_from_slice(&data[within..within + piece]),
            }
        }
        Ok(())
    }

    fn write_at(&self, offset: u64, data: &[u8], _fua: bool) -> Result<()> {
        self.check_fault("write")?;
        self.check_writable("write")?;
        self.check_range("write", offset, data.len() as u64)?;
        for (index, within, piece, at) in self.pieces(offset, data.len() as u64) {
            let source = &data[at as usize..at as usize + piece];
            let block_length = self.block_length(index);
            let mut block = sync::write(&self.blocks[index]);
            match &mut *block {
                Block::Data(existing) => existing[within..within + piece].copy_from_slice(source),
                _ if piece == block_length => *block = Block::Data(source.into()),
                _ => {
                    let mut fresh = vec![0u8; block_length].into_boxed_slice();
                    fresh[within..within + piece].copy_from_slice(source);
                    *block = Block::Data(fresh);
                }
            }
        }
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, length: u64, options: ZeroOptions) -> Result<()> {
        self.check_fault("write zeroes")?;
        self.check_writable("write zeroes")?;
        self.check_range("write zeroes", offset, length)?;
        if options.fast {
            // Zeroing part of a block that holds data needs a real write: not fast.
            for (index, _, piece, _) in self.pieces(offset, length) {
                let partial = piece != self.block_length(index);
                let block = sync::read(&self.blocks[index]);
                if partial && matches!(*block, Block::Data(_)) {
                    return Err(Error::export(
                        ErrorKind::NotSupported,
                        format!("zeroing part of block {index} is not fast"),
                    ));
                }
            }
        }
        for (index, within, piece, _) in self.pieces(offset, length) {
            let whole = piece == self.block_length(index);
            let mut block = sync::write(&self.blocks[index]);
            match &mut *block {
                _ if whole && options.may_trim => *block = Block::Unmapped,
                _ if whole => *block = Block::Zeroed,
                Block::Data(data) => data[within..within + piece].fill(0),
                Block::Unmapped if !options.may_trim => *block = Block::Zeroed,
                Block::Unmapped | Block::Zeroed => {}
            }
        }
        Ok(())
    }

    fn trim(&self, offset: u64, length: u64, _fua: bool) -> Result<()> {
        self.check_fault("trim")?;
        self.check_writable("trim")?;
        self.check_range("trim", offset, length)?;
        for (index, _, piece, _) in self.pieces(offset, length) {
            if piece == self.block_length(index) {
                *sync::write(&self.blocks[index]) = Block::Unmapped;
            }
        }
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        self.check_fault("flush")?;
        self.flush_count.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    fn cache(&self, offset: u64, length: u64) -> Result<()> {
        self.check_fault("cache")?;
        self.check_range("cache", offset, length)
    }

    fn block_status(&self, offset: u64, length: u64, extents_max: usize) -> Result<Vec<Extent>> {
        self.check_fault("block status")?;
        self.check_range("block status", offset, length)?;
        let mut extents: Vec<Extent> = Vec::new();
        for (index, _, piece, _) in self.pieces(offset, length) {
            let (hole, zero) = match *sync::read(&self.blocks[index]) {
                Block::Unmapped => (true, true),
                Block::Zeroed => (false, true),
                Block::Data(_) => (false, false),
            };
            let full = extents.len() >= extents_max;
            match extents.last_mut() {
                Some(last) if last.hole == hole && last.zero == zero => {
                    last.length_bytes += piece as u64;
                }
                _ if full => break,
                _ => extents.push(Extent {
                    length_bytes: piece as u64,
                    hole,
                    zero,
                }),
            }
        }
        Ok(extents)
    }

    fn meta_contexts(&self, prefix: &str) -> Vec<String> {
        if !self.test_contexts {
            return Vec::new();
        }
        Self::TEST_CONTEXTS
            .iter()
            .filter(|name| name.starts_with(prefix))
            .map(|name| name.to_string())
            .collect()
    }

    fn meta_context(&self, name: &str) -> Option<Arc<dyn MetaContext>> {
        let which = match name {
            _ if !self.test_contexts => return None,
            "x-memory:data" => TestContext::Data,
            "x-memory:zeroed" => TestContext::Zeroed,
            "x-memory:failing" => TestContext::Failing,
            _ => return None,
        };
        Some(Arc::new(BlockContext {
            which,
            blocks: Arc::clone(&self.blocks),
            block_size_bytes: self.block_size_bytes,
            size_bytes: self.size_bytes,
        }))
    }
}

/// Which test context a [`BlockContext`] reports.
#[derive(Clone, Copy, PartialEq, Eq)]
enum TestContext {
    Data,
    Zeroed,
    Failing,
}

/// A test context of a [`MemoryExport`]: flag 1 on the blocks of one state, or a failure.
struct BlockContext {
    which: TestContext,
    blocks: Arc<Vec<RwLock<Block>>>,
    block_size_bytes: u64,
    size_bytes: u64,
}

impl MetaContext for BlockContext {
    fn block_status(
        &self,
        offset: u64,
        length: u64,
        extents_max: usize,
    ) -> Result<Vec<StatusExtent>> {
        if self.which == TestContext::Failing {
            return Err(Error::export(
                ErrorKind::Io,
                "x-memory:failing always fails",
            ));
        }
        let end = offset
            .checked_add(length)
            .filter(|end| *end <= self.size_bytes)
            .ok_or_else(|| {
                Error::export(
                    ErrorKind::InvalidArgument,
                    format!("block status at {offset} length {length} is past the end"),
                )
            })?;
        let mut extents: Vec<StatusExtent> = Vec::new();
        let mut position = offset;
        while position < end {
            let index = (position / self.block_size_bytes) as usize;
            let block_end = ((index as u64 + 1) * self.block_size_bytes).min(end);
            let flags = match (&*sync::read(&self.blocks[index]), self.which) {
                (Block::Data(_), TestContext::Data) | (Block::Zeroed, TestContext::Zeroed) => 1,
                _ => 0,
            };
            let piece = block_end - position;
            position = block_end;
            let full = extents.len() >= extents_max;
            match extents.last_mut() {
                Some(last) if last.flags == flags => last.length_bytes += piece,
                _ if full => break,
                _ => extents.push(StatusExtent {
                    length_bytes: piece,
                    flags,
                }),
            }
        }
        Ok(extents)
    }
}

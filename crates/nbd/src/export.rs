//! The [`Export`] trait the server serves, the [`ExportRegistry`] it looks exports up in, and
//! two in-memory implementations: [`ExportMap`] (a mutable name-to-export map) and
//! [`MemoryExport`] (a sparse memory disk with a real allocation map, used by the tests).
//!
//! Contract between the session and an export: the session only calls data methods with
//! ranges inside `[0, size_bytes)`, with offsets and lengths that are multiples of
//! [`crate::protocol::BLOCK_SIZE_MIN`], with READ/WRITE buffers of at most
//! [`crate::protocol::PAYLOAD_LENGTH_MAX`] bytes, and never calls a writing method on a
//! read-only export. Every method takes `&self` and is called concurrently from many threads
//! and connections, so exports are `Send + Sync`. A FLUSH on any connection calls
//! [`Export::flush`], which must make every write completed on any connection durable.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use crate::error::{Error, ErrorKind, Result};
use crate::protocol::BLOCK_SIZE_MIN;
use crate::sync;

/// One run of equally-allocated bytes reported by [`Export::block_status`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    /// Length of the run in bytes; nonzero.
    pub length_bytes: u64,
    /// Not allocated: a write here may need space (NBD_STATE_HOLE).
    pub hole: bool,
    /// Reads as zeroes (NBD_STATE_ZERO).
    pub zero: bool,
}

/// How [`Export::write_zeroes`] may achieve its result.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ZeroOptions {
    /// The range may be unmapped (no NBD_CMD_FLAG_NO_HOLE); otherwise it must end allocated.
    pub may_trim: bool,
    /// NBD_CMD_FLAG_FAST_ZERO: if zeroing is not faster than writing zeroes, fail with
    /// [`ErrorKind::NotSupported`] and change nothing.
    pub fast: bool,
    /// NBD_CMD_FLAG_FUA: the result must be durable before returning.
    pub fua: bool,
}

/// A block device served over NBD. Byte-offset based; see the module docs for what the
/// session guarantees about the arguments.
pub trait Export: Send + Sync {
    /// Canonical name (sent as NBD_INFO_NAME).
    fn name(&self) -> &str;

    /// Human-readable description (NBD_INFO_DESCRIPTION, LIST); empty for none.
    fn description(&self) -> &str {
        ""
    }

    /// Size in bytes; a multiple of 512.
    fn size_bytes(&self) -> u64;

    /// Block size that avoids read-modify-write inside the export (NBD_INFO_BLOCK_SIZE
    /// preferred); a power of two from 512 bytes to 32 MiB, otherwise 4096 is advertised.
    fn preferred_block_size_bytes(&self) -> u32 {
        crate::protocol::BLOCK_SIZE_PREFERRED
    }

    /// Writes, trims and zeroing are refused with `NBD_EPERM`.
    fn read_only(&self) -> bool {
        false
    }

    /// TRIM does something useful (advertised as NBD_FLAG_SEND_TRIM).
    fn can_trim(&self) -> bool {
        false
    }

    /// [`ZeroOptions::fast`] can ever succeed (advertised as NBD_FLAG_SEND_FAST_ZERO).
    fn can_fast_zero(&self) -> bool {
        false
    }

    /// FLUSH and FUA on one connection cover writes completed on every connection
    /// (advertised as NBD_FLAG_CAN_MULTI_CONN).
    fn can_multi_conn(&self) -> bool {
        false
    }

    /// Fills all of `buffer` with the bytes at `offset`. The buffer's previous contents are
    /// unspecified (the session reuses buffers without zeroing them), so every byte must be
    /// written, zeroes included.
    fn read_at(&self, offset: u64, buffer: &mut [u8]) -> Result<()>;

    /// Writes `data` at `offset`; if `fua`, the data is durable when this returns.
    fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> Result<()>;

    /// Makes `length` bytes at `offset` read as zeroes. The default writes zero buffers and
    /// refuses `fast`.
    fn write_zeroes(&self, offset: u64, length: u64, options: ZeroOptions) -> Result<()> {
        if options.fast {
            return Err(Error::export(
                ErrorKind::NotSupported,
                "fast zero not supported",
            ));
        }
        let zeroes = vec![0u8; 1 << 20];
        let mut done = 0;
        while done < length {
            let piece = (length - done).min(zeroes.len() as u64) as usize;
            self.write_at(offset + done, &zeroes[..piece], options.fua)?;
            done += piece as u64;
        }
        Ok(())
    }

    /// Hint that `length` bytes at `offset` are no longer needed; contents become undefined.
    /// May round inward or do nothing (the default).
    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<()> {
        let _ = (offset, length, fua);
        Ok(())
    }

    /// Makes every write that has returned, on any connection, durable.
    fn flush(&self) -> Result<()>;

    /// Prefetch hint; the default does nothing.
    fn cache(&self, offset: u64, length: u64) -> Result<()> {
        let _ = (offset, length);
        Ok(())
    }

    /// Allocation status of the range starting at `offset`. Returns consecutive extents that
    /// start exactly at `offset`, at least one and at most `extents_max`, none past the end of
    /// the export; they may stop before `offset + length` (the client asks again) or run a
    /// little past it. The default reports everything as allocated data, which is always safe.
    fn block_status(&self, offset: u64, length: u64, extents_max: usize) -> Result<Vec<Extent>> {
        let _ = (offset, extents_max);
        Ok(vec![Extent {
            length_bytes: length,
            hole: false,
            zero: false,
        }])
    }
}

/// One entry of an NBD_OPT_LIST answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportListing {
    /// Export name.
    pub name: String,
    /// Human-readable description; may be empty.
    pub description: String,
}

/// Where the server looks exports up by name. Implementations may add and remove exports
/// while serving; a connection keeps the `Arc` it opened until it ends, so an export that is
/// removed should fail further requests (for instance with [`ErrorKind::Shutdown`]).
pub trait ExportRegistry: Send + Sync {
    /// Exports offered to NBD_OPT_LIST.
    fn list(&self) -> Vec<ExportListing>;

    /// Opens the export called `name`; the empty name means the default export.
    /// `Ok(None)` means there is no such export.
    fn open(&self, name: &str) -> Result<Option<Arc<dyn Export>>>;
}

/// A registry backed by a map from name to export; exports can be inserted and removed at
/// any time.
#[derive(Default)]
pub struct ExportMap {
    exports: RwLock<BTreeMap<String, Arc<dyn Export>>>,
    default_name: RwLock<Option<String>>,
}

impl ExportMap {
    /// An empty map.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) an export under its own name.
    pub fn insert(&self, export: Arc<dyn Export>) {
        let name = export.name().to_owned();
        sync::write(&self.exports).insert(name, export);
    }

    /// Removes an export; open connections keep serving their `Arc`.
    pub fn remove(&self, name: &str) -> Option<Arc<dyn Export>> {
        sync::write(&self.exports).remove(name)
    }

    /// Chooses which export the empty name opens.
    pub fn set_default(&self, name: Option<String>) {
        *sync::write(&self.default_name) = name;
    }
}

impl ExportRegistry for ExportMap {
    fn list(&self) -> Vec<ExportListing> {
        sync::read(&self.exports)
            .values()
            .map(|export| ExportListing {
                name: export.name().to_owned(),
                description: export.description().to_owned(),
            })
            .collect()
    }

    fn open(&self, name: &str) -> Result<Option<Arc<dyn Export>>> {
        let name = if name.is_empty() {
            match sync::read(&self.default_name).clone() {
                Some(default) => default,
                None => return Ok(None),
            }
        } else {
            name.to_owned()
        };
        Ok(sync::read(&self.exports).get(&name).cloned())
    }
}

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
    blocks: Vec<RwLock<Block>>,
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
            blocks: Vec::new(),
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

    fn reset_blocks(&mut self) {
        let count = self.size_bytes.div_ceil(self.block_size_bytes);
        self.blocks = (0..count).map(|_| RwLock::new(Block::Unmapped)).collect();
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

    fn read_only(&self) -> bool {
        self.read_only
    }

    fn can_trim(&self) -> bool {
        true
    }

    fn can_fast_zero(&self) -> bool {
        true
    }

    fn can_multi_conn(&self) -> bool {
        true
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn export() -> MemoryExport {
        MemoryExport::new("m", 1 << 20).with_block_size(4096)
    }

    #[test]
    fn new_export_is_one_hole() {
        let export = export();
        let extents = export.block_status(0, 1 << 20, 100).unwrap();
        assert_eq!(
            extents,
            vec![Extent {
                length_bytes: 1 << 20,
                hole: true,
                zero: true
            }]
        );
        let mut buffer = vec![1u8; 8192];
        export.read_at(4096, &mut buffer).unwrap();
        assert!(buffer.iter().all(|&b| b == 0));
    }

    #[test]
    fn partial_write_allocates_one_block_and_reads_back() {
        let export = export();
        export.write_at(4096 + 512, &[7u8; 512], false).unwrap();
        assert_eq!(export.allocated_block_count(), 1);
        let mut buffer = vec![0u8; 4096];
        export.read_at(4096, &mut buffer).unwrap();
        assert!(buffer[..512].iter().all(|&b| b == 0));
        assert!(buffer[512..1024].iter().all(|&b| b == 7));
        assert!(buffer[1024..].iter().all(|&b| b == 0));
        let extents = export.block_status(0, 3 * 4096, 10).unwrap();
        assert_eq!(extents.len(), 3);
        assert!(!extents[1].hole && !extents[1].zero);
    }

    #[test]
    fn trim_and_write_zeroes_make_holes_only_for_whole_blocks() {
        let export = export();
        export.write_at(0, &[1u8; 3 * 4096], false).unwrap();
        export.trim(512, 3 * 4096 - 1024, false).unwrap();
        assert_eq!(export.allocated_block_count(), 2);
        let options = ZeroOptions {
            may_trim: true,
            ..Default::default()
        };
        export.write_zeroes(0, 512, options).unwrap();
        let mut buffer = vec![9u8; 1024];
        export.read_at(0, &mut buffer).unwrap();
        assert!(buffer[..512].iter().all(|&b| b == 0));
        assert!(buffer[512..].iter().all(|&b| b == 1));
        export.write_zeroes(0, 3 * 4096, options).unwrap();
        assert_eq!(export.allocated_block_count(), 0);
    }

    #[test]
    fn no_hole_zeroing_leaves_blocks_allocated_zero() {
        let export = export();
        export
            .write_zeroes(0, 8192, ZeroOptions::default())
            .unwrap();
        assert_eq!(export.allocated_block_count(), 2);
        let extents = export.block_status(0, 8192, 10).unwrap();
        assert_eq!(
            extents,
            vec![Extent {
                length_bytes: 8192,
                hole: false,
                zero: true
            }]
        );
    }

    #[test]
    fn fast_zero_refuses_partial_data_blocks_and_changes_nothing() {
        let export = export();
        export.write_at(0, &[5u8; 4096], false).unwrap();
        let fast = ZeroOptions {
            may_trim: true,
            fast: true,
            fua: false,
        };
        let error = export.write_zeroes(0, 1024, fast).unwrap_err();
        assert_eq!(error.kind(), ErrorKind::NotSupported);
        let mut buffer = vec![0u8; 4096];
        export.read_at(0, &mut buffer).unwrap();
        assert!(buffer.iter().all(|&b| b == 5));
        export.write_zeroes(0, 4096, fast).unwrap();
        assert_eq!(export.allocated_block_count(), 0);
    }

    #[test]
    fn block_status_respects_extents_max() {
        let export = export();
        for block in (0..16).step_by(2) {
            export.write_at(block * 4096, &[1u8; 4096], false).unwrap();
        }
        let extents = export.block_status(0, 16 * 4096, 3).unwrap();
        assert_eq!(extents.len(), 3);
        assert_eq!(
            extents.iter().map(|e| e.length_bytes).sum::<u64>(),
            3 * 4096
        );
    }

    #[test]
    fn read_only_refuses_writes_and_faults_are_reported() {
        let export = MemoryExport::new("r", 8192).with_read_only(true);
        let error = export.write_at(0, &[0u8; 512], false).unwrap_err();
        assert_eq!(error.kind(), ErrorKind::PermissionDenied);
        export.set_fault(Some(ErrorKind::NoSpace));
        let mut buffer = [0u8; 512];
        assert_eq!(
            export.read_at(0, &mut buffer).unwrap_err().kind(),
            ErrorKind::NoSpace
        );
        export.set_fault(None);
        export.read_at(0, &mut buffer).unwrap();
    }

    #[test]
    fn export_map_opens_by_name_and_default() {
        let map = ExportMap::new();
        map.insert(Arc::new(
            MemoryExport::new("a", 512).with_description("first"),
        ));
        map.insert(Arc::new(MemoryExport::new("b", 512)));
        assert!(map.open("").unwrap().is_none());
        map.set_default(Some("b".into()));
        assert_eq!(map.open("").unwrap().unwrap().name(), "b");
        assert_eq!(map.open("a").unwrap().unwrap().description(), "first");
        assert!(map.open("zzz").unwrap().is_none());
        assert_eq!(map.list().len(), 2);
        map.remove("a");
        assert_eq!(map.list().len(), 1);
    }
}

//! The [`Export`] trait the server serves, the [`ExportRegistry`] it looks exports up in, and
//! two in-memory implementations: [`ExportMap`] (a mutable name-to-export map) and
//! [`MemoryExport`] (a sparse memory disk with a real allocation map, used by the tests).
//!
//! Contract between the session and an export: the session only calls data methods with
//! ranges inside `[0, size_bytes)`, with offsets and lengths that are multiples of
//! [`crate::protocol::BLOCK_SIZE_MIN`] (a client's unaligned requests reach the export as
//! aligned ones, through `unaligned`'s read-modify-write), with READ/WRITE buffers of at most
//! [`crate::protocol::PAYLOAD_LENGTH_MAX`] bytes, and never calls a writing method on a
//! read-only export. Every method takes `&self` and is called concurrently from many threads
//! and connections, so exports are `Send + Sync`. A FLUSH on any connection calls
//! [`Export::flush`], which must make every write completed on any connection durable.
//!
//! Metadata contexts: every export serves `base:allocation` through [`Export::block_status`].
//! An export may offer more contexts (in a namespace of its own, never `base:`) through
//! [`Export::meta_contexts`] (names, for NBD_OPT_LIST_META_CONTEXT) and
//! [`Export::meta_context`] (the context itself, for NBD_OPT_SET_META_CONTEXT). The handshake
//! keeps the [`MetaContext`] it got at SET time for the connection's whole life, so a context
//! can bind what it describes then (for instance the identity of another volume).
//!
//! A context that describes another export as well (its *subject*, say the base of a diff:
//! [`Export::meta_context_subject`]) is listed and selected only on a connection whose
//! registry may open that export ([`ExportRegistry::may_open`], NBD_OPT_GO's rule), so a
//! connection limited to some exports learns nothing of the others through contexts.

use std::collections::BTreeMap;
use std::os::fd::BorrowedFd;
use std::sync::{Arc, RwLock};

use crate::error::{Error, ErrorKind, Result};
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

/// Where the bytes of a READ lie in a file ([`Export::read_source`]): the session may then
/// send them from the file to the socket with `splice`, without copying them through a
/// buffer.
#[derive(Clone, Copy, Debug)]
pub struct ReadSource<'a> {
    /// A regular file, opened for reading.
    pub file: BorrowedFd<'a>,
    /// Offset in `file` of the first byte of the range.
    pub offset: u64,
}

/// One run of equal status in a context other than `base:allocation`, reported by
/// [`MetaContext::block_status`]; the context defines what the flags mean.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatusExtent {
    /// Length of the run in bytes; nonzero.
    pub length_bytes: u64,
    /// Status flags as sent in the block-status descriptor.
    pub flags: u32,
}

/// A metadata context an export offers besides `base:allocation`, selected by a client with
/// NBD_OPT_SET_META_CONTEXT and answered in every NBD_CMD_BLOCK_STATUS reply of that
/// connection. Called concurrently, like the export.
pub trait MetaContext: Send + Sync {
    /// Status of the range starting at `offset` (inside the export, nonzero `length`, both
    /// multiples of 512), with the contract of [`Export::block_status`]: consecutive extents
    /// that start exactly at `offset`, at least one and at most `extents_max`, none past the
    /// end of the export; they may stop before `offset + length`. An error fails that one
    /// request (for instance when what the context describes no longer exists).
    fn block_status(
        &self,
        offset: u64,
        length: u64,
        extents_max: usize,
    ) -> Result<Vec<StatusExtent>>;
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

/// What an export can do ([`Export::capabilities`]): the transmission flags it is
/// advertised with and the block size it prefers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// Writes, trims and zeroing are refused with `NBD_EPERM` (NBD_FLAG_READ_ONLY).
    pub read_only: bool,
    /// TRIM does something useful (NBD_FLAG_SEND_TRIM).
    pub trim: bool,
    /// [`ZeroOptions::fast`] can ever succeed (NBD_FLAG_SEND_FAST_ZERO).
    pub fast_zero: bool,
    /// FLUSH and FUA on one connection cover writes completed on every connection
    /// (NBD_FLAG_CAN_MULTI_CONN).
    pub multi_conn: bool,
    /// Block size that avoids read-modify-write inside the export (NBD_INFO_BLOCK_SIZE
    /// preferred); a power of two from 512 bytes to 32 MiB, otherwise 4096 is advertised.
    pub preferred_block_size_bytes: u32,
}

impl Default for Capabilities {
    fn default() -> Self {
        Capabilities {
            read_only: false,
            trim: false,
            fast_zero: false,
            multi_conn: false,
            preferred_block_size_bytes: crate::protocol::BLOCK_SIZE_PREFERRED,
        }
    }
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

    /// What the export can do and how it likes to be used; the default is
    /// [`Capabilities::default`] (writable, no trim, no fast zero, no multi-conn, 4 KiB
    /// preferred blocks).
    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
    }

    /// Fills all of `buffer` with the bytes at `offset`. The buffer's previous contents are
    /// unspecified (the session reuses buffers without zeroing them), so every byte must be
    /// written, zeroes included.
    fn read_at(&self, offset: u64, buffer: &mut [u8]) -> Result<()>;

    /// The file range holding the `length` bytes at `offset`, if they lie in one file, so a
    /// READ reply can be sent from it without a copy (plaintext connections, large reads;
    /// the session falls back to [`Export::read_at`] if the file ends early or `splice`
    /// fails). The kernel may keep references to the file's cached pages after the reply is
    /// written (a socket's send queue holds them until the peer reads them), so only an export
    /// whose file range can never come to hold other data may answer: a plain file served as
    /// is, yes; a thin volume, whose blocks may be freed and given to another volume once the
    /// read ends, no. The default is `None`.
    fn read_source(&self, offset: u64, length: u64) -> Option<ReadSource<'_>> {
        let _ = (offset, length);
        None
    }

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

    /// Names of the metadata contexts this export offers besides `base:allocation` that
    /// start with `prefix` (the empty prefix: all of them). Each name is `namespace:leaf`
    /// with a namespace other than `base`, at most
    /// [`crate::protocol::STRING_LENGTH_MAX`] bytes. The default offers none.
    fn meta_contexts(&self, prefix: &str) -> Vec<String> {
        let _ = prefix;
        Vec::new()
    }

    /// The context called exactly `name`, if this export offers it; `None` means the client
    /// asked for a context that does not exist, which is not an error (the client simply
    /// does not get it). The default offers none.
    fn meta_context(&self, name: &str) -> Option<Arc<dyn MetaContext>> {
        let _ = name;
        None
    }

    /// The other export the context `name` describes, if any (the base a diff context
    /// compares against): the handshake then offers and selects the context only if the
    /// connection's registry may open that export ([`ExportRegistry::may_open`]). A
    /// wrapper must forward it along with the contexts. The default: none.
    fn meta_context_subject(&self, name: &str) -> Option<String> {
        let _ = name;
        None
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

    /// Whether this registry's connections may open `name` if it exists (NBD_OPT_GO's rule,
    /// without opening it): asked for the subjects of metadata contexts
    /// ([`Export::meta_context_subject`]). A registry that refuses names it could open (an
    /// allow-list) says no for those, and a wrapper forwards it. The default: every name.
    fn may_open(&self, name: &str) -> bool {
        let _ = name;
        true
    }
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

mod memory;
mod unaligned;

pub use memory::MemoryExport;
pub use unaligned::SECTOR_BYTES;
pub(crate) use unaligned::{Unaligned, UnalignedContext};

#[cfg(test)]
mod tests;

//! What the pool last wrote to block 0 of its metadata device ([`LastWritten`]), so that a
//! commit can tell whether someone else wrote the metadata since (`thinpool restore -o`
//! with the lock bypassed, a second server on an alias of the device, an editor): the
//! server then writes nothing over the foreign change (finding 2 of issue 20).
//!
//! The check costs one 4 KiB read of block 0 per commit, past the block manager's cache;
//! what the commit wrote is taken from that cache (it holds every block as written), so
//! recording costs no I/O.

use crate::error::{Error, Result};
use crate::format::metadata::PoolMetadata;
use crate::format::superblock::Superblock;
use persistent_data::block::{Block, MetadataBlock, BLOCK_SIZE};
use persistent_data::BlockDevice;
use std::sync::Arc;

/// Block 0 as the pool last wrote it (or read it at open).
pub(crate) struct LastWritten {
    superblock: Arc<Block>,
}

impl LastWritten {
    /// Block 0 of `md`'s device as `md` last read or wrote it.
    pub(crate) fn of(md: &PoolMetadata) -> Result<LastWritten> {
        let superblock = md
            .transaction_manager()
            .block_manager()
            .read_raw(MetadataBlock::SUPERBLOCK)?;
        Ok(LastWritten { superblock })
    }

    /// The transaction id of the superblock last written.
    pub(crate) fn transaction_id(&self) -> u64 {
        transaction_id_of(&self.superblock)
    }

    /// Read block 0 of `device` (one read, past any cache) and compare it with what the
    /// pool last wrote: any difference is a foreign write, refused with
    /// [`Error::MetadataChangedUnderServer`].
    pub(crate) fn check(&self, device: &dyn BlockDevice) -> Result<()> {
        let mut on_disk = [0u8; BLOCK_SIZE];
        device
            .read(MetadataBlock::SUPERBLOCK, &mut on_disk)
            .map_err(|source| Error::Io {
                what: "reading the superblock before a commit".to_string(),
                source,
            })?;
        if on_disk == *self.superblock {
            return Ok(());
        }
        let found = match persistent_data::block_manager::validate(
            MetadataBlock::SUPERBLOCK,
            &on_disk,
            persistent_data::checksum::BlockKind::Superblock,
        ) {
            Ok(()) => {
                match Superblock::decode(MetadataBlock::SUPERBLOCK, &on_disk, device.block_count())
                {
                    Ok(superblock) => superblock.transaction_id.to_string(),
                    Err(e) => format!("{} (unreadable: {e})", transaction_id_of(&on_disk)),
                }
            }
            Err(e) => format!("unreadable ({e})"),
        };
        Err(Error::MetadataChangedUnderServer {
            found,
            expected: self.transaction_id(),
        })
    }
}

/// The transaction id field of an encoded superblock, whatever the rest holds.
fn transaction_id_of(block: &Block) -> u64 {
    u64::from_le_bytes(block[48..56].try_into().expect("8 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use persistent_data::MemoryDevice;

    #[test]
    fn a_foreign_superblock_is_named_and_our_own_passes() {
        let device = Arc::new(MemoryDevice::new(256));
        let mut md = PoolMetadata::format(device.clone(), 128, 100).unwrap();
        let written = LastWritten::of(&md).unwrap();
        written.check(&*device).unwrap();
        // Our own commit: recorded, passes; the old record now sees a change.
        let tid = md.transaction_id();
        md.set_transaction_id(tid, tid.next()).unwrap();
        md.commit().unwrap();
        let error = written.check(&*device).unwrap_err();
        assert!(
            matches!(&error, Error::MetadataChangedUnderServer { found, expected }
                if *found == tid.next().get().to_string() && *expected == tid.get()),
            "{error:?}"
        );
        let written = LastWritten::of(&md).unwrap();
        written.check(&*device).unwrap();
        // Garbage in block 0: still a foreign change, said as unreadable.
        device
            .write(MetadataBlock::SUPERBLOCK, &[7u8; BLOCK_SIZE])
            .unwrap();
        let error = written.check(&*device).unwrap_err();
        assert!(error.to_string().contains("unreadable"), "{error}");
        assert!(error.to_string().contains("another writer?"), "{error}");
    }
}

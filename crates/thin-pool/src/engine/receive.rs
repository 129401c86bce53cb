//! Receiving a volume off to the side and publishing it in one transaction (what
//! `thin_pool::stream`'s receive drives), and the content identities streams name.
//!
//! **Content ids.** A read-only volume may carry a content id in the catalog (a uuid): set
//! when it is first sent ([`assign_content_id`]) or when it is received (the stream's id),
//! dropped by whatever changes its content (a revert, a resize). An incremental stream names
//! its base by that id, so a receiver applies it only on a volume that holds exactly the
//! base's content, whatever its name.
//!
//! **Staging** ([`VolumeReceiver`]): byte extents (data, holes) arrive in increasing order;
//! they are assembled per data block of *this* pool (the sender's block size may differ).
//! A block that gets data (or, in an incremental, a block of the base partly covered by a
//! hole) is written to a freshly reserved data block: reserved blocks are outside the
//! committed space map, so until [`VolumeReceiver::finish`] nothing is visible and a crash
//! or an abandoned receive (the receiver dropped) leaves the pool as it was (a resumable
//! receive's checkpoints keep a partial one: `receive_partial`). Whole blocks of a data
//! extent are written straight from it, into blocks reserved together, one write per run
//! of consecutive ones; only a partly covered block is assembled first. `finish`
//! makes the volume in one transaction (`Change::commit_catalog`): `create_thin` or
//! `create_snap` of the base (so every block the stream does not touch stays shared with
//! the base), the new mappings, the unmapped blocks (holes over mapped base blocks) and
//! the catalog entry (read-only, with the stream's content id). A block only holes cover
//! stays unmapped, and so does a block of the base that gets no data and whose remaining
//! content, once its holes are zeroed, is all zeros: holes are never written as zeros.
//!
//! Parts of a block the stream does not cover keep the base's content (an incremental) or
//! read as zeros (a full stream): with a larger block here than the sender's, a partly
//! mapped block is mapped whole.

use crate::engine::catalog::{validate_name, CatalogVolume};
use crate::engine::data_device::DataDevice;
use crate::engine::meta::Meta;
use crate::engine::volume::Volume;
use crate::engine::volumes::{VolumeState, Volumes};
use crate::error::{Error, Result};
use crate::ids::{DataBlock, VirtualBlock};
use std::sync::Arc;

/// What a receive makes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReceiveSpec {
    /// The new volume's name.
    pub name: String,
    /// Its size in bytes (for an incremental, the base's size).
    pub size_bytes: u64,
    /// For an incremental: the content id of its base.
    pub base_content_id: Option<String>,
    /// The content id the new volume gets (the stream's).
    pub content_id: String,
}

/// The content id of volume `name`, if it has one (reads the catalog, changes nothing).
pub(crate) fn content_id(meta: &Meta, volumes: &Volumes, name: &str) -> Result<Option<String>> {
    volumes.named(name)?;
    meta.read(|view| {
        view.catalog
            .find(name)
            .map(|entry| entry.content_id.clone())
            .ok_or_else(|| Error::NoSuchVolume(name.to_string()))
    })
}

/// The content id of read-only volume `name`, given one (a catalog-only transaction) if
/// it has none. Refused for a writable volume: its content has no identity.
pub(crate) fn assign_content_id(meta: &Meta, volumes: &Volumes, name: &str) -> Result<String> {
    if let Some(id) = content_id(meta, volumes, name)? {
        return Ok(id);
    }
    let mut change = meta.changes()?.begin()?;
    let mut catalog = change.catalog().clone();
    let entry = catalog
        .volumes
        .iter_mut()
        .find(|v| v.name == name)
        .ok_or_else(|| Error::NoSuchVolume(name.to_string()))?;
    if let Some(id) = &entry.content_id {
        return Ok(id.clone());
    }
    if !entry.read_only {
        return Err(Error::BadStream(format!(
            "volume {name:?} is writable: only a read-only snapshot can be sent \
             (thinpool volume snapshot {name} {name}-s1 --read-only)"
        )));
    }
    let id = uuid::Uuid::new_v4().to_string();
    entry.content_id = Some(id.clone());
    change.commit_catalog(catalog, |_| Ok(()))?;
    Ok(id)
}

/// The name of the volume holding content `id`, if any.
fn holder_of(catalog: &crate::engine::catalog::Catalog, id: &str) -> Option<String> {
    catalog
        .volumes
        .iter()
        .find(|v| v.content_id.as_deref() == Some(id))
        .map(|v| v.name.clone())
}

/// The block being assembled.
pub(super) struct Pending {
    pub(super) block: u64,
    buf: Vec<u8>,
    /// Covered ranges inside the block (block-relative, in order, not overlapping).
    covered: Vec<(usize, usize)>,
    has_data: bool,
}

/// A volume being received (see the module doc). Dropped before
/// [`VolumeReceiver::finish`]: its reserved blocks are released and nothing changed
/// (but what [`VolumeReceiver::checkpoint`] committed, see `receive_partial`).
pub struct VolumeReceiver {
    pub(super) meta: Arc<Meta>,
    pub(super) volumes: Arc<Volumes>,
    data: Arc<dyn DataDevice>,
    pub(super) spec: ReceiveSpec,
    /// The volume holding the base's content, held open (so it cannot be deleted,
    /// reverted or renamed meanwhile), for an incremental.
    pub(super) base: Option<Volume>,
    pub(super) block_size: u64,
    pub(super) pending: Option<Pending>,
    /// Extents must start at or after this byte.
    pub(super) next_offset: u64,
    /// Mappings made since the last checkpoint (their blocks reserved, not committed).
    pub(super) inserts: Vec<(VirtualBlock, DataBlock)>,
    pub(super) removes: Vec<VirtualBlock>,
    generation: Option<u64>,
    finished: bool,
    /// The last block's buffer, for the next one.
    spare: Vec<u8>,
    /// What checkpoints committed: the partial receive's thin id, and where it stands.
    pub(super) staged: Option<Staged>,
}

/// A partial receive committed by a checkpoint (the catalog's `PartialReceive`).
pub(super) struct Staged {
    pub(super) id: crate::ids::VolumeId,
    /// Its offset as this receiver last committed or found it.
    pub(super) offset: u64,
    pub(super) blocks: u64,
}

impl VolumeReceiver {
    /// Start receiving `spec`. Refused, with nothing changed, for a name in use, a content
    /// id already held (a replay), or an incremental whose base content is not here.
    /// `open_base` opens the named volume (the pool's `volume`).
    pub(crate) fn begin(
        meta: Arc<Meta>,
        volumes: Arc<Volumes>,
        data: Arc<dyn DataDevice>,
        spec: ReceiveSpec,
        open_base: impl FnOnce(&str) -> Result<Volume>,
    ) -> Result<VolumeReceiver> {
        validate_name(&spec.name)?;
        meta.check_changes_allowed()?;
        let base_name = check_spec(&meta, &spec)?;
        Self::start(meta, volumes, data, spec, base_name, open_base)
    }

    /// [`VolumeReceiver::begin`] for a resumed receive: the name's partial receive is
    /// allowed (the resume checked it is this stream's).
    pub(super) fn begin_unchecked(
        meta: Arc<Meta>,
        volumes: Arc<Volumes>,
        data: Arc<dyn DataDevice>,
        spec: ReceiveSpec,
        open_base: impl FnOnce(&str) -> Result<Volume>,
    ) -> Result<VolumeReceiver> {
        meta.check_changes_allowed()?;
        // The name's partial entry is its own.
        let base_name = meta.read(|view| check_spec_in(view.catalog, &spec))?;
        Self::start(meta, volumes, data, spec, base_name, open_base)
    }

    fn start(
        meta: Arc<Meta>,
        volumes: Arc<Volumes>,
        data: Arc<dyn DataDevice>,
        spec: ReceiveSpec,
        base_name: Option<String>,
        open_base: impl FnOnce(&str) -> Result<Volume>,
    ) -> Result<VolumeReceiver> {
        let base = match base_name {
            Some(name) => {
                let base = open_base(&name)?;
                if base.size_bytes() != spec.size_bytes {
                    return Err(Error::BadStream(format!(
                        "the base {name:?} is {} bytes, the stream's volume {}",
                        base.size_bytes(),
                        spec.size_bytes
                    )));
                }
                Some(base)
            }
            None => None,
        };
        crate::engine::limits::check_volume_size(spec.size_bytes)?;
        Ok(VolumeReceiver {
            block_size: meta.block_size_bytes(),
            meta,
            volumes,
            data,
            spec,
            base,
            pending: None,
            next_offset: 0,
            inserts: Vec::new(),
            removes: Vec::new(),
            generation: None,
            finished: false,
            spare: Vec::new(),
            staged: None,
        })
    }

    /// Bytes `offset..offset + data.len()` of the volume are `data`.
    pub fn data(&mut self, offset: u64, data: &[u8]) -> Result<()> {
        self.extent(offset, data.len() as u64, Some(data))
    }

    /// Bytes `offset..offset + len` of the volume are a hole (unmapped, reads as zeros).
    pub fn hole(&mut self, offset: u64, len: u64) -> Result<()> {
        self.extent(offset, len, None)
    }

    /// Data blocks written so far.
    pub fn blocks_written(&self) -> usize {
        self.inserts.len()
    }

    fn extent(&mut self, offset: u64, len: u64, data: Option<&[u8]>) -> Result<()> {
        let end = offset
            .checked_add(len)
            .filter(|&end| end <= self.spec.size_bytes)
            .ok_or_else(|| {
                Error::BadStream(format!(
                    "extent {offset}+{len} is past the volume's end ({} bytes)",
                    self.spec.size_bytes
                ))
            })?;
        if offset < self.next_offset || len == 0 {
            return Err(Error::BadStream(format!(
                "extent {offset}+{len} is empty, out of order or overlaps the one before"
            )));
        }
        self.next_offset = end;
        let mut at = offset;
        while at < end {
            let block = at / self.block_size;
            let within = (at % self.block_size) as usize;
            let n = (self.block_size - within as u64).min(end - at) as usize;
            if let (Some(data), 0) = (data, within) {
                if end - at >= self.block_size {
                    // Whole blocks of data: written from the record as they are, in runs
                    // (no assembly; a pending block is an earlier one).
                    self.flush_pending()?;
                    let from = (at - offset) as usize;
                    let bytes = ((end - at) / self.block_size * self.block_size) as usize;
                    self.write_run(block, &data[from..from + bytes])?;
                    at += bytes as u64;
                    continue;
                }
            }
            if self.pending.as_ref().is_some_and(|p| p.block != block) {
                self.flush_pending()?;
            }
            if self.pending.is_none() {
                let mut buf = std::mem::take(&mut self.spare);
                buf.clear();
                buf.resize(self.block_size as usize, 0);
                self.pending = Some(Pending {
                    block,
                    buf,
                    covered: Vec::new(),
                    has_data: false,
                });
            }
            let pending = self.pending.as_mut().expect("just set");
            if let Some(data) = data {
                let from = (at - offset) as usize;
                pending.buf[within..within + n].copy_from_slice(&data[from..from + n]);
                pending.has_data = true;
            }
            pending.covered.push((within, within + n));
            at += n as u64;
        }
        Ok(())
    }

    /// Decide what the assembled block becomes (see the module doc).
    pub(super) fn flush_pending(&mut self) -> Result<()> {
        let Some(mut p) = self.pending.take() else {
            return Ok(());
        };
        let start = p.block * self.block_size;
        let block_len = self.block_size.min(self.spec.size_bytes - start) as usize;
        let covered: usize = p.covered.iter().map(|(a, b)| b - a).sum();
        assert!(covered <= block_len, "extents never overlap");
        let vblock = VirtualBlock::new(p.block);
        let base_mapped = match &self.base {
            Some(base) => base
                .block_status(start, block_len as u64)?
                .iter()
                .any(|e| e.mapped),
            None => false,
        };
        if !p.has_data && (covered == block_len || !base_mapped) {
            if base_mapped {
                self.removes.push(vblock);
            }
            return Ok(());
        }
        if covered < block_len && base_mapped {
            let base = self.base.as_ref().expect("base_mapped needs a base");
            let mut old = vec![0; block_len];
            base.read(start, &mut old)?;
            let mut at = 0;
            for &(a, b) in p
                .covered
                .iter()
                .chain(std::iter::once(&(block_len, block_len)))
            {
                p.buf[at..a].copy_from_slice(&old[at..a]);
                at = b;
            }
            if !p.has_data && p.buf.iter().all(|&b| b == 0) {
                // What the base had here became holes: the block stays unmapped.
                self.removes.push(vblock);
                return Ok(());
            }
        }
        let written = self.write_block(vblock, &p.buf);
        self.spare = p.buf;
        written
    }

    /// Write whole blocks `first..` (`bytes`, a multiple of the block size) into blocks
    /// reserved together, each run of consecutive ones with one write.
    fn write_run(&mut self, first: u64, bytes: &[u8]) -> Result<()> {
        let size = self.block_size as usize;
        assert!(!bytes.is_empty() && bytes.len().is_multiple_of(size));
        let count = bytes.len() / size;
        let Some((blocks, grant)) = self.meta.reserve_many(count)? else {
            // Fewer free blocks than the run: one by one, up to the refusal.
            for (i, chunk) in bytes.chunks(size).enumerate() {
                self.write_block(VirtualBlock::new(first + i as u64), chunk)?;
            }
            return Ok(());
        };
        if *self.generation.get_or_insert(grant.generation) != grant.generation {
            for &block in &blocks {
                self.meta.release(block, grant.generation);
            }
            return Err(Error::ReadOnly { needs_check: true });
        }
        // Mapped (kept by a checkpoint) only once written: a failed write releases the rest.
        let mut i = 0;
        while i < count {
            let start = blocks[i].get();
            let run = blocks[i..]
                .iter()
                .enumerate()
                .take_while(|&(k, b)| b.get() == start + k as u64)
                .count();
            let written = self
                .data
                .write_at(start * self.block_size, &bytes[i * size..(i + run) * size]);
            if let Err(source) = written {
                for &block in &blocks[i..] {
                    self.meta.release(block, grant.generation);
                }
                return Err(Error::Io {
                    what: format!(
                        "writing received blocks {}..{}",
                        first + i as u64,
                        first + (i + run) as u64
                    ),
                    source,
                });
            }
            for (k, &block) in blocks[i..i + run].iter().enumerate() {
                let vblock = VirtualBlock::new(first + (i + k) as u64);
                self.inserts.push((vblock, block));
            }
            i += run;
        }
        Ok(())
    }

    fn write_block(&mut self, vblock: VirtualBlock, buf: &[u8]) -> Result<()> {
        let (block, grant) = self.meta.reserve()?;
        if *self.generation.get_or_insert(grant.generation) != grant.generation {
            self.meta.release(block, grant.generation);
            return Err(Error::ReadOnly { needs_check: true });
        }
        // Mapped (kept by a checkpoint) only once written.
        if let Err(source) = self.data.write_at(block.get() * self.block_size, buf) {
            self.meta.release(block, grant.generation);
            return Err(Error::Io {
                what: format!("writing received block {vblock}"),
                source,
            });
        }
        self.inserts.push((vblock, block));
        Ok(())
    }

    /// Make the volume, in one transaction (see the module doc). Refused, with nothing
    /// changed, if the name or the content id was taken meanwhile.
    pub fn finish(mut self) -> Result<()> {
        self.flush_pending()?;
        let base_state = match &self.base {
            Some(base) => Some(self.volumes.named(base.name())?),
            None => None,
        };
        let mut change = self.meta.changes()?.begin()?;
        let base_name = check_spec_in(change.catalog(), &self.spec)?;
        if base_name.as_deref() != self.base.as_ref().map(|b| b.name()) {
            return Err(Error::BadStream(
                "the base's content moved to another volume during the receive".to_string(),
            ));
        }
        let mut catalog = change.catalog().clone();
        let staged = self.claim_staged(&mut catalog)?;
        let id = match staged {
            Some(id) => id,
            None => catalog.free_id(&change.view().md()?.volumes())?,
        };
        let entry = CatalogVolume {
            name: self.spec.name.clone(),
            id,
            size_bytes: self.spec.size_bytes,
            read_only: true,
            origin: base_state.as_ref().map(|b| b.id()),
            content_id: Some(self.spec.content_id.clone()),
        };
        catalog.volumes.push(entry.clone());
        let (inserts, removes) = (&self.inserts, &self.removes);
        let origin = entry.origin;
        change.commit_catalog(catalog, |md| {
            match (staged, origin) {
                (Some(_), _) => {}
                (None, Some(origin)) => md.create_snap(id, origin)?,
                (None, None) => md.create_thin(id)?,
            }
            for &block in removes {
                md.remove(id, block)?;
            }
            for &(vblock, block) in inserts {
                md.insert(id, vblock, block)?;
            }
            Ok(())
        })?;
        self.finished = true;
        let time = match &base_state {
            _ if staged.is_some() => {
                let details = change.view().md()?.details(id)?;
                crate::engine::load::snapshot_time(&self.spec.name, &details)?
            }
            Some(base) => {
                let time = change.advance_time()?;
                base.snapshotted_at(time);
                time
            }
            None => self.meta.time(),
        };
        // No index: built from its tree on first use, as after a snapshot.
        self.volumes
            .publish(Arc::new(VolumeState::new(&entry, None, time)));
        change.reclaim_freed();
        Ok(())
    }
}

impl Drop for VolumeReceiver {
    fn drop(&mut self) {
        if !self.finished {
            if let Some(generation) = self.generation {
                for &(_, block) in &self.inserts {
                    self.meta.release(block, generation);
                }
            }
            self.meta.notify_space();
        }
    }
}

/// [`check_spec_in`] on the current catalog.
/// Refused too: a name a partial receive keeps (see `receive_partial`).
pub(super) fn check_spec(meta: &Meta, spec: &ReceiveSpec) -> Result<Option<String>> {
    meta.read(|view| {
        if let Some(kept) = view.catalog.partial.iter().find(|p| p.name == spec.name) {
            return Err(Error::BadStream(format!(
                "a partial receive of {:?} is kept ({} of {} bytes of stream {}): resume it \
                 (thinpool send --resume TOKEN, the token `thinpool receive --list-partial` \
                 shows) or drop it (thinpool receive --abort {})",
                kept.name, kept.offset, kept.size_bytes, kept.content_id, kept.name
            )));
        }
        check_spec_in(view.catalog, spec)
    })
}

/// Refuse a name in use, a content id already held (a replay) or an absent base; answers
/// the name of the volume holding the base's content.
fn check_spec_in(
    catalog: &crate::engine::catalog::Catalog,
    spec: &ReceiveSpec,
) -> Result<Option<String>> {
    if catalog.find(&spec.name).is_some() {
        return Err(Error::NameExists(spec.name.clone()));
    }
    if let Some(holder) = holder_of(catalog, &spec.content_id) {
        return Err(Error::BadStream(format!(
            "this stream was received already, as volume {holder:?} (a replay)"
        )));
    }
    match &spec.base_content_id {
        None => Ok(None),
        Some(base) => holder_of(catalog, base).map(Some).ok_or_else(|| {
            Error::BadStream(format!(
                "the stream's base (content id {base}) is not in this pool: \
                 receive the base first, or send a full stream"
            ))
        }),
    }
}

//! What `thinpool serve` hands the NBD server: [`VolumeExport`] (a thin volume as an
//! [`nbd::Export`]) and [`PoolRegistry`] (the [`nbd::ExportRegistry`] that looks volumes up
//! in the pool at every open, so volumes created or deleted while serving appear and
//! disappear at once, beside any fixed exports a caller adds: `thinpool-bench serve`'s
//! raw-file and null exports).
//!
//! A volume export also offers the metadata context `x-thinpool:diff:BASE` for every other
//! volume BASE of the pool ([`diff_context`]): the bytes where it differs from BASE.
//!
//! The requests' meaning (FUA, fast zero, the block-status walk limit, errors as errno) is the
//! front-end seam's, [`thinpool_frontend::VolumeTarget`], shared with vhost-user-blk; this
//! file only translates NBD's calls and turns errnos into NBD errors ([`target_error`]).
//!
//! Invariants: every NBD connection that opens a thin volume holds its own
//! [`thin_pool::Volume`] handle until it ends, so the engine refuses to delete a volume while a
//! client has it open; the registry itself holds no handle. [`nbd_error`] is the only place
//! that turns an engine error into an NBD error
//! ([`target_error`] for the seam's errors, by the same errno).

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::bail;
use nbd::{
    Capabilities, Error as NbdError, ErrorKind, Export, ExportListing, ExportRegistry, Extent,
    MetaContext, ZeroOptions,
};
use thin_pool::{Pool, Volume};
use thinpool_frontend::{Target, TargetError, VolumeTarget, ZeroMode};

pub mod diff_context;

pub use diff_context::DiffContext;

/// Name of the volume created with a new default pool; the empty export name opens it.
pub const DEFAULT_VOLUME: &str = "disk";

pub(crate) use thinpool_frontend::BLOCK_STATUS_BLOCKS_MAX;

/// Turns an engine error into the NBD error the client sees: the engine's errno
/// ([`thin_pool::Error::errno`], the same one the control socket reports), classified by the
/// nbd crate's one errno table ([`ErrorKind::from_errno`]). The engine error stays the source.
pub fn nbd_error(error: thin_pool::Error, what: String) -> NbdError {
    NbdError::export_with_source(ErrorKind::from_errno(error.errno()), what, error)
}

/// Turns a failed [`Target`] request into the NBD error the client sees, by its errno
/// (the same table as [`nbd_error`]).
pub fn target_error(error: TargetError) -> NbdError {
    let (errno, what, source) = error.into_parts();
    let kind = ErrorKind::from_errno(errno);
    match source {
        Some(source) => NbdError::export_with_source(kind, what, BoxedCause(source)),
        None => NbdError::export(kind, what),
    }
}

/// A boxed cause as a concrete error type, for [`NbdError::export_with_source`].
#[derive(Debug)]
struct BoxedCause(Box<dyn std::error::Error + Send + Sync>);

impl std::fmt::Display for BoxedCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for BoxedCause {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

/// A thin volume served over NBD: the NBD face of a [`VolumeTarget`] (the requests' meaning
/// is the seam's; this only translates), plus the diff contexts. Holds the volume open for
/// as long as the connection lives.
pub struct VolumeExport {
    target: VolumeTarget,
    name: String,
    description: String,
    /// The pool, for the diff contexts; none offered without it.
    pool: Option<Pool>,
}

impl VolumeExport {
    /// Wraps an open volume, served under `name`.
    pub fn new(volume: Volume, name: String, description: String) -> Self {
        VolumeExport {
            target: VolumeTarget::new(volume),
            name,
            description,
            pool: None,
        }
    }

    /// Offers the `x-thinpool:diff:BASE` contexts against the other volumes of `pool` (the
    /// pool the volume belongs to).
    pub fn with_pool(mut self, pool: Pool) -> Self {
        self.pool = Some(pool);
        self
    }
}

impl Export for VolumeExport {
    fn name(&self) -> &str {
        &self.name
    }

    fn description(&self) -> &str {
        &self.description
    }

    fn size_bytes(&self) -> u64 {
        self.target.geometry().size_bytes
    }

    fn capabilities(&self) -> Capabilities {
        let geometry = self.target.geometry();
        Capabilities {
            read_only: geometry.read_only,
            trim: geometry.can_discard,
            fast_zero: true,
            // A flush commits the whole pool, so it covers every connection's writes.
            multi_conn: true,
            preferred_block_size_bytes: geometry
                .block_size_bytes
                .min(nbd::protocol::PAYLOAD_LENGTH_MAX as u64)
                as u32,
        }
    }

    fn read_at(&self, offset: u64, buffer: &mut [u8]) -> nbd::Result<()> {
        self.target.read(offset, buffer).map_err(target_error)
    }

    fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> nbd::Result<()> {
        self.target.write(offset, data, fua).map_err(target_error)
    }

    fn write_zeroes(&self, offset: u64, length: u64, options: ZeroOptions) -> nbd::Result<()> {
        let mode = ZeroMode {
            may_unmap: options.may_trim,
            fast: options.fast,
            fua: options.fua,
        };
        self.target
            .write_zeroes(offset, length, mode)
            .map_err(target_error)
    }

    fn trim(&self, offset: u64, length: u64, fua: bool) -> nbd::Result<()> {
        self.target
            .discard(offset, length, fua)
            .map_err(target_error)
    }

    fn flush(&self) -> nbd::Result<()> {
        self.target.flush().map_err(target_error)
    }

    fn block_status(
        &self,
        offset: u64,
        length: u64,
        extents_max: usize,
    ) -> nbd::Result<Vec<Extent>> {
        let extents = self
            .target
            .block_status(offset, length, extents_max)
            .map_err(target_error)?;
        Ok(extents
            .into_iter()
            .map(|extent| Extent {
                length_bytes: extent.length_bytes,
                hole: !extent.mapped,
                zero: !extent.mapped,
            })
            .collect())
    }

    fn meta_contexts(&self, prefix: &str) -> Vec<String> {
        let volume = self.target.volume();
        match &self.pool {
            Some(pool) => diff_context::diff_context_names(pool, volume.name(), prefix),
            None => Vec::new(),
        }
    }

    fn meta_context(&self, name: &str) -> Option<Arc<dyn MetaContext>> {
        let pool = self.pool.as_ref()?;
        let volume = self.target.volume();
        Some(Arc::new(DiffContext::open(pool, volume.name(), name)?))
    }

    fn meta_context_subject(&self, name: &str) -> Option<String> {
        diff_context::base_of(name).map(str::to_string)
    }
}

/// The exports of a served pool: every volume under its own name, live (looked up in the
/// pool at each open), plus fixed exports (the benchmarks' raw-file and null exports). The
/// empty name opens
/// [`DEFAULT_VOLUME`] if it exists, else the only export if there is exactly one.
pub struct PoolRegistry {
    pool: Pool,
    /// The fixed exports, by name.
    raw: BTreeMap<String, Arc<dyn Export>>,
}

impl PoolRegistry {
    /// A registry over `pool` and `fixed` exports; fails if a fixed export's name is a
    /// volume's or another fixed export's.
    pub fn new(pool: Pool, fixed: Vec<Arc<dyn Export>>) -> anyhow::Result<Self> {
        let mut registry = PoolRegistry {
            pool,
            raw: BTreeMap::new(),
        };
        for export in fixed {
            registry.add_fixed(export)?;
        }
        Ok(registry)
    }

    fn add_fixed(&mut self, export: Arc<dyn Export>) -> anyhow::Result<()> {
        let name = export.name().to_string();
        if self.pool.volume(&name).is_ok() {
            bail!("export {name:?} has the name of a volume in the pool");
        }
        if self.raw.insert(name.clone(), export).is_some() {
            bail!("export {name:?} is given twice");
        }
        Ok(())
    }

    /// Names taken by fixed exports (volumes may not be created with them).
    pub fn raw_names(&self) -> Vec<String> {
        self.raw.keys().cloned().collect()
    }

    fn default_name(&self) -> Option<String> {
        if self.pool.volume(DEFAULT_VOLUME).is_ok() {
            return Some(DEFAULT_VOLUME.to_string());
        }
        let listing = self.list();
        match listing.as_slice() {
            [only] => Some(only.name.clone()),
            _ => None,
        }
    }
}

/// Description of a volume for NBD_OPT_LIST and NBD_INFO_DESCRIPTION.
fn describe(info: &thin_pool::VolumeInfo) -> String {
    let kind = match &info.origin {
        Some(origin) => format!("snapshot of {origin}"),
        None => "thin volume".to_string(),
    };
    let access = if info.read_only { ", read-only" } else { "" };
    format!(
        "{kind}, {}{access}",
        crate::pool_dir::format_size(info.size_bytes)
    )
}

impl ExportRegistry for PoolRegistry {
    fn list(&self) -> Vec<ExportListing> {
        let mut listing: Vec<ExportListing> = self
            .pool
            .list()
            .iter()
            .map(|info| ExportListing {
                name: info.name.clone(),
                description: describe(info),
            })
            .collect();
        listing.extend(self.raw.values().map(|export| ExportListing {
            name: export.name().to_string(),
            description: export.description().to_string(),
        }));
        listing
    }

    fn open(&self, name: &str) -> nbd::Result<Option<Arc<dyn Export>>> {
        let name = if name.is_empty() {
            match self.default_name() {
                Some(default) => default,
                None => return Ok(None),
            }
        } else {
            name.to_string()
        };
        if let Some(export) = self.raw.get(&name) {
            return Ok(Some(Arc::clone(export) as Arc<dyn Export>));
        }
        // The pool only fails this lookup for a missing name.
        let Ok(volume) = self.pool.volume(&name) else {
            return Ok(None);
        };
        let description = self
            .pool
            .info(&name)
            .map(|info| describe(&info))
            .unwrap_or_default();
        Ok(Some(Arc::new(
            VolumeExport::new(volume, name, description).with_pool(self.pool.clone()),
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::OpError;
    use persistent_data::MemoryDevice;
    use std::io;
    use thin_pool::catalog::MemoryCatalog;
    use thin_pool::data_device::{DataCounters, DataDevice, MemoryDataDevice};
    use thin_pool::PoolOptions;

    const BLOCK: u64 = 64 * 1024;

    /// A data device on a host file system that is full: reads work, anything that would
    /// allocate fails with the host's ENOSPC.
    struct FullDataDevice(MemoryDataDevice);

    fn no_space() -> io::Result<()> {
        Err(io::Error::from_raw_os_error(libc::ENOSPC))
    }

    impl DataDevice for FullDataDevice {
        fn size_bytes(&self) -> u64 {
            self.0.size_bytes()
        }
        fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
            self.0.read_at(offset, buf)
        }
        fn write_at(&self, _offset: u64, _data: &[u8]) -> io::Result<()> {
            no_space()
        }
        fn zero(&self, _offset: u64, _len: u64) -> io::Result<()> {
            no_space()
        }
        fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
            self.0.discard(offset, len)
        }
        fn copy(&self, _from: u64, _to: u64, _len: u64) -> io::Result<()> {
            no_space()
        }
        fn flush(&self) -> io::Result<()> {
            self.0.flush()
        }
        fn counters(&self) -> &DataCounters {
            self.0.counters()
        }
    }

    #[test]
    fn host_enospc_on_the_data_device_reaches_the_client_as_nbd_enospc() {
        let pool = Pool::format_parts(
            Arc::new(MemoryDevice::new(256)),
            Arc::new(FullDataDevice(MemoryDataDevice::new(16 * BLOCK))),
            Box::new(MemoryCatalog::default()),
            BLOCK,
            PoolOptions {
                commit_interval: None,
                ..PoolOptions::default()
            },
        )
        .unwrap();
        pool.create_volume("v", 4 * BLOCK).unwrap();
        let export = VolumeExport::new(pool.volume("v").unwrap(), "v".into(), String::new());
        for data in [vec![7u8; 4096], vec![7u8; BLOCK as usize]] {
            let error = export.write_at(BLOCK, &data, false).unwrap_err();
            assert_eq!(error.kind(), ErrorKind::NoSpace, "{}", error.report());
            assert_eq!(
                nbd::nbd_error_code(&error),
                nbd::protocol::errno::ENOSPC,
                "{}",
                error.report()
            );
        }
        pool.close().unwrap();
    }

    /// Engine errors of every kind, each with the errno and name the control socket must
    /// report and the error an NBD client must see.
    fn cases() -> Vec<(thin_pool::Error, i32, &'static str, u32)> {
        use nbd::protocol::errno as wire;
        let io = |errno| thin_pool::Error::Io {
            what: "writing the data device".into(),
            source: io::Error::from_raw_os_error(errno),
        };
        vec![
            (
                thin_pool::Error::OutOfDataSpace { block_count: 8 },
                libc::ENOSPC,
                "ENOSPC",
                wire::ENOSPC,
            ),
            (io(libc::ENOSPC), libc::ENOSPC, "ENOSPC", wire::ENOSPC),
            (io(libc::EIO), libc::EIO, "EIO", wire::EIO),
            (io(libc::EACCES), libc::EACCES, "EACCES", wire::EPERM),
            (
                thin_pool::Error::BadVolumeSize { size_bytes: 0 },
                libc::EINVAL,
                "EINVAL",
                wire::EINVAL,
            ),
            (
                thin_pool::Error::ReadOnly { needs_check: false },
                libc::EROFS,
                "EROFS",
                wire::EPERM,
            ),
            (
                thin_pool::Error::ReadOnly { needs_check: true },
                libc::EIO,
                "EIO",
                wire::EIO,
            ),
            (
                thin_pool::Error::Corrupt("mapping root 99 beyond 64 blocks".into()),
                libc::EIO,
                "EIO",
                wire::EIO,
            ),
            (
                thin_pool::Error::Internal("op applied twice".into()),
                libc::EIO,
                "EIO",
                wire::EIO,
            ),
            (
                thin_pool::Error::Busy("volume \"v\" is open".into()),
                libc::EBUSY,
                "EBUSY",
                wire::EIO,
            ),
            (
                thin_pool::Error::NameExists("v".into()),
                libc::EEXIST,
                "EEXIST",
                wire::EIO,
            ),
            (
                thin_pool::Error::NoSuchVolume("v".into()),
                libc::ENOENT,
                "ENOENT",
                wire::EIO,
            ),
        ]
    }

    #[test]
    fn control_socket_and_nbd_report_the_same_errno() {
        // Errnos the NBD protocol itself defines; any of these must reach the client unchanged.
        let nbd_defined = [
            libc::EPERM,
            libc::EIO,
            libc::ENOMEM,
            libc::EINVAL,
            libc::ENOSPC,
            libc::EOVERFLOW,
            libc::ENOTSUP,
            libc::ESHUTDOWN,
        ];
        for (index, (error, errno, code, nbd_code)) in cases().into_iter().enumerate() {
            let described = format!("{error:?}");
            assert_eq!(error.errno(), errno, "{described}");
            // The same error again, for the control socket (thin_pool::Error is not Clone).
            let again = cases().swap_remove(index).0;
            let json = serde_json::to_value(OpError::from(again)).unwrap();
            assert_eq!(json["errno"], errno, "{described}: {json}");
            assert_eq!(json["code"], code, "{described}: {json}");
            let nbd = nbd_error(error, "write at 0".into());
            assert_eq!(nbd::nbd_error_code(&nbd), nbd_code, "{described}");
            if nbd_defined.contains(&errno) {
                assert_eq!(nbd_code as i32, errno, "{described}");
            }
        }
    }

    #[test]
    fn control_messages_name_each_cause_once() {
        let cause = io::Error::from_raw_os_error(libc::ENOSPC).to_string();
        let error = OpError::from(thin_pool::Error::Io {
            what: "extending /pool/data".into(),
            source: io::Error::from_raw_os_error(libc::ENOSPC),
        });
        assert_eq!(error.message, format!("extending /pool/data: {cause}"));
        assert_eq!(error.code, "ENOSPC");
    }
}

//! Building pool metadata from a dump (the `thin_restore` equivalent).
//!
//! [`restore`] parses XML (0.9.0 or 1.x form) with the streaming parser and feeds a
//! [`Restorer`], a [`DumpVisitor`] that writes new metadata on a device as the events
//! arrive:
//!
//! - `<superblock>` formats the device (its whole size) and a data space map of
//!   `nr_data_blocks`; time and transaction id come from the XML, version is 2, flags 0
//!   (as `thin_restore` 1.x writes them);
//! - each `<def>` is packed into shared leaves; each `<device>` into a tree built bottom up
//!   (`persistent_data::btree::builder`), adopting a def's leaves by reference for every
//!   `<ref>`, with the packing rules of `thin_restore` 1.x, so that `thin_dump` 1.x finds the
//!   same shared leaves in our output as in theirs;
//! - at `</superblock>` the details tree and the top level of the mapping tree are built,
//!   the defs' own references released, and everything committed.
//!
//! Reference counts follow spec §7.8: a leaf holds one data reference per mapping however
//! many devices share it; a shared leaf has one metadata reference per parent.
//!
//! Memory stays bounded for big inputs: the builder holds at most two leaves' worth of
//! mappings, and the transaction is committed whenever [`COMMIT_INTERVAL_BLOCKS`] blocks
//! are dirty (intermediate commits describe an empty pool; only the final one describes the
//! restored pool). What grows is per device (its root and details) and per def (its leaves).
//! `mapped_blocks` is taken from the XML, as 1.x does.

use crate::format::details::{pack_block_time, DeviceDetails};
use crate::format::dump::{self, DeviceInfo, DumpVisitor, Mapping, SuperblockInfo};
use crate::format::superblock::{valid_data_block_size, Superblock, VERSION};
use crate::ids::DATA_BLOCK_MAX;
use persistent_data::block_manager::{BlockManager, CACHE_BLOCKS_DEFAULT};
use persistent_data::btree::builder::{
    build_tree, release_nodes, NodeBuilder, NodeSummary, TreeBuilder,
};
use persistent_data::btree::{self, NoRefs, RefCounter};
use persistent_data::space_map::{DataSpaceMap, SpaceMapRoot};
use persistent_data::{BlockDevice, CopyOnWrite, MetadataBlock, TransactionManager};
use std::collections::{BTreeMap, HashMap};
use std::io::BufRead;
use std::sync::Arc;

/// Dirty metadata blocks (4 KiB each) that trigger an intermediate commit.
pub const COMMIT_INTERVAL_BLOCKS: usize = 16_384;

/// Errors of a restore.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The input could not be read or parsed, or describes impossible metadata.
    #[error("restoring the dump")]
    Dump(#[from] dump::Error),
    /// Writing the metadata failed.
    #[error("writing metadata")]
    Metadata(#[from] crate::Error),
}

/// Overrides of `thin_restore`, and how often to commit.
#[derive(Debug, Clone)]
pub struct RestoreOptions {
    /// Replace the transaction id of the XML (`--transaction-id`).
    pub transaction_id: Option<u64>,
    /// Replace the data block size of the XML (`--data-block-size`).
    pub data_block_size_sectors: Option<u32>,
    /// Replace the number of data blocks of the XML (`--nr-data-blocks`).
    pub data_block_count: Option<u64>,
    /// Commit whenever this many metadata blocks are dirty ([`COMMIT_INTERVAL_BLOCKS`]).
    pub commit_interval_blocks: usize,
}

impl Default for RestoreOptions {
    fn default() -> RestoreOptions {
        RestoreOptions {
            transaction_id: None,
            data_block_size_sectors: None,
            data_block_count: None,
            commit_interval_blocks: COMMIT_INTERVAL_BLOCKS,
        }
    }
}

/// What a restore wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RestoreSummary {
    /// Devices restored.
    pub device_count: u64,
    /// Mappings restored (counting a shared def once per reference).
    pub mapping_count: u64,
    /// Metadata blocks in use at the end.
    pub metadata_used_blocks: u64,
}

/// Restore the XML dump read from `input` onto `device`, overwriting it.
pub fn restore<R: BufRead>(
    input: R,
    device: Arc<dyn BlockDevice>,
    options: &RestoreOptions,
) -> Result<RestoreSummary, Error> {
    let mut restorer = Restorer::new(device, options.clone());
    dump::xml::parse(input, &mut restorer).map_err(|e| match e {
        dump::Error::Visitor(source) => match source.downcast::<crate::Error>() {
            Ok(error) => Error::Metadata(*error),
            Err(source) => Error::Dump(dump::Error::Visitor(source)),
        },
        other => Error::Dump(other),
    })?;
    restorer.summary.ok_or_else(|| {
        Error::Metadata(crate::Error::Invalid(
            "the dump ended before </superblock>".to_string(),
        ))
    })
}

/// Bottom-level values reference data blocks.
struct DataRefs<'a>(&'a mut DataSpaceMap);

impl RefCounter<u64> for DataRefs<'_> {
    fn inc(&mut self, _: &mut dyn CopyOnWrite, value: &u64) -> persistent_data::Result<()> {
        self.0.inc(value >> 24)
    }
    fn dec(&mut self, _: &mut dyn CopyOnWrite, value: &u64) -> persistent_data::Result<()> {
        self.0.dec(value >> 24).map(|_| ())
    }
}

/// State after `<superblock>`.
struct Pool {
    tm: TransactionManager,
    data_sm: DataSpaceMap,
    superblock: Superblock,
    /// Empty trees the intermediate superblocks point at.
    /// Empty trees for the superblock of intermediate commits, made at the first one (so
    /// that, as with thin_restore, the first blocks allocated hold mappings).
    placeholder_roots: Option<(MetadataBlock, MetadataBlock)>,
}

/// The mappings being built: a def's or a device's.
struct Section {
    builder: NodeBuilder<u64>,
    def_name: Option<String>,
    device: Option<DeviceInfo>,
}

/// A [`DumpVisitor`] that writes the metadata a dump describes (module docs).
pub struct Restorer {
    device: Arc<dyn BlockDevice>,
    options: RestoreOptions,
    pool: Option<Pool>,
    section: Option<Section>,
    defs: HashMap<String, Vec<NodeSummary>>,
    devices: BTreeMap<u32, (MetadataBlock, DeviceDetails)>,
    mapping_count: u64,
    summary: Option<RestoreSummary>,
}

impl std::fmt::Debug for Restorer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Restorer")
            .field("devices", &self.devices.len())
            .field("defs", &self.defs.len())
            .finish()
    }
}

fn visitor_error(e: impl Into<crate::Error>) -> dump::Error {
    dump::Error::Visitor(Box::new(e.into()))
}

fn invalid(message: String) -> dump::Error {
    visitor_error(crate::Error::Invalid(message))
}

impl Restorer {
    /// A restorer writing onto `device`.
    pub fn new(device: Arc<dyn BlockDevice>, options: RestoreOptions) -> Restorer {
        Restorer {
            device,
            options,
            pool: None,
            section: None,
            defs: HashMap::new(),
            devices: BTreeMap::new(),
            mapping_count: 0,
            summary: None,
        }
    }

    /// What was written, once the dump is complete.
    pub fn summary(&self) -> Option<RestoreSummary> {
        self.summary
    }

    fn pool(&mut self) -> &mut Pool {
        self.pool.as_mut().expect("events after <superblock>")
    }

    fn begin(&mut self, def_name: Option<String>, device: Option<DeviceInfo>) {
        assert!(self.section.is_none(), "sections do not nest");
        self.section = Some(Section {
            builder: NodeBuilder::leaves(),
            def_name,
            device,
        });
    }

    fn end(&mut self) -> Result<(Section, Vec<NodeSummary>), dump::Error> {
        let mut section = self.section.take().expect("inside a section");
        let builder = std::mem::replace(&mut section.builder, NodeBuilder::leaves());
        let pool = self.pool.as_mut().expect("events after <superblock>");
        let nodes = builder
            .complete(&mut pool.tm, &mut DataRefs(&mut pool.data_sm))
            .map_err(visitor_error)?;
        Ok((section, nodes))
    }

    /// Commit what is built so far if enough is dirty, under a superblock of an empty pool.
    fn maybe_commit(&mut self) -> Result<(), dump::Error> {
        let interval = self.options.commit_interval_blocks;
        let pool = self.pool();
        if pool.tm.dirty_count() < interval {
            return Ok(());
        }
        let (mapping_root, details_root) = match pool.placeholder_roots {
            Some(roots) => roots,
            None => {
                let roots = (
                    btree::create_empty::<u64>(&mut pool.tm).map_err(visitor_error)?,
                    btree::create_empty::<DeviceDetails>(&mut pool.tm).map_err(visitor_error)?,
                );
                pool.placeholder_roots = Some(roots);
                roots
            }
        };
        let mut superblock = pool.superblock.clone();
        superblock.data_mapping_root = mapping_root.0;
        superblock.device_details_root = details_root.0;
        commit(pool, superblock).map_err(visitor_error)
    }
}

fn commit(pool: &mut Pool, mut superblock: Superblock) -> crate::Result<()> {
    superblock.data_space_map = pool.data_sm.commit(&mut pool.tm)?;
    superblock.metadata_space_map = pool.tm.commit_space_map()?;
    pool.tm.commit(superblock.encode())?;
    Ok(())
}

impl DumpVisitor for Restorer {
    fn superblock_begin(&mut self, info: &SuperblockInfo) -> Result<(), dump::Error> {
        let data_block_size = self
            .options
            .data_block_size_sectors
            .unwrap_or(info.data_block_size_sectors);
        if !valid_data_block_size(data_block_size) {
            return Err(invalid(format!(
                "data block size {data_block_size} sectors: must be a multiple of 128 from 128 to 2097152"
            )));
        }
        let data_block_count = self
            .options
            .data_block_count
            .unwrap_or(info.data_block_count);
        if data_block_count > DATA_BLOCK_MAX + 1 {
            return Err(invalid(format!(
                "{data_block_count} data blocks: at most 2^40"
            )));
        }
        if info.time >= 1 << 24 {
            return Err(invalid(format!("time {} does not fit 24 bits", info.time)));
        }
        let block_count = self.device.block_count();
        let bm = Arc::new(BlockManager::new(self.device.clone(), CACHE_BLOCKS_DEFAULT));
        let mut tm = TransactionManager::format(bm, block_count).map_err(visitor_error)?;
        let data_sm = DataSpaceMap::format(&mut tm, data_block_count).map_err(visitor_error)?;
        let superblock = Superblock {
            flags: 0,
            blocknr: 0,
            uuid: [0; 16],
            version: VERSION,
            time: info.time,
            transaction_id: self.options.transaction_id.unwrap_or(info.transaction),
            metadata_snap: 0,
            data_space_map: SpaceMapRoot::default(),
            metadata_space_map: SpaceMapRoot::default(),
            data_mapping_root: 0,
            device_details_root: 0,
            data_block_size_sectors: data_block_size,
            metadata_block_count: tm.space_map().block_count(),
            compat_flags: 0,
            compat_ro_flags: 0,
            incompat_flags: 0,
        };
        self.pool = Some(Pool {
            tm,
            data_sm,
            superblock,
            placeholder_roots: None,
        });
        Ok(())
    }

    fn superblock_end(&mut self) -> Result<(), dump::Error> {
        let devices = std::mem::take(&mut self.devices);
        let defs = std::mem::take(&mut self.defs);
        let pool = self.pool.as_mut().expect("events after <superblock>");
        let tm = &mut pool.tm;
        let mut details = TreeBuilder::<DeviceDetails>::new();
        let mut roots = TreeBuilder::<u64>::new();
        for (&id, &(root, detail)) in &devices {
            details
                .push_value(tm, &mut NoRefs, u64::from(id), detail)
                .map_err(visitor_error)?;
            roots
                .push_value(tm, &mut NoRefs, u64::from(id), root.0)
                .map_err(visitor_error)?;
        }
        let details_root = details.complete(tm, &mut NoRefs).map_err(visitor_error)?;
        let mapping_root = roots.complete(tm, &mut NoRefs).map_err(visitor_error)?;
        for nodes in defs.values() {
            release_nodes::<u64, _>(tm, &mut DataRefs(&mut pool.data_sm), nodes)
                .map_err(visitor_error)?;
        }
        if let Some((placeholder_mapping, placeholder_details)) = pool.placeholder_roots {
            tm.dec(placeholder_mapping).map_err(visitor_error)?;
            tm.dec(placeholder_details).map_err(visitor_error)?;
        }
        let mut superblock = pool.superblock.clone();
        superblock.data_mapping_root = mapping_root.0;
        superblock.device_details_root = details_root.0;
        commit(pool, superblock).map_err(visitor_error)?;
        self.summary = Some(RestoreSummary {
            device_count: devices.len() as u64,
            mapping_count: self.mapping_count,
            metadata_used_blocks: pool.tm.space_map().allocated_count(),
        });
        Ok(())
    }

    fn def_begin(&mut self, name: &str) -> Result<(), dump::Error> {
        self.begin(Some(name.to_string()), None);
        Ok(())
    }

    fn def_end(&mut self) -> Result<(), dump::Error> {
        let (section, nodes) = self.end()?;
        let name = section.def_name.expect("a def section");
        self.defs.insert(name, nodes);
        self.maybe_commit()
    }

    fn device_begin(&mut self, device: &DeviceInfo) -> Result<(), dump::Error> {
        if self.devices.contains_key(&device.dev_id) {
            return Err(invalid(format!("device {} appears twice", device.dev_id)));
        }
        if device.dev_id > crate::VolumeId::MAX.0 {
            return Err(invalid(format!(
                "device id {} is out of range (0..=16777215)",
                device.dev_id
            )));
        }
        self.begin(None, Some(*device));
        Ok(())
    }

    fn device_end(&mut self) -> Result<(), dump::Error> {
        let (section, nodes) = self.end()?;
        let info = section.device.expect("a device section");
        let pool = self.pool();
        let root = build_tree(&mut pool.tm, nodes).map_err(visitor_error)?;
        let details = DeviceDetails {
            mapped_blocks: info.mapped_block_count,
            transaction_id: info.transaction,
            creation_time: info.creation_time,
            snapshotted_time: info.snap_time,
        };
        self.devices.insert(info.dev_id, (root, details));
        self.maybe_commit()
    }

    fn mapping(&mut self, mapping: &Mapping) -> Result<(), dump::Error> {
        if mapping.time >= 1 << 24 {
            return Err(invalid(format!(
                "mapping of virtual block {} has time {}, which does not fit 24 bits",
                mapping.virtual_begin, mapping.time
            )));
        }
        let pool = self.pool.as_mut().expect("events after <superblock>");
        let data_last = mapping.data_last();
        if data_last >= pool.data_sm.block_count() {
            return Err(invalid(format!(
                "mapping of virtual block {} to data block {} is beyond the data device ({} blocks)",
                mapping.virtual_begin,
                data_last,
                pool.data_sm.block_count()
            )));
        }
        let section = self.section.as_mut().expect("mappings inside a section");
        for i in 0..mapping.length {
            let value = pack_block_time(mapping.data_begin + i, mapping.time);
            section
                .builder
                .push_value(
                    &mut pool.tm,
                    &mut DataRefs(&mut pool.data_sm),
                    mapping.virtual_begin + i,
                    value,
                )
                .map_err(visitor_error)?;
        }
        if section.device.is_some() {
            self.mapping_count += mapping.length;
        }
        self.maybe_commit()
    }

    fn reference(&mut self, name: &str) -> Result<(), dump::Error> {
        let nodes = self
            .defs
            .get(name)
            .ok_or_else(|| invalid(format!("<ref name={name:?}> names no <def>")))?;
        let pool = self.pool.as_mut().expect("events after <superblock>");
        let section = self.section.as_mut().expect("references inside a device");
        section
            .builder
            .push_nodes(&mut pool.tm, &mut DataRefs(&mut pool.data_sm), nodes)
            .map_err(visitor_error)?;
        self.mapping_count += nodes.iter().map(|n| n.entry_count as u64).sum::<u64>();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::dump::metadata::{dump, DumpOptions};
    use crate::format::dump::XmlWriter;
    use persistent_data::MemoryDevice;
    use std::fmt::Write as _;
    use std::io::Cursor;

    /// Two devices of 20 000 mappings sharing a 600-mapping def, and a snapshot-like copy.
    fn big_xml() -> String {
        let mut xml = String::from(
            "<superblock uuid=\"\" time=\"2\" transaction=\"5\" data_block_size=\"128\" nr_data_blocks=\"100000\">\n  <def name=\"x\">\n    <range_mapping origin_begin=\"30000\" data_begin=\"90000\" length=\"600\" time=\"1\"/>\n  </def>\n",
        );
        for dev in 0..2u64 {
            writeln!(xml, "  <device dev_id=\"{dev}\" mapped_blocks=\"20600\" transaction=\"0\" creation_time=\"0\" snap_time=\"0\">").unwrap();
            for vb in 0..20_000u64 {
                let db = dev * 40_000 + vb * 2;
                writeln!(
                    xml,
                    "    <single_mapping origin_block=\"{vb}\" data_block=\"{db}\" time=\"0\"/>"
                )
                .unwrap();
            }
            writeln!(xml, "    <ref name=\"x\"/>\n  </device>").unwrap();
        }
        xml.push_str("</superblock>\n");
        xml
    }

    fn restore_and_dump(xml: &str, interval: usize) -> String {
        let device = Arc::new(MemoryDevice::new(4096));
        let options = RestoreOptions {
            commit_interval_blocks: interval,
            ..RestoreOptions::default()
        };
        let summary = restore(Cursor::new(xml.as_bytes()), device.clone(), &options).unwrap();
        assert_eq!(summary.device_count, 2);
        assert_eq!(summary.mapping_count, 41_200);
        let mut writer = XmlWriter::new(Vec::new());
        dump(device, &DumpOptions::default(), &mut writer).unwrap();
        String::from_utf8(writer.into_inner()).unwrap()
    }

    #[test]
    fn intermediate_commits_do_not_change_the_result() {
        let xml = big_xml();
        let once = restore_and_dump(&xml, usize::MAX);
        let often = restore_and_dump(&xml, 16);
        assert!(once.contains("<def name="), "the def stays shared");
        // Def names are block numbers, which intermediate commits may change.
        let strip = |s: &str| {
            s.lines()
                .filter(|l| !l.contains(" name=\""))
                .collect::<Vec<_>>()
                .join("\n")
        };
        assert_eq!(strip(&once), strip(&often));
    }

    #[test]
    fn mappings_beyond_the_data_device_are_refused() {
        let xml = "<superblock uuid=\"\" time=\"0\" transaction=\"0\" data_block_size=\"128\" nr_data_blocks=\"10\">\n  <device dev_id=\"0\" mapped_blocks=\"1\" transaction=\"0\" creation_time=\"0\" snap_time=\"0\">\n    <single_mapping origin_block=\"0\" data_block=\"10\" time=\"0\"/>\n  </device>\n</superblock>\n";
        let device = Arc::new(MemoryDevice::new(256));
        let error = restore(
            Cursor::new(xml.as_bytes()),
            device,
            &RestoreOptions::default(),
        )
        .unwrap_err();
        assert!(
            matches!(error, Error::Metadata(crate::Error::Invalid(_))),
            "{error:?}"
        );
    }
}

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
//! Formatting, the data references of mapping values, building the details and top-level
//! trees and committing are [`writer`]'s, shared with
//! [`PoolMetadata`](crate::format::metadata::PoolMetadata).
//!
//! Reference counts follow spec §7.8: a leaf holds one data reference per mapping however
//! many devices share it; a shared leaf has one metadata reference per parent.
//!
//! Memory stays bounded for big inputs: the builder holds at most two leaves' worth of
//! mappings, and the transaction is committed whenever [`COMMIT_INTERVAL_BLOCKS`] blocks
//! are dirty (intermediate commits describe an empty pool; only the final one describes the
//! restored pool). What grows is per device (its root and details) and per def (its leaves).
//! `mapped_blocks` is taken from the XML, as 1.x does.

use crate::format::details::DeviceDetails;
use crate::format::dump::{self, DeviceInfo, DumpVisitor, Mapping, SuperblockInfo};
use crate::format::writer::{self, DataRefs, Formatted, NewPool, VolumeEntry};
use crate::ids::{BlockTime, DataBlock, Time, TransactionId, VolumeId};
use persistent_data::btree;
use persistent_data::btree::builder::{build_tree, release_nodes, NodeBuilder, NodeSummary};
use persistent_data::{BlockDevice, MetadataBlock};
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
        Error::Metadata(crate::Error::BadDump(
            "the dump ended before </superblock>".to_string(),
        ))
    })
}

/// State after `<superblock>`.
struct Restoring {
    /// The metadata being written (its superblock holds the dump's settings).
    metadata: Formatted,
    /// Empty trees for the superblock of intermediate commits, made at the first one (so
    /// that, as with thin_restore, the first blocks allocated hold mappings).
    placeholder_roots: Option<(MetadataBlock, MetadataBlock)>,
}

impl Restoring {
    /// Commit with these roots in the superblock.
    fn commit(
        &mut self,
        mapping_root: MetadataBlock,
        details_root: MetadataBlock,
    ) -> crate::Result<()> {
        let metadata = &mut self.metadata;
        let data_space_map = metadata.data_sm.commit(&mut metadata.tm)?;
        writer::commit(
            &mut metadata.tm,
            &mut metadata.superblock,
            data_space_map,
            mapping_root,
            details_root,
        )
    }
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
    pool: Option<Restoring>,
    section: Option<Section>,
    defs: HashMap<String, Vec<NodeSummary>>,
    devices: BTreeMap<VolumeId, (MetadataBlock, DeviceDetails)>,
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
    visitor_error(crate::Error::BadDump(message))
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

    fn pool(&mut self) -> &mut Restoring {
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
        let pool = &mut self.pool().metadata;
        let nodes = builder
            .complete(&mut pool.tm, &mut DataRefs(&mut pool.data_sm))
            .map_err(visitor_error)?;
        Ok((section, nodes))
    }

    /// Commit what is built so far if enough is dirty, under a superblock of an empty pool.
    fn maybe_commit(&mut self) -> Result<(), dump::Error> {
        let interval = self.options.commit_interval_blocks;
        let pool = self.pool();
        if pool.metadata.tm.dirty_count() < interval {
            return Ok(());
        }
        let (mapping_root, details_root) = match pool.placeholder_roots {
            Some(roots) => roots,
            None => {
                let tm = &mut pool.metadata.tm;
                let roots = (
                    btree::create_empty::<u64>(tm).map_err(visitor_error)?,
                    btree::create_empty::<DeviceDetails>(tm).map_err(visitor_error)?,
                );
                pool.placeholder_roots = Some(roots);
                roots
            }
        };
        pool.commit(mapping_root, details_root)
            .map_err(visitor_error)
    }
}

impl DumpVisitor for Restorer {
    fn superblock_begin(&mut self, info: &SuperblockInfo) -> Result<(), dump::Error> {
        let time = Time::new(info.time)
            .ok_or_else(|| invalid(format!("time {} does not fit 24 bits", info.time)))?;
        let new_pool = NewPool {
            data_block_size_sectors: self
                .options
                .data_block_size_sectors
                .unwrap_or(info.data_block_size_sectors),
            data_block_count: self
                .options
                .data_block_count
                .unwrap_or(info.data_block_count),
            time,
            transaction_id: TransactionId::new(
                self.options.transaction_id.unwrap_or(info.transaction),
            ),
        };
        let metadata = writer::format(self.device.clone(), &new_pool).map_err(visitor_error)?;
        self.pool = Some(Restoring {
            metadata,
            placeholder_roots: None,
        });
        Ok(())
    }

    fn superblock_end(&mut self) -> Result<(), dump::Error> {
        let devices = std::mem::take(&mut self.devices);
        let defs = std::mem::take(&mut self.defs);
        let pool = self.pool();
        let metadata = &mut pool.metadata;
        let volumes =
            devices
                .iter()
                .map(|(&id, &(root, details))| VolumeEntry { id, root, details });
        let (mapping_root, details_root) =
            writer::build_volume_trees(&mut metadata.tm, volumes).map_err(visitor_error)?;
        for nodes in defs.values() {
            release_nodes::<u64, _>(
                &mut metadata.tm,
                &mut DataRefs(&mut metadata.data_sm),
                nodes,
            )
            .map_err(visitor_error)?;
        }
        if let Some((placeholder_mapping, placeholder_details)) = pool.placeholder_roots {
            let tm = &mut pool.metadata.tm;
            tm.dec(placeholder_mapping).map_err(visitor_error)?;
            tm.dec(placeholder_details).map_err(visitor_error)?;
        }
        pool.commit(mapping_root, details_root)
            .map_err(visitor_error)?;
        let metadata_used_blocks = pool.metadata.tm.space_map().allocated_count();
        self.summary = Some(RestoreSummary {
            device_count: devices.len() as u64,
            mapping_count: self.mapping_count,
            metadata_used_blocks,
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
        if self.devices.contains_key(&VolumeId::new(device.dev_id)) {
            return Err(invalid(format!("device {} appears twice", device.dev_id)));
        }
        if VolumeId::new(device.dev_id) > VolumeId::MAX {
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
        let root = build_tree(&mut self.pool().metadata.tm, nodes).map_err(visitor_error)?;
        let details = DeviceDetails {
            mapped_blocks: info.mapped_block_count,
            transaction_id: info.transaction,
            creation_time: info.creation_time,
            snapshotted_time: info.snap_time,
        };
        self.devices
            .insert(VolumeId::new(info.dev_id), (root, details));
        self.maybe_commit()
    }

    fn mapping(&mut self, mapping: &Mapping) -> Result<(), dump::Error> {
        let time = Time::new(mapping.time).ok_or_else(|| {
            invalid(format!(
                "mapping of virtual block {} has time {}, which does not fit 24 bits",
                mapping.virtual_begin, mapping.time
            ))
        })?;
        let pool = &mut self
            .pool
            .as_mut()
            .expect("events after <superblock>")
            .metadata;
        let data_block_count = pool.data_sm.block_count();
        let data_last = mapping
            .data_begin
            .checked_add(mapping.length.saturating_sub(1));
        if data_last.is_none_or(|last| last >= data_block_count) {
            return Err(invalid(format!(
                "mapping of virtual block {} to data blocks from {} ({} blocks) is beyond the data device ({data_block_count} blocks)",
                mapping.virtual_begin, mapping.data_begin, mapping.length
            )));
        }
        let section = self.section.as_mut().expect("mappings inside a section");
        for i in 0..mapping.length {
            let value = BlockTime::new(DataBlock::new(mapping.data_begin + i), time).pack();
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
        let pool = &mut self
            .pool
            .as_mut()
            .expect("events after <superblock>")
            .metadata;
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
            matches!(error, Error::Metadata(crate::Error::BadDump(_))),
            "{error:?}"
        );
    }
}

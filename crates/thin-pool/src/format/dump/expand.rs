//! [`Expanded`]: a visitor that resolves a dump into plain per-device mappings (every
//! `<ref>` replaced by its `<def>`), for comparing dumps by meaning rather than by text.
//!
//! It holds every mapping in memory, so it is meant for tests and small pools; the dump
//! producers and the restorer stream instead.

use super::{DeviceInfo, DumpVisitor, Error, Mapping, SuperblockInfo};
use std::collections::{BTreeMap, HashMap};

/// One device of an expanded dump.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ExpandedDevice {
    /// The device header.
    pub info: DeviceInfo,
    /// Virtual block → (data block, time), every mapping of the device.
    pub mappings: BTreeMap<u64, (u64, u32)>,
}

/// A whole dump with definitions resolved.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Expanded {
    /// The superblock line.
    pub superblock: SuperblockInfo,
    /// Devices by id.
    pub devices: BTreeMap<u32, ExpandedDevice>,
    defs: HashMap<String, Vec<Mapping>>,
    current_def: Option<(String, Vec<Mapping>)>,
    current_device: Option<ExpandedDevice>,
}

impl Expanded {
    /// An empty collector.
    pub fn new() -> Expanded {
        Expanded::default()
    }

    fn add(device: &mut ExpandedDevice, mapping: &Mapping) -> Result<(), Error> {
        for i in 0..mapping.length {
            let previous = device.mappings.insert(
                mapping.virtual_begin + i,
                (mapping.data_begin + i, mapping.time),
            );
            if previous.is_some() {
                return Err(Error::Visitor(
                    format!(
                        "device {} maps virtual block {} twice",
                        device.info.dev_id,
                        mapping.virtual_begin + i
                    )
                    .into(),
                ));
            }
        }
        Ok(())
    }
}

impl DumpVisitor for Expanded {
    fn superblock_begin(&mut self, superblock: &SuperblockInfo) -> Result<(), Error> {
        self.superblock = superblock.clone();
        Ok(())
    }

    fn superblock_end(&mut self) -> Result<(), Error> {
        Ok(())
    }

    fn def_begin(&mut self, name: &str) -> Result<(), Error> {
        self.current_def = Some((name.to_string(), Vec::new()));
        Ok(())
    }

    fn def_end(&mut self) -> Result<(), Error> {
        let (name, mappings) = self.current_def.take().expect("inside a def");
        self.defs.insert(name, mappings);
        Ok(())
    }

    fn device_begin(&mut self, device: &DeviceInfo) -> Result<(), Error> {
        self.current_device = Some(ExpandedDevice {
            info: *device,
            mappings: BTreeMap::new(),
        });
        Ok(())
    }

    fn device_end(&mut self) -> Result<(), Error> {
        let device = self.current_device.take().expect("inside a device");
        self.devices.insert(device.info.dev_id, device);
        Ok(())
    }

    fn mapping(&mut self, mapping: &Mapping) -> Result<(), Error> {
        if let Some((_, def)) = self.current_def.as_mut() {
            def.push(*mapping);
            return Ok(());
        }
        let device = self.current_device.as_mut().expect("inside a device");
        Expanded::add(device, mapping)
    }

    fn reference(&mut self, name: &str) -> Result<(), Error> {
        let def = self
            .defs
            .get(name)
            .ok_or_else(|| Error::Visitor(format!("reference to unknown def {name:?}").into()))?;
        let device = self.current_device.as_mut().expect("inside a device");
        for mapping in def {
            Expanded::add(device, mapping)?;
        }
        Ok(())
    }
}

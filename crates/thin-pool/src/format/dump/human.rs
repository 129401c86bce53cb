//! The human-readable dump (`thin_dump --format human_readable`), byte for byte as
//! thin-provisioning-tools 1.1.0 prints it (0.9.0 on request):
//!
//! ```text
//! begin superblock: "", 3, 9, 0, 2, 128, 20000
//! def: 2
//!     (201..599) -> (1201..1599), 0
//!
//! device: 0
//! mapped_blocks: 602
//! transaction: 0
//! creation time: 0
//! snap time: 2
//!     (700..700) -> (5..5), 1
//!     ref: 2
//!
//! end superblock
//! ```
//!
//! The superblock line gives uuid, time, transaction, flags, version, data block size and
//! number of data blocks. 1.1.0 prints the flags as the needs-check bit (0 or 1) and a run of
//! one as a range; 0.9.0 prints the raw flags and a run of one as `700 -> 5, 1`.

use std::io::Write;

use super::{DeviceInfo, DumpVisitor, Error, Event, Flavour, Mapping, Position, SuperblockInfo};

/// Writes a dump in the human-readable format. Flushes the output at
/// [`DumpVisitor::superblock_end`].
#[derive(Debug)]
pub struct HumanWriter<W: Write> {
    output: W,
    flavour: Flavour,
    position: Position,
}

impl<W: Write> HumanWriter<W> {
    /// A writer of the 1.x form.
    pub fn new(output: W) -> HumanWriter<W> {
        HumanWriter::with_flavour(output, Flavour::V1)
    }

    /// A writer of the form of the given `thin_dump` version.
    pub fn with_flavour(output: W, flavour: Flavour) -> HumanWriter<W> {
        HumanWriter {
            output,
            flavour,
            position: Position::BeforeSuperblock,
        }
    }

    /// The output, after the dump has been written.
    pub fn into_inner(self) -> W {
        self.output
    }
}

impl<W: Write> DumpVisitor for HumanWriter<W> {
    fn superblock_begin(&mut self, superblock: &SuperblockInfo) -> Result<(), Error> {
        self.position.advance(Event::SuperblockBegin);
        let flags = match self.flavour {
            Flavour::V1 => u32::from(superblock.needs_check()),
            Flavour::V0_9 => superblock.flags,
        };
        writeln!(
            self.output,
            "begin superblock: \"{}\", {}, {}, {}, {}, {}, {}",
            superblock.uuid,
            superblock.time,
            superblock.transaction,
            flags,
            superblock.version,
            superblock.data_block_size_sectors,
            superblock.data_block_count
        )?;
        Ok(())
    }

    fn superblock_end(&mut self) -> Result<(), Error> {
        self.position.advance(Event::SuperblockEnd);
        writeln!(self.output, "end superblock")?;
        self.output.flush()?;
        Ok(())
    }

    fn def_begin(&mut self, name: &str) -> Result<(), Error> {
        self.position.advance(Event::DefBegin);
        writeln!(self.output, "def: {name}")?;
        Ok(())
    }

    fn def_end(&mut self) -> Result<(), Error> {
        self.position.advance(Event::DefEnd);
        writeln!(self.output)?;
        Ok(())
    }

    fn device_begin(&mut self, device: &DeviceInfo) -> Result<(), Error> {
        self.position.advance(Event::DeviceBegin);
        writeln!(
            self.output,
            "device: {}\nmapped_blocks: {}\ntransaction: {}\ncreation time: {}\nsnap time: {}",
            device.dev_id,
            device.mapped_block_count,
            device.transaction,
            device.creation_time,
            device.snap_time
        )?;
        Ok(())
    }

    fn device_end(&mut self) -> Result<(), Error> {
        self.position.advance(Event::DeviceEnd);
        writeln!(self.output)?;
        Ok(())
    }

    fn mapping(&mut self, mapping: &Mapping) -> Result<(), Error> {
        self.position.advance(Event::Mapping);
        if mapping.length == 1 && self.flavour == Flavour::V0_9 {
            writeln!(
                self.output,
                "    {} -> {}, {}",
                mapping.virtual_begin, mapping.data_begin, mapping.time
            )?;
        } else {
            writeln!(
                self.output,
                "    ({}..{}) -> ({}..{}), {}",
                mapping.virtual_begin,
                mapping.virtual_last(),
                mapping.data_begin,
                mapping.data_last(),
                mapping.time
            )?;
        }
        Ok(())
    }

    fn reference(&mut self, name: &str) -> Result<(), Error> {
        self.position.advance(Event::Reference);
        writeln!(self.output, "    ref: {name}")?;
        Ok(())
    }
}

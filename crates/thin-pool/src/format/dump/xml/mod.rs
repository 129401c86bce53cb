//! The XML dump format of `thin_dump` / `thin_restore`: a writer ([`XmlWriter`]) that prints
//! exactly what `thin_dump` 1.1.0 (or 0.9.0) prints, and a streaming parser ([`parse`], on
//! `quick-xml`) that accepts both forms.
//!
//! Output of 1.1.0 (0.9.0 differs as noted):
//!
//! ```text
//! <superblock uuid="" time="3" transaction="9" version="2" data_block_size="128" nr_data_blocks="20000">
//!   <def name="1">
//!     <range_mapping origin_begin="0" data_begin="1000" length="201" time="0"/>
//!   </def>
//!   <device dev_id="0" mapped_blocks="602" transaction="0" creation_time="0" snap_time="2">
//!     <single_mapping origin_block="700" data_block="5" time="1"/>
//!     <ref name="1"/>
//!   </device>
//! </superblock>
//! ```
//!
//! - `flags`: 1.1.0 prints `flags="1"` after `transaction` only when the needs-check bit is
//!   set (other bits are dropped); 0.9.0 always prints the raw flags.
//! - 1.1.0 writes no newline after `</superblock>`; 0.9.0 does.
//! - `<def>` / `<ref>` exist in 1.x only.
//! - Neither version prints `metadata_snap`; the uuid is always empty in real dumps.

mod parse;
mod reader;

pub use parse::parse;

use std::io::Write;

use super::{DeviceInfo, DumpVisitor, Error, Event, Flavour, Mapping, Position, SuperblockInfo};

/// Writes a dump as `thin_dump` XML. Flushes the output at [`DumpVisitor::superblock_end`].
#[derive(Debug)]
pub struct XmlWriter<W: Write> {
    output: W,
    flavour: Flavour,
    position: Position,
}

impl<W: Write> XmlWriter<W> {
    /// A writer of the 1.x form.
    pub fn new(output: W) -> XmlWriter<W> {
        XmlWriter::with_flavour(output, Flavour::V1)
    }

    /// A writer of the given form.
    pub fn with_flavour(output: W, flavour: Flavour) -> XmlWriter<W> {
        XmlWriter {
            output,
            flavour,
            position: Position::BeforeSuperblock,
        }
    }

    /// The output, after the dump has been written.
    pub fn into_inner(self) -> W {
        self.output
    }

    fn unsupported(&self, what: &'static str) -> Result<(), Error> {
        match self.flavour {
            Flavour::V1 => Ok(()),
            Flavour::V0_9 => Err(Error::Unsupported {
                what,
                format: "thin_dump 0.9.0 xml",
            }),
        }
    }
}

impl<W: Write> DumpVisitor for XmlWriter<W> {
    fn superblock_begin(&mut self, superblock: &SuperblockInfo) -> Result<(), Error> {
        self.position.advance(Event::SuperblockBegin);
        let out = &mut self.output;
        write!(
            out,
            "<superblock uuid=\"{}\" time=\"{}\" transaction=\"{}\"",
            Escaped(&superblock.uuid),
            superblock.time,
            superblock.transaction
        )?;
        match self.flavour {
            Flavour::V1 if superblock.needs_check() => write!(out, " flags=\"1\"")?,
            Flavour::V1 => {}
            Flavour::V0_9 => write!(out, " flags=\"{}\"", superblock.flags)?,
        }
        writeln!(
            out,
            " version=\"{}\" data_block_size=\"{}\" nr_data_blocks=\"{}\">",
            superblock.version, superblock.data_block_size_sectors, superblock.data_block_count
        )?;
        Ok(())
    }

    fn superblock_end(&mut self) -> Result<(), Error> {
        self.position.advance(Event::SuperblockEnd);
        match self.flavour {
            Flavour::V1 => write!(self.output, "</superblock>")?,
            Flavour::V0_9 => writeln!(self.output, "</superblock>")?,
        }
        self.output.flush()?;
        Ok(())
    }

    fn def_begin(&mut self, name: &str) -> Result<(), Error> {
        self.position.advance(Event::DefBegin);
        self.unsupported("<def>")?;
        writeln!(self.output, "  <def name=\"{}\">", Escaped(name))?;
        Ok(())
    }

    fn def_end(&mut self) -> Result<(), Error> {
        self.position.advance(Event::DefEnd);
        writeln!(self.output, "  </def>")?;
        Ok(())
    }

    fn device_begin(&mut self, device: &DeviceInfo) -> Result<(), Error> {
        self.position.advance(Event::DeviceBegin);
        writeln!(
            self.output,
            "  <device dev_id=\"{}\" mapped_blocks=\"{}\" transaction=\"{}\" creation_time=\"{}\" snap_time=\"{}\">",
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
        writeln!(self.output, "  </device>")?;
        Ok(())
    }

    fn mapping(&mut self, mapping: &Mapping) -> Result<(), Error> {
        self.position.advance(Event::Mapping);
        assert!(mapping.length >= 1, "empty mapping run");
        if mapping.length == 1 {
            writeln!(
                self.output,
                "    <single_mapping origin_block=\"{}\" data_block=\"{}\" time=\"{}\"/>",
                mapping.virtual_begin, mapping.data_begin, mapping.time
            )?;
        } else {
            writeln!(
                self.output,
                "    <range_mapping origin_begin=\"{}\" data_begin=\"{}\" length=\"{}\" time=\"{}\"/>",
                mapping.virtual_begin, mapping.data_begin, mapping.length, mapping.time
            )?;
        }
        Ok(())
    }

    fn reference(&mut self, name: &str) -> Result<(), Error> {
        self.position.advance(Event::Reference);
        self.unsupported("<ref>")?;
        writeln!(self.output, "    <ref name=\"{}\"/>", Escaped(name))?;
        Ok(())
    }
}

/// Displays a string as an XML attribute value (the five predefined entities escaped).
struct Escaped<'a>(&'a str);

impl std::fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut rest = self.0;
        while let Some(index) = rest.find(['&', '<', '>', '"', '\'']) {
            f.write_str(&rest[..index])?;
            f.write_str(match rest.as_bytes()[index] {
                b'&' => "&amp;",
                b'<' => "&lt;",
                b'>' => "&gt;",
                b'"' => "&quot;",
                _ => "&apos;",
            })?;
            rest = &rest[index + 1..];
        }
        f.write_str(rest)
    }
}

//! [`NullExport`]: an export with no data behind it (`thinpool-bench serve --null-export NAME=SIZE`).
//! READs answer zeroes, WRITEs, TRIMs and zeroing are accepted and dropped, FLUSH does
//! nothing, and BLOCK_STATUS reports one hole that reads as zeroes. No file is touched, so a
//! benchmark through it measures the NBD front end alone (socket, parsing, threads, replies):
//! compare it with a raw export to see what the I/O itself costs, and with `nbdkit null` for
//! the same measurement of nbdkit.

use nbd::{Capabilities, Export, Extent, ZeroOptions};

use thinpool_daemon::pool_dir::{format_size, parse_size};

/// An export of `size_bytes` zeroes that forgets every write.
pub struct NullExport {
    name: String,
    description: String,
    size_bytes: u64,
}

impl NullExport {
    /// A null export named `name` of `size_bytes` (a nonzero multiple of 512).
    pub fn new(name: &str, size_bytes: u64) -> anyhow::Result<Self> {
        if size_bytes == 0 || !size_bytes.is_multiple_of(512) {
            anyhow::bail!(
                "null export {name:?}: size {size_bytes} is not a nonzero multiple of 512 bytes"
            );
        }
        Ok(NullExport {
            name: name.to_string(),
            description: format!(
                "null export, {}: reads zeroes, drops writes",
                format_size(size_bytes)
            ),
            size_bytes,
        })
    }

    /// Parses `NAME=SIZE` (`SIZE` as `parse_size` reads it: `1G`, `512M`, `4096`).
    pub fn parse(spec: &str) -> anyhow::Result<Self> {
        let (name, size) = spec
            .split_once('=')
            .filter(|(name, size)| !name.is_empty() && !size.is_empty())
            .ok_or_else(|| anyhow::anyhow!("--null-export {spec:?}: expected NAME=SIZE"))?;
        let size_bytes =
            parse_size(size).map_err(|e| anyhow::anyhow!("--null-export {spec:?}: {e}"))?;
        NullExport::new(name, size_bytes)
    }
}

impl Export for NullExport {
    fn name(&self) -> &str {
        &self.name
    }

    fn description(&self) -> &str {
        &self.description
    }

    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            trim: true,
            fast_zero: true,
            // Nothing is kept, so every flush trivially covers every connection.
            multi_conn: true,
            ..Capabilities::default()
        }
    }

    fn read_at(&self, _offset: u64, buffer: &mut [u8]) -> nbd::Result<()> {
        // The session reuses buffers: every byte must be written.
        buffer.fill(0);
        Ok(())
    }

    fn write_at(&self, _offset: u64, _data: &[u8], _fua: bool) -> nbd::Result<()> {
        Ok(())
    }

    fn write_zeroes(&self, _offset: u64, _length: u64, _options: ZeroOptions) -> nbd::Result<()> {
        Ok(())
    }

    fn trim(&self, _offset: u64, _length: u64, _fua: bool) -> nbd::Result<()> {
        Ok(())
    }

    fn flush(&self) -> nbd::Result<()> {
        Ok(())
    }

    fn block_status(
        &self,
        offset: u64,
        length: u64,
        _extents_max: usize,
    ) -> nbd::Result<Vec<Extent>> {
        Ok(vec![Extent {
            length_bytes: length.min(self.size_bytes - offset),
            hole: true,
            zero: true,
        }])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_zeroes_over_old_buffer_contents_and_drops_writes() {
        let export = NullExport::parse("n=1M").unwrap();
        assert_eq!(export.size_bytes(), 1 << 20);
        export.write_at(4096, &[7u8; 4096], true).unwrap();
        let mut buffer = vec![0xa5u8; 8192];
        export.read_at(0, &mut buffer).unwrap();
        assert!(buffer.iter().all(|&byte| byte == 0));
        let extents = export.block_status(4096, 1 << 20, 16).unwrap();
        assert_eq!(
            extents,
            [Extent {
                length_bytes: (1 << 20) - 4096,
                hole: true,
                zero: true
            }]
        );
    }

    #[test]
    fn bad_specs_are_refused() {
        for spec in ["n", "=1M", "n=", "n=1000", "n=0", "n=1Q"] {
            assert!(NullExport::parse(spec).is_err(), "{spec}");
        }
        assert_eq!(NullExport::parse("n=1536").unwrap().size_bytes(), 1536);
    }
}

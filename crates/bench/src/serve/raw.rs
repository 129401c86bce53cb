//! [`RawFileExport`]: a plain file served as is (`thinpool-bench serve --raw-export
//! NAME=FILE`), the control for benchmarks measuring what thin mapping costs through the
//! same NBD front end.

use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use nbd::{Error as NbdError, Export, ReadSource};

/// A plain file served as is: no mapping, no allocation, no snapshots.
pub struct RawFileExport {
    name: String,
    description: String,
    path: PathBuf,
    file: File,
    size_bytes: u64,
}

impl RawFileExport {
    /// Opens `path` read-write; its size, rounded down to 512 bytes, is the export's.
    pub fn open(name: &str, path: &Path) -> anyhow::Result<Self> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .with_context(|| format!("cannot open raw export file {}", path.display()))?;
        let length = file
            .metadata()
            .with_context(|| format!("cannot stat {}", path.display()))?
            .len();
        let size_bytes = length / 512 * 512;
        if size_bytes == 0 {
            bail!(
                "raw export file {} is {length} bytes: at least 512 needed",
                path.display()
            );
        }
        Ok(RawFileExport {
            name: name.to_string(),
            description: format!("raw file {}", path.display()),
            path: path.to_path_buf(),
            file,
            size_bytes,
        })
    }

    fn io_error(&self, what: String, error: std::io::Error) -> NbdError {
        NbdError::io(format!("{what} on {}", self.path.display()), error)
    }
}

impl Export for RawFileExport {
    fn name(&self) -> &str {
        &self.name
    }

    fn description(&self) -> &str {
        &self.description
    }

    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn capabilities(&self) -> nbd::Capabilities {
        nbd::Capabilities {
            // fdatasync covers writes made through every connection's copy of the file.
            multi_conn: true,
            ..nbd::Capabilities::default()
        }
    }

    fn read_at(&self, offset: u64, buffer: &mut [u8]) -> nbd::Result<()> {
        self.file
            .read_exact_at(buffer, offset)
            .map_err(|e| self.io_error(format!("read at {offset}"), e))
    }

    /// The file is the export, byte for byte, and its ranges never hold anything else, so
    /// READ replies may be spliced from it.
    fn read_source(&self, offset: u64, _length: u64) -> Option<ReadSource<'_>> {
        Some(ReadSource {
            file: self.file.as_fd(),
            offset,
        })
    }

    fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> nbd::Result<()> {
        self.file
            .write_all_at(data, offset)
            .map_err(|e| self.io_error(format!("write at {offset}"), e))?;
        if fua {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&self) -> nbd::Result<()> {
        self.file
            .sync_data()
            .map_err(|e| self.io_error("fdatasync".to_string(), e))
    }
}

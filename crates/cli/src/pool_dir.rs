//! The pool directory as the management commands see it: where it is (`--pool DIR`, else
//! `$THINPOOL_POOL`, else `./thinpool-pool`), the files the binary keeps beside the engine's
//! (`pool.json` with the options chosen at create, `nbd.sock`, `control.sock`), size parsing
//! with K/M/G/T suffixes, and the text formatting shared by `list`, `status` and the volume
//! commands.
//!
//! Layout of a pool directory (the engine owns `metadata`, `data` and the catalogs):
//!
//! ```text
//!   DIR/metadata           pool metadata (dm-thin format)      engine
//!   DIR/data               data blocks                          engine
//!   DIR/catalog-N.json     volume names and sizes               engine
//!   DIR/pool.json          options chosen at create             this module
//!   DIR/nbd.sock           NBD Unix socket while serving        serve
//!   DIR/control.sock       control socket while serving         serve
//! ```

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::PathBuf;
use thin_pool::PoolOptions;

/// Environment variable naming the pool directory when `--pool` is not given.
pub const POOL_VARIABLE: &str = "THINPOOL_POOL";
/// Pool directory when neither `--pool` nor `$THINPOOL_POOL` names one.
pub const DEFAULT_POOL_DIR: &str = "thinpool-pool";
/// The options file inside a pool directory.
pub const OPTIONS_FILE: &str = "pool.json";
/// Default NBD Unix socket inside a pool directory.
pub const NBD_SOCKET_FILE: &str = "nbd.sock";
/// Control socket inside a pool directory.
pub const CONTROL_SOCKET_FILE: &str = "control.sock";

/// The `--pool DIR` argument every management command takes.
#[derive(clap::Args, Debug, Clone)]
pub struct PoolArg {
    /// Pool directory [default: $THINPOOL_POOL, else ./thinpool-pool].
    #[arg(long = "pool", value_name = "DIR")]
    pub pool: Option<PathBuf>,
}

/// Where the pool directory is and how it was chosen.
#[derive(Clone, Debug)]
pub struct PoolDir {
    /// The directory.
    pub path: PathBuf,
    /// Neither `--pool` nor `$THINPOOL_POOL` named it.
    pub is_default: bool,
}

impl PoolArg {
    /// Resolves the directory: `--pool`, else `$THINPOOL_POOL`, else `./thinpool-pool`.
    pub fn resolve(&self) -> PoolDir {
        if let Some(path) = &self.pool {
            return PoolDir {
                path: path.clone(),
                is_default: false,
            };
        }
        match std::env::var_os(POOL_VARIABLE) {
            Some(value) if !value.is_empty() => PoolDir {
                path: PathBuf::from(value),
                is_default: false,
            },
            _ => PoolDir {
                path: PathBuf::from(DEFAULT_POOL_DIR),
                is_default: true,
            },
        }
    }
}

impl PoolDir {
    /// The options file.
    pub fn options_path(&self) -> PathBuf {
        self.path.join(OPTIONS_FILE)
    }

    /// The control socket.
    pub fn control_socket(&self) -> PathBuf {
        self.path.join(CONTROL_SOCKET_FILE)
    }

    /// The default NBD socket.
    pub fn nbd_socket(&self) -> PathBuf {
        self.path.join(NBD_SOCKET_FILE)
    }

    /// Fails with a hint unless the directory holds a pool.
    pub fn require_pool(&self) -> anyhow::Result<()> {
        if !thin_pool::Pool::exists(&self.path) {
            bail!(
                "no pool in {} (create one with `thinpool create --pool {}`)",
                self.path.display(),
                self.path.display()
            );
        }
        Ok(())
    }
}

/// Pool options chosen at create that every later open must use, kept in `pool.json`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredOptions {
    /// Format version of this file.
    pub version: u32,
    /// Zero the unwritten part of a newly provisioned block (off with `--no-zero`).
    pub zero_new_blocks: bool,
    /// Fail writes at once when out of data space instead of queueing them.
    pub error_if_no_space: bool,
}

impl Default for StoredOptions {
    fn default() -> Self {
        StoredOptions {
            version: 1,
            zero_new_blocks: true,
            error_if_no_space: false,
        }
    }
}

impl StoredOptions {
    /// Reads `pool.json`; a pool without one (made by an older binary or by hand) gets the
    /// defaults.
    pub fn load(dir: &PoolDir) -> anyhow::Result<StoredOptions> {
        let path = dir.options_path();
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                return Ok(StoredOptions::default())
            }
            Err(error) => {
                return Err(error).with_context(|| format!("cannot read {}", path.display()))
            }
        };
        let options: StoredOptions = serde_json::from_str(&text)
            .with_context(|| format!("{} is not a valid options file", path.display()))?;
        if options.version != 1 {
            bail!(
                "{}: options version {} is not supported (expected 1)",
                path.display(),
                options.version
            );
        }
        Ok(options)
    }

    /// Writes `pool.json` durably (temporary file, fsync, rename, fsync of the directory).
    pub fn store(&self, dir: &PoolDir) -> anyhow::Result<()> {
        let path = dir.options_path();
        let temporary = dir.path.join(format!("{OPTIONS_FILE}.tmp"));
        let text = serde_json::to_string_pretty(self).context("cannot encode pool options")?;
        let write = || -> std::io::Result<()> {
            let mut file = std::fs::File::create(&temporary)?;
            file.write_all(text.as_bytes())?;
            file.write_all(b"\n")?;
            file.sync_all()?;
            std::fs::rename(&temporary, &path)?;
            std::fs::File::open(&dir.path)?.sync_all()
        };
        write().with_context(|| format!("cannot write {}", path.display()))
    }

    /// The engine options for an open.
    pub fn pool_options(&self) -> PoolOptions {
        PoolOptions {
            zero_new_blocks: self.zero_new_blocks,
            error_if_no_space: self.error_if_no_space,
            ..PoolOptions::default()
        }
    }
}

/// Parses a size: a number of bytes, optionally with a binary suffix `K`, `M`, `G` or `T`
/// (also `KiB`, `KB`, lower case), e.g. `512`, `64K`, `1.5G`. Fractions are allowed with a
/// suffix; the result must be a whole number of bytes.
pub fn parse_size(text: &str) -> anyhow::Result<u64> {
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(trimmed.len());
    let (number, suffix) = trimmed.split_at(split);
    let shift = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => bail!("size {text:?}: unknown suffix {suffix:?} (use K, M, G or T)"),
    };
    if number.is_empty() {
        bail!("size {text:?} has no number");
    }
    let unit = 1u64 << shift;
    let bytes = match number.split_once('.') {
        None => number
            .parse::<u64>()
            .ok()
            .and_then(|whole| whole.checked_mul(unit)),
        Some((whole, fraction)) => {
            let whole: u64 = if whole.is_empty() {
                0
            } else {
                whole.parse().with_context(|| format!("size {text:?}"))?
            };
            if fraction.is_empty()
                || fraction.len() > 9
                || !fraction.bytes().all(|b| b.is_ascii_digit())
            {
                bail!("size {text:?}: bad fraction");
            }
            let denominator = 10u128.pow(fraction.len() as u32);
            let numerator = fraction.parse::<u128>().expect("digits") * u128::from(unit);
            if numerator % denominator != 0 {
                bail!("size {text:?} is not a whole number of bytes");
            }
            whole
                .checked_mul(unit)
                .and_then(|w| w.checked_add((numerator / denominator) as u64))
        }
    };
    bytes.with_context(|| format!("size {text:?} is too large"))
}

/// A size for people: `512B`, `64.00KiB`, `1.50GiB`.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut unit = 0;
    let mut value = bytes as f64;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes}B")
    } else {
        format!("{value:.2}{}", UNITS[unit])
    }
}

/// `used` as a percentage of `total` (0 for an empty total).
pub fn percent(used: u64, total: u64) -> f64 {
    if total == 0 {
        0.0
    } else {
        used as f64 * 100.0 / total as f64
    }
}

/// Renders rows as left-aligned columns separated by two spaces (the last column unpadded);
/// columns named in `right` are right-aligned.
pub fn table(header: &[&str], rows: &[Vec<String>], right: &[usize]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (column, cell) in row.iter().enumerate() {
            widths[column] = widths[column].max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let header_row: Vec<String> = header.iter().map(|h| h.to_string()).collect();
    for row in std::iter::once(&header_row).chain(rows) {
        let mut line = String::new();
        for (column, cell) in row.iter().enumerate() {
            if column > 0 {
                line.push_str("  ");
            }
            let pad = widths[column] - cell.chars().count();
            if right.contains(&column) {
                line.push_str(&" ".repeat(pad));
                line.push_str(cell);
            } else {
                line.push_str(cell);
                if column + 1 < row.len() {
                    line.push_str(&" ".repeat(pad));
                }
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_size("512").unwrap(), 512);
        assert_eq!(parse_size("64K").unwrap(), 65536);
        assert_eq!(parse_size("64k").unwrap(), 65536);
        assert_eq!(parse_size("1M").unwrap(), 1 << 20);
        assert_eq!(parse_size("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_size("1T").unwrap(), 1 << 40);
        assert_eq!(parse_size("1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_size(" 3 M ").unwrap(), 3 << 20);
    }

    #[test]
    fn bad_sizes_are_refused() {
        for bad in ["", "G", "12X", "1.5", "0.3K", "99999999999T", "1..2G", "-1"] {
            assert!(parse_size(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn sizes_format_for_people() {
        assert_eq!(format_size(0), "0B");
        assert_eq!(format_size(512), "512B");
        assert_eq!(format_size(65536), "64.00KiB");
        assert_eq!(format_size(3 << 29), "1.50GiB");
    }

    #[test]
    fn tables_align() {
        let text = table(
            &["NAME", "SIZE", "RO"],
            &[vec!["a".into(), "1.00GiB".into(), "no".into()]],
            &[1],
        );
        assert_eq!(text, "NAME     SIZE  RO\na     1.00GiB  no\n");
    }
}

//! Metadata size estimates, as `thin_metadata_size` prints them: how large a metadata device
//! a pool of a given size, data block size and number of thin devices needs.
//!
//! This module owns the estimate ([`estimate`]), the size syntax of the tool's arguments
//! ([`parse_size_bytes`], [`Unit`]) and the text of its answer ([`format()`]). The `cli`
//! crate parses the command line and prints. Numbers, messages and output match
//! thin-provisioning-tools 1.1.0 (0.9.0 differs, see [`estimate`]).
//!
//! The estimate, in 4 KiB metadata blocks, for `n = pool size / data block size` (rounded
//! down) data blocks and `m` thin devices:
//!
//! ```text
//! blocks = ceil(n / 126) + m + 1        (mapping leaves half full; one block per device;
//!                                        the superblock) — added modulo 2^64, like the tool
//! size   = min(blocks, 4 161 600) × 4096 bytes
//! ```

use std::fmt;
use std::str::FromStr;

/// Size of a metadata block.
pub const METADATA_BLOCK_SIZE_BYTES: u64 = 4096;
/// Largest usable metadata device, in metadata blocks (255 bitmaps of 16 320 entries).
pub const METADATA_BLOCK_COUNT_MAX: u64 = 255 * 16_320;
/// Mappings per leaf the estimate assumes (a 252-entry leaf, half full).
const MAPPINGS_PER_LEAF: u64 = 126;
/// Data block sizes must be a multiple of this (128 sectors).
pub const DATA_BLOCK_SIZE_GRANULE_BYTES: u64 = 64 << 10;
/// Largest data block size (2 097 152 sectors).
pub const DATA_BLOCK_SIZE_MAX_BYTES: u64 = 1 << 30;

/// Why an estimate or a size argument was refused. Messages are the tool's own.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The data block size is zero or not a multiple of 64 KiB.
    #[error("block size must be a multiple of 64 KiB")]
    BlockSizeNotMultiple {
        /// The data block size given.
        data_block_size_bytes: u64,
    },
    /// The data block size is above 1 GiB.
    #[error("maximum block size is 1 GiB")]
    BlockSizeTooLarge {
        /// The data block size given.
        data_block_size_bytes: u64,
    },
    /// The pool is smaller than one data block.
    #[error("pool size must be larger than block size")]
    PoolTooSmall {
        /// The pool size given.
        pool_size_bytes: u64,
        /// The data block size given.
        data_block_size_bytes: u64,
    },
    /// A size argument has no digits before its unit.
    #[error("cannot parse integer from empty string")]
    EmptyNumber,
    /// A size argument's number does not fit in 64 bits.
    #[error("number too large to fit in target type")]
    NumberTooLarge,
    /// A size argument's number times its unit does not fit in 64 bits.
    #[error("value out of bounds")]
    SizeOutOfBounds,
    /// A unit letter outside `bskKmMgGtTpPeE`, or more than one letter.
    #[error("Invalid unit specifier")]
    InvalidUnit,
}

/// What to estimate for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Data block size (`-b`).
    pub data_block_size_bytes: u64,
    /// Pool (data device) size (`-s`).
    pub pool_size_bytes: u64,
    /// Maximum number of thin devices and snapshots (`-m`).
    pub thin_count_max: u64,
}

/// The metadata size `thin_metadata_size` 1.1.0 recommends for `request`, in bytes (a
/// multiple of [`METADATA_BLOCK_SIZE_BYTES`]).
///
/// Checks, in this order: the block size is a non-zero multiple of 64 KiB, at most 1 GiB,
/// and not larger than the pool. 0.9.0 computes a different, fractional estimate, usually
/// one block (4096 bytes) less.
pub fn estimate(request: &Request) -> Result<u64, Error> {
    let block_size_bytes = request.data_block_size_bytes;
    if block_size_bytes == 0 || !block_size_bytes.is_multiple_of(DATA_BLOCK_SIZE_GRANULE_BYTES) {
        return Err(Error::BlockSizeNotMultiple {
            data_block_size_bytes: block_size_bytes,
        });
    }
    if block_size_bytes > DATA_BLOCK_SIZE_MAX_BYTES {
        return Err(Error::BlockSizeTooLarge {
            data_block_size_bytes: block_size_bytes,
        });
    }
    if request.pool_size_bytes < block_size_bytes {
        return Err(Error::PoolTooSmall {
            pool_size_bytes: request.pool_size_bytes,
            data_block_size_bytes: block_size_bytes,
        });
    }
    let data_block_count = request.pool_size_bytes / block_size_bytes;
    let leaf_count = data_block_count.div_ceil(MAPPINGS_PER_LEAF);
    // The tool adds modulo 2^64: a huge thin count wraps around instead of saturating.
    let block_count = leaf_count
        .wrapping_add(request.thin_count_max)
        .wrapping_add(1)
        .min(METADATA_BLOCK_COUNT_MAX);
    Ok(block_count * METADATA_BLOCK_SIZE_BYTES)
}

/// A unit letter of the tool: lower case binary (powers of 1024), upper case decimal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// `b`
    Byte,
    /// `s`, 512 bytes (the default).
    Sector,
    /// `k`
    Kibibyte,
    /// `K`
    Kilobyte,
    /// `m`
    Mebibyte,
    /// `M`
    Megabyte,
    /// `g`
    Gibibyte,
    /// `G`
    Gigabyte,
    /// `t`
    Tebibyte,
    /// `T`
    Terabyte,
    /// `p`
    Pebibyte,
    /// `P`
    Petabyte,
    /// `e`
    Exbibyte,
    /// `E`
    Exabyte,
}

impl Unit {
    /// Every unit.
    pub const ALL: [Unit; 14] = [
        Unit::Byte,
        Unit::Sector,
        Unit::Kibibyte,
        Unit::Kilobyte,
        Unit::Mebibyte,
        Unit::Megabyte,
        Unit::Gibibyte,
        Unit::Gigabyte,
        Unit::Tebibyte,
        Unit::Terabyte,
        Unit::Pebibyte,
        Unit::Petabyte,
        Unit::Exbibyte,
        Unit::Exabyte,
    ];

    /// The unit named by `letter`.
    pub fn from_letter(letter: char) -> Option<Unit> {
        Unit::ALL.into_iter().find(|unit| unit.letter() == letter)
    }

    /// The letter naming the unit.
    pub fn letter(self) -> char {
        match self {
            Unit::Byte => 'b',
            Unit::Sector => 's',
            Unit::Kibibyte => 'k',
            Unit::Kilobyte => 'K',
            Unit::Mebibyte => 'm',
            Unit::Megabyte => 'M',
            Unit::Gibibyte => 'g',
            Unit::Gigabyte => 'G',
            Unit::Tebibyte => 't',
            Unit::Terabyte => 'T',
            Unit::Pebibyte => 'p',
            Unit::Petabyte => 'P',
            Unit::Exbibyte => 'e',
            Unit::Exabyte => 'E',
        }
    }

    /// The size of one unit.
    pub fn size_bytes(self) -> u64 {
        match self {
            Unit::Byte => 1,
            Unit::Sector => 512,
            Unit::Kibibyte => 1 << 10,
            Unit::Kilobyte => 1_000,
            Unit::Mebibyte => 1 << 20,
            Unit::Megabyte => 1_000_000,
            Unit::Gibibyte => 1 << 30,
            Unit::Gigabyte => 1_000_000_000,
            Unit::Tebibyte => 1 << 40,
            Unit::Terabyte => 1_000_000_000_000,
            Unit::Pebibyte => 1 << 50,
            Unit::Petabyte => 1_000_000_000_000_000,
            Unit::Exbibyte => 1 << 60,
            Unit::Exabyte => 1_000_000_000_000_000_000,
        }
    }

    /// The plural name the tool prints. 1.1.0 calls `t` "terabytes" too, and so do we.
    pub fn plural_name(self) -> &'static str {
        match self {
            Unit::Byte => "bytes",
            Unit::Sector => "sectors",
            Unit::Kibibyte => "kibibytes",
            Unit::Kilobyte => "kilobytes",
            Unit::Mebibyte => "mebibytes",
            Unit::Megabyte => "megabytes",
            Unit::Gibibyte => "gibibytes",
            Unit::Gigabyte => "gigabytes",
            Unit::Tebibyte | Unit::Terabyte => "terabytes",
            Unit::Pebibyte => "pebibytes",
            Unit::Petabyte => "petabytes",
            Unit::Exbibyte => "exbibytes",
            Unit::Exabyte => "exabytes",
        }
    }
}

impl FromStr for Unit {
    type Err = Error;

    /// Exactly one unit letter (the `-u` argument).
    fn from_str(text: &str) -> Result<Unit, Error> {
        let mut letters = text.chars();
        match (letters.next(), letters.next()) {
            (Some(letter), None) => Unit::from_letter(letter).ok_or(Error::InvalidUnit),
            _ => Err(Error::InvalidUnit),
        }
    }
}

impl fmt::Display for Unit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.letter())
    }
}

/// Parses a size argument (`-b`, `-s`): decimal digits, then an optional unit letter
/// (sectors if none). Errors, in the tool's order: no digits, number too large, bad unit,
/// product too large.
pub fn parse_size_bytes(text: &str) -> Result<u64, Error> {
    let digits_end = text
        .find(|character: char| !character.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, suffix) = text.split_at(digits_end);
    if digits.is_empty() {
        return Err(Error::EmptyNumber);
    }
    let number: u64 = digits.parse().map_err(|_| Error::NumberTooLarge)?;
    let unit = if suffix.is_empty() {
        Unit::Sector
    } else {
        suffix.parse()?
    };
    number
        .checked_mul(unit.size_bytes())
        .ok_or(Error::SizeOutOfBounds)
}

/// How the answer is printed (`-n` and its optional value).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OutputStyle {
    /// `1073232 sectors` (no `-n`).
    #[default]
    Full,
    /// `1073232` (`-n`).
    NumericOnly,
    /// `1073232s` (`-n=short`).
    NumericShort,
    /// `1073232sectors` (`-n=long`).
    NumericLong,
}

/// The line `thin_metadata_size` prints for `size_bytes` in `unit` (without the newline).
///
/// A whole number of units prints as an integer; otherwise a value of at least 1 prints
/// with two decimals (`524.04`) and a smaller one in full (`0.5117568969726563`).
pub fn format(size_bytes: u64, unit: Unit, style: OutputStyle) -> String {
    let unit_bytes = unit.size_bytes();
    let value = if size_bytes.is_multiple_of(unit_bytes) {
        (size_bytes / unit_bytes).to_string()
    } else {
        // Precision loss is what the tool shows too: it divides as f64.
        let value = size_bytes as f64 / unit_bytes as f64;
        if value >= 1.0 {
            std::format!("{value:.2}")
        } else {
            std::format!("{value}")
        }
    };
    match style {
        OutputStyle::Full => std::format!("{value} {}", unit.plural_name()),
        OutputStyle::NumericOnly => value,
        OutputStyle::NumericShort => std::format!("{value}{}", unit.letter()),
        OutputStyle::NumericLong => std::format!("{value}{}", unit.plural_name()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(block: &str, pool: &str, thins: u64) -> Request {
        Request {
            data_block_size_bytes: parse_size_bytes(block).unwrap(),
            pool_size_bytes: parse_size_bytes(pool).unwrap(),
            thin_count_max: thins,
        }
    }

    #[test]
    fn estimate_matches_observed_values() {
        // (block, pool, thins, bytes) observed from thin_metadata_size 1.1.0.
        for (block, pool, thins, bytes) in [
            ("64k", "1t", 1000, 549_494_784),
            ("64k", "1m", 1, 12_288),
            ("64k", "1g", 0, 1056 * 512),
            ("64k", "1G", 1, 992 * 512),
            ("1g", "1t", 1, 88 * 512),
            ("64k", "100k", 1, 24 * 512),
            ("64k", "1p", 1, 17_045_913_600),
            ("64k", "1g", u64::MAX, 1048 * 512),
            ("64k", "1g", u64::MAX - 1, 532_480),
            ("64k", "1g", 1 << 52, 33_292_800 * 512),
        ] {
            assert_eq!(
                estimate(&request(block, pool, thins)),
                Ok(bytes),
                "-b {block} -s {pool} -m {thins}"
            );
        }
    }

    #[test]
    fn leaf_boundaries() {
        for (blocks, metadata_blocks) in [(1, 3), (126, 3), (127, 4), (252, 4), (253, 5)] {
            let pool = format!("{}s", blocks * 128);
            assert_eq!(
                estimate(&request("128", &pool, 1)),
                Ok(metadata_blocks * 4096)
            );
        }
    }

    #[test]
    fn refusals_in_the_tools_order() {
        let check = |block: &str, pool: &str| estimate(&request(block, pool, 1)).unwrap_err();
        assert!(matches!(
            check("64", "0"),
            Error::BlockSizeNotMultiple { .. }
        ));
        assert!(matches!(
            check("0", "1g"),
            Error::BlockSizeNotMultiple { .. }
        ));
        assert!(matches!(
            check("1G", "1p"),
            Error::BlockSizeNotMultiple { .. }
        ));
        assert!(matches!(check("2g", "1p"), Error::BlockSizeTooLarge { .. }));
        assert!(matches!(check("128k", "64k"), Error::PoolTooSmall { .. }));
        assert_eq!(
            Error::PoolTooSmall {
                pool_size_bytes: 0,
                data_block_size_bytes: 1
            }
            .to_string(),
            "pool size must be larger than block size"
        );
    }

    #[test]
    fn size_arguments() {
        assert_eq!(parse_size_bytes("128"), Ok(65_536));
        assert_eq!(parse_size_bytes("01g"), Ok(1 << 30));
        assert_eq!(parse_size_bytes("1K"), Ok(1_000));
        assert_eq!(parse_size_bytes("1e"), Ok(1 << 60));
        assert_eq!(parse_size_bytes("g"), Err(Error::EmptyNumber));
        assert_eq!(parse_size_bytes(""), Err(Error::EmptyNumber));
        assert_eq!(parse_size_bytes("+64k"), Err(Error::EmptyNumber));
        assert_eq!(parse_size_bytes("x"), Err(Error::EmptyNumber));
        assert_eq!(
            parse_size_bytes("99999999999999999999x"),
            Err(Error::NumberTooLarge)
        );
        assert_eq!(parse_size_bytes("1.5g"), Err(Error::InvalidUnit));
        assert_eq!(parse_size_bytes("64kb"), Err(Error::InvalidUnit));
        assert_eq!(parse_size_bytes("1S"), Err(Error::InvalidUnit));
        assert_eq!(parse_size_bytes("16e"), Err(Error::SizeOutOfBounds));
        assert_eq!(parse_size_bytes("18446744073709551615b"), Ok(u64::MAX));
    }

    #[test]
    fn output_formats() {
        let bytes = 549_494_784;
        assert_eq!(
            format(bytes, Unit::Sector, OutputStyle::Full),
            "1073232 sectors"
        );
        assert_eq!(
            format(bytes, Unit::Mebibyte, OutputStyle::Full),
            "524.04 mebibytes"
        );
        assert_eq!(
            format(bytes, Unit::Kilobyte, OutputStyle::NumericOnly),
            "549494.78"
        );
        assert_eq!(
            format(bytes, Unit::Gibibyte, OutputStyle::NumericShort),
            "0.5117568969726563g"
        );
        assert_eq!(
            format(bytes, Unit::Tebibyte, OutputStyle::NumericLong),
            "0.0004997625946998596terabytes"
        );
        assert_eq!(
            format(bytes, Unit::Exbibyte, OutputStyle::Full),
            "0.0000000004766107508658024 exbibytes"
        );
        assert_eq!(
            format(1_572_864, Unit::Mebibyte, OutputStyle::Full),
            "1.50 mebibytes"
        );
        assert_eq!(
            format(1_179_648, Unit::Mebibyte, OutputStyle::Full),
            "1.12 mebibytes"
        );
        assert_eq!(
            format(524_288, Unit::Mebibyte, OutputStyle::Full),
            "0.5 mebibytes"
        );
    }

    #[test]
    fn unit_letters_round_trip() {
        for unit in Unit::ALL {
            assert_eq!(unit.to_string().parse::<Unit>(), Ok(unit));
        }
        assert_eq!("".parse::<Unit>(), Err(Error::InvalidUnit));
        assert_eq!("kk".parse::<Unit>(), Err(Error::InvalidUnit));
        assert_eq!("z".parse::<Unit>(), Err(Error::InvalidUnit));
    }
}

//! Sizes and tables as the commands parse and print them: sizes with K/M/G/T suffixes, the
//! human form of a byte count, percentages, aligned tables (`list`, `status`, the volume
//! commands).

use anyhow::{bail, Context};

/// Parses a size: a number of bytes, optionally with a binary suffix `K`, `M`, `G` or `T`
/// (also `KiB`, `KB`, lower case), e.g. `512`, `64K`, `1.5G`. Fractions are allowed with a
/// suffix; the result must be a whole number of bytes. Each way to get it wrong has its
/// own message: a negative size, no number, an unknown suffix, a bad fraction, a size too
/// large for 64 bits.
pub fn parse_size(text: &str) -> anyhow::Result<u64> {
    let trimmed = text.trim();
    if let Some(rest) = trimmed.strip_prefix('-') {
        bail!("size {text:?} is negative: give a size in bytes, e.g. {rest}");
    }
    if let Some(rest) = trimmed.strip_prefix('+') {
        bail!("size {text:?}: give the size without a sign, e.g. {rest}");
    }
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
        _ => {
            bail!("size {text:?}: unknown suffix {suffix:?} (use K, M, G or T, or none for bytes)")
        }
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
    bytes.with_context(|| format!("size {text:?} is too large (more than 2^64 bytes)"))
}

/// [`parse_size`] for a size that must not be zero (a volume's, a pool's, a block's).
pub fn parse_size_nonzero(text: &str) -> anyhow::Result<u64> {
    let bytes = parse_size(text)?;
    if bytes == 0 {
        bail!("size {text:?} is zero: give a size greater than 0, e.g. 1G");
    }
    Ok(bytes)
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
    fn each_bad_size_says_what_is_wrong() {
        let message = |text: &str| format!("{:#}", parse_size_nonzero(text).unwrap_err());
        assert!(message("-5G").contains("negative"), "{}", message("-5G"));
        assert!(message("+5G").contains("without a sign"));
        assert!(message("0").contains("zero"));
        assert!(message("0G").contains("zero"));
        assert!(message("5X").contains("unknown suffix"));
        assert!(message("99999999999T").contains("too large"));
        assert!(message("184467440737095516160").contains("too large"));
        assert_eq!(parse_size_nonzero("5G").unwrap(), 5 << 30);
        assert_eq!(parse_size("0").unwrap(), 0);
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

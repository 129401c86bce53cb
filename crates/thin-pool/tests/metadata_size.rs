//! Goal: `metadata_size` gives the numbers, messages and output text of the real
//! `thin_metadata_size` 1.1.0.
//!
//! Method: run the real tool over a grid of block sizes, pool sizes and thin counts, over
//! every unit and output style, over malformed arguments, and over seeded random arguments
//! (`THINPOOL_SEED`, printed on failure); compute the same with the library and compare the
//! output line (or the error message) exactly.

use rand::Rng;
use testkit::ThinTools;
use thin_pool::format::metadata_size::{self, OutputStyle, Request, Unit};

/// What the library says for these arguments: `Ok(line)` or `Err(message)`.
fn ours(
    block: &str,
    pool: &str,
    thins: u64,
    unit: Unit,
    style: OutputStyle,
) -> Result<String, String> {
    let data_block_size_bytes =
        metadata_size::parse_size_bytes(block).map_err(|e| e.to_string())?;
    let pool_size_bytes = metadata_size::parse_size_bytes(pool).map_err(|e| e.to_string())?;
    let size_bytes = metadata_size::estimate(&Request {
        data_block_size_bytes,
        pool_size_bytes,
        thin_count_max: thins,
    })
    .map_err(|e| e.to_string())?;
    Ok(metadata_size::format(size_bytes, unit, style))
}

/// What the real tool says: `Ok(line)` or `Err(message)` (clap's prefix removed).
fn theirs(
    tools: &ThinTools,
    block: &str,
    pool: &str,
    thins: u64,
    unit: Unit,
    style: OutputStyle,
) -> Result<String, String> {
    let thins = thins.to_string();
    let unit = unit.to_string();
    let mut args = vec!["-b", block, "-s", pool, "-m", &thins, "-u", &unit];
    match style {
        OutputStyle::Full => {}
        OutputStyle::NumericOnly => args.push("-n"),
        OutputStyle::NumericShort => args.push("-n=short"),
        OutputStyle::NumericLong => args.push("-n=long"),
    }
    let output = tools.run("thin_metadata_size", &args);
    if output.success() {
        let line = output.stdout.strip_suffix('\n');
        return Ok(line
            .unwrap_or_else(|| panic!("no final newline: {output}"))
            .to_owned());
    }
    let message = output.stderr.lines().next().unwrap_or_default();
    // clap: "error: invalid value '1x' for '--pool-size <SIZE[bskmgtp]>': Invalid unit specifier"
    let message = match message.strip_prefix("error: invalid value ") {
        Some(rest) => rest.rsplit_once("': ").map_or(rest, |(_, reason)| reason),
        None => message,
    };
    Err(message.to_owned())
}

fn compare(tools: &ThinTools, block: &str, pool: &str, thins: u64, unit: Unit, style: OutputStyle) {
    assert_eq!(
        ours(block, pool, thins, unit, style),
        theirs(tools, block, pool, thins, unit, style),
        "thin_metadata_size -b {block} -s {pool} -m {thins} -u {unit} ({style:?})"
    );
}

#[test]
fn grid_of_sizes_matches_the_tool() {
    let tools = ThinTools::v1_1();
    for block in ["64k", "128", "192k", "1m", "4m", "65536b", "1g"] {
        for pool in [
            "1m",
            "100m",
            "1g",
            "10G",
            "1t",
            "3t",
            "16t",
            "1p",
            "1e",
            "12345678s",
        ] {
            for thins in [0, 1, 10, 1000, 100_000, u64::MAX] {
                compare(&tools, block, pool, thins, Unit::Sector, OutputStyle::Full);
            }
        }
    }
}

#[test]
fn every_unit_and_style_matches_the_tool() {
    let tools = ThinTools::v1_1();
    let styles = [
        OutputStyle::Full,
        OutputStyle::NumericOnly,
        OutputStyle::NumericShort,
        OutputStyle::NumericLong,
    ];
    for (block, pool, thins) in [
        ("64k", "1t", 1000),
        ("64k", "1m", 1),
        ("64k", "3g", 7),
        ("1m", "1p", 5),
    ] {
        for unit in Unit::ALL {
            for style in styles {
                compare(&tools, block, pool, thins, unit, style);
            }
        }
    }
}

#[test]
fn refusals_match_the_tool() {
    let tools = ThinTools::v1_1();
    for (block, pool) in [
        ("64", "1g"),
        ("0", "1g"),
        ("96k", "1g"),
        ("1G", "1p"),
        ("2g", "1t"),
        ("1e", "1p"),
        ("3000000000b", "1p"),
        ("64k", "0"),
        ("128k", "64k"),
        ("64k", "1000b"),
        ("64k", "1.5g"),
        ("64k", "1x"),
        ("64kb", "1g"),
        ("64k", "g"),
        ("+64k", "1g"),
        ("64k", "16e"),
        ("64k", "18446744073709551615s"),
        ("64k", "18446744073709551616b"),
        ("64k", "0x10"),
    ] {
        compare(&tools, block, pool, 1, Unit::Sector, OutputStyle::Full);
    }
}

#[test]
fn random_arguments_match_the_tool() {
    let tools = ThinTools::v1_1();
    let (_report, mut rng) = testkit::seeded_rng();
    let letters = ['b', 's', 'k', 'm', 'g', 't', 'K', 'M', 'G', 'T'];
    for _ in 0..testkit::case_count(150) {
        let block = if rng.gen_bool(0.9) {
            format!("{}k", 64 * rng.gen_range(1..=16_384u64))
        } else {
            format!("{}s", rng.gen_range(0..5_000u64))
        };
        let pool = format!(
            "{}{}",
            rng.gen_range(0..100_000u64),
            letters[rng.gen_range(0..letters.len())]
        );
        let thins = match rng.gen_range(0..4) {
            0 => rng.gen(),
            1 => rng.gen_range(0..10),
            _ => rng.gen_range(0..5_000_000),
        };
        let unit = Unit::ALL[rng.gen_range(0..Unit::ALL.len())];
        compare(&tools, &block, &pool, thins, unit, OutputStyle::Full);
    }
}

//! `thin_delta` 1.1.0's XML for a diff ([`write_xml`]).

use super::{DeltaHeader, DeltaKind, DeltaRange};
use std::io::Write;

/// Print a diff as `thin_delta` 1.1.0 prints it, no newline after the last line. `ranges`
/// must list `same` ranges for the output to match.
///
/// The default form gives each range one element; `verbose` (`thin_delta --verbose`)
/// groups consecutive ranges of one kind in one element, each a `<range>` with the data
/// block its first block maps to (`data_begin`, or `left_data_begin` and
/// `right_data_begin` for `different`).
pub fn write_xml(
    out: &mut dyn Write,
    header: &DeltaHeader,
    left_id: u32,
    right_id: u32,
    ranges: &[DeltaRange],
    verbose: bool,
) -> std::io::Result<()> {
    writeln!(
        out,
        "<superblock uuid=\"\" time=\"{}\" transaction=\"{}\" data_block_size=\"{}\" nr_data_blocks=\"{}\">",
        header.time, header.transaction_id, header.data_block_size_sectors, header.data_block_count
    )?;
    writeln!(out, "  <diff left=\"{left_id}\" right=\"{right_id}\">")?;
    if verbose {
        write_verbose_ranges(out, ranges)?;
    } else {
        for range in ranges {
            writeln!(
                out,
                "    <{} begin=\"{}\" length=\"{}\"/>",
                range.kind.xml_name(),
                range.begin,
                range.length
            )?;
        }
    }
    writeln!(out, "  </diff>")?;
    write!(out, "</superblock>")
}

/// The ranges of `thin_delta --verbose`: a run of one kind in one element.
fn write_verbose_ranges(out: &mut dyn Write, ranges: &[DeltaRange]) -> std::io::Result<()> {
    let data = |block: Option<u64>| block.map_or_else(|| "?".to_string(), |b| b.to_string());
    for run in ranges.chunk_by(|a, b| a.kind == b.kind) {
        let name = run[0].kind.xml_name();
        writeln!(out, "    <{name}>")?;
        for range in run {
            let data_begin = match range.kind {
                DeltaKind::Different => format!(
                    "left_data_begin=\"{}\" right_data_begin=\"{}\"",
                    data(range.left_data_begin),
                    data(range.right_data_begin)
                ),
                DeltaKind::RightOnly => format!("data_begin=\"{}\"", data(range.right_data_begin)),
                DeltaKind::Same | DeltaKind::LeftOnly => {
                    format!("data_begin=\"{}\"", data(range.left_data_begin))
                }
            };
            writeln!(
                out,
                "      <range begin=\"{}\" {data_begin} length=\"{}\"/>",
                range.begin, range.length
            )?;
        }
        writeln!(out, "    </{name}>")?;
    }
    Ok(())
}

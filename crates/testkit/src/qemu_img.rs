//! `qemu-img` as a test client of an NBD server (Debian package `qemu-utils`): `map`,
//! `convert` and `compare` on raw images named by URI or path, each run with a timeout and
//! required to succeed.

use std::path::Path;
use std::time::Duration;

use crate::process::run_ok;

/// How long one `qemu-img` run may take.
pub const TIMEOUT: Duration = Duration::from_secs(120);

/// `qemu-img map --output=json` of a raw image: `(start, length, data)` entries, adjacent
/// entries of the same kind merged.
pub fn map(image: &str) -> Vec<(u64, u64, bool)> {
    let output = run_ok(
        "qemu-img",
        &["map", "--output=json", "-f", "raw", image],
        TIMEOUT,
    );
    let mut entries: Vec<(u64, u64, bool)> = Vec::new();
    for line in output.lines().filter(|line| line.contains("\"start\"")) {
        let start = json_field(line, "start").parse().expect("numeric start");
        let length: u64 = json_field(line, "length").parse().expect("numeric length");
        let data = json_field(line, "data") == "true";
        match entries.last_mut() {
            Some(last) if last.2 == data && last.0 + last.1 == start => last.1 += length,
            _ => entries.push((start, length, data)),
        }
    }
    entries
}

/// The ranges `(start, length)` that [`map`] reports as data.
pub fn data_extents(image: &str) -> Vec<(u64, u64)> {
    map(image)
        .into_iter()
        .filter(|entry| entry.2)
        .map(|(start, length, _)| (start, length))
        .collect()
}

/// The value of `"key": value` in one line of qemu-img's JSON (one object per line).
fn json_field<'a>(line: &'a str, key: &str) -> &'a str {
    let label = format!("\"{key}\": ");
    let at = line
        .find(&label)
        .unwrap_or_else(|| panic!("no {key:?} in qemu-img output line {line:?}"))
        + label.len();
    let rest = &line[at..];
    rest[..rest.find([',', '}']).unwrap_or(rest.len())].trim()
}

/// `qemu-img convert -n`: copies raw `from` into the existing raw `to` (same size).
pub fn convert_into(from: &str, to: &str) {
    run_ok(
        "qemu-img",
        &["convert", "-n", "-f", "raw", "-O", "raw", from, to],
        TIMEOUT,
    );
}

/// `qemu-img convert`: copies raw `from` into a new raw file `to`.
pub fn convert_to_file(from: &str, to: &Path) {
    let to = to.to_str().expect("a UTF-8 path");
    run_ok(
        "qemu-img",
        &["convert", "-f", "raw", "-O", "raw", from, to],
        TIMEOUT,
    );
}

/// `qemu-img compare` of two raw images; fails the test if they differ.
pub fn compare(first: &str, second: &str) {
    run_ok(
        "qemu-img",
        &["compare", "-f", "raw", "-F", "raw", first, second],
        TIMEOUT,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_fields_are_read_from_one_line() {
        let line = r#"{ "start": 0, "length": 1048576, "depth": 0, "present": true, "zero": false, "data": true, "offset": 0},"#;
        assert_eq!(json_field(line, "start"), "0");
        assert_eq!(json_field(line, "length"), "1048576");
        assert_eq!(json_field(line, "data"), "true");
        assert_eq!(json_field(line, "offset"), "0");
    }
}

//! Goal: metadata written by the real `thin_restore` is read by us exactly as the real
//! `thin_dump` reads it, and metadata written by our restore is what the real tools expect.
//!
//! Method: for many seeds, a random dump — devices with random ids and details, single and
//! range mappings, data blocks shared between devices (snapshot-like copies and stray
//! duplicates), random times — is written twice: expanded (the 0.9.0 form) and with
//! `<def>`/`<ref>` for shared runs (the 1.x form; defs both above and below half a leaf).
//! Then:
//! - `thin_restore` 0.9.0 (expanded form) and 1.1.0 (both forms) write metadata, which our
//!   dump prints byte for byte like `thin_dump` 1.1.0, and which our checker accepts;
//! - our restore of the same XML gives metadata that both `thin_check` versions and our
//!   checker accept, that means the same mappings, and that `thin_dump` 1.1.0 prints exactly
//!   as it prints `thin_restore` 1.1.0's output of that XML, byte for byte — same shared
//!   leaves in the same blocks, so the same defs, refs and def names.
//!
//! Seeds: `THINPOOL_SEED` fixes the base seed; `THINPOOL_CASES` scales the case count
//! (default 100). A failure names the case's own seed.

use persistent_data::FileDevice;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Cursor;
use std::path::Path;
use std::sync::Arc;
use testkit::scratch::ScratchDir;
use testkit::tools::ThinTools;
use thin_pool::format::check::{check, CheckOptions};
use thin_pool::format::dump::expand::Expanded;
use thin_pool::format::dump::metadata::{dump, DumpOptions};
use thin_pool::format::dump::{xml, XmlWriter};

const DATA_BLOCKS: u64 = 200_000;
const METADATA_SIZE_BYTES: u64 = 8 << 20;
/// Each device's virtual space is split into regions; region k may hold def k.
const REGIONS: u64 = 4;
const REGION_BLOCKS: u64 = 2000;
const DEF_OFFSET: u64 = 500;

/// One piece of a device: inline mappings, or a reference to a def.
#[derive(Clone, Debug)]
enum Piece {
    Mappings(Vec<(u64, u64, u32)>),
    Ref(usize),
}

struct Dump {
    time: u32,
    transaction: u64,
    data_block_size: u32,
    defs: Vec<Vec<(u64, u64, u32)>>,
    /// dev id → (transaction, creation_time, snap_time, pieces)
    devices: BTreeMap<u32, (u64, u32, u32, Vec<Piece>)>,
}

fn random_mappings(
    rng: &mut StdRng,
    next_data: &mut u64,
    begin: u64,
    end: u64,
    time: u32,
) -> Vec<(u64, u64, u32)> {
    let mut out = Vec::new();
    let mut vb = begin + rng.gen_range(0..20);
    while vb < end {
        let length = match rng.gen_range(0..4) {
            0 => 1,
            1 => rng.gen_range(2..10),
            _ => rng.gen_range(10..300),
        }
        .min(end - vb);
        // Fresh data blocks: a data block mapped twice in one leaf is something neither the
        // kernel nor thin_restore 1.1.0 counts consistently. Sharing comes from copies.
        let data = *next_data;
        *next_data += length + rng.gen_range(0..3);
        let t = rng.gen_range(0..=time);
        for i in 0..length {
            out.push((vb + i, data + i, t));
        }
        vb += length + rng.gen_range(0..40);
    }
    out
}

fn random_dump(rng: &mut StdRng) -> Dump {
    let time = rng.gen_range(0..30);
    let mut next_data = rng.gen_range(0..1000);
    let defs: Vec<Vec<(u64, u64, u32)>> = (0..REGIONS)
        .map(|k| {
            let length = if rng.gen_bool(0.3) {
                rng.gen_range(10..126)
            } else {
                rng.gen_range(126..700)
            };
            let begin = k * REGION_BLOCKS + DEF_OFFSET;
            let data = next_data;
            next_data += length + 1;
            let t = rng.gen_range(0..=time);
            (0..length)
                .map(|i| {
                    // Mostly one run, sometimes broken up by time.
                    let t = if rng.gen_bool(0.01) {
                        rng.gen_range(0..=time)
                    } else {
                        t
                    };
                    (begin + i, data + i, t)
                })
                .collect()
        })
        .collect();
    let mut devices = BTreeMap::new();
    let device_count = rng.gen_range(1..6);
    // Per device, per slot (three per region: before, at and after the def's place).
    let mut previous: Vec<Vec<Option<Piece>>> = Vec::new();
    while devices.len() < device_count {
        let id = if rng.gen_bool(0.1) {
            rng.gen_range(0..(1u32 << 24))
        } else {
            rng.gen_range(0..40)
        };
        if devices.contains_key(&id) {
            continue;
        }
        let slots: Vec<Option<Piece>> = if !previous.is_empty() && rng.gen_bool(0.2) {
            // A snapshot-like copy of an earlier device.
            previous[rng.gen_range(0..previous.len())].clone()
        } else {
            (0..REGIONS * 3)
                .map(|slot| {
                    if !previous.is_empty() && rng.gen_bool(0.25) {
                        // Share this slot's mappings with an earlier device.
                        return previous[rng.gen_range(0..previous.len())][slot as usize].clone();
                    }
                    let base = (slot / 3) * REGION_BLOCKS;
                    let (begin, end) = match slot % 3 {
                        0 => (base, base + DEF_OFFSET - 20),
                        1 => (base + DEF_OFFSET, base + DEF_OFFSET + 700),
                        _ => (base + DEF_OFFSET + 720, base + REGION_BLOCKS),
                    };
                    match rng.gen_range(0..3) {
                        0 if slot % 3 == 1 => Some(Piece::Ref((slot / 3) as usize)),
                        0 | 1 => Some(Piece::Mappings(random_mappings(
                            rng,
                            &mut next_data,
                            begin,
                            end,
                            time,
                        ))),
                        _ => None,
                    }
                })
                .collect()
        };
        previous.push(slots.clone());
        let creation_time = rng.gen_range(0..=time);
        let snap_time = rng.gen_range(creation_time..=time);
        devices.insert(
            id,
            (
                rng.gen_range(0..1000),
                creation_time,
                snap_time,
                slots.into_iter().flatten().collect(),
            ),
        );
    }
    assert!(next_data < DATA_BLOCKS, "data blocks exhausted");
    Dump {
        time,
        transaction: rng.gen_range(0..1_000_000),
        data_block_size: 128 * rng.gen_range(1..5),
        defs,
        devices,
    }
}

fn push_runs(out: &mut String, mappings: &[(u64, u64, u32)]) {
    let mut i = 0;
    while i < mappings.len() {
        let (vb, db, t) = mappings[i];
        let mut length = 1;
        while i + length < mappings.len()
            && mappings[i + length] == (vb + length as u64, db + length as u64, t)
        {
            length += 1;
        }
        if length == 1 {
            writeln!(
                out,
                "    <single_mapping origin_block=\"{vb}\" data_block=\"{db}\" time=\"{t}\"/>"
            )
            .unwrap();
        } else {
            writeln!(out, "    <range_mapping origin_begin=\"{vb}\" data_begin=\"{db}\" length=\"{length}\" time=\"{t}\"/>").unwrap();
        }
        i += length;
    }
}

/// The dump as XML, with defs (1.x form) or expanded (0.9.0 form).
fn to_xml(dump: &Dump, with_defs: bool) -> String {
    let mut out = String::new();
    writeln!(out, "<superblock uuid=\"\" time=\"{}\" transaction=\"{}\" version=\"2\" data_block_size=\"{}\" nr_data_blocks=\"{DATA_BLOCKS}\">", dump.time, dump.transaction, dump.data_block_size).unwrap();
    let used: Vec<bool> = (0..dump.defs.len())
        .map(|k| {
            dump.devices
                .values()
                .any(|d| d.3.iter().any(|p| matches!(p, Piece::Ref(r) if *r == k)))
        })
        .collect();
    if with_defs {
        for (k, def) in dump.defs.iter().enumerate() {
            if used[k] {
                writeln!(out, "  <def name=\"def{k}\">").unwrap();
                push_runs(&mut out, def);
                writeln!(out, "  </def>").unwrap();
            }
        }
    }
    for (id, (transaction, creation_time, snap_time, pieces)) in &dump.devices {
        let mapped: usize = pieces
            .iter()
            .map(|p| match p {
                Piece::Mappings(m) => m.len(),
                Piece::Ref(k) => dump.defs[*k].len(),
            })
            .sum();
        writeln!(out, "  <device dev_id=\"{id}\" mapped_blocks=\"{mapped}\" transaction=\"{transaction}\" creation_time=\"{creation_time}\" snap_time=\"{snap_time}\">").unwrap();
        // Inline mappings next to each other print as one run sequence.
        let mut inline: Vec<(u64, u64, u32)> = Vec::new();
        for piece in pieces {
            match piece {
                Piece::Mappings(m) => inline.extend_from_slice(m),
                Piece::Ref(k) if with_defs => {
                    push_runs(&mut out, &inline);
                    inline.clear();
                    writeln!(out, "    <ref name=\"def{k}\"/>").unwrap();
                }
                Piece::Ref(k) => inline.extend_from_slice(&dump.defs[*k]),
            }
        }
        push_runs(&mut out, &inline);
        writeln!(out, "  </device>").unwrap();
    }
    out.push_str("</superblock>\n");
    out
}

fn model(dump: &Dump) -> BTreeMap<u32, BTreeMap<u64, (u64, u32)>> {
    dump.devices
        .iter()
        .map(|(&id, (_, _, _, pieces))| {
            let mut map = BTreeMap::new();
            for piece in pieces {
                let mappings = match piece {
                    Piece::Mappings(m) => m,
                    Piece::Ref(k) => &dump.defs[*k],
                };
                for &(vb, db, t) in mappings {
                    map.insert(vb, (db, t));
                }
            }
            (id, map)
        })
        .collect()
}

fn our_dump(path: &Path) -> String {
    let device = Arc::new(FileDevice::open(path, false).unwrap());
    let mut writer = XmlWriter::new(Vec::new());
    dump(device, &DumpOptions::default(), &mut writer).unwrap();
    String::from_utf8(writer.into_inner()).unwrap()
}

fn our_check(path: &Path, context: &str) {
    let device = Arc::new(FileDevice::open(path, false).unwrap());
    let report = check(device, &CheckOptions::default(), &mut |_| {});
    assert!(report.is_clean(), "{context}: our checker: {report:?}");
}

fn our_restore(xml: &Path, out: &Path) {
    testkit::sized_file(out, METADATA_SIZE_BYTES);
    let device = Arc::new(FileDevice::open(out, true).unwrap());
    let input = std::io::BufReader::new(std::fs::File::open(xml).unwrap());
    thin_pool::format::restore::restore(input, device, &Default::default()).unwrap();
}

fn run_case(index: u64, seed: u64, dir: &ScratchDir, v0: &ThinTools, v1: &ThinTools) {
    let context = format!("case {index} (case seed {seed})");
    let mut rng = StdRng::seed_from_u64(seed);
    let dump = random_dump(&mut rng);
    let expected = model(&dump);
    for with_defs in [false, true] {
        let xml_path = dir.join(format!("case-{index}-{with_defs}.xml"));
        std::fs::write(&xml_path, to_xml(&dump, with_defs)).unwrap();
        let context = format!("{context}, defs {with_defs}");

        // The real restores, read by our dump.
        let restorers: &[&ThinTools] = if with_defs { &[v1] } else { &[v0, v1] };
        let mut reference_dump = None;
        for tools in restorers {
            let theirs = dir.join(format!("case-{index}-{with_defs}-{}.bin", tools.version));
            tools
                .restore_sized(&xml_path, &theirs, METADATA_SIZE_BYTES)
                .assert_success();
            let their_dump = v1.dump(&theirs, &[]);
            assert_eq!(
                our_dump(&theirs),
                their_dump,
                "{context}: our dump of thin_restore {} output",
                tools.version
            );
            our_check(&theirs, &context);
            if tools.version == v1.version {
                reference_dump = Some(their_dump);
            }
            std::fs::remove_file(&theirs).unwrap();
        }

        // Our restore, read by the real tools.
        let ours = dir.join(format!("case-{index}-{with_defs}-ours.bin"));
        our_restore(&xml_path, &ours);
        for tools in [v0, v1] {
            let output = tools.check(&ours);
            assert!(output.success(), "{context}: our restore: {output}");
        }
        our_check(&ours, &context);
        let dumped = v1.dump(&ours, &[]);
        let mut expanded = Expanded::new();
        xml::parse(Cursor::new(dumped.as_bytes()), &mut expanded).unwrap();
        let got: BTreeMap<u32, BTreeMap<u64, (u64, u32)>> = expanded
            .devices
            .into_iter()
            .map(|(id, d)| (id, d.mappings))
            .collect();
        assert_eq!(got, expected, "{context}: mappings of our restore");
        assert_eq!(
            dumped,
            reference_dump.expect("1.1.0 restored"),
            "{context}: thin_dump of our restore vs of thin_restore 1.1.0"
        );
        std::fs::remove_file(&ours).unwrap();
        std::fs::remove_file(&xml_path).unwrap();
    }
}

#[test]
fn random_dumps_round_trip_through_both_restores() {
    let (v0, v1) = (ThinTools::v0_9(), ThinTools::v1_1());
    let dir = ScratchDir::new("backward-random-xml");
    // The 1.x tools spend about half a second in their progress reporter whatever the input,
    // so cases overlap on more threads than cores.
    testkit::seed::run_cases(100, 8, |index, seed| run_case(index, seed, &dir, &v0, &v1));
}

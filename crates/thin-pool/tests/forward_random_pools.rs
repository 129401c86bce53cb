//! Goal: metadata written by `PoolMetadata` is dm-thin metadata as the real tools see it, and
//! `thinpool dump` prints exactly what the real `thin_dump` prints for it.
//!
//! Method: for many seeds, a small pool on a file gets random operations — create, snapshot
//! (also of snapshots), delete, map ranges, unmap ranges, commit, reserve and release a
//! metadata snapshot — beside a model (a map per volume; a snapshot copies its origin's).
//! Then, on the final commit:
//! - `thin_check` 0.9.0 and 1.1.0 exit 0;
//! - `thin_dump` 1.1.0's XML, with its defs resolved, equals the model, and equals our dump
//!   byte for byte (also `--format human_readable`, `-m` when a metadata snapshot is held,
//!   and our 0.9.0 flavour against `thin_dump` 0.9.0);
//! - `thin_ls` 1.1.0's mapped/exclusive/shared counts per device equal the model's;
//! - `thin_delta` 1.1.0 between snapshot/origin pairs gives the model's differences.
//!
//! Seeds: `THINPOOL_SEED` fixes the base seed; `THINPOOL_CASES` scales the case count
//! (default 200). Cases run on eight threads (the tools mostly wait); a failure names the case's own seed.

use persistent_data::FileDevice;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, HashMap};
use std::io::Cursor;
use std::path::Path;
use std::sync::Arc;
use testkit::scratch::ScratchDir;
use testkit::tools::ThinTools;
use thin_pool::format::dump::expand::Expanded;
use thin_pool::format::dump::metadata::{dump, DumpOptions, Source};
use thin_pool::format::dump::{xml, Flavour, HumanWriter, XmlWriter};
use thin_pool::{PoolMetadata, VirtualBlock, VolumeId};

const DATA_BLOCKS: u64 = 30_000;
const METADATA_BLOCKS: u64 = 2048;
const VOLUMES_MAX: usize = 8;
const VIRTUAL_BLOCKS: u64 = 3000;

/// Virtual block → (data block, time), per volume.
type Model = BTreeMap<u32, BTreeMap<u64, (u64, u32)>>;

struct Case {
    model: Model,
    /// (origin, snapshot) pairs created.
    snapshots: Vec<(u32, u32)>,
    metadata_snap_held: bool,
}

fn random_workload(rng: &mut StdRng, md: &mut PoolMetadata) -> Case {
    let mut case = Case {
        model: Model::new(),
        snapshots: Vec::new(),
        metadata_snap_held: false,
    };
    let ops = rng.gen_range(10..60);
    for _ in 0..ops {
        let ids: Vec<u32> = case.model.keys().copied().collect();
        let pick = |rng: &mut StdRng| ids[rng.gen_range(0..ids.len())];
        let fresh_id = |rng: &mut StdRng, model: &Model| loop {
            let id = rng.gen_range(0..32u32);
            if !model.contains_key(&id) {
                return id;
            }
        };
        match rng.gen_range(0..100) {
            0..=11 if ids.len() < VOLUMES_MAX => {
                let id = fresh_id(rng, &case.model);
                md.create_thin(VolumeId::new(id)).unwrap();
                case.model.insert(id, BTreeMap::new());
            }
            12..=25 if !ids.is_empty() && ids.len() < VOLUMES_MAX => {
                let origin = pick(rng);
                let id = fresh_id(rng, &case.model);
                md.create_snap(VolumeId::new(id), VolumeId::new(origin))
                    .unwrap();
                let copy = case.model[&origin].clone();
                case.model.insert(id, copy);
                case.snapshots.push((origin, id));
            }
            26..=30 if !ids.is_empty() => {
                let id = pick(rng);
                md.delete(VolumeId::new(id)).unwrap();
                case.model.remove(&id);
            }
            31..=69 if !ids.is_empty() => {
                let id = pick(rng);
                let start = rng.gen_range(0..VIRTUAL_BLOCKS);
                let length = rng.gen_range(1..300u64);
                let stride = if rng.gen_bool(0.2) { 2 } else { 1 };
                if md.usage().data_used_blocks + length + 10 >= DATA_BLOCKS {
                    continue;
                }
                let time = md.time();
                for vb in (start..start + length).step_by(stride) {
                    let db = md.alloc_data_block().unwrap();
                    md.insert(VolumeId::new(id), VirtualBlock::new(vb), db)
                        .unwrap();
                    case.model
                        .get_mut(&id)
                        .unwrap()
                        .insert(vb, (db.get(), time));
                }
            }
            70..=81 if !ids.is_empty() => {
                let id = pick(rng);
                let start = rng.gen_range(0..VIRTUAL_BLOCKS);
                if rng.gen_bool(0.3) {
                    md.remove(VolumeId::new(id), VirtualBlock::new(start))
                        .unwrap();
                    case.model.get_mut(&id).unwrap().remove(&start);
                } else {
                    let end = start + rng.gen_range(1..400u64);
                    md.remove_range(
                        VolumeId::new(id),
                        VirtualBlock::new(start),
                        VirtualBlock::new(end),
                    )
                    .unwrap();
                    case.model
                        .get_mut(&id)
                        .unwrap()
                        .retain(|vb, _| !(start..end).contains(vb));
                }
            }
            82..=93 => md.commit().unwrap(),
            94..=99 => {
                if case.metadata_snap_held {
                    md.release_metadata_snap().unwrap();
                } else {
                    md.reserve_metadata_snap().unwrap();
                }
                case.metadata_snap_held = !case.metadata_snap_held;
            }
            _ => {}
        }
    }
    md.commit().unwrap();
    case
}

fn our_dump(path: &Path, options: &DumpOptions, human: bool) -> String {
    let device = Arc::new(FileDevice::open(path, false).unwrap());
    let bytes = if human {
        let mut writer = HumanWriter::with_flavour(Vec::new(), options.flavour);
        dump(device, options, &mut writer).unwrap();
        writer.into_inner()
    } else {
        let mut writer = XmlWriter::with_flavour(Vec::new(), options.flavour);
        dump(device, options, &mut writer).unwrap();
        writer.into_inner()
    };
    String::from_utf8(bytes).unwrap()
}

fn expand(text: &str) -> Expanded {
    let mut expanded = Expanded::new();
    xml::parse(Cursor::new(text.as_bytes()), &mut expanded).unwrap();
    expanded
}

/// DEV -> (mapped, exclusive, shared) as the model says: a mapping is exclusive when no other
/// mapping (of any volume) uses its data block.
fn model_usage(model: &Model) -> BTreeMap<u32, (u64, u64, u64)> {
    let mut users: HashMap<u64, u64> = HashMap::new();
    for mappings in model.values() {
        for &(db, _) in mappings.values() {
            *users.entry(db).or_default() += 1;
        }
    }
    model
        .iter()
        .map(|(&id, mappings)| {
            let exclusive = mappings.values().filter(|(db, _)| users[db] == 1).count() as u64;
            let mapped = mappings.len() as u64;
            (id, (mapped, exclusive, mapped - exclusive))
        })
        .collect()
}

fn tool_usage(text: &str) -> BTreeMap<u32, (u64, u64, u64)> {
    text.lines()
        .skip(1)
        .filter(|line| !line.trim().is_empty())
        .map(|line| {
            let fields: Vec<u64> = line
                .split_whitespace()
                .map(|f| f.parse().unwrap())
                .collect();
            (fields[0] as u32, (fields[1], fields[2], fields[3]))
        })
        .collect()
}

/// The non-verbose `thin_delta` ranges the model implies: (kind, begin, length).
fn model_delta(
    left: &BTreeMap<u64, (u64, u32)>,
    right: &BTreeMap<u64, (u64, u32)>,
) -> Vec<(String, u64, u64)> {
    let mut keys: Vec<u64> = left.keys().chain(right.keys()).copied().collect();
    keys.sort_unstable();
    keys.dedup();
    let mut ranges: Vec<(String, u64, u64)> = Vec::new();
    for vb in keys {
        let kind = match (left.get(&vb), right.get(&vb)) {
            (Some(l), Some(r)) if l.0 == r.0 => "same",
            (Some(_), Some(_)) => "different",
            (Some(_), None) => "left_only",
            (None, Some(_)) => "right_only",
            (None, None) => unreachable!(),
        };
        match ranges.last_mut() {
            Some((k, begin, length)) if k == kind && *begin + *length == vb => *length += 1,
            _ => ranges.push((kind.to_string(), vb, 1)),
        }
    }
    ranges
}

fn tool_delta(text: &str) -> Vec<(String, u64, u64)> {
    let attribute = |line: &str, name: &str| -> u64 {
        let at = line.find(&format!("{name}=\"")).unwrap() + name.len() + 2;
        let rest = &line[at..];
        rest[..rest.find('"').unwrap()].parse().unwrap()
    };
    text.lines()
        .map(str::trim)
        .filter(|line| {
            ["<same ", "<different ", "<left_only ", "<right_only "]
                .iter()
                .any(|p| line.starts_with(p))
        })
        .map(|line| {
            let kind = line[1..line.find(' ').unwrap()].to_string();
            (kind, attribute(line, "begin"), attribute(line, "length"))
        })
        .collect()
}

fn run_case(index: u64, seed: u64, dir: &ScratchDir, v0: &ThinTools, v1: &ThinTools) {
    let context = format!("case {index} (case seed {seed})");
    let mut rng = StdRng::seed_from_u64(seed);
    let path = dir.join(format!("case-{index}"));
    let device = Arc::new(FileDevice::create(&path, METADATA_BLOCKS).unwrap());
    let mut md = PoolMetadata::format(device, 128, DATA_BLOCKS).unwrap();
    let case = random_workload(&mut rng, &mut md);
    drop(md);

    for tools in [v0, v1] {
        let output = tools.check(&path);
        assert!(output.success(), "{context}: {output}");
    }

    let theirs = v1.dump(&path, &[]);
    let ours = our_dump(&path, &DumpOptions::default(), false);
    assert_eq!(
        ours, theirs,
        "{context}: xml dump differs from thin_dump 1.1.0"
    );

    let expanded = expand(&theirs);
    assert_eq!(
        expanded.devices.keys().copied().collect::<Vec<_>>(),
        case.model.keys().copied().collect::<Vec<_>>(),
        "{context}: devices"
    );
    for (id, device) in &expanded.devices {
        assert_eq!(device.mappings, case.model[id], "{context}: device {id}");
        assert_eq!(
            device.info.mapped_block_count,
            case.model[id].len() as u64,
            "{context}: mapped_blocks of {id}"
        );
    }

    let v09 = DumpOptions {
        flavour: Flavour::V0_9,
        ..DumpOptions::default()
    };
    assert_eq!(
        our_dump(&path, &v09, false),
        v0.dump(&path, &[]),
        "{context}: 0.9.0 flavour differs from thin_dump 0.9.0"
    );

    if index.is_multiple_of(2) {
        assert_eq!(
            our_dump(&path, &DumpOptions::default(), true),
            v1.dump(&path, &["--format", "human_readable"]),
            "{context}: human-readable dump differs"
        );
    }

    if case.metadata_snap_held {
        let snap = DumpOptions {
            source: Source::MetadataSnap(None),
            ..DumpOptions::default()
        };
        assert_eq!(
            our_dump(&path, &snap, false),
            v1.dump(&path, &["-m"]),
            "{context}: metadata-snapshot dump differs"
        );
    }

    let ls = v1.ls(
        &path,
        &["-o", "DEV,MAPPED_BLOCKS,EXCLUSIVE_BLOCKS,SHARED_BLOCKS"],
    );
    assert!(ls.success(), "{context}: {ls}");
    assert_eq!(
        tool_usage(&ls.stdout),
        model_usage(&case.model),
        "{context}: thin_ls"
    );

    let pairs: Vec<(u32, u32)> = case
        .snapshots
        .iter()
        .filter(|(o, s)| case.model.contains_key(o) && case.model.contains_key(s))
        .copied()
        .take(2)
        .collect();
    for (origin, snapshot) in pairs {
        let (a, b) = (origin.to_string(), snapshot.to_string());
        let delta = v1.delta(&path, &["--snap1", &a, "--snap2", &b]);
        assert!(delta.success(), "{context}: {delta}");
        assert_eq!(
            tool_delta(&delta.stdout),
            model_delta(&case.model[&origin], &case.model[&snapshot]),
            "{context}: thin_delta {origin} {snapshot}"
        );
    }
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn random_pools_match_the_real_tools() {
    let (v0, v1) = (ThinTools::v0_9(), ThinTools::v1_1());
    let dir = ScratchDir::new("forward-random-pools");
    // The 1.x tools spend about half a second in their progress reporter whatever the
    // input, so cases overlap on more threads than cores.
    testkit::seed::run_cases(200, 8, |index, seed| run_case(index, seed, &dir, &v0, &v1));
}

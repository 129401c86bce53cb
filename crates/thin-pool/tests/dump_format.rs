//! Goal: our dump writers print exactly what the real `thin_dump` prints, and our parser reads
//! everything it prints.
//!
//! Method: restore hand-written and seeded random XML with the real `thin_restore` (1.1.0,
//! or 0.9.0 where only it can express the case, e.g. the needs-check flag), dump the
//! metadata with the real `thin_dump` of both versions in both formats, then parse each XML
//! dump with `dump::xml::parse` and write it back with our writer of the same version; the
//! text must be identical byte for byte. Random cases take their seed from `THINPOOL_SEED`
//! and print it on failure.

use std::fmt::Write as _;
use std::path::Path;

use persistent_data::checksum::{self, BlockKind};
use persistent_data::{Block, BLOCK_SIZE};
use rand::Rng;
use testkit::{ScratchDir, ThinTools, ToolVersion};
use thin_pool::format::dump::{self, Flavour, HumanWriter, XmlWriter};

/// Which version's `thin_dump` output our writers are compared with.
fn flavour(version: ToolVersion) -> Flavour {
    match version {
        ToolVersion::V0_9 => Flavour::V0_9,
        ToolVersion::V1_1 => Flavour::V1,
    }
}

/// Parses `xml` and writes it back as XML of `flavour`.
fn rewrite_xml(xml: &str, flavour: Flavour) -> String {
    let mut writer = XmlWriter::with_flavour(Vec::new(), flavour);
    dump::xml::parse(xml.as_bytes(), &mut writer)
        .unwrap_or_else(|error| panic!("cannot parse the tool's dump: {error}\n{xml}"));
    String::from_utf8(writer.into_inner()).unwrap()
}

/// Parses `xml` and writes it as the human-readable form of `flavour`.
fn rewrite_human(xml: &str, flavour: Flavour) -> String {
    let mut writer = HumanWriter::with_flavour(Vec::new(), flavour);
    dump::xml::parse(xml.as_bytes(), &mut writer)
        .unwrap_or_else(|error| panic!("cannot parse the tool's dump: {error}\n{xml}"));
    String::from_utf8(writer.into_inner()).unwrap()
}

/// Dumps `metadata` with every tool version in both formats (plus `extra` arguments, e.g.
/// `-m`) and checks that our writers reproduce each dump from the same version's XML.
/// Returns the 1.1.0 XML dump.
fn assert_dumps_reproduced(metadata: &Path, extra: &[&str]) -> String {
    let mut v1_xml = String::new();
    for tools in ThinTools::all() {
        let xml = tools.dump(metadata, extra);
        let mut human_args = vec!["--format", "human_readable"];
        human_args.extend_from_slice(extra);
        let human = tools.dump(metadata, &human_args);
        let flavour = flavour(tools.version);
        assert_eq!(
            rewrite_xml(&xml, flavour),
            xml,
            "xml of thin_dump {} not reproduced",
            tools.version
        );
        assert_eq!(
            rewrite_human(&xml, flavour),
            human,
            "human-readable output of thin_dump {} not reproduced",
            tools.version
        );
        if tools.version == ToolVersion::V1_1 {
            v1_xml = xml;
        }
    }
    v1_xml
}

/// Restores `xml` with `restorer` into a fresh 8 MiB metadata file and checks every dump.
/// Returns the 1.1.0 XML dump.
fn restore_and_compare(label: &str, xml: &str, restorer: ToolVersion) -> String {
    let scratch = ScratchDir::new(label);
    let input = scratch.join("input.xml");
    let metadata = scratch.join("metadata");
    std::fs::write(&input, xml).unwrap();
    ThinTools::find(restorer)
        .restore(&input, &metadata)
        .assert_success();
    assert_dumps_reproduced(&metadata, &[])
}

const DEVICE_HEADER: &str =
    "mapped_blocks=\"0\" transaction=\"1\" creation_time=\"1\" snap_time=\"1\"";

#[test]
fn singles_ranges_and_empty_devices_are_reproduced() {
    let xml = r#"<superblock uuid="" time="3" transaction="7" flags="0" version="2" data_block_size="128" nr_data_blocks="20000">
  <device dev_id="0" mapped_blocks="602" transaction="0" creation_time="0" snap_time="1">
    <range_mapping origin_begin="0" data_begin="1000" length="600" time="0"/>
    <single_mapping origin_block="700" data_block="5" time="1"/>
    <single_mapping origin_block="800" data_block="10" time="0"/>
  </device>
  <device dev_id="1" mapped_blocks="52" transaction="3" creation_time="1" snap_time="1">
    <range_mapping origin_begin="0" data_begin="1000" length="50" time="0"/>
    <single_mapping origin_block="60" data_block="2000" time="1"/>
    <single_mapping origin_block="800" data_block="10" time="0"/>
  </device>
  <device dev_id="2" mapped_blocks="11" transaction="5" creation_time="2" snap_time="2">
    <range_mapping origin_begin="100" data_begin="17000" length="10" time="2"/>
    <single_mapping origin_block="800" data_block="10" time="0"/>
  </device>
  <device dev_id="16777215" mapped_blocks="0" transaction="6" creation_time="3" snap_time="3">
  </device>
</superblock>
"#;
    for restorer in ToolVersion::ALL {
        let v1 = restore_and_compare("dump-singles-ranges", xml, restorer);
        assert!(v1.contains("<single_mapping origin_block=\"700\""), "{v1}");
        assert!(v1.ends_with("</superblock>"), "{v1}");
    }
}

#[test]
fn pool_without_devices_is_reproduced() {
    let xml = "<superblock uuid=\"\" time=\"0\" transaction=\"0\" version=\"2\" data_block_size=\"2097152\" nr_data_blocks=\"1\">\n</superblock>\n";
    for restorer in ToolVersion::ALL {
        restore_and_compare("dump-no-devices", xml, restorer);
    }
}

#[test]
fn needs_check_flag_and_old_version_are_reproduced() {
    // Only 0.9.0 restore copies flags and version from the XML; 1.x writes 0 and 2.
    for flags in [1, 2, 3] {
        let xml = format!(
            "<superblock uuid=\"\" time=\"5\" transaction=\"9\" flags=\"{flags}\" version=\"1\" data_block_size=\"256\" nr_data_blocks=\"1000\">\n  \
             <device dev_id=\"3\" {DEVICE_HEADER}>\n    \
             <range_mapping origin_begin=\"10\" data_begin=\"20\" length=\"2\" time=\"3\"/>\n  \
             </device>\n</superblock>\n"
        );
        let v1 = restore_and_compare("dump-needs-check", &xml, ToolVersion::V0_9);
        let expect_flag = flags & 1 == 1;
        assert_eq!(v1.contains(" flags=\"1\""), expect_flag, "{v1}");
    }
}

#[test]
fn shared_leaves_print_as_def_and_ref() {
    let xml = r#"<superblock uuid="" time="3" transaction="9" version="2" data_block_size="128" nr_data_blocks="20000">
  <def name="a">
    <range_mapping origin_begin="0" data_begin="1000" length="201" time="0"/>
  </def>
  <def name="b">
    <range_mapping origin_begin="201" data_begin="1201" length="399" time="0"/>
    <single_mapping origin_block="700" data_block="5" time="0"/>
    <single_mapping origin_block="800" data_block="10" time="0"/>
  </def>
  <device dev_id="0" mapped_blocks="602" transaction="0" creation_time="0" snap_time="2">
    <ref name="a"/>
    <ref name="b"/>
  </device>
  <device dev_id="1" mapped_blocks="602" transaction="1" creation_time="1" snap_time="1">
    <ref name="a"/>
    <ref name="b"/>
  </device>
  <device dev_id="2" mapped_blocks="602" transaction="2" creation_time="2" snap_time="3">
    <range_mapping origin_begin="0" data_begin="1000" length="60" time="0"/>
    <single_mapping origin_block="60" data_block="2000" time="2"/>
    <range_mapping origin_begin="61" data_begin="1061" length="140" time="0"/>
    <ref name="b"/>
  </device>
  <device dev_id="5" mapped_blocks="0" transaction="2" creation_time="2" snap_time="3">
  </device>
</superblock>
"#;
    let v1 = restore_and_compare("dump-def-ref", xml, ToolVersion::V1_1);
    assert!(v1.contains("  <def name=\""), "{v1}");
    assert!(v1.contains("    <ref name=\""), "{v1}");
}

/// Turns the live superblock into one with a metadata snapshot at `snapshot_block`: a copy
/// of the superblock there without space-map roots (spec §4.1). Reference counts are not
/// updated, which `thin_dump` does not check.
fn add_metadata_snapshot(metadata: &Path, snapshot_block: u64) {
    let mut image = std::fs::read(metadata).unwrap();
    let mut live: Block = image[..BLOCK_SIZE].try_into().unwrap();
    let mut snapshot = live;
    snapshot[8..16].copy_from_slice(&snapshot_block.to_le_bytes());
    snapshot[56..64].fill(0);
    snapshot[64..320].fill(0);
    checksum::stamp(&mut snapshot, BlockKind::Superblock);
    live[56..64].copy_from_slice(&snapshot_block.to_le_bytes());
    checksum::stamp(&mut live, BlockKind::Superblock);
    let offset = usize::try_from(snapshot_block).unwrap() * BLOCK_SIZE;
    image[offset..offset + BLOCK_SIZE].copy_from_slice(&snapshot);
    image[..BLOCK_SIZE].copy_from_slice(&live);
    std::fs::write(metadata, image).unwrap();
}

#[test]
fn metadata_snapshot_dump_is_reproduced_and_metadata_snap_is_not_printed() {
    let xml = format!(
        "<superblock uuid=\"\" time=\"1\" transaction=\"2\" version=\"2\" data_block_size=\"128\" nr_data_blocks=\"100\">\n  \
         <device dev_id=\"1\" {DEVICE_HEADER}>\n    \
         <single_mapping origin_block=\"10\" data_block=\"20\" time=\"1\"/>\n  \
         </device>\n</superblock>\n"
    );
    let scratch = ScratchDir::new("dump-metadata-snap");
    let input = scratch.join("input.xml");
    let metadata = scratch.join("metadata");
    std::fs::write(&input, xml).unwrap();
    ThinTools::v0_9()
        .restore(&input, &metadata)
        .assert_success();
    add_metadata_snapshot(&metadata, 2000);

    let live = assert_dumps_reproduced(&metadata, &[]);
    let snapshot = assert_dumps_reproduced(&metadata, &["-m"]);
    assert!(!live.contains("metadata_snap"), "{live}");
    assert!(snapshot.contains("nr_data_blocks=\"0\""), "{snapshot}");
}

/// Seeded random pool: devices made of segments of the virtual space, each segment either a
/// shared definition (`<def>`, referenced by some devices) or private runs.
fn random_xml(rng: &mut impl Rng, with_sharing: bool) -> String {
    let nr_data_blocks: u64 = rng.gen_range(1_000..200_000);
    let time: u32 = rng.gen_range(0..10);
    let segment_count = rng.gen_range(1..12);
    let segments: Vec<(u64, u64)> = {
        let mut begin = rng.gen_range(0..1000);
        (0..segment_count)
            .map(|index| {
                let length = if index == 0 {
                    rng.gen_range(1000..3000)
                } else {
                    rng.gen_range(1..2000)
                };
                let segment = (begin, length);
                begin += length + rng.gen_range(0..5000);
                segment
            })
            .collect()
    };
    let device_count = if with_sharing {
        rng.gen_range(2..6)
    } else {
        rng.gen_range(1..6)
    };
    let mut dev_ids: Vec<u32> = Vec::new();
    while dev_ids.len() < device_count {
        let dev_id = rng.gen_range(0..=16_777_215);
        if !dev_ids.contains(&dev_id) {
            dev_ids.push(dev_id);
        }
    }
    dev_ids.sort_unstable();

    // Which devices reference which segment's definition. With sharing, every device
    // references the first segment, so the dump has at least one shared leaf.
    let shared: Vec<Vec<bool>> = segments
        .iter()
        .enumerate()
        .map(|(index, _)| {
            let share = with_sharing && (index == 0 || rng.gen_bool(0.4));
            dev_ids
                .iter()
                .map(|_| share && (index == 0 || rng.gen_bool(0.6)))
                .collect()
        })
        .collect();

    // Runs inside a segment; dense runs fill it (1.1.0 restore keeps only big definitions
    // as shared leaves, so the guaranteed one is dense).
    let runs_in = |rng: &mut dyn rand::RngCore, (begin, length): (u64, u64), dense: bool| {
        let mut out = Vec::new();
        let gap_max = if dense { 1 } else { 30 };
        let mut virtual_block = begin + if dense { 0 } else { rng.gen_range(0..length) };
        while virtual_block < begin + length {
            let run_length = rng.gen_range(1..=(begin + length - virtual_block).min(40));
            let data_begin = rng.gen_range(0..nr_data_blocks - run_length);
            let run_time = rng.gen_range(0..=time);
            out.push((virtual_block, data_begin, run_length, run_time));
            virtual_block += run_length + rng.gen_range(0..gap_max);
        }
        out
    };
    let write_runs = |text: &mut String, runs: &[(u64, u64, u64, u32)]| {
        for &(virtual_block, data_block, length, run_time) in runs {
            if length == 1 {
                writeln!(text, "    <single_mapping origin_block=\"{virtual_block}\" data_block=\"{data_block}\" time=\"{run_time}\"/>").unwrap();
            } else {
                writeln!(text, "    <range_mapping origin_begin=\"{virtual_block}\" data_begin=\"{data_block}\" length=\"{length}\" time=\"{run_time}\"/>").unwrap();
            }
        }
    };

    let mut text = format!(
        "<superblock uuid=\"\" time=\"{time}\" transaction=\"{}\" version=\"2\" data_block_size=\"128\" nr_data_blocks=\"{nr_data_blocks}\">\n",
        rng.gen_range(0..1000u64)
    );
    let mut def_sizes = vec![0u64; segments.len()];
    for (index, &segment) in segments.iter().enumerate() {
        if shared[index].iter().any(|&uses| uses) {
            let runs = runs_in(rng, segment, index == 0);
            def_sizes[index] = runs.iter().map(|run| run.2).sum();
            writeln!(text, "  <def name=\"s{index}\">").unwrap();
            write_runs(&mut text, &runs);
            writeln!(text, "  </def>").unwrap();
        }
    }
    for (device, dev_id) in dev_ids.iter().enumerate() {
        let mut body = String::new();
        let mut mapped = 0;
        for (index, &segment) in segments.iter().enumerate() {
            if shared[index][device] {
                writeln!(body, "    <ref name=\"s{index}\"/>").unwrap();
                mapped += def_sizes[index];
            } else if rng.gen_bool(0.7) {
                let runs = runs_in(rng, segment, false);
                mapped += runs.iter().map(|run| run.2).sum::<u64>();
                write_runs(&mut body, &runs);
            }
        }
        let creation_time = rng.gen_range(0..=time);
        writeln!(
            text,
            "  <device dev_id=\"{dev_id}\" mapped_blocks=\"{mapped}\" transaction=\"{}\" creation_time=\"{creation_time}\" snap_time=\"{}\">",
            rng.gen_range(0..1000u64),
            rng.gen_range(creation_time..=time)
        )
        .unwrap();
        text.push_str(&body);
        writeln!(text, "  </device>").unwrap();
    }
    text.push_str("</superblock>\n");
    text
}

#[test]
fn random_pools_are_reproduced() {
    let (_report, mut rng) = testkit::seeded_rng();
    for case in 0..testkit::case_count(6) {
        let with_sharing = case % 2 == 1;
        let xml = random_xml(&mut rng, with_sharing);
        let restorer = if with_sharing {
            ToolVersion::V1_1
        } else if rng.gen_bool(0.5) {
            ToolVersion::V0_9
        } else {
            ToolVersion::V1_1
        };
        let v1 = restore_and_compare("dump-random", &xml, restorer);
        if with_sharing {
            assert!(v1.contains("<def name="), "no shared leaf in\n{v1}");
        }
    }
}

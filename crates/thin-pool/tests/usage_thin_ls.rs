//! Goal: `format::metadata::usage::volume_usage` counts mapped, exclusive and shared blocks
//! exactly as the real `thin_ls -o DEV,MAPPED_BLOCKS,EXCLUSIVE_BLOCKS,SHARED_BLOCKS` (1.1.0)
//! does, also where the engine never goes: a data block mapped by many volumes, or twice by
//! one volume (thin_ls: shared), volumes with no mappings.
//! Method: seeded random thin_dump XML (devices mapping random virtual blocks to data blocks
//! drawn from a small range, so that blocks collide across and within devices), built into
//! metadata by the real thin_restore, then read by thin_ls and by `volume_usage`.

use persistent_data::{BlockDevice, FileDevice};
use rand::Rng;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Arc;
use testkit::scratch::ScratchDir;
use testkit::tools::ThinTools;
use thin_pool::format::metadata::usage::{volume_usage, VolumeUsage};
use thin_pool::PoolMetadata;

const DATA_BLOCKS: u64 = 600;

fn random_xml(rng: &mut impl Rng) -> String {
    let mut xml = String::new();
    writeln!(
        xml,
        r#"<superblock uuid="" time="1" transaction="1" flags="0" version="2" data_block_size="128" nr_data_blocks="{DATA_BLOCKS}">"#
    )
    .unwrap();
    let devices = rng.gen_range(1..7);
    let mut dev_id = 0;
    for _ in 0..devices {
        dev_id += rng.gen_range(1..4);
        let count = match rng.gen_range(0..4) {
            0 => 0,
            _ => rng.gen_range(1..400),
        };
        let mut mappings = BTreeMap::new();
        for _ in 0..count {
            mappings.insert(rng.gen_range(0..2000u64), rng.gen_range(0..DATA_BLOCKS / 2));
        }
        writeln!(
            xml,
            r#"  <device dev_id="{dev_id}" mapped_blocks="{}" transaction="0" creation_time="0" snap_time="1">"#,
            mappings.len()
        )
        .unwrap();
        for (origin, data) in mappings {
            writeln!(
                xml,
                r#"    <single_mapping origin_block="{origin}" data_block="{data}" time="0"/>"#
            )
            .unwrap();
        }
        writeln!(xml, "  </device>").unwrap();
    }
    writeln!(xml, "</superblock>").unwrap();
    xml
}

fn thin_ls(tools: &ThinTools, metadata: &std::path::Path) -> BTreeMap<u32, VolumeUsage> {
    let output = tools.ls(
        metadata,
        &[
            "--no-headers",
            "-o",
            "DEV,MAPPED_BLOCKS,EXCLUSIVE_BLOCKS,SHARED_BLOCKS",
        ],
    );
    output.assert_success();
    output
        .stdout
        .lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| {
            let n: Vec<u64> = line
                .split_whitespace()
                .map(|f| f.parse().unwrap())
                .collect();
            let usage = VolumeUsage {
                mapped_blocks: n[1],
                exclusive_blocks: n[2],
                shared_blocks: n[3],
            };
            (n[0] as u32, usage)
        })
        .collect()
}

#[test]
fn volume_usage_matches_thin_ls_on_random_sharing() {
    let (_report, mut rng) = testkit::seeded_rng();
    let tools = ThinTools::v1_1();
    let scratch = ScratchDir::new("usage-thin-ls");
    for case in 0..testkit::case_count(12) {
        let xml_path = scratch.join(format!("case-{case}.xml"));
        let metadata_path = scratch.join(format!("case-{case}.metadata"));
        let xml = random_xml(&mut rng);
        std::fs::write(&xml_path, &xml).unwrap();
        tools.restore(&xml_path, &metadata_path).assert_success();
        let expected = thin_ls(&tools, &metadata_path);

        let device: Arc<dyn BlockDevice> =
            Arc::new(FileDevice::open(&metadata_path, false).unwrap());
        let md = PoolMetadata::open(device).unwrap();
        let found: BTreeMap<u32, VolumeUsage> = volume_usage(
            &**md.transaction_manager().block_manager(),
            md.superblock().data_mapping_root,
        )
        .unwrap()
        .into_iter()
        .map(|(id, usage)| (id.get(), usage))
        .collect();
        assert_eq!(found, expected, "case {case}:\n{xml}");
    }
}

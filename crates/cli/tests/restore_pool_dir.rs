//! Goal: metadata restored from a thin_dump XML, by LVM's real `thin_restore` or by
//! `thinpool restore`, into a pool directory's `metadata` beside its data file, can be
//! listed and served (issue 9, item 6): the volumes are named `thin-ID` when the directory
//! has no catalog, and they read back the data blocks the XML maps.
//! Method: an XML with two volumes (a snapshot sharing a block with its origin, a range and
//! single mappings) is restored by each installed thin_restore (0.9.0 and 1.1.0) into a
//! fresh private directory with a data file whose blocks hold a distinct pattern each;
//! `thinpool list --json` names the volumes; `thinpool serve` serves them and a raw NBD
//! client reads every mapped block and some unmapped ones. Then `thinpool restore` of the
//! same XML over a pool made by `thinpool create` (with a volume of its own) replaces the
//! catalog the same way.

mod e2e_support;

use e2e_support::*;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use testkit::tools::ThinTools;

const BLOCK_BYTES: u64 = 64 * 1024;
const DATA_BLOCKS: u64 = 64;

const XML: &str = r#"<superblock uuid="" time="1" transaction="5" flags="0" version="2" data_block_size="128" nr_data_blocks="64">
  <device dev_id="1" mapped_blocks="3" transaction="0" creation_time="0" snap_time="1">
    <range_mapping origin_begin="0" data_begin="0" length="2" time="0"/>
    <single_mapping origin_block="10" data_block="5" time="0"/>
  </device>
  <device dev_id="2" mapped_blocks="2" transaction="0" creation_time="1" snap_time="1">
    <single_mapping origin_block="0" data_block="0" time="0"/>
    <single_mapping origin_block="1" data_block="7" time="1"/>
  </device>
</superblock>
"#;

/// (volume, virtual block, data block) of every mapping in [`XML`].
const MAPPINGS: [(&str, u64, u64); 5] = [
    ("thin-1", 0, 0),
    ("thin-1", 1, 1),
    ("thin-1", 10, 5),
    ("thin-2", 0, 0),
    ("thin-2", 1, 7),
];

/// The content of data block `block`.
fn block_pattern(block: u64) -> Vec<u8> {
    pattern(1000 + block, BLOCK_BYTES as usize)
}

/// A private pool directory with a data file holding [`block_pattern`] in each block.
fn pool_dir(dir: &Path) {
    std::fs::create_dir(dir).unwrap();
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    let mut data = Vec::new();
    for block in 0..DATA_BLOCKS {
        data.extend_from_slice(&block_pattern(block));
    }
    std::fs::write(dir.join("data"), data).unwrap();
    std::fs::set_permissions(dir.join("data"), std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// `list --json` names the two volumes `thin-ID` with no origin; serving them reads back
/// what the XML maps, zeros elsewhere.
fn check_served(dir: &Path) {
    let pool = dir.to_str().unwrap();
    let listing: serde_json::Value =
        serde_json::from_str(&thinpool_ok(&["list", "--json", "--pool", pool])).unwrap();
    let volumes = listing["volumes"].as_array().unwrap();
    let names: Vec<&str> = volumes
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["thin-1", "thin-2"], "{listing}");
    for volume in volumes {
        assert!(volume["origin"].is_null(), "{volume}");
        assert_eq!(volume["size_bytes"], DATA_BLOCKS * BLOCK_BYTES, "{volume}");
    }
    let served = serve(dir, &[]);
    for name in ["thin-1", "thin-2"] {
        let mut client = Client::open(&served.socket, name);
        for (volume, virtual_block, data_block) in MAPPINGS {
            if volume == name {
                let read = client.read(virtual_block * BLOCK_BYTES, BLOCK_BYTES);
                assert!(
                    read == block_pattern(data_block),
                    "{name} block {virtual_block} should read data block {data_block}"
                );
            }
        }
        let unmapped = client.read(20 * BLOCK_BYTES, BLOCK_BYTES);
        assert!(
            unmapped.iter().all(|b| *b == 0),
            "{name}: unmapped reads zeros"
        );
        client.disconnect();
    }
    drop(served);
}

#[test]
fn metadata_from_real_thin_restore_is_served_as_thin_id_volumes() {
    let scratch = ScratchDir::new("restore-pool-dir");
    let xml = scratch.join("pool.xml");
    std::fs::write(&xml, XML).unwrap();
    for tools in ThinTools::all() {
        let dir = scratch.join(format!("pool-{}", tools.version.as_str()));
        pool_dir(&dir);
        let metadata = dir.join("metadata");
        tools
            .restore_sized(&xml, &metadata, 4 << 20)
            .assert_success();
        std::fs::set_permissions(&metadata, std::fs::Permissions::from_mode(0o600)).unwrap();
        check_served(&dir);
        // The pool is still valid metadata for both tools.
        for checker in ThinTools::all() {
            checker.check(&metadata).assert_success();
        }
    }
}

#[test]
fn thinpool_restore_into_a_pool_dir_replaces_its_catalog() {
    let scratch = ScratchDir::new("restore-pool-dir-ours");
    let xml = scratch.join("pool.xml");
    std::fs::write(&xml, XML).unwrap();
    let dir = scratch.join("pool");
    create_pool(&dir, &["--data-size", "4M"]);
    create_volume(&dir, "old", "1M");
    let mut data = Vec::new();
    for block in 0..DATA_BLOCKS {
        data.extend_from_slice(&block_pattern(block));
    }
    std::fs::write(dir.join("data"), data).unwrap();
    let metadata = dir.join("metadata");
    thinpool_ok(&[
        "restore",
        "-i",
        xml.to_str().unwrap(),
        "-o",
        metadata.to_str().unwrap(),
    ]);
    check_served(&dir);
}

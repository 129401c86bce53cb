//! Goal: qemu's NBD client reads back what it wrote to a thin volume, `qemu-img map` and
//! `nbdinfo --map` report exactly the provisioned blocks, and `qemu-img convert` copies images
//! to and from a volume.
//!
//! Method: serve a pool with 64 KiB blocks, write patterns with `qemu-io` (one of them over
//! TCP), compare both tools' allocation maps with the blocks the writes touched, then convert a
//! sparse image in and out and compare bytes.

mod e2e_support;

use e2e_support::*;
use std::time::Duration;

const BLOCK: u64 = 64 * 1024;

fn qemu_io(uri: &str, commands: &[&str]) -> String {
    let mut args = vec!["-f", "raw"];
    for command in commands {
        args.push("-c");
        args.push(command);
    }
    args.push(uri);
    let output = run_ok("qemu-io", &args, Duration::from_secs(60));
    assert!(
        !output.contains("Pattern verification failed") && !output.contains("failed"),
        "qemu-io {commands:?}:\n{output}"
    );
    output
}

#[test]
fn qemu_io_patterns_and_exact_allocation_maps() {
    require_tool("qemu-io", "qemu-utils");
    require_tool("qemu-img", "qemu-utils");
    require_tool("nbdinfo", "libnbd-bin");
    let temp = ScratchDir::new("serve-qemu");
    let pool = temp.join("pool");
    create_pool(&pool, &["--data-size", "256M"]);
    create_volume(&pool, "vol", "16M");
    let served = serve(&pool, &["--tcp", "0"]);
    let uri = served.uri("vol");
    assert_eq!(nbdinfo_data_extents(&uri), vec![]);

    qemu_io(&uri, &["write -P 0xab 0 1M", "read -P 0xab 0 1M"]);
    qemu_io(&uri, &["write -P 0xcd 4100K 4K"]);
    let tcp_uri = format!("nbd://{}/vol", served.tcp.as_ref().unwrap());
    qemu_io(
        &tcp_uri,
        &["write -P 0xef 8191K 2K", "read -P 0xef 8191K 2K"],
    );
    // Everything written reads back, and the rest of each new block reads as zeroes.
    qemu_io(
        &uri,
        &[
            "read -P 0xab 0 1M",
            "read -P 0 1M 3M",
            "read -P 0 4096K 4K",
            "read -P 0xcd 4100K 4K",
            "read -P 0 4104K 56K",
            "read -P 0 8128K 63K",
            "read -P 0xef 8191K 2K",
            "read -P 0 8193K 63K",
            "read -P 0 8256K 64K",
        ],
    );

    let expected = vec![(0, MIB), (4 * MIB, BLOCK), (8 * MIB - BLOCK, 2 * BLOCK)];
    assert_eq!(nbdinfo_data_extents(&uri), expected, "nbdinfo --map");
    assert_eq!(qemu_img_data_extents(&uri), expected, "qemu-img map");
    let listing = thinpool_ok(&["list", "--json", "--pool", pool.to_str().unwrap()]);
    let listing: serde_json::Value = serde_json::from_str(&listing).unwrap();
    assert_eq!(listing["volumes"][0]["mapped_blocks"], 16 + 1 + 2);

    // Discard whole blocks: they become holes again.
    qemu_io(&uri, &["discard 0 512K"]);
    let expected = vec![
        (512 * 1024, 512 * 1024),
        (4 * MIB, BLOCK),
        (8 * MIB - BLOCK, 2 * BLOCK),
    ];
    assert_eq!(nbdinfo_data_extents(&uri), expected, "after discard");
    qemu_io(&uri, &["read -P 0 0 512K", "read -P 0xab 512K 512K"]);
    served.stop();
}

#[test]
fn qemu_img_convert_to_and_from_a_volume() {
    require_tool("qemu-img", "qemu-utils");
    let temp = ScratchDir::new("serve-convert");
    let pool = temp.join("pool");
    create_pool(&pool, &["--data-size", "256M"]);
    create_volume(&pool, "target", "32M");
    let served = serve(&pool, &[]);

    // A sparse source image: data at 0, 5 MiB and the last MiB.
    let source = temp.join("source.img");
    let file = sized_file(&source, 32 * MIB);
    use std::os::unix::fs::FileExt;
    for (index, offset) in [0, 5 * MIB, 31 * MIB].into_iter().enumerate() {
        file.write_all_at(&pattern(index as u64 + 1, MIB as usize), offset)
            .unwrap();
    }
    drop(file);

    let uri = served.uri("target");
    let source_path = source.to_str().unwrap();
    testkit::qemu_img::convert_into(source_path, &uri);
    testkit::qemu_img::compare(source_path, &uri);
    // Only the data was provisioned.
    assert_eq!(
        nbdinfo_data_extents(&uri),
        vec![(0, MIB), (5 * MIB, MIB), (31 * MIB, MIB)]
    );

    let back = temp.join("back.img");
    testkit::qemu_img::convert_to_file(&uri, &back);
    assert_eq!(
        std::fs::read(&back).unwrap(),
        std::fs::read(&source).unwrap()
    );
    served.stop();
}

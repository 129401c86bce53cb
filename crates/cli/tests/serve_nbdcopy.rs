//! Goal: `nbdcopy` copies a sparse thin volume to another volume of the same pool and the copy
//! stays sparse: same bytes, same allocation map.
//!
//! Method: write a few scattered regions with our raw client, `nbdcopy` between two exports of
//! one server, then compare `nbdinfo --map` of both and the bytes through a checksum.

mod e2e_support;

use e2e_support::*;
use std::time::Duration;

#[test]
fn nbdcopy_keeps_a_sparse_volume_sparse() {
    require_tool("nbdcopy", "libnbd-bin");
    require_tool("nbdinfo", "libnbd-bin");
    let temp = ScratchDir::new("serve-nbdcopy");
    let pool = temp.join("pool");
    create_pool(&pool, &["--data-size", "256M"]);
    create_volume(&pool, "source", "64M");
    create_volume(&pool, "copy", "64M");
    let served = serve(&pool, &[]);

    let mut client = Client::open(&served.socket, "source");
    for (index, offset) in [0, 3 * MIB, 17 * MIB + 65536, 40 * MIB, 64 * MIB - 131072]
        .into_iter()
        .enumerate()
    {
        client.write(offset, &pattern(index as u64, 131072));
    }
    client.flush();
    client.disconnect();

    let source = served.uri("source");
    let copy = served.uri("copy");
    let source_map = nbdinfo_data_extents(&source);
    assert_eq!(
        source_map.iter().map(|(_, length)| length).sum::<u64>(),
        5 * 131072
    );
    run_ok("nbdcopy", &[&source, &copy], Duration::from_secs(120));
    assert_eq!(
        nbdinfo_data_extents(&copy),
        source_map,
        "the copy is not as sparse"
    );

    let checksum = |uri: &str| {
        let output = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("timeout 120 nbdcopy '{uri}' - | sha256sum"))
            .output()
            .unwrap();
        assert!(output.status.success());
        String::from_utf8(output.stdout).unwrap()
    };
    assert_eq!(checksum(&source), checksum(&copy));
    served.stop();
}

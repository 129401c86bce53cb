//! Goal: `thinpool volume revert VOLUME SNAPSHOT [--delete-snapshot]` and `thinpool volume
//! rename OLD NEW` work served (through the control socket) and offline: a revert is refused
//! with a clear error while an NBD client has VOLUME open, and afterwards VOLUME reads as
//! SNAPSHOT did; a rename moves the NBD export name; `list` keeps ancestry by thin id through
//! both; thin_check passes; each new command's `--help` has an example.
//! Method: drive the binary against a served pool with the raw NBD client, then offline.

mod e2e_support;

use e2e_support::*;
use testkit::tools::ThinTools;

const BLOCK: u64 = 64 * 1024;

fn pair(name: &str, origin: Option<&str>) -> (String, Option<String>) {
    (name.to_string(), origin.map(str::to_string))
}

#[test]
fn revert_and_rename_served_and_offline() {
    let scratch = ScratchDir::new("volume-revert");
    let dir = scratch.join("pool");
    let p = dir.to_str().unwrap();
    create_pool(&dir, &["--data-size", "64M"]);
    create_volume(&dir, "vm", "1M");
    let served = serve(&dir, &[]);

    let original = pattern(1, 4 * BLOCK as usize);
    let mut client = Client::open(&served.socket, "vm");
    client.write(0, &original);
    client.flush();
    thinpool_ok(&[
        "volume",
        "snapshot",
        "vm",
        "good",
        "--read-only",
        "--pool",
        p,
    ]);
    client.write(BLOCK, &pattern(2, 2 * BLOCK as usize));
    client.flush();

    // Open: refused, clearly, and nothing changes.
    let refused = thinpool_err(&["volume", "revert", "vm", "good", "--pool", p]);
    assert!(
        refused.contains("cannot revert volume \"vm\" to \"good\"")
            && refused.contains("\"vm\" is open")
            && refused.contains("EBUSY"),
        "{refused}"
    );
    assert_ne!(client.read(0, 4 * BLOCK), original);
    client.disconnect();

    let out = thinpool_ok(&["volume", "revert", "vm", "good", "--pool", p]);
    assert_eq!(
        out,
        "reverted volume \"vm\" (id 0, 1.00MiB) to the content of \"good\"\n"
    );
    let mut client = Client::open(&served.socket, "vm");
    assert_eq!(client.read(0, 4 * BLOCK), original);
    assert_eq!(client.read(4 * BLOCK, BLOCK), vec![0; BLOCK as usize]);
    client.disconnect();
    assert_eq!(
        origins(p),
        [pair("good", Some("vm")), pair("vm", None)],
        "no edge added"
    );

    // Rename, served: the export moves.
    let out = thinpool_ok(&["volume", "rename", "vm", "vm-old", "--pool", p, "--json"]);
    let renamed: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(renamed["name"], "vm-old");
    assert_eq!(renamed["id"], 0);
    assert!(Client::try_open(&served.socket, "vm").is_err());
    let mut client = Client::open(&served.socket, "vm-old");
    assert_eq!(client.read(0, 4 * BLOCK), original);
    let refused = thinpool_err(&["volume", "rename", "vm-old", "x", "--pool", p]);
    assert!(
        refused.contains("is open") && refused.contains("EBUSY"),
        "{refused}"
    );
    client.disconnect();
    let taken = thinpool_err(&["volume", "rename", "vm-old", "good", "--pool", p]);
    assert!(taken.contains("EEXIST"), "{taken}");
    assert_eq!(
        origins(p),
        [pair("good", Some("vm-old")), pair("vm-old", None)]
    );
    assert!(served.stop().success());

    // Offline: a new volume under the old name is nobody's origin; revert with delete.
    create_volume(&dir, "vm", "2M");
    assert_eq!(
        origins(p),
        [
            pair("good", Some("vm-old")),
            pair("vm", None),
            pair("vm-old", None)
        ]
    );
    thinpool_ok(&["volume", "snapshot", "good", "vm-next", "--pool", p]);
    let out = thinpool_ok(&[
        "volume",
        "revert",
        "vm",
        "vm-next",
        "--delete-snapshot",
        "--pool",
        p,
    ]);
    assert!(out.contains("; deleted \"vm-next\""), "{out}");
    let listing: serde_json::Value =
        serde_json::from_str(&thinpool_ok(&["list", "--json", "--pool", p])).unwrap();
    let vm = listing["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "vm")
        .unwrap()
        .clone();
    assert_eq!(vm["size_bytes"], 1 << 20, "the snapshot's size");
    assert_eq!(vm["mapped_bytes"], 4 * BLOCK);
    assert_eq!(vm["shared_bytes"], 4 * BLOCK, "shared with good and vm-old");
    assert_eq!(
        origins(p),
        [
            pair("good", Some("vm-old")),
            pair("vm", None),
            pair("vm-old", None)
        ]
    );
    let missing = thinpool_err(&["volume", "revert", "vm", "nothing", "--pool", p]);
    assert!(missing.contains("ENOENT"), "{missing}");
    ThinTools::v1_1()
        .check(&dir.join("metadata"))
        .assert_success();

    for command in ["revert", "rename"] {
        let help = thinpool_ok(&["volume", command, "--help"]);
        assert!(help.contains("Example"), "{help}");
    }
    for command in ["reserve", "release"] {
        let help = thinpool_ok(&["metadata-snap", command, "--help"]);
        assert!(help.contains("Example"), "{help}");
    }
    assert!(thinpool_ok(&["list", "--help"]).contains("--ids"));
}

//! Goal: `thinpool-bench serve --null-export NAME=SIZE` serves an export of exactly SIZE bytes that
//! reads as zeroes whatever was written to it, accepts writes, flushes and trims inside it,
//! refuses requests past its end like any export, reports itself as a hole to block status,
//! and cannot share a name with a volume.
//!
//! Method: serve a pool with a null export beside a thin volume; ask `nbdinfo` for the size
//! and map, write and read back with libnbd's Python binding (the one `nbdsh` runs) and with
//! the raw test client, which also checks the error codes past the end.

mod support;

use std::process::Command;
use std::time::Duration;
use support::*;

const TIMEOUT: Duration = Duration::from_secs(60);

/// Runs a Python program with libnbd's binding (Debian's python3-libnbd is for
/// /usr/bin/python3, which another python3 on PATH may not be); returns stdout.
fn python_nbd(program: &str, args: &[&str]) -> String {
    require_tool("nbdsh", "python3-libnbd");
    let mut command = Command::new("/usr/bin/python3");
    command.arg("-c").arg(program).args(args);
    let output = testkit::process::run_command(command, "python3 (libnbd)", TIMEOUT);
    assert!(
        output.status.success(),
        "python failed:\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

#[test]
fn null_export_reads_zeroes_drops_writes_and_keeps_its_size() {
    require_tool("nbdinfo", "libnbd-bin");
    let temp = ScratchDir::new("serve-null");
    let pool = temp.join("pool");
    create_pool(&pool, 64 * MIB);
    create_volume(&pool, "thin", 8 * MIB).expect("create volume thin");
    // 3 MiB + 512 bytes: a size that is no power of two and not a multiple of 4 KiB.
    let size = 3 * MIB + 512;
    let served = serve(&pool, &["--null-export", &format!("zero={size}")]);
    let uri = served.uri("zero");

    let info = run_ok("nbdinfo", &["--json", &uri], TIMEOUT);
    let info: serde_json::Value = serde_json::from_str(&info).unwrap();
    assert_eq!(info["exports"][0]["export-size"], size);
    assert_eq!(info["exports"][0]["is_read_only"], false);
    // One extent, a hole that reads as zeroes (type 3), over the whole export.
    let map = run_ok("nbdinfo", &["--map", "--json", &uri], TIMEOUT);
    let map: serde_json::Value = serde_json::from_str(&map).unwrap();
    let extents = map.as_array().unwrap();
    assert_eq!(extents.len(), 1, "{map}");
    assert_eq!(extents[0]["length"], size);
    assert_eq!(extents[0]["type"], 3);

    // A real client: writes, flush and trim succeed; reads give zeroes, including the
    // range just written and the last sector.
    let output = python_nbd(
        r#"
import sys, nbd
h = nbd.NBD()
h.connect_uri(sys.argv[1])
size = h.get_size()
h.pwrite(b"\x5a" * 65536, 1 << 20)
h.flush()
h.trim(4096, 0)
assert h.pread(65536, 1 << 20) == bytes(65536), "written range not zero"
assert h.pread(512, size - 512) == bytes(512), "last sector not zero"
assert h.pread(1 << 20, 0) == bytes(1 << 20), "first MiB not zero"
print(size)
h.shutdown()
"#,
        &[&uri],
    );
    assert_eq!(output.trim(), size.to_string());

    // The raw client: old buffer contents never leak into a reply (a READ after a large
    // WRITE reuses the thread's buffer), and requests past the end fail as on any export.
    let mut client = Client::open(&served.socket, "zero");
    assert_eq!(client.size, size);
    client.write(0, &pattern(7, 256 * 1024));
    assert_eq!(client.read(0, 256 * 1024), vec![0u8; 256 * 1024]);
    assert_eq!(client.write_errno(size, &[1u8; 512]), ENOSPC);
    let past = client.request(CMD_READ, 0, size - 512, 1024, &[]);
    assert_eq!(past.error, EINVAL);
    client.flush();
    client.disconnect();

    // The volume beside it is served as usual.
    let mut client = Client::open(&served.socket, "thin");
    client.write(0, &pattern(9, 4096));
    assert_eq!(client.read(0, 4096), pattern(9, 4096));
    client.disconnect();

    // A volume may not take the null export's name.
    let error = create_volume(&pool, "zero", MIB).expect_err("a volume named zero");
    assert!(error.to_string().contains("\"zero\""), "{error}");
    assert!(served.stop().success());

    // Nor may the null export take a volume's name, or a size that is not whole sectors.
    for spec in ["thin=1M", "odd=1000", "nosize"] {
        let error = bench_err(&[
            "serve",
            "--pool",
            pool.to_str().unwrap(),
            "--socket",
            temp.join("refused.sock").to_str().unwrap(),
            "--null-export",
            spec,
        ]);
        let name = spec.split('=').next().unwrap();
        assert!(error.contains(&format!("\"{name}")), "{spec}: {error}");
    }
}

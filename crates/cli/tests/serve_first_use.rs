//! Goal: `thinpool serve` works on a fresh machine (it creates the default pool directory with
//! a `disk` volume), prints how to connect, listens on TCP only when asked and on loopback by
//! default (raw-file and null exports are `thinpool-bench serve`'s, not its), refuses a second server on the same pool,
//! and commits on SIGTERM.
//!
//! Method: run `serve` in an empty working directory, follow its banner with `nbdinfo`, write
//! through our raw client without a flush, stop it with SIGTERM and serve again to read the
//! data back.

mod e2e_support;

use e2e_support::*;
use std::path::Path;
use std::time::Duration;

#[test]
fn serve_on_a_fresh_directory_creates_the_default_pool_and_commits_on_sigterm() {
    require_tool("nbdinfo", "libnbd-bin");
    let temp = ScratchDir::new("serve-first");
    let served = serve_in(Path::new(""), &[], temp.path());
    let pool = temp.join("thinpool-pool");
    assert!(pool.join("metadata").is_file());
    assert!(pool.join("pool.json").is_file());
    assert_eq!(served.socket, pool.join("nbd.sock"));
    assert!(served.tcp.is_none(), "TCP without --tcp");
    for expected in [
        "nbdinfo '",
        "qemu-img info '",
        "nbdfuse ",
        "nbd+unix:///disk?socket=",
    ] {
        assert!(
            served.banner.contains(expected),
            "banner lacks {expected:?}:\n{}",
            served.banner
        );
    }
    // The banner's nbdinfo line works as printed.
    let line = served
        .banner
        .lines()
        .find(|line| line.trim_start().starts_with("nbdinfo '"))
        .unwrap();
    let uri = line
        .trim()
        .trim_start_matches("nbdinfo '")
        .trim_end_matches('\'');
    let info = run_ok("nbdinfo", &["--json", uri], Duration::from_secs(30));
    let info: serde_json::Value = serde_json::from_str(&info).unwrap();
    assert_eq!(info["exports"][0]["export-size"], 16u64 << 30);
    // The empty export name opens `disk`.
    let client = Client::open(&served.socket, "");
    assert_eq!(client.size, 16 << 30);
    client.disconnect();

    // A second server on the same pool is refused.
    let output = run_tool_in(
        THINPOOL,
        &[
            "serve",
            "--socket",
            temp.join("other.sock").to_str().unwrap(),
        ],
        Duration::from_secs(30),
        Some(temp.path()),
        &[],
    );
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("held by another process"), "{stderr}");

    // Written without a flush; SIGTERM must commit it.
    let mut client = Client::open(&served.socket, "disk");
    client.write(5 * MIB, &pattern(3, 65536));
    client.disconnect();
    let status = served.stop();
    assert!(status.success(), "{status}");
    assert!(!pool.join("nbd.sock").exists());
    assert!(!pool.join("control.sock").exists());

    let served = serve_in(Path::new(""), &[], temp.path());
    let mut client = Client::open(&served.socket, "disk");
    assert_eq!(client.read(5 * MIB, 65536), pattern(3, 65536));
    client.disconnect();
    assert!(served.stop().success());
}

#[test]
fn tcp_on_loopback_and_a_custom_socket() {
    require_tool("nbdinfo", "libnbd-bin");
    let temp = ScratchDir::new("serve-tcp");
    let pool = temp.join("pool");
    create_pool(&pool, &["--data-size", "64M"]);
    create_volume(&pool, "thin", "8M");
    let socket = temp.join("custom.sock");
    let served = serve(&pool, &["--tcp", "0", "--socket", socket.to_str().unwrap()]);
    assert_eq!(served.socket, socket);
    let tcp = served.tcp.clone().unwrap();
    assert!(tcp.starts_with("127.0.0.1:"), "{tcp}");
    assert!(
        served.banner.contains(&format!("nbd://{tcp}/thin")),
        "{}",
        served.banner
    );

    let listing = run_ok(
        "nbdinfo",
        &["--list", "--json", &format!("nbd://{tcp}")],
        Duration::from_secs(30),
    );
    let listing: serde_json::Value = serde_json::from_str(&listing).unwrap();
    let names: Vec<&str> = listing["exports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|export| export["export-name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["thin"]);
    assert!(served.stop().success());
    assert!(!socket.exists());
}

#[test]
fn benchmark_exports_are_not_served_by_the_production_binary() {
    let temp = ScratchDir::new("serve-no-raw");
    let pool = temp.join("pool");
    create_pool(&pool, &["--data-size", "64M"]);
    for flag in ["--raw-export", "--null-export"] {
        let error = thinpool_err(&["serve", "--pool", pool.to_str().unwrap(), flag, "x=1M"]);
        assert!(error.contains(flag), "{flag}: {error}");
    }
}

//! Goal (issue 25, item 4): figures an operator can trust.
//!
//! - `list` takes every figure of a row from one view, the last commit: MAPPED% and the
//!   mapped blocks agree with MAPPED (they mixed live and committed counts, `MAPPED% 0.00`
//!   beside `MAPPED 8.00MiB` after a discard), and an OPEN column counts the clients.
//! - `status` says whether the pool is served, by which pid, with its connections.
//! - trim and passdown count each block once: a second trim gives back nothing new.
//! - `volume create`/`resize` warn when the volumes' sizes exceed the data, and `status`
//!   has the field.
//!
//! Method: a served pool, a raw NBD client, the binary's `--json` answers.

mod e2e_support;

use e2e_support::*;

const BLOCK: u64 = 64 * 1024;

fn json(args: &[&str]) -> serde_json::Value {
    serde_json::from_str(&thinpool_ok(args)).unwrap()
}

fn volume<'a>(list: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    list["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == name)
        .unwrap_or_else(|| panic!("{name} in {list}"))
}

#[test]
fn list_figures_come_from_one_view_with_an_open_column() {
    let scratch = ScratchDir::new("figures-list");
    let pool = scratch.join("pool");
    let p = pool.to_str().unwrap();
    create_pool(&pool, &["--data-size", "64M"]);
    create_volume(&pool, "vm", "16M");
    let served = serve(&pool, &["--quiet"]);
    let mut client = Client::open(&served.socket, "vm");
    for block in 0..(8 * MIB / BLOCK) {
        client.write(block * BLOCK, &pattern(block, BLOCK as usize));
    }
    client.flush();
    // Unmapped live at once; the committed view follows at the next commit.
    let done = client.request(CMD_TRIM, 0, 0, 8 * MIB, &[]);
    assert_eq!(done.error, 0);
    let list = json(&["list", "--json", "--pool", p]);
    let vm = volume(&list, "vm");
    let mapped_bytes = vm["mapped_bytes"].as_u64().expect("committed figures");
    let size = vm["size_bytes"].as_u64().unwrap();
    assert_eq!(
        vm["mapped_blocks"].as_u64().unwrap() * BLOCK,
        mapped_bytes,
        "{vm}"
    );
    let percent = vm["mapped_percent"].as_f64().unwrap();
    assert!(
        (percent - mapped_bytes as f64 * 100.0 / size as f64).abs() < 1e-9,
        "{vm}"
    );
    assert_eq!(vm["open_count"], 1);
    let table = thinpool_ok(&["list", "--pool", p]);
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(header.last(), Some(&"OPEN"), "{table}");
    let row: Vec<&str> = table
        .lines()
        .find(|l| l.starts_with("vm "))
        .unwrap()
        .split_whitespace()
        .collect();
    assert_eq!(row.last(), Some(&"1"), "{table}");
    client.disconnect();
    assert!(served.stop().success());
}

#[test]
fn status_says_who_serves_the_pool_with_its_connections() {
    let scratch = ScratchDir::new("figures-status");
    let pool = scratch.join("pool");
    let p = pool.to_str().unwrap();
    create_pool(&pool, &["--data-size", "64M"]);
    create_volume(&pool, "vm", "16M");
    let idle = json(&["status", "--json", "--pool", p]);
    assert!(idle["served"].is_null(), "{idle}");
    assert!(thinpool_ok(&["status", "--pool", p]).contains("served:            no"));

    let served = serve(&pool, &["--quiet"]);
    let client = Client::open(&served.socket, "vm");
    let status = json(&["status", "--json", "--pool", p]);
    assert_eq!(status["served"]["pid"], served.pid(), "{status}");
    assert_eq!(status["served"]["nbd_unix_connections"], 1, "{status}");
    assert_eq!(status["served"]["nbd_tcp_connections"], 0, "{status}");
    let text = thinpool_ok(&["status", "--pool", p]);
    assert!(
        text.contains(&format!("yes, by pid {}", served.pid())),
        "{text}"
    );
    client.disconnect();
    assert!(served.stop().success());
}

#[test]
fn trim_counts_each_block_once() {
    let scratch = ScratchDir::new("figures-trim");
    let pool = scratch.join("pool");
    let p = pool.to_str().unwrap();
    create_pool(&pool, &["--data-size", "32M"]);
    create_volume(&pool, "vm", "8M");
    let served = serve(&pool, &["--quiet"]);
    let mut client = Client::open(&served.socket, "vm");
    for block in 0..(4 * MIB / BLOCK) {
        client.write(block * BLOCK, &pattern(block, BLOCK as usize));
    }
    client.flush();
    client.disconnect();
    let trimmed = |text: String| -> u64 {
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        v["trimmed_bytes"].as_u64().unwrap()
    };
    let first = trimmed(thinpool_ok(&["trim", "--json", "--pool", p]));
    assert_eq!(first, 28 * MIB, "the free blocks, once");
    let second = trimmed(thinpool_ok(&["trim", "--json", "--pool", p]));
    assert_eq!(second, 0, "nothing freed since: nothing new given back");
    let before = json(&["status", "--json", "--pool", p])["data_passed_down_bytes"]
        .as_u64()
        .unwrap();
    assert_eq!(before, 28 * MIB);
    // Deleting the volume passes its 4 MiB down (once); a trim after that adds nothing.
    thinpool_ok(&["volume", "delete", "vm", "--pool", p]);
    thinpool_ok(&["trim", "--json", "--pool", p]);
    let after = json(&["status", "--json", "--pool", p])["data_passed_down_bytes"]
        .as_u64()
        .unwrap();
    assert_eq!(after, 32 * MIB, "each block counted once");
    assert!(served.stop().success());
}

#[test]
fn over_provisioning_is_warned_of_and_shown() {
    let scratch = ScratchDir::new("figures-overprov");
    let pool = scratch.join("pool");
    let p = pool.to_str().unwrap();
    create_pool(&pool, &["--data-size", "64M"]);
    let fits = thinpool(&["volume", "create", "a", "--size", "32M", "--pool", p]);
    assert!(fits.status.success());
    assert!(!String::from_utf8_lossy(&fits.stderr).contains("over-provisioned"));
    let status = json(&["status", "--json", "--pool", p]);
    assert_eq!(status["overprovisioned"], false);
    assert_eq!(status["volumes_size_bytes"], 32 * MIB);

    let over = thinpool(&["volume", "create", "b", "--size", "48M", "--pool", p]);
    assert!(over.status.success(), "a warning, not a refusal");
    let stderr = String::from_utf8_lossy(&over.stderr);
    assert!(stderr.contains("over-provisioned"), "{stderr}");
    assert!(stderr.contains("80.00MiB"), "{stderr}");
    let status = json(&["status", "--json", "--pool", p]);
    assert_eq!(status["overprovisioned"], true);
    assert!(thinpool_ok(&["status", "--pool", p]).contains("over-provisioned"));

    thinpool_ok(&["volume", "resize", "b", "--size", "16M", "--pool", p]);
    let grown = thinpool(&["volume", "resize", "a", "--size", "60M", "--pool", p]);
    assert!(String::from_utf8_lossy(&grown.stderr).contains("over-provisioned"));
}

//! Goal: the NBD metadata context `x-thinpool:diff:BASE` reports exactly the blocks in which
//! a served volume differs from BASE, to real clients: `nbdinfo --map`, `qemu-img map` with
//! `x-dirty-bitmap`, and libnbd's Python binding (the one `nbdsh` runs), which lists the
//! contexts, selects one together with `base:allocation`, and gets no context (and a
//! working connection) for an unknown base. A base deleted while selected fails that
//! connection's BLOCK_STATUS with EIO (and keeps failing it, even once a volume of that name
//! exists again) and nothing else.
//!
//! Method: write a known set of 64 KiB blocks to a volume, snapshot it, change a few blocks
//! (partial and whole writes, a new block, a whole-block discard), snapshot again; the
//! expected dirty extents are the changed blocks (the model), compared with each client's
//! output.

mod e2e_support;

use e2e_support::*;
use std::path::Path;
use std::process::Command;
use std::time::Duration;
use testkit::nbd_client::{
    meta_request, CMD_BLOCK_STATUS, EIO, OPT_SET_META_CONTEXT, OPT_STRUCTURED_REPLY, REP_ACK,
    REP_META_CONTEXT,
};
use testkit::process::run_command;

const BLOCK: u64 = 64 * 1024;
const SIZE: u64 = 16 * MIB;
const TIMEOUT: Duration = Duration::from_secs(120);

/// The blocks that differ between snap1 and snap2 in [`setup`].
const DIRTY_BLOCKS: [u64; 5] = [1, 20, 21, 50, 200];

/// A served pool with `vm`, `snap1` (before) and `snap2` (after the changes).
fn setup(name: &str) -> (ScratchDir, std::path::PathBuf, Served) {
    let temp = ScratchDir::new(name);
    let pool = temp.join("pool");
    create_pool(&pool, &["--data-size", "256M", "--block-size", "64K"]);
    create_volume(&pool, "vm", "16M");
    let served = serve(&pool, &[]);
    let mut client = Client::open(&served.socket, "vm");
    for (index, (block, count)) in [(0, 4), (10, 1), (20, 2), (100, 1), (200, 1)]
        .into_iter()
        .enumerate()
    {
        client.write(
            block * BLOCK,
            &pattern(index as u64, (count * BLOCK) as usize),
        );
    }
    client.flush();
    snapshot(&pool, "vm", "snap1");
    // Partial write in block 1, a new block 50, blocks 20-21 discarded, block 200 rewritten.
    client.write(BLOCK + 4096, &pattern(10, 4096));
    client.write(50 * BLOCK, &pattern(11, BLOCK as usize));
    let reply = client.request(CMD_TRIM, 0, 20 * BLOCK, 2 * BLOCK, &[]);
    assert_eq!(reply.error, 0, "trim: {reply:?}");
    client.write(200 * BLOCK, &pattern(12, BLOCK as usize));
    client.flush();
    client.disconnect();
    snapshot(&pool, "vm", "snap2");
    (temp, pool, served)
}

fn snapshot(pool: &Path, origin: &str, name: &str) {
    thinpool_ok(&[
        "volume",
        "snapshot",
        origin,
        name,
        "--read-only",
        "--pool",
        pool.to_str().unwrap(),
    ]);
}

/// `(offset, length, dirty)` extents covering `size` for the dirty `blocks`.
fn expected_extents(blocks: &[u64], size: u64) -> Vec<(u64, u64, bool)> {
    let mut extents: Vec<(u64, u64, bool)> = Vec::new();
    for block in 0..size / BLOCK {
        let dirty = blocks.contains(&block);
        match extents.last_mut() {
            Some(last) if last.2 == dirty => last.1 += BLOCK,
            _ => extents.push((block * BLOCK, BLOCK, dirty)),
        }
    }
    extents
}

/// Runs a Python program with libnbd's binding (Debian's python3-libnbd is for
/// /usr/bin/python3, which another python3 on PATH may not be); returns stdout.
fn python_nbd(program: &str, args: &[&str]) -> String {
    require_tool("nbdsh", "python3-libnbd");
    let mut command = Command::new("/usr/bin/python3");
    command.arg("-c").arg(program).args(args);
    let output = run_command(command, "python3 (libnbd)", TIMEOUT);
    assert!(
        output.status.success(),
        "python failed:\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

#[test]
fn nbdinfo_map_prints_exactly_the_changed_extents() {
    require_tool("nbdinfo", "libnbd-bin");
    let (_temp, _pool, served) = setup("diff-nbdinfo");
    let output = run_ok(
        "nbdinfo",
        &["--map=x-thinpool:diff:snap1", &served.uri("snap2")],
        TIMEOUT,
    );
    let rows: Vec<(u64, u64, bool)> = output
        .lines()
        .map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let flags: u64 = fields[2].parse().unwrap();
            (
                fields[0].parse().unwrap(),
                fields[1].parse().unwrap(),
                flags == 1,
            )
        })
        .collect();
    assert_eq!(rows, expected_extents(&DIRTY_BLOCKS, SIZE), "{output}");
    // Against itself... there is no such context; against the live origin, nothing differs
    // but the blocks written after the second snapshot (none).
    let output = run_ok(
        "nbdinfo",
        &["--map=x-thinpool:diff:vm", &served.uri("snap2")],
        TIMEOUT,
    );
    assert_eq!(output.lines().count(), 1, "{output}");
    assert!(output.trim_end().ends_with(" 0"), "{output}");
    // Listing: every other volume is a possible base, and base:allocation is there too.
    let listing = run_ok("nbdinfo", &[&served.uri("snap2")], TIMEOUT);
    for context in [
        "base:allocation",
        "x-thinpool:diff:snap1",
        "x-thinpool:diff:vm",
    ] {
        assert!(listing.contains(context), "{context}: {listing}");
    }
    assert!(!listing.contains("x-thinpool:diff:snap2"), "{listing}");
    served.stop();
}

#[test]
fn qemu_img_map_reports_the_changed_extents_as_a_dirty_bitmap() {
    require_tool("qemu-img", "qemu-utils");
    let (_temp, _pool, served) = setup("diff-qemu");
    let options = format!(
        "driver=nbd,path={},export=snap2,x-dirty-bitmap=x-thinpool:diff:snap1",
        served.socket.display()
    );
    let output = run_ok(
        "qemu-img",
        &["map", "--output=json", "--image-opts", &options],
        TIMEOUT,
    );
    let entries: serde_json::Value = serde_json::from_str(&output).expect("qemu-img json");
    // qemu reads the context's flags as base:allocation's: bit 0 (dirty) shows as "no data".
    let mut extents: Vec<(u64, u64, bool)> = Vec::new();
    for entry in entries.as_array().expect("array") {
        let start = entry["start"].as_u64().unwrap();
        let length = entry["length"].as_u64().unwrap();
        let dirty = !entry["data"].as_bool().unwrap();
        match extents.last_mut() {
            Some(last) if last.2 == dirty && last.0 + last.1 == start => last.1 += length,
            _ => extents.push((start, length, dirty)),
        }
    }
    assert_eq!(extents, expected_extents(&DIRTY_BLOCKS, SIZE), "{output}");
    served.stop();
}

/// Lists the contexts matching each query, then selects three contexts (one of them for an
/// unknown base) with base:allocation; prints JSON.
const PYTHON_CONTEXTS: &str = r#"
import json, sys, nbd
uri = sys.argv[1]
result = {}
for query in ["x-thinpool:diff:", "x-thinpool:", "x-thinpool:diff:snap1", "x-thinpool:diff:nosuch"]:
    h = nbd.NBD()
    h.set_opt_mode(True)
    h.connect_uri(uri)
    h.add_meta_context(query)
    names = []
    h.opt_list_meta_context(lambda name: names.append(name))
    result["list " + query] = sorted(names)
    h.opt_abort()
contexts = ["base:allocation", "x-thinpool:diff:snap1", "x-thinpool:diff:nosuch"]
h = nbd.NBD()
for context in contexts:
    h.add_meta_context(context)
h.connect_uri(uri)
result["can"] = {context: h.can_meta_context(context) for context in contexts}
seen = {}
def extent(context, offset, entries, error):
    seen.setdefault(context, []).extend(entries)
    return 0
h.block_status(h.get_size(), 0, extent)
result["extents"] = seen
result["read"] = h.pread(512, 50 * 65536)[:8].hex()
h.shutdown()
print(json.dumps(result))
"#;

#[test]
fn libnbd_lists_selects_with_base_allocation_and_skips_an_unknown_base() {
    let (_temp, _pool, served) = setup("diff-libnbd");
    let output = python_nbd(PYTHON_CONTEXTS, &[&served.uri("snap2")]);
    let result: serde_json::Value = serde_json::from_str(&output).expect("json");
    let diff_contexts = serde_json::json!(["x-thinpool:diff:snap1", "x-thinpool:diff:vm"]);
    assert_eq!(result["list x-thinpool:diff:"], diff_contexts, "{output}");
    assert_eq!(result["list x-thinpool:"], diff_contexts, "{output}");
    assert_eq!(
        result["list x-thinpool:diff:snap1"],
        serde_json::json!(["x-thinpool:diff:snap1"])
    );
    assert_eq!(result["list x-thinpool:diff:nosuch"], serde_json::json!([]));
    assert_eq!(
        result["can"],
        serde_json::json!({
            "base:allocation": true,
            "x-thinpool:diff:snap1": true,
            "x-thinpool:diff:nosuch": false,
        })
    );
    let pairs = |context: &str| -> Vec<(u64, u64)> {
        let entries = result["extents"][context].as_array().unwrap();
        entries
            .chunks(2)
            .map(|pair| (pair[0].as_u64().unwrap(), pair[1].as_u64().unwrap()))
            .collect()
    };
    let dirty: Vec<(u64, u64)> = expected_extents(&DIRTY_BLOCKS, SIZE)
        .into_iter()
        .map(|(_, length, dirty)| (length, u64::from(dirty)))
        .collect();
    assert_eq!(pairs("x-thinpool:diff:snap1"), dirty, "{output}");
    // base:allocation of snap2 in the same reply: mapped blocks are 0, holes 3.
    let mapped = [0, 1, 2, 3, 10, 50, 100, 200];
    let allocation: Vec<(u64, u64)> = expected_extents(&mapped, SIZE)
        .into_iter()
        .map(|(_, length, mapped)| (length, if mapped { 0 } else { 3 }))
        .collect();
    assert_eq!(pairs("base:allocation"), allocation, "{output}");
    assert!(result["extents"]["x-thinpool:diff:nosuch"].is_null());
    // The connection served a read after all that.
    let expected: String = pattern(11, 8).iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(result["read"], expected.as_str());
    served.stop();
}

#[test]
fn a_base_deleted_while_selected_fails_block_status_with_eio_only() {
    require_tool("nbdinfo", "libnbd-bin");
    let (_temp, pool, served) = setup("diff-deleted");
    snapshot(&pool, "vm", "tmp");
    let mut client = Client::start(&served.socket);
    assert_eq!(
        client.option(OPT_STRUCTURED_REPLY, &[])[0].reply_type,
        REP_ACK
    );
    let replies = client.option(
        OPT_SET_META_CONTEXT,
        &meta_request("snap2", &["base:allocation", "x-thinpool:diff:tmp"]),
    );
    assert_eq!(replies.len(), 3, "{replies:?}");
    assert_eq!(replies[1].reply_type, REP_META_CONTEXT);
    client.go("snap2");
    client.mode = Mode::Structured;
    let reply = client.request(CMD_BLOCK_STATUS, 0, 0, SIZE, &[]);
    assert_eq!(reply.error, 0, "{reply:?}");
    assert_eq!(reply.block_status.len(), 2);
    // The selection holds no handle on the base: it can be deleted.
    let pool_arg = pool.to_str().unwrap();
    thinpool_ok(&["volume", "delete", "tmp", "--pool", pool_arg]);
    let reply = client.request(CMD_BLOCK_STATUS, 0, 0, SIZE, &[]);
    assert_eq!(reply.error, EIO, "{reply:?}");
    assert!(reply.error_message.contains("deleted"), "{reply:?}");
    assert_eq!(client.read(50 * BLOCK, 512), pattern(11, 512));
    // A new volume under the old name is not the base that was selected.
    snapshot(&pool, "vm", "tmp");
    let reply = client.request(CMD_BLOCK_STATUS, 0, 0, SIZE, &[]);
    assert_eq!(reply.error, EIO, "{reply:?}");
    assert!(reply.error_message.contains("deleted"), "{reply:?}");
    // A new connection can select the new volume.
    let output = run_ok(
        "nbdinfo",
        &["--map=x-thinpool:diff:tmp", &served.uri("snap2")],
        TIMEOUT,
    );
    assert_eq!(output.lines().count(), 1, "{output}");
    client.disconnect();
    served.stop();
}

/// A structured connection to `export` with `contexts` selected; returns it and the
/// number of contexts the server selected.
fn select(served: &Served, export: &str, contexts: &[&str]) -> (Client, usize) {
    let mut client = Client::start(&served.socket);
    assert_eq!(
        client.option(OPT_STRUCTURED_REPLY, &[])[0].reply_type,
        REP_ACK
    );
    let replies = client.option(OPT_SET_META_CONTEXT, &meta_request(export, contexts));
    let selected = replies
        .iter()
        .filter(|r| r.reply_type == REP_META_CONTEXT)
        .count();
    client.go(export);
    client.mode = Mode::Structured;
    (client, selected)
}

#[test]
fn a_base_reverted_recreated_or_renamed_between_requests_fails_block_status_with_eio() {
    let (_temp, pool, served) = setup("diff-identity");
    let p = pool.to_str().unwrap();
    let changes: [(&str, &dyn Fn()); 3] = [
        ("revert", &|| {
            thinpool_ok(&["volume", "revert", "tmp", "snap1", "--pool", p]);
        }),
        ("delete and re-create", &|| {
            let id = |list: String| -> serde_json::Value {
                let volumes: serde_json::Value = serde_json::from_str(&list).unwrap();
                let found = volumes["volumes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|v| v["name"] == "tmp")
                    .cloned()
                    .unwrap();
                found["id"].clone()
            };
            let before = id(thinpool_ok(&["list", "--pool", p, "--json"]));
            thinpool_ok(&["volume", "delete", "tmp", "--pool", p]);
            snapshot(&pool, "vm", "tmp");
            let after = id(thinpool_ok(&["list", "--pool", p, "--json"]));
            assert_eq!(before, after, "the thin id is reused");
        }),
        ("rename away and back", &|| {
            thinpool_ok(&["volume", "rename", "tmp", "tmp-away", "--pool", p]);
            thinpool_ok(&["volume", "rename", "tmp-away", "tmp", "--pool", p]);
        }),
    ];
    for (what, change) in changes {
        snapshot(&pool, "vm", "tmp");
        let (mut client, selected) = select(&served, "snap2", &["x-thinpool:diff:tmp"]);
        assert_eq!(selected, 1, "{what}");
        let reply = client.request(CMD_BLOCK_STATUS, 0, 0, SIZE, &[]);
        assert_eq!(reply.error, 0, "{what}: {reply:?}");
        change();
        for _ in 0..2 {
            let reply = client.request(CMD_BLOCK_STATUS, 0, 0, SIZE, &[]);
            assert_eq!(reply.error, EIO, "{what}: {reply:?}");
            assert!(
                reply.error_message.contains("reverted"),
                "{what}: {reply:?}"
            );
        }
        // Reads go on.
        assert_eq!(client.read(50 * BLOCK, 512), pattern(11, 512), "{what}");
        client.disconnect();
        thinpool_ok(&["volume", "delete", "tmp", "--pool", p]);
    }
    // Each context logged why, once.
    let (_, log) = served.stop_with_log();
    assert_eq!(log.matches("fails from now on").count(), 3, "{log}");
}

/// Lists the diff contexts of the export in the URI, then selects two; prints JSON.
const PYTHON_SCOPE: &str = r#"
import json, sys, nbd
uri = sys.argv[1]
result = {}
h = nbd.NBD()
h.set_opt_mode(True)
h.connect_uri(uri)
h.add_meta_context("x-thinpool:")
names = []
h.opt_list_meta_context(lambda name: names.append(name))
result["list"] = sorted(names)
h.opt_abort()
h = nbd.NBD()
contexts = ["x-thinpool:diff:snap1", "x-thinpool:diff:vm"]
for context in contexts:
    h.add_meta_context(context)
h.connect_uri(uri)
result["can"] = {context: h.can_meta_context(context) for context in contexts}
h.shutdown()
print(json.dumps(result))
"#;

#[test]
fn a_tcp_export_listener_offers_only_diff_contexts_of_the_exports_it_serves() {
    let (_temp, _pool, served) = setup("diff-scope");
    let unix = python_nbd(PYTHON_SCOPE, &[&served.uri("snap2")]);
    served.stop();
    let unix: serde_json::Value = serde_json::from_str(&unix).expect("json");
    assert_eq!(
        unix["list"],
        serde_json::json!(["x-thinpool:diff:snap1", "x-thinpool:diff:vm"])
    );
    let pool = _temp.join("pool");
    let served = serve(
        &pool,
        &[
            "--tcp",
            "0",
            "--tcp-export",
            "snap2",
            "--tcp-export",
            "snap1",
        ],
    );
    let tcp = format!("nbd://{}/snap2", served.tcp.clone().unwrap());
    let output = python_nbd(PYTHON_SCOPE, &[&tcp]);
    let result: serde_json::Value = serde_json::from_str(&output).expect("json");
    // vm is not served on TCP: its name is not listed and its context not given.
    assert_eq!(result["list"], serde_json::json!(["x-thinpool:diff:snap1"]));
    assert_eq!(
        result["can"],
        serde_json::json!({"x-thinpool:diff:snap1": true, "x-thinpool:diff:vm": false})
    );
    // The Unix socket still offers both.
    let unix = python_nbd(PYTHON_SCOPE, &[&served.uri("snap2")]);
    let unix: serde_json::Value = serde_json::from_str(&unix).expect("json");
    assert_eq!(unix["can"]["x-thinpool:diff:vm"], true, "{unix}");
    served.stop();
}

#[test]
fn a_huge_block_status_over_many_differences_is_answered_in_part() {
    let temp = ScratchDir::new("diff-bounded");
    let pool = temp.join("pool");
    create_pool(&pool, &["--data-size", "1G", "--block-size", "64K"]);
    create_volume(&pool, "big", "1G");
    create_volume(&pool, "empty", "1G");
    let served = serve(&pool, &[]);
    // 12,000 mapped blocks: about 50 mapping leaves or more, against an empty base.
    let mapped = 12_000u64;
    let mut client = Client::open(&served.socket, "big");
    for block in 0..mapped {
        client.write(block * BLOCK, &[1; 512]);
    }
    client.flush();
    client.disconnect();
    let (mut client, selected) = select(&served, "big", &["x-thinpool:diff:empty"]);
    assert_eq!(selected, 1);
    let size = 1u64 << 30;
    let mut offset = 0;
    let mut extents: Vec<(u64, u64, bool)> = Vec::new();
    let mut replies = 0;
    while offset < size {
        let reply = client.request(CMD_BLOCK_STATUS, 0, offset, size - offset, &[]);
        assert_eq!(reply.error, 0, "{reply:?}");
        let (_, chunk) = &reply.block_status[0];
        let covered: u64 = chunk.iter().map(|(length, _)| length).sum();
        if replies == 0 {
            assert!(covered < size, "one reply walked all {mapped} differences");
        }
        for &(length, flags) in chunk {
            let dirty = flags == 1;
            match extents.last_mut() {
                Some(last) if last.2 == dirty => last.1 += length,
                _ => extents.push((offset, length, dirty)),
            }
            offset += length;
        }
        replies += 1;
    }
    assert!(replies > 1);
    assert_eq!(
        extents,
        vec![
            (0, mapped * BLOCK, true),
            (mapped * BLOCK, size - mapped * BLOCK, false)
        ]
    );
    client.disconnect();
    served.stop();
}

//! Goal: freed data blocks give their space back to the host while the pool serves:
//! deleting a volume, shrinking one and discarding through NBD punch holes in the data file,
//! and `thinpool trim` (through the control socket) punches every free block of a pool made
//! with `--no-discard-passdown`; every volume reads back unchanged throughout.
//!
//! Method: the data file's allocated size (`st_blocks`, as `stat -c %b`) before and after
//! each step; volumes read back through NBD against a model of what was written.

mod e2e_support;

use e2e_support::*;
use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

const BLOCK: u64 = 64 * 1024;
/// Blocks per volume (8 MiB).
const BLOCKS: u64 = 128;

/// Volume → its contents (zeros where unwritten).
type Model = BTreeMap<String, Vec<u8>>;

fn allocated(pool: &Path) -> u64 {
    std::fs::metadata(pool.join("data")).unwrap().blocks() * 512
}

fn fill(served: &Served, model: &mut Model, name: &str, tag: u64) {
    let mut client = Client::open(&served.socket, name);
    let mut contents = Vec::new();
    for block in 0..BLOCKS {
        let data = pattern(tag * 1000 + block, BLOCK as usize);
        client.write(block * BLOCK, &data);
        contents.extend_from_slice(&data);
    }
    client.flush();
    client.disconnect();
    model.insert(name.to_string(), contents);
}

fn check(served: &Served, model: &Model) {
    for (name, contents) in model {
        let mut client = Client::open(&served.socket, name);
        assert!(
            client.read(0, contents.len() as u64) == *contents,
            "volume {name} reads back"
        );
        client.disconnect();
    }
}

fn fell(before: u64, after: u64, blocks: u64, what: &str) {
    assert!(
        after + blocks * BLOCK <= before,
        "{what}: allocated {before} → {after} bytes, expected a fall of {} bytes",
        blocks * BLOCK
    );
}

fn volume(pool: &str, args: &[&str]) {
    let mut all = vec!["volume"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--pool", pool]);
    thinpool_ok(&all);
}

#[test]
fn delete_shrink_and_discard_give_space_back() {
    let temp = ScratchDir::new("host-space-cli");
    let pool = temp.join("pool");
    let p = pool.to_str().unwrap();
    create_pool(&pool, &["--data-size", "64M"]);
    for name in ["a", "b", "c"] {
        create_volume(&pool, name, "8M");
    }
    let served = serve(&pool, &["--quiet"]);
    let mut model = Model::new();
    for (tag, name) in ["a", "b", "c"].into_iter().enumerate() {
        fill(&served, &mut model, name, tag as u64 + 1);
    }
    let full = allocated(&pool);
    assert!(full >= 3 * BLOCKS * BLOCK, "{full}");

    volume(p, &["delete", "c"]);
    model.remove("c");
    let after_delete = allocated(&pool);
    fell(full, after_delete, BLOCKS, "delete");
    check(&served, &model);

    volume(p, &["resize", "b", "--size", "2M", "--force"]);
    model.get_mut("b").unwrap().truncate((2 * MIB) as usize);
    let after_shrink = allocated(&pool);
    fell(after_delete, after_shrink, BLOCKS - 32, "shrink");
    check(&served, &model);

    let mut client = Client::open(&served.socket, "a");
    let reply = client.request(CMD_TRIM, 0, MIB, 2 * MIB, &[]);
    assert_eq!(reply.error, 0, "trim: {}", reply.error_message);
    client.flush();
    client.disconnect();
    model.get_mut("a").unwrap()[MIB as usize..(3 * MIB) as usize].fill(0);
    let after_discard = allocated(&pool);
    fell(after_shrink, after_discard, 32, "discard");
    check(&served, &model);
    assert!(served.stop().success());
}

#[test]
fn trim_punches_every_free_block_of_a_pool_without_passdown() {
    let temp = ScratchDir::new("host-trim-cli");
    let pool = temp.join("pool");
    let p = pool.to_str().unwrap();
    create_pool(&pool, &["--data-size", "64M", "--no-discard-passdown"]);
    for name in ["keep", "gone", "shrunk"] {
        create_volume(&pool, name, "8M");
    }
    let served = serve(&pool, &["--quiet"]);
    let mut model = Model::new();
    for (tag, name) in ["keep", "gone", "shrunk"].into_iter().enumerate() {
        fill(&served, &mut model, name, tag as u64 + 1);
    }
    let full = allocated(&pool);
    volume(p, &["delete", "gone"]);
    model.remove("gone");
    volume(p, &["resize", "shrunk", "--size", "4M", "--force"]);
    model
        .get_mut("shrunk")
        .unwrap()
        .truncate((4 * MIB) as usize);
    assert_eq!(allocated(&pool), full, "no passdown: nothing punched yet");

    let answer: serde_json::Value =
        serde_json::from_str(&thinpool_ok(&["trim", "--json", "--pool", p])).unwrap();
    let status: serde_json::Value =
        serde_json::from_str(&thinpool_ok(&["status", "--json", "--pool", p])).unwrap();
    let free = status["data_total_blocks"].as_u64().unwrap()
        - status["data_used_blocks"].as_u64().unwrap();
    assert_eq!(answer["trimmed_bytes"].as_u64().unwrap(), free * BLOCK);
    let after_trim = allocated(&pool);
    fell(full, after_trim, BLOCKS + 64, "trim");
    check(&served, &model);
    assert!(served.stop().success());
    // Offline (no server holds the pool) the same command works on the pool directly.
    let text = thinpool_ok(&["trim", "--pool", p]);
    assert!(text.starts_with("trimmed "), "{text}");
    assert_eq!(allocated(&pool), after_trim);
}

//! Goal: the incremental backup of `docs/backup.md` works end to end: a full `nbdcopy` of
//! snapshot 1, then `scripts/incremental-backup` copying only the extents that
//! `x-thinpool:diff:snap1` marks on snapshot 2, gives an image byte-identical to snapshot 2,
//! and copies exactly the blocks that changed (so the bytes copied are the bytes changed,
//! rounded out to whole blocks). The volume keeps changing while it is served and while the
//! full copy runs, grows between the snapshots, and has ranges discarded (the backup must
//! read zeros there).
//!
//! Method: seeded random writes and whole-block discards through our raw client, applied
//! alongside to a model of the volume's bytes and of each block's state (shared with
//! snapshot 1, written since, unmapped); `thinpool volume resize` grows the volume while it
//! is served. The backup image is compared with the model and with a full `nbdcopy` of
//! snapshot 2 (`cmp`); the script's byte count with the model's dirty blocks.

mod e2e_support;

use e2e_support::*;
use rand::rngs::StdRng;
use rand::Rng;
use std::path::Path;
use std::process::Command;
use std::time::Duration;
use testkit::nbd_client::CMD_TRIM;
use testkit::process::run_command;

const BLOCK: u64 = 64 * 1024;
const SIZE_BEFORE: u64 = 32 * MIB;
const SIZE_AFTER: u64 = 48 * MIB;
const TIMEOUT: Duration = Duration::from_secs(180);

/// What a block of the volume holds relative to snapshot 1.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum State {
    /// Unmapped (never written, or discarded).
    Unmapped,
    /// Mapped, and the same data block as in snapshot 1.
    Shared,
    /// Written since snapshot 1.
    Written,
}

/// The volume's bytes and the state of each block.
struct Model {
    bytes: Vec<u8>,
    states: Vec<State>,
    /// Which blocks snapshot 1 maps.
    base_mapped: Vec<bool>,
}

/// One change made through NBD.
#[derive(Clone, Debug)]
enum Change {
    Write { offset: u64, data: Vec<u8> },
    Discard { offset: u64, length: u64 },
}

impl Model {
    fn new(size: u64) -> Self {
        Model {
            bytes: vec![0; size as usize],
            states: vec![State::Unmapped; (size / BLOCK) as usize],
            base_mapped: Vec::new(),
        }
    }

    fn apply(&mut self, change: &Change) {
        match change {
            Change::Write { offset, data } => {
                let start = *offset as usize;
                self.bytes[start..start + data.len()].copy_from_slice(data);
                let first = offset / BLOCK;
                let last = (offset + data.len() as u64).div_ceil(BLOCK);
                for block in first..last {
                    self.states[block as usize] = State::Written;
                }
            }
            Change::Discard { offset, length } => {
                assert_eq!(offset % BLOCK, 0);
                assert_eq!(length % BLOCK, 0);
                let start = *offset as usize;
                self.bytes[start..start + *length as usize].fill(0);
                for block in offset / BLOCK..(offset + length) / BLOCK {
                    self.states[block as usize] = State::Unmapped;
                }
            }
        }
    }

    /// Snapshot 1 is taken: every mapped block is now shared with it.
    fn snapshot(&mut self) {
        self.base_mapped = self.states.iter().map(|s| *s != State::Unmapped).collect();
        for state in &mut self.states {
            if *state == State::Written {
                *state = State::Shared;
            }
        }
    }

    fn grow(&mut self, size: u64) {
        self.bytes.resize(size as usize, 0);
        self.states.resize((size / BLOCK) as usize, State::Unmapped);
    }

    /// Blocks in which the volume differs from snapshot 1.
    fn dirty_blocks(&self) -> u64 {
        (0..self.states.len())
            .filter(|&block| {
                let base = self.base_mapped.get(block).copied().unwrap_or(false);
                match self.states[block] {
                    State::Written => true,
                    State::Unmapped => base,
                    State::Shared => false,
                }
            })
            .count() as u64
    }
}

fn send(client: &mut Client, change: &Change) {
    match change {
        Change::Write { offset, data } => client.write(*offset, data),
        Change::Discard { offset, length } => {
            let reply = client.request(CMD_TRIM, 0, *offset, *length, &[]);
            assert_eq!(reply.error, 0, "trim: {reply:?}");
        }
    }
}

/// Random 512-byte aligned writes (up to 256 KiB) and whole-block discards inside `size`.
fn changes(rng: &mut StdRng, count: usize, from: u64, size: u64) -> Vec<Change> {
    (0..count)
        .map(|index| {
            if index % 4 == 3 {
                let blocks = rng.gen_range(1..4u64);
                let block = rng.gen_range(from / BLOCK..size / BLOCK - blocks);
                Change::Discard {
                    offset: block * BLOCK,
                    length: blocks * BLOCK,
                }
            } else {
                let length = rng.gen_range(1..=512u64) * 512;
                let offset = rng.gen_range(from / 512..(size - length) / 512) * 512;
                Change::Write {
                    offset,
                    data: pattern(rng.gen_range(0..u64::MAX), length as usize),
                }
            }
        })
        .collect()
}

fn thinpool_in(pool: &Path, args: &[&str]) {
    let mut all = args.to_vec();
    all.extend(["--pool", pool.to_str().unwrap()]);
    thinpool_ok(&all);
}

fn changed_bytes(changes: &[Change]) -> u64 {
    changes
        .iter()
        .map(|change| match change {
            Change::Write { data, .. } => data.len() as u64,
            Change::Discard { length, .. } => *length,
        })
        .sum()
}

#[test]
fn incremental_backup_after_writes_discards_and_a_grow_matches_snapshot_2() {
    require_tool("nbdcopy", "libnbd-bin");
    require_tool("nbdsh", "python3-libnbd");
    require_tool("cmp", "diffutils");
    let (_report, mut rng) = testkit::seeded_rng();
    let temp = ScratchDir::new("incremental-backup");
    let pool = temp.join("pool");
    create_pool(&pool, &["--data-size", "512M", "--block-size", "64K"]);
    create_volume(&pool, "vm", "32M");
    let served = serve(&pool, &[]);
    let mut model = Model::new(SIZE_BEFORE);

    // The volume before snapshot 1.
    let mut client = Client::open(&served.socket, "vm");
    for change in changes(&mut rng, 60, 0, SIZE_BEFORE) {
        send(&mut client, &change);
        model.apply(&change);
    }
    client.flush();
    thinpool_in(&pool, &["volume", "snapshot", "vm", "snap1", "--read-only"]);
    model.snapshot();

    // Full copy of snapshot 1 while the volume keeps changing.
    let during = changes(&mut rng, 40, 0, SIZE_BEFORE);
    let writer = {
        let during = during.clone();
        std::thread::spawn(move || {
            for change in &during {
                send(&mut client, change);
            }
            client.flush();
            client.disconnect();
        })
    };
    let backup = temp.join("backup.img");
    std::fs::File::create(&backup)
        .unwrap()
        .set_len(SIZE_BEFORE)
        .unwrap();
    let backup_arg = backup.to_str().unwrap();
    run_ok("nbdcopy", &[&served.uri("snap1"), backup_arg], TIMEOUT);
    writer.join().expect("writer thread");
    for change in &during {
        model.apply(change);
    }
    let snap1_bytes = std::fs::read(&backup).unwrap();
    assert!(
        snap1_bytes != model.bytes[..],
        "the changes made no difference"
    );

    // The volume grows while served; a new connection writes into the new part.
    thinpool_in(&pool, &["volume", "resize", "vm", "--size", "48M"]);
    model.grow(SIZE_AFTER);
    let after = changes(&mut rng, 20, SIZE_BEFORE - 4 * BLOCK, SIZE_AFTER);
    let mut client = Client::open(&served.socket, "vm");
    assert_eq!(client.size, SIZE_AFTER);
    for change in &after {
        send(&mut client, change);
        model.apply(change);
    }
    client.flush();
    client.disconnect();
    thinpool_in(&pool, &["volume", "snapshot", "vm", "snap2", "--read-only"]);

    // The incremental copy.
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/incremental-backup");
    let mut command = Command::new(&script);
    command.args(["--base", "snap1", &served.uri("snap2"), backup_arg]);
    let output = run_command(command, "scripts/incremental-backup", TIMEOUT);
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "incremental-backup failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let copied: u64 = stdout
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no byte count in {stdout:?}"));

    // Byte-identical to snapshot 2: the model, and a full copy compared with cmp.
    let image = std::fs::read(&backup).unwrap();
    assert_eq!(image.len() as u64, SIZE_AFTER);
    if let Some(at) = (0..image.len()).find(|&i| image[i] != model.bytes[i]) {
        panic!(
            "backup differs from the model at byte {at} (block {})",
            at as u64 / BLOCK
        );
    }
    let full = temp.join("full.img");
    std::fs::File::create(&full)
        .unwrap()
        .set_len(SIZE_AFTER)
        .unwrap();
    run_ok(
        "nbdcopy",
        &[&served.uri("snap2"), full.to_str().unwrap()],
        TIMEOUT,
    );
    run_ok("cmp", &[backup_arg, full.to_str().unwrap()], TIMEOUT);

    // Only what changed was copied: exactly the blocks the model says differ.
    let dirty_bytes = model.dirty_blocks() * BLOCK;
    let changed = changed_bytes(&during) + changed_bytes(&after);
    eprintln!(
        "changed {changed} bytes in {} operations; copied {copied} bytes ({} blocks of {BLOCK}); volume {SIZE_AFTER} bytes",
        during.len() + after.len(),
        copied / BLOCK
    );
    assert_eq!(copied, dirty_bytes, "{stdout}");
    assert!(copied < SIZE_AFTER / 2, "copied {copied} of {SIZE_AFTER}");
    served.stop();
}

//! Goal: killing the server with SIGKILL while clients write and flush loses nothing that a
//! completed FLUSH covered, and leaves metadata that both thin_check versions accept.
//!
//! Method: two writer threads (two connections, two volumes, one of them snapshotted over the
//! control socket while it is written) overwrite 64 KiB slots with self-describing sectors
//! (`testkit::slots`: slot, generation, sector index, then a fill byte) and flush every few writes, recording
//! for each slot the generation the last completed flush covered. The server is killed at a
//! random moment, both `thin_check` versions run on the metadata, the server restarts (on its
//! stale sockets), and every slot must hold a valid sector image of at least its flushed
//! generation. Three crash cycles. Seeded by testkit (`THINPOOL_SEED`, printed on failure).

mod e2e_support;

use e2e_support::*;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use testkit::slots::{check_slot, slot_image};
use testkit::tools::ThinTools;

const SLOT_BYTES: usize = 64 * 1024;
const SLOTS: u64 = 96;
const WRITES_PER_FLUSH: usize = 8;

/// Per volume: the generation each slot's last completed flush covered.
type Flushed = Arc<Mutex<Vec<u64>>>;

/// Writes slots in a seeded order until the connection fails (the server was killed).
fn writer(socket: &Path, volume: &str, flushed: Flushed, seed: u64, first_generation: u64) {
    let Ok(mut client) = Client::try_open(socket, volume) else {
        return;
    };
    let mut state = seed | 1;
    let mut generation = first_generation;
    let mut pending: Vec<(u64, u64)> = Vec::new();
    loop {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let slot = state % SLOTS;
        generation += 1;
        let image = slot_image(slot, generation, SLOT_BYTES);
        let offset = slot * SLOT_BYTES as u64;
        if !succeeds(&mut client, CMD_WRITE, offset, &image) {
            return;
        }
        pending.push((slot, generation));
        if pending.len() == WRITES_PER_FLUSH {
            if !succeeds(&mut client, CMD_FLUSH, 0, &[]) {
                return;
            }
            let mut flushed = flushed.lock().unwrap();
            for (slot, generation) in pending.drain(..) {
                flushed[slot as usize] = flushed[slot as usize].max(generation);
            }
        }
    }
}

/// Whether a WRITE (or FLUSH, without payload) got a successful reply; false once the socket
/// fails because the server was killed.
fn succeeds(client: &mut Client, command: u16, offset: u64, payload: &[u8]) -> bool {
    let reply = client.try_request(command, offset, payload);
    matches!(reply.map(|reply| reply.error), Ok(0))
}

fn verify(socket: &Path, volume: &str, flushed: &Flushed) -> u64 {
    let flushed = flushed.lock().unwrap().clone();
    let mut client = Client::open(socket, volume);
    for slot in 0..SLOTS {
        let data = client.read(slot * SLOT_BYTES as u64, SLOT_BYTES as u64);
        check_slot(volume, slot, &data, flushed[slot as usize]);
    }
    client.disconnect();
    flushed.iter().filter(|&&generation| generation > 0).count() as u64
}

#[test]
fn sigkill_during_flushed_writes_keeps_every_flushed_write() {
    let report = seed_report();
    let seed = report.seed();
    let temp = ScratchDir::new("e2e-crash");
    let pool = temp.join("pool");
    let p = pool.to_str().unwrap();
    create_pool(&pool, &["--data-size", "512M"]);
    create_volume(&pool, "a", "8M");
    create_volume(&pool, "b", "8M");
    let flushed: Vec<Flushed> = (0..2)
        .map(|_| Arc::new(Mutex::new(vec![0u64; SLOTS as usize])))
        .collect();
    let mut snapshots = 0;
    for cycle in 0..3u64 {
        let served = serve(&pool, &["--quiet"]);
        // What the last cycle flushed survived its crash.
        for (volume, flushed) in ["a", "b"].iter().zip(&flushed) {
            let covered = verify(&served.socket, volume, flushed);
            let newest = flushed.lock().unwrap().iter().copied().max().unwrap_or(0);
            eprintln!(
                "cycle {cycle}: {volume}: {covered} slots flushed, newest generation {newest:#x}"
            );
        }
        let writers: Vec<_> = ["a", "b"]
            .iter()
            .zip(&flushed)
            .enumerate()
            .map(|(index, (volume, flushed))| {
                let socket = served.socket.clone();
                let volume = volume.to_string();
                let flushed = Arc::clone(flushed);
                let writer_seed = seed ^ ((cycle * 2 + index as u64 + 1) * 0x9e37_79b9);
                std::thread::spawn(move || {
                    writer(&socket, &volume, flushed, writer_seed, (cycle + 1) << 32)
                })
            })
            .collect();
        // Let some flushes complete, snapshot `a` under load, then crash at a seeded moment.
        std::thread::sleep(Duration::from_millis(300));
        let name = format!("a-snap-{cycle}");
        thinpool_ok(&["volume", "snapshot", "a", &name, "--pool", p]);
        snapshots += 1;
        std::thread::sleep(Duration::from_millis(300 + (seed >> (cycle * 8)) % 700));
        served.kill9();
        for writer in writers {
            writer.join().unwrap();
        }
        ThinTools::check_all(&pool.join("metadata"));
    }
    let served = serve(&pool, &["--quiet"]);
    for (volume, flushed) in ["a", "b"].iter().zip(&flushed) {
        let covered = verify(&served.socket, volume, flushed);
        assert!(
            covered > SLOTS / 2,
            "only {covered} slots of {volume} were ever flushed"
        );
    }
    let listing: serde_json::Value =
        serde_json::from_str(&thinpool_ok(&["list", "--json", "--pool", p])).unwrap();
    assert_eq!(listing["volumes"].as_array().unwrap().len(), 2 + snapshots);
    assert!(served.stop().success());
    ThinTools::check_all(&pool.join("metadata"));
}

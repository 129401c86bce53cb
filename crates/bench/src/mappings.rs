//! Management of a large volume: snapshot creation, volume deletion and activation (opening
//! the pool and the volume) with 1M mappings (64 GiB virtual, 64 KiB blocks; `--quick`
//! uses fewer), each against the same operation on an empty volume of the same size.
//!
//! The volume is provisioned with `Volume::write_zeroes` without unmapping (NBD's
//! `WRITE_ZEROES` with `NO_HOLE`): every block is allocated and mapped like a first write,
//! and the data device zeroes it with `fallocate` instead of writing 64 KiB, so 1M real
//! mappings cost seconds and no RAM on `/dev/shm`.
//!
//! Two deletions are measured. Deleting a snapshot whose mappings are all still shared with
//! its origin only drops a reference to the shared mapping tree (dm-thin's design, O(1)).
//! Deleting a volume whose blocks nobody else holds walks its mappings and frees every data
//! block; each repetition provisions a fresh volume for it.

use super::dir::BenchDir;
use super::report::{Row, Target};
use super::{create_pool, progress, time, Sizes, BLOCK_SIZE_BYTES};
use anyhow::{ensure, Context};
use thin_pool::{Pool, PoolOptions};

/// Provisioning step between Ctrl-C checks: 1 GiB.
const PROVISION_CHUNK_BYTES: u64 = 1 << 30;

/// Activation must be well under a second; we hold it to half of one.
const ACTIVATION_MAX_MS: f64 = 500.0;

/// Names of the pool with the large volume and of its baseline.
const POOL: &str = "mappings";
const EMPTY_POOL: &str = "mappings-empty";

/// Snapshot and delete times, then activation times.
pub fn run(dir: &BenchDir, sizes: &Sizes) -> anyhow::Result<Vec<Row>> {
    let mapping_count = sizes.mapping_count;
    let volume_bytes = mapping_count * BLOCK_SIZE_BYTES;
    // The large volume and one more of the same size, provisioned to be deleted.
    let data_bytes = 2 * volume_bytes + 16 * BLOCK_SIZE_BYTES;
    let pool = create_pool(dir, POOL, data_bytes, BLOCK_SIZE_BYTES)?;
    pool.create_volume("big", volume_bytes)?;
    pool.create_volume("empty", volume_bytes)?;
    progress(&format!(
        "large volume: provisioning {mapping_count} mappings"
    ));
    let (seconds, ()) = time(|| provision(dir, &pool, "big"))?;
    let mapped = pool.info("big")?.mapped_blocks;
    ensure!(
        mapped == mapping_count,
        "the volume maps {mapped} blocks, expected {mapping_count}"
    );
    progress(&format!(
        "large volume: {mapping_count} mappings in {seconds:.1} s ({:.0} provisions/s)",
        mapping_count as f64 / seconds
    ));

    let times = snapshots_and_deletes(dir, sizes, &pool, volume_bytes)?;
    pool.close()?;
    drop(pool);
    let (activate_big, activate_empty) = activations(dir, sizes, data_bytes, volume_bytes)?;
    dir.remove_pool(POOL)?;
    dir.remove_pool(EMPTY_POOL)?;
    let count = mapping_label(mapping_count);
    Ok(vec![
        Row::new(
            format!("snapshot creation: {count}-mapping volume vs empty volume"),
            &times.snapshot_big,
            &times.snapshot_empty,
            "ms",
        ),
        Row::new(
            format!("volume deletion: {count}-mapping snapshot, all shared, vs empty snapshot"),
            &times.delete_shared,
            &times.delete_empty,
            "ms",
        ),
        Row::new(
            format!("volume deletion: {count}-mapping volume, unshared, vs empty snapshot"),
            &times.delete_unshared,
            &times.delete_empty,
            "ms",
        ),
        Row::new(
            format!("activation (Pool::open + volume): {count}-mapping volume vs empty volume"),
            &activate_big,
            &activate_empty,
            "ms",
        )
        .target(Target::ABelow(ACTIVATION_MAX_MS)),
    ])
}

/// Milliseconds per repetition: snapshots and their deletions of the large and the empty
/// volume, and deletions of an unshared volume as large.
struct SnapshotTimes {
    snapshot_big: Vec<f64>,
    snapshot_empty: Vec<f64>,
    delete_shared: Vec<f64>,
    delete_empty: Vec<f64>,
    delete_unshared: Vec<f64>,
}

/// Snapshots of `big` and `empty` (which goes first alternating) and their deletion, then
/// the deletion of a freshly provisioned unshared volume.
fn snapshots_and_deletes(
    dir: &BenchDir,
    sizes: &Sizes,
    pool: &Pool,
    volume_bytes: u64,
) -> anyhow::Result<SnapshotTimes> {
    let mapping_count = sizes.mapping_count;
    let (mut snapshot_big, mut snapshot_empty) = (Vec::new(), Vec::new());
    let (mut delete_shared, mut delete_empty) = (Vec::new(), Vec::new());
    let mut delete_unshared = Vec::new();
    for repetition in 0..sizes.repetition_count {
        dir.check_interrupted()?;
        let big_first = repetition % 2 == 0;
        for turn in 0..2 {
            let (origin, snapshots, deletes) = if (turn == 0) == big_first {
                ("big", &mut snapshot_big, &mut delete_shared)
            } else {
                ("empty", &mut snapshot_empty, &mut delete_empty)
            };
            let name = format!("{origin}-snap-{repetition}");
            let (seconds, _) = time(|| Ok(pool.snapshot(origin, &name, false)?))?;
            snapshots.push(seconds * 1e3);
            let (seconds, ()) = time(|| Ok(pool.delete_volume(&name)?))?;
            deletes.push(seconds * 1e3);
        }
        let name = format!("unshared-{repetition}");
        pool.create_volume(&name, volume_bytes)?;
        provision(dir, pool, &name)?;
        let (seconds, ()) = time(|| Ok(pool.delete_volume(&name)?))?;
        delete_unshared.push(seconds * 1e3);
        progress(&format!(
            "large volume {}/{}: snapshot {:.1} vs {:.1} ms, delete {:.1} (shared) and {:.1} \
             (unshared) vs {:.1} ms ({mapping_count} mappings vs empty)",
            repetition + 1,
            sizes.repetition_count,
            snapshot_big[repetition],
            snapshot_empty[repetition],
            delete_shared[repetition],
            delete_unshared[repetition],
            delete_empty[repetition],
        ));
    }
    Ok(SnapshotTimes {
        snapshot_big,
        snapshot_empty,
        delete_shared,
        delete_empty,
        delete_unshared,
    })
}

/// Activation of the large volume's pool against a same-size pool with one empty volume
/// (made here), which goes first alternating; milliseconds per repetition.
fn activations(
    dir: &BenchDir,
    sizes: &Sizes,
    data_bytes: u64,
    volume_bytes: u64,
) -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
    let mapping_count = sizes.mapping_count;
    // The baseline: a pool of the same size holding one empty volume.
    let empty = create_pool(dir, EMPTY_POOL, data_bytes, BLOCK_SIZE_BYTES)?;
    empty.create_volume("big", volume_bytes)?;
    empty.close()?;
    drop(empty);
    let (mut activate_big, mut activate_empty) = (Vec::new(), Vec::new());
    for repetition in 0..sizes.repetition_count {
        dir.check_interrupted()?;
        let big_first = repetition % 2 == 0;
        for turn in 0..2 {
            let (name, samples) = if (turn == 0) == big_first {
                (POOL, &mut activate_big)
            } else {
                (EMPTY_POOL, &mut activate_empty)
            };
            let path = dir.pool_path(name);
            let (seconds, (pool, volume)) = time(|| {
                let pool = Pool::open(&path, PoolOptions::default())
                    .with_context(|| format!("opening {}", path.display()))?;
                let volume = pool.volume("big")?;
                Ok((pool, volume))
            })?;
            samples.push(seconds * 1e3);
            drop(volume);
            pool.close()?;
        }
        progress(&format!(
            "activation {}/{}: {:.1} vs {:.1} ms ({mapping_count} mappings vs empty)",
            repetition + 1,
            sizes.repetition_count,
            activate_big[repetition],
            activate_empty[repetition],
        ));
    }
    Ok((activate_big, activate_empty))
}

/// Map every block of volume `name` with whole-block zero writes that allocate.
pub(super) fn provision(dir: &BenchDir, pool: &Pool, name: &str) -> anyhow::Result<()> {
    let volume = pool.volume(name)?;
    let size = volume.size_bytes();
    let mut offset = 0;
    while offset < size {
        dir.check_interrupted()?;
        let n = PROVISION_CHUNK_BYTES.min(size - offset);
        volume
            .write_zeroes(offset, n, false, false)
            .with_context(|| format!("provisioning {n} bytes at {offset}"))?;
        offset += n;
    }
    volume.flush().context("flushing")?;
    Ok(())
}

/// "1M" for 2^20, "32K" for 2^15, else the number.
pub(super) fn mapping_label(count: u64) -> String {
    if count.is_multiple_of(1 << 20) {
        format!("{}M", count >> 20)
    } else if count.is_multiple_of(1 << 10) {
        format!("{}K", count >> 10)
    } else {
        count.to_string()
    }
}

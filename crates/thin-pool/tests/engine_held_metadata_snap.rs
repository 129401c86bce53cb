//! Goal (issue 20, finding 1): a held metadata snapshot never keeps the pool from opening.
//! A write that shadows a mapping leaf while the snapshot is held leaves that leaf's data
//! blocks with two references (the live leaf's and the snapshot's old copy); those are the
//! snapshot's, not sharing, so the read-write open check must not refuse them, and the
//! snapshot can always be released afterwards.
//!
//! Method: a small workload (reserve, first writes that shadow the leaf, an overwrite in
//! place, a snapshot and a write breaking its sharing, release) on a device pair sharing
//! one power supply. After every step the pool is closed and reopened (a restart), and a
//! reference run counts the device operations so that the power can be cut at each of them
//! (a crash): every image opens read-write, reads what the model says was flushed, releases
//! a snapshot it still holds and passes `thinpool check` (and both thin_check versions on a
//! sample of the images).
//!
//! The kernel-made variant (a pool whose metadata snapshot dm-thin reserved) belongs to the
//! UML tests of issue 22.

mod engine_kit;

use engine_kit::{check_metadata, CrashDataDevice, ForkableCatalog, PairedMetadata, Power};
use persistent_data::BlockDevice;
use rand::rngs::StdRng;
use rand::SeedableRng;
use std::sync::Arc;
use testkit::crash::CrashMode;
use testkit::scratch::ScratchDir;
use testkit::tools::ThinTools;
use thin_pool::data_device::DataDevice;
use thin_pool::{Pool, PoolOptions};

const BLOCK: u64 = 65536;
const DATA_BLOCKS: u64 = 64;
const METADATA_BLOCKS: u64 = 256;
const VOLUME_BLOCKS: u64 = 32;

fn options() -> PoolOptions {
    PoolOptions {
        commit_interval: None,
        error_if_no_space: true,
        ..PoolOptions::default()
    }
}

/// One step of the workload.
#[derive(Clone, Copy, Debug)]
enum Step {
    Reserve,
    /// Write `tag` over data block `block` of `v` (a first write or an overwrite) and flush.
    Write {
        block: u64,
        tag: u8,
    },
    Snapshot,
    Release,
}

const STEPS: &[Step] = &[
    Step::Reserve,
    // A first write into the leaf holding blocks 0..8: the leaf is shadowed while the
    // snapshot holds its old copy, so blocks 0..8 get a second reference.
    Step::Write { block: 9, tag: 19 },
    // An overwrite in place of a block the held snapshot also references (dm-thin writes
    // it in place: a metadata snapshot keeps metadata, not data).
    Step::Write { block: 0, tag: 10 },
    Step::Snapshot,
    // Breaks the sharing with the snapshot `s`.
    Step::Write { block: 1, tag: 11 },
    Step::Release,
    Step::Reserve,
    Step::Write { block: 12, tag: 22 },
];

/// What `v` holds, one tag per block (0: unmapped, reads as zeros).
type Model = [u8; VOLUME_BLOCKS as usize];

fn initial_model() -> Model {
    let mut model = [0u8; VOLUME_BLOCKS as usize];
    for (block, tag) in model.iter_mut().enumerate().take(8) {
        *tag = block as u8 + 1;
    }
    model
}

fn write_block(pool: &Pool, block: u64, tag: u8) -> thin_pool::Result<()> {
    let volume = pool.volume("v")?;
    volume.write(block * BLOCK, &vec![tag; BLOCK as usize], false)?;
    volume.flush()
}

/// Applies `step`, updating `model` when it is a write that succeeded.
fn apply(pool: &Pool, step: Step, model: &mut Model) -> thin_pool::Result<()> {
    match step {
        Step::Reserve => pool.reserve_metadata_snap().map(|_| ()),
        Step::Release => pool.release_metadata_snap(),
        Step::Snapshot => pool.snapshot("v", "s", false).map(|_| ()),
        Step::Write { block, tag } => {
            write_block(pool, block, tag)?;
            model[block as usize] = tag;
            Ok(())
        }
    }
}

fn assert_reads(pool: &Pool, model: &Model, context: &str) {
    let volume = pool
        .volume("v")
        .unwrap_or_else(|e| panic!("{context}: open v: {e}"));
    let mut buf = vec![0u8; BLOCK as usize];
    for (block, tag) in model.iter().enumerate() {
        volume.read(block as u64 * BLOCK, &mut buf).unwrap();
        assert!(
            buf.iter().all(|b| b == tag),
            "{context}: block {block} should hold {tag}, holds {}",
            buf[0]
        );
    }
}

struct Rig {
    power: Arc<Power>,
    metadata: Arc<PairedMetadata>,
    data: Arc<CrashDataDevice>,
    catalog: Arc<ForkableCatalog>,
}

/// A pool with volume `v` whose blocks 0..8 are written and committed.
fn setup() -> (Rig, Pool) {
    let power = Power::new();
    let rig = Rig {
        metadata: Arc::new(PairedMetadata::new(METADATA_BLOCKS, power.clone())),
        data: Arc::new(CrashDataDevice::new(DATA_BLOCKS * BLOCK, power.clone())),
        catalog: ForkableCatalog::new(),
        power,
    };
    let pool = Pool::format_parts(
        rig.metadata.clone(),
        rig.data.clone(),
        Box::new(rig.catalog.clone()),
        BLOCK,
        options(),
    )
    .unwrap();
    pool.create_volume("v", VOLUME_BLOCKS * BLOCK).unwrap();
    for (block, tag) in initial_model().iter().enumerate().take(8) {
        write_block(&pool, block as u64, *tag).unwrap();
    }
    (rig, pool)
}

fn reopen(
    metadata: Arc<dyn BlockDevice>,
    data: Arc<dyn DataDevice>,
    catalog: Arc<ForkableCatalog>,
    context: &str,
) -> Pool {
    Pool::open_parts(metadata, data, Box::new(catalog), options(), None)
        .unwrap_or_else(|e| panic!("{context}: the pool does not open: {e}"))
}

/// Regression: after a reserve and a write that shadows a mapping leaf, every restart
/// refused the pool ("volume v maps block 0 ... (2 references)"), release included.
#[test]
fn a_restart_after_every_step_opens_the_pool_and_release_works() {
    let (rig, mut pool) = setup();
    let mut model = initial_model();
    let mut held = false;
    for (index, step) in STEPS.iter().enumerate() {
        apply(&pool, *step, &mut model).unwrap();
        held = match step {
            Step::Reserve => true,
            Step::Release => false,
            _ => held,
        };
        pool.close().unwrap();
        drop(pool);
        let context = format!("restart after step {index} ({step:?})");
        pool = reopen(
            rig.metadata.clone(),
            rig.data.clone(),
            rig.catalog.clone(),
            &context,
        );
        assert_eq!(pool.status().metadata_snap.is_some(), held, "{context}");
        assert_reads(&pool, &model, &context);
    }
    // The held snapshot is released after a restart too, and the pool then checks clean.
    pool.release_metadata_snap().unwrap();
    pool.close().unwrap();
    drop(pool);
    check_metadata(rig.metadata.clone(), None).unwrap();
    let pool = reopen(
        rig.metadata.clone(),
        rig.data.clone(),
        rig.catalog.clone(),
        "final",
    );
    assert_reads(&pool, &model, "final");
}

/// Runs the setup and every step with the power cut after `cut` device operations (None:
/// never); returns the rig and the model of what was made durable before the cut.
fn run(cut: Option<u64>) -> (Rig, Model) {
    let (rig, pool) = setup();
    rig.power
        .set_cut_after(cut.map(|c| c + rig.power.operations()));
    let mut durable = initial_model();
    for step in STEPS {
        let mut next = durable;
        if apply(&pool, *step, &mut next).is_err() {
            break;
        }
        durable = next;
    }
    drop(pool);
    (rig, durable)
}

/// A crash at every device operation of the workload: the image opens read-write, holds
/// every flushed write (a write whose flush did not return may or may not be there), and a
/// snapshot it still holds can be released.
#[test]
fn a_crash_at_every_point_opens_the_pool_and_release_works() {
    let (reference, _) = run(None);
    let total = reference.power.operations();
    let tools = ThinTools::all();
    let scratch = ScratchDir::new("held-metadata-snap");
    let image = scratch.join("metadata.img");
    let mut rng = StdRng::seed_from_u64(20);
    let mut images = 0;
    for cut in 0..total {
        let (rig, durable) = run(Some(cut));
        for mode in CrashMode::ALL {
            let context = format!("cut after {cut} of {total} operations, {mode:?}");
            let metadata: Arc<dyn BlockDevice> =
                Arc::new(rig.metadata.device.crash_image(mode, &mut rng));
            let data: Arc<dyn DataDevice> = Arc::new(rig.data.crash_image(mode, &mut rng));
            let pool = reopen(metadata.clone(), data, rig.catalog.fork(), &context);
            let volume = pool.volume("v").unwrap();
            let mut buf = vec![0u8; BLOCK as usize];
            for (block, tag) in durable.iter().enumerate() {
                volume.read(block as u64 * BLOCK, &mut buf).unwrap();
                // The write interrupted by the cut may have reached the disk as well.
                let interrupted = STEPS.iter().any(|s| {
                    matches!(s, Step::Write { block: b, tag: t } if *b == block as u64 && buf[0] == *t)
                });
                assert!(
                    buf.iter().all(|b| b == tag) || interrupted,
                    "{context}: block {block} should hold {tag}, holds {}",
                    buf[0]
                );
            }
            drop(volume);
            if pool.status().metadata_snap.is_some() {
                pool.release_metadata_snap()
                    .unwrap_or_else(|e| panic!("{context}: release: {e}"));
            }
            pool.close().unwrap();
            drop(pool);
            // The real tools on every 32nd image (they take a process each).
            let sample = images % 32 == 0;
            check_metadata(metadata, sample.then_some((&tools[..], image.as_path())))
                .unwrap_or_else(|e| panic!("{context}: {e}"));
            images += 1;
        }
    }
    assert!(images > 0);
}

//! Goal: management operations and the lock-free I/O paths racing each other never let one
//! volume see or change another's data, never panic, and never commit what cannot be
//! reopened.
//!
//! - Handles have a lifetime: a delete that returns ok had no handle alive or being
//!   opened, so the thin id and the data blocks it frees reach nobody
//!   (`delete_refuses_a_handle_opened_during_its_commit`, `delete_races_with_opens`).
//! - A write that waited at the write gate while a shrink held it checks its range again
//!   (`shrink_refuses_a_write_that_waited_at_the_gate`, `resize_races_with_tail_writes`).
//! - A data block freed by a discard is not reused while a read or write that looked it up
//!   before the free can still touch it (`read_through_a_stale_lookup_…`,
//!   `write_through_a_stale_lookup_…`, `discard_and_reprovision_race_with_other_volumes`).
//!
//! Method: the deterministic tests stop one device operation in the middle (a flush, a
//! read, a write; see [`HookedData`]) and run the racing operation there; the stress tests
//! run many rounds on threads, every block written carrying its volume's tag, its block
//! and a counter ([`BlockHeader`]), so a read that returns another volume's block fails.
//! Stress tests stop after their rounds (`THINPOOL_CASES` scales them) or their time
//! budget (20 s, scaled the same way), and print the rounds run.

mod engine_kit;

use engine_kit::{check_metadata, BlockHeader, ForkableCatalog};
use persistent_data::MemoryDevice;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use testkit::scratch::ScratchDir;
use testkit::tools::ThinTools;
use thin_pool::data_device::{DataCounters, DataDevice, MemoryDataDevice};
use thin_pool::testing::PoolParts;
use thin_pool::{Error, Pool, PoolOptions, Volume};

const BLOCK: u64 = 65536;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

// ---------------------------------------------------------------------------------------
// A data device that can stop one operation in the middle.

/// A rendezvous with one stopped device operation: the operation says it arrived, then
/// waits until released.
#[derive(Default)]
struct Stop {
    state: Mutex<(bool, bool)>,
    changed: Condvar,
}

impl Stop {
    fn arrive_and_wait(&self) {
        let mut state = lock(&self.state);
        state.0 = true;
        self.changed.notify_all();
        while !state.1 {
            state = self.changed.wait(state).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Wait until the operation arrived (a deadline only detects a hang).
    fn wait_arrived(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut state = lock(&self.state);
        while !state.0 {
            assert!(
                Instant::now() < deadline,
                "the stopped operation never came"
            );
            state = self
                .changed
                .wait_timeout(state, Duration::from_millis(50))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn release(&self) {
        lock(&self.state).1 = true;
        self.changed.notify_all();
    }
}

type Hook = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct Hooks {
    next_flush: Option<Hook>,
    next_read: Option<Arc<Stop>>,
    next_write: Option<Arc<Stop>>,
}

/// A memory data device whose next flush runs a hook first, and whose next read or write
/// can be stopped before it touches the bytes.
struct HookedData {
    inner: MemoryDataDevice,
    hooks: Mutex<Hooks>,
    /// Make every flush take a while, as a disk's does (widens the windows around it).
    slow_flush: AtomicBool,
}

impl HookedData {
    fn new(size_bytes: u64) -> HookedData {
        HookedData {
            inner: MemoryDataDevice::new(size_bytes),
            hooks: Mutex::new(Hooks::default()),
            slow_flush: AtomicBool::new(false),
        }
    }

    fn on_next_flush(&self, hook: impl FnOnce() + Send + 'static) {
        lock(&self.hooks).next_flush = Some(Box::new(hook));
    }

    fn stop_next_read(&self) -> Arc<Stop> {
        let stop = Arc::new(Stop::default());
        lock(&self.hooks).next_read = Some(stop.clone());
        stop
    }

    fn stop_next_write(&self) -> Arc<Stop> {
        let stop = Arc::new(Stop::default());
        lock(&self.hooks).next_write = Some(stop.clone());
        stop
    }
}

impl DataDevice for HookedData {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let stop = lock(&self.hooks).next_read.take();
        if let Some(stop) = stop {
            stop.arrive_and_wait();
        }
        self.inner.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let stop = lock(&self.hooks).next_write.take();
        if let Some(stop) = stop {
            stop.arrive_and_wait();
        }
        self.inner.write_at(offset, data)
    }
    fn zero(&self, offset: u64, len: u64) -> io::Result<()> {
        self.inner.zero(offset, len)
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.inner.discard(offset, len)
    }
    fn copy(&self, from: u64, to: u64, len: u64) -> io::Result<()> {
        self.inner.copy(from, to, len)
    }
    fn flush(&self) -> io::Result<()> {
        // A real flush takes a while: let other threads run inside it.
        if self.slow_flush.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_micros(200));
        } else {
            std::thread::yield_now();
        }
        let hook = lock(&self.hooks).next_flush.take();
        if let Some(hook) = hook {
            hook();
        }
        self.inner.flush()
    }
    fn counters(&self) -> &DataCounters {
        self.inner.counters()
    }
    fn grow_to(&self, size_bytes: u64) -> io::Result<u64> {
        self.inner.grow_to(size_bytes)
    }
}

/// With no hook armed, it keeps the data device contract, as the engine expects of any.
#[test]
fn hooked_data_keeps_the_data_device_contract() {
    use thin_pool::testing::data_device_contract::{conforms, Subject, DEVICE_BYTES};
    conforms("HookedData", || {
        Some(Subject::new(Arc::new(HookedData::new(DEVICE_BYTES))))
    });
}

// ---------------------------------------------------------------------------------------
// A pool on those devices, reopenable.

struct Env {
    parts: PoolParts<MemoryDevice, HookedData, ForkableCatalog>,
    options: PoolOptions,
}

impl Env {
    fn new(data_blocks: u64, options: PoolOptions) -> (Env, Pool) {
        let env = Env {
            parts: PoolParts::on(
                Arc::new(MemoryDevice::new(1024)),
                Arc::new(HookedData::new(data_blocks * BLOCK)),
                ForkableCatalog::new(),
            ),
            options,
        };
        let pool = env.parts.format(BLOCK, env.options.clone());
        (env, pool)
    }

    /// Open the pool again (the previous handle must be dropped).
    fn reopen(&self) -> thin_pool::Result<Pool> {
        self.parts.try_reopen(self.options.clone())
    }

    /// Our checker and, when present, both thin_check versions.
    fn check(&self) {
        let dir = ScratchDir::new("engine-races");
        let tools = ThinTools::all();
        check_metadata(
            self.parts.metadata.clone(),
            Some((&tools[..], &dir.path().join("metadata"))),
        )
        .unwrap_or_else(|e| panic!("metadata check failed: {e}"));
    }
}

/// No commit thread; a write that finds no space waits for it (queue mode), so a block
/// held back for a reader is waited for, not reported as ENOSPC.
fn queue_options() -> PoolOptions {
    PoolOptions {
        commit_interval: None,
        error_if_no_space: false,
        no_space_timeout: Duration::from_secs(60),
        ..PoolOptions::default()
    }
}

fn block_of(tag: u32, block: u64, generation: u64) -> Vec<u8> {
    BlockHeader {
        tag,
        block,
        generation,
    }
    .bytes(BLOCK as usize)
}

fn read_block(volume: &Volume, block: u64) -> Option<BlockHeader> {
    let mut buf = vec![0u8; BLOCK as usize];
    volume.read(block * BLOCK, &mut buf).expect("read");
    BlockHeader::decode(&buf).unwrap_or_else(|e| panic!("{} block {block}: {e}", volume.name()))
}

/// Run `round` until `default_rounds` (scaled by `THINPOOL_CASES`) rounds or the time
/// budget (20 s, scaled the same way) are used up. Returns the rounds run.
fn run_rounds(test: &str, default_rounds: u64, mut round: impl FnMut(u64)) -> u64 {
    let rounds = testkit::case_count(default_rounds);
    let factor = rounds.div_ceil(default_rounds).max(1);
    let budget = Duration::from_secs(20 * factor);
    let start = Instant::now();
    let mut done = 0;
    while done < rounds && start.elapsed() < budget {
        round(done);
        done += 1;
    }
    eprintln!("{test}: {done} rounds");
    done
}

// ---------------------------------------------------------------------------------------
// Regressions (issue 9, reproductions 1, 2 and 8).

/// Reproduction 1: `delete_volume` checked the open count before its slow section (data
/// flush, catalog, commit) and unpublished the volume only after it, so a handle opened in
/// between (an NBD GO) outlived the delete; a new volume then got the same thin id and the
/// freed data blocks, and the stale handle read and wrote them. Either the open or the
/// delete must be refused.
#[test]
fn delete_refuses_a_handle_opened_during_its_commit() {
    let (env, pool) = Env::new(32, queue_options());
    pool.create_volume("v", 4 * BLOCK).unwrap();
    {
        let v = pool.volume("v").unwrap();
        for b in 0..4 {
            v.write(b * BLOCK, &block_of(1, b, 1), false).unwrap();
        }
    }
    pool.commit().unwrap();
    let opened: Arc<Mutex<Option<thin_pool::Result<Volume>>>> = Arc::default();
    {
        let (pool, opened) = (pool.clone(), opened.clone());
        env.parts.data.on_next_flush(move || {
            *lock(&opened) = Some(pool.volume("v"));
        });
    }
    let deleted = pool.delete_volume("v");
    let opened = lock(&opened)
        .take()
        .expect("the delete flushes the data device");
    match (deleted, opened) {
        (Ok(()), Ok(stale)) => {
            // Show what the stale handle reaches: the next volume's blocks.
            pool.create_volume("w", 4 * BLOCK).unwrap();
            let w = pool.volume("w").unwrap();
            for b in 0..4 {
                w.write(b * BLOCK, &block_of(2, b, 1), false).unwrap();
            }
            let mut buf = vec![0u8; BLOCK as usize];
            let seen = stale.read(0, &mut buf).map(|()| BlockHeader::decode(&buf));
            panic!(
                "delete returned ok while a handle opened during it is alive \
                 (through it, block 0 reads {seen:?})"
            );
        }
        (Ok(()), Err(e)) => assert!(
            matches!(e, Error::Busy(_) | Error::NoSuchVolume(_)),
            "open during the delete: {e}"
        ),
        (Err(Error::Busy(_)), Ok(handle)) => {
            assert_eq!(read_block(&handle, 3).map(|h| h.tag), Some(1));
            drop(handle);
            pool.delete_volume("v").unwrap();
        }
        (Err(e), _) => panic!("delete failed: {e}"),
    }
    assert!(pool.volume("v").is_err(), "the deleted volume opens");
    pool.verify_index().unwrap();
    drop(pool);
    let pool = env.reopen().expect("reopen");
    assert!(pool.list().is_empty());
    drop(pool);
    env.check();
}

/// Reproduction 2: a write that passed the range check waited at the write gate while a
/// shrink held it, then went on past the new end: the connection thread panicked (`index
/// set beyond the volume`) after queueing the mapping, the mapping was committed, and the
/// pool no longer opened (`volume "r" maps block 7 beyond its size`). Since issue 20
/// (finding 4) no write can be there: a shrink is refused while a handle is open, and no
/// handle opens while a shrink runs (one tried during the shrink's data flush is refused).
/// The pool reopens with the shrunk volume.
#[test]
fn shrink_refuses_a_write_that_waited_at_the_gate() {
    let (env, pool) = Env::new(32, queue_options());
    let pool = Arc::new(pool);
    pool.create_volume("r", 8 * BLOCK).unwrap();
    let volume = pool.volume("r").unwrap();
    volume.write(0, &block_of(1, 0, 1), false).unwrap();
    volume.write(7 * BLOCK, &block_of(1, 7, 1), false).unwrap();
    let refused = pool.resize_volume("r", 4 * BLOCK, thin_pool::Shrink::DropData);
    assert!(matches!(refused, Err(Error::Busy(_))), "{refused:?}");
    drop(volume);
    let opened: Arc<Mutex<Option<thin_pool::Result<()>>>> = Arc::default();
    {
        let (opened, pool) = (opened.clone(), pool.clone());
        // Runs in the resize's data flush, while it holds the gate and the claim.
        env.parts.data.on_next_flush(move || {
            *lock(&opened) = Some(pool.volume("r").map(|_| ()));
        });
    }
    let shrunk = pool.resize_volume("r", 4 * BLOCK, thin_pool::Shrink::DropData);
    assert_eq!(shrunk.unwrap().unmapped_blocks, 1);
    let opened = lock(&opened)
        .take()
        .expect("the resize flushes the data device");
    assert!(
        matches!(opened, Err(Error::Busy(_))),
        "an open during a shrink: {opened:?}"
    );
    pool.commit().unwrap();
    let pool = Arc::into_inner(pool).expect("no other reference");
    drop(pool);
    let pool = env
        .reopen()
        .unwrap_or_else(|e| panic!("the pool does not reopen after the race: {e}"));
    assert_eq!(pool.info("r").unwrap().size_bytes, 4 * BLOCK);
    assert_eq!(pool.info("r").unwrap().mapped_blocks, 1);
    pool.verify_index().unwrap();
    drop(pool);
    env.check();
}

/// Reproduction 8, read side: a read looked up its data block, then the block was
/// discarded, freed by a commit and provisioned to another volume before the read's pread:
/// the read returned the other volume's data. The freed block must not be reused while the
/// read can still touch it.
#[test]
fn read_through_a_stale_lookup_never_returns_another_volume_data() {
    let data_blocks = 8;
    let (env, pool) = Env::new(data_blocks, queue_options());
    pool.create_volume("a", BLOCK).unwrap();
    pool.create_volume("b", data_blocks * BLOCK).unwrap();
    let a = pool.volume("a").unwrap();
    let b = pool.volume("b").unwrap();
    a.write(0, &block_of(1, 0, 1), false).unwrap();
    pool.commit().unwrap();

    let stop = env.parts.data.stop_next_read();
    let reader = {
        let a = a.clone();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; BLOCK as usize];
            a.read(0, &mut buf).map(|()| BlockHeader::decode(&buf))
        })
    };
    stop.wait_arrived();
    // The reader has looked up a's block and waits inside its pread.
    a.discard(0, BLOCK).unwrap();
    pool.commit().unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let writer = {
        let (b, done) = (b.clone(), done.clone());
        std::thread::spawn(move || {
            // Every data block, so a's freed block is taken too if it is free.
            for block in 0..data_blocks {
                b.write(block * BLOCK, &block_of(2, block, 1), false)?;
            }
            done.store(true, Ordering::Release);
            Ok::<(), Error>(())
        })
    };
    // Fixed code: b's last block waits until the reader leaves. Old code: b takes a's
    // block at once. Either way, let the reader go once b is done or after a while.
    let deadline = Instant::now() + Duration::from_secs(2);
    while !done.load(Ordering::Acquire) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    stop.release();
    let read = reader.join().expect("reader");
    writer.join().expect("writer").expect("b's writes");
    match read {
        Ok(Ok(None)) => {}
        Ok(Ok(Some(h))) if h.tag == 1 && h.block == 0 => {}
        other => panic!("a's read returned {other:?}, not a's block or zeros"),
    }
    for block in 0..data_blocks {
        assert_eq!(
            read_block(&b, block).map(|h| (h.tag, h.block)),
            Some((2, block))
        );
    }
    drop((a, b));
    pool.verify_index().unwrap();
    drop(pool);
    env.check();
}

/// Reproduction 8, write side: an overwrite looked up its data block, then the block was
/// discarded, freed and provisioned to another volume before the overwrite's pwrite: the
/// write landed in the other volume's block.
#[test]
fn write_through_a_stale_lookup_never_lands_in_another_volume() {
    let data_blocks = 8;
    let (env, pool) = Env::new(data_blocks, queue_options());
    pool.create_volume("a", BLOCK).unwrap();
    pool.create_volume("b", data_blocks * BLOCK).unwrap();
    let a = pool.volume("a").unwrap();
    let b = pool.volume("b").unwrap();
    a.write(0, &block_of(1, 0, 1), false).unwrap();
    pool.commit().unwrap();

    let stop = env.parts.data.stop_next_write();
    let overwriter = {
        let a = a.clone();
        std::thread::spawn(move || a.write(0, &block_of(1, 0, 2), false))
    };
    stop.wait_arrived();
    // The overwrite has looked up a's block and waits inside its pwrite.
    a.discard(0, BLOCK).unwrap();
    pool.commit().unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let writer = {
        let (b, done) = (b.clone(), done.clone());
        std::thread::spawn(move || {
            for block in 0..data_blocks {
                b.write(block * BLOCK, &block_of(2, block, 1), false)?;
            }
            done.store(true, Ordering::Release);
            Ok::<(), Error>(())
        })
    };
    let deadline = Instant::now() + Duration::from_secs(2);
    while !done.load(Ordering::Acquire) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    stop.release();
    overwriter
        .join()
        .expect("overwriter")
        .expect("a's overwrite");
    writer.join().expect("writer").expect("b's writes");
    for block in 0..data_blocks {
        let seen = read_block(&b, block).map(|h| (h.tag, h.block));
        assert_eq!(
            seen,
            Some((2, block)),
            "b's block {block} holds {seen:?}: a's stale write landed in it"
        );
    }
    drop((a, b));
    pool.verify_index().unwrap();
    drop(pool);
    env.check();
}

// ---------------------------------------------------------------------------------------
// Stress.

/// Deletes race with threads that open the volume, write and read it: a delete that
/// returns ok left no handle behind, so the next volume (same thin id, same data blocks)
/// keeps exactly what was written to it.
#[test]
fn delete_races_with_opens() {
    let report = testkit::seed_report();
    let (env, pool) = Env::new(64, queue_options());
    env.parts.data.slow_flush.store(true, Ordering::Relaxed);
    const OPENERS: u64 = 3;
    const BLOCKS: u64 = 4;
    // The tag of the volume "v" now (0: none).
    let current_tag = Arc::new(AtomicU64::new(0));
    // Handles of "v" alive: counted after the open, uncounted before the drop, so a count
    // above zero means a handle is certainly alive.
    let live = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let openers: Vec<_> = (0..OPENERS)
        .map(|t| {
            let (pool, current_tag, live, stop) = (
                pool.clone(),
                current_tag.clone(),
                live.clone(),
                stop.clone(),
            );
            let mut rng = StdRng::seed_from_u64(report.seed() ^ (t + 1));
            std::thread::spawn(move || {
                let mut opened = 0u64;
                while !stop.load(Ordering::Acquire) {
                    // Connections come and go: a pause between them lets the deletes in.
                    std::thread::sleep(Duration::from_micros(rng.gen_range(0..300)));
                    let Ok(v) = pool.volume("v") else {
                        continue;
                    };
                    live.fetch_add(1, Ordering::SeqCst);
                    opened += 1;
                    // The tag of the volume this handle opened: it was set before the
                    // volume was created and cannot change while the handle is alive.
                    let tag = current_tag.load(Ordering::Acquire) as u32;
                    for _ in 0..rng.gen_range(1..4) {
                        let block = rng.gen_range(0..BLOCKS);
                        if rng.gen_bool(0.5) {
                            v.write(block * BLOCK, &block_of(tag, block, opened), false)
                                .expect("write");
                        } else if let Some(h) = read_block(&v, block) {
                            assert_eq!(
                                (h.tag, h.block),
                                (tag, block),
                                "a handle of volume {tag} reads another volume's block"
                            );
                        }
                    }
                    live.fetch_sub(1, Ordering::SeqCst);
                    drop(v);
                }
            })
        })
        .collect();
    let mut rng = report.rng();
    let rounds = run_rounds("delete_races_with_opens", 2000, |round| {
        let tag = round as u32 + 1;
        // Set before "v" exists, so every handle of it sees its tag.
        current_tag.store(u64::from(tag), Ordering::Release);
        pool.create_volume("v", BLOCKS * BLOCK).unwrap();
        for _ in 0..rng.gen_range(0..50) {
            std::thread::yield_now();
        }
        loop {
            match pool.delete_volume("v") {
                Ok(()) => break,
                Err(Error::Busy(_)) => std::thread::sleep(Duration::from_micros(50)),
                Err(e) => panic!("delete: {e}"),
            }
        }
        assert_eq!(
            live.load(Ordering::SeqCst),
            0,
            "round {round}: the delete returned ok while a handle of the volume is alive"
        );
        // The id and blocks go to "w" now; a stale handle of "v" would show or clobber.
        pool.create_volume("w", BLOCKS * BLOCK).unwrap();
        let w = pool.volume("w").unwrap();
        for block in 0..BLOCKS {
            w.write(block * BLOCK, &block_of(0, block, u64::from(tag)), false)
                .unwrap();
        }
        for _ in 0..rng.gen_range(0..50) {
            std::thread::yield_now();
        }
        for block in 0..BLOCKS {
            let seen = read_block(&w, block).map(|h| (h.tag, h.block, h.generation));
            assert_eq!(
                seen,
                Some((0, block, u64::from(tag))),
                "round {round}: w's block {block} was changed through a stale handle"
            );
        }
        drop(w);
        pool.delete_volume("w").unwrap();
    });
    stop.store(true, Ordering::Release);
    for opener in openers {
        opener.join().expect("opener");
    }
    assert!(rounds > 0);
    pool.verify_index().unwrap();
    drop(pool);
    env.reopen().expect("reopen");
    env.check();
}

/// Shrinks and grows race with handles opened and closed around writes, discards and
/// reads near the end: a grow goes ahead under open handles, a shrink only between them
/// (busy otherwise, and an open during a shrink is busy); writes beyond the end fail with
/// an error, nothing panics, and the pool reopens with every mapping inside its volume.
#[test]
fn resize_races_with_tail_writes() {
    let report = testkit::seed_report();
    let (env, pool) = Env::new(64, queue_options());
    let pool = Arc::new(pool);
    const BLOCKS: u64 = 16;
    pool.create_volume("r", BLOCKS * BLOCK).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..3u64)
        .map(|t| {
            let (pool, stop) = (pool.clone(), stop.clone());
            let mut rng = StdRng::seed_from_u64(report.seed() ^ (t + 1));
            std::thread::spawn(move || {
                let mut generation = 0;
                while !stop.load(Ordering::Acquire) {
                    generation += 1;
                    if generation % 4 == 0 {
                        // Between handles: a shrink's chance.
                        std::thread::yield_now();
                    }
                    let volume = match pool.volume("r") {
                        Ok(volume) => volume,
                        Err(Error::Busy(_)) => continue,
                        Err(e) => panic!("open: {e}"),
                    };
                    let block = rng.gen_range(BLOCKS / 4..BLOCKS);
                    let result = match rng.gen_range(0..10) {
                        0..=5 => volume.write(
                            block * BLOCK,
                            &block_of(1, block, generation),
                            rng.gen_bool(0.05),
                        ),
                        6 => volume.discard(block * BLOCK, BLOCK),
                        _ => {
                            let mut buf = vec![0u8; BLOCK as usize];
                            volume.read(block * BLOCK, &mut buf).map(|()| {
                                if let Some(h) = BlockHeader::decode(&buf)
                                    .unwrap_or_else(|e| panic!("block {block}: {e}"))
                                {
                                    assert_eq!((h.tag, h.block), (1, block));
                                }
                            })
                        }
                    };
                    match result {
                        Ok(())
                        | Err(Error::BeyondVolume { .. } | Error::BlockBeyondVolume { .. }) => {}
                        Err(e) => panic!("block {block}: {e}"),
                    }
                }
            })
        })
        .collect();
    let mut rng = report.rng();
    run_rounds("resize_races_with_tail_writes", 3000, |_| {
        let blocks = rng.gen_range(BLOCKS / 4..=BLOCKS);
        match pool.resize_volume("r", blocks * BLOCK, thin_pool::Shrink::DropData) {
            Ok(_) | Err(Error::Busy(_)) => {}
            Err(e) => panic!("resize to {blocks} blocks: {e}"),
        }
    });
    stop.store(true, Ordering::Release);
    for worker in workers {
        worker.join().expect("a worker panicked");
    }
    pool.verify_index().unwrap();
    let pool = Arc::into_inner(pool).expect("the workers are gone");
    drop(pool);
    let pool = env.reopen().expect("reopen");
    pool.verify_index().unwrap();
    drop(pool);
    env.check();
}

/// Discards and re-provisioning of some volumes race with reads and writes of the others,
/// in a pool small enough that freed blocks are reused at once, with commits running: no
/// read ever returns another volume's (or another block's) data, and at the end every
/// block holds its last write.
#[test]
fn discard_and_reprovision_race_with_other_volumes() {
    let report = testkit::seed_report();
    const VOLUMES: u32 = 4;
    const BLOCKS: u64 = 6;
    // As many data blocks as virtual ones: a block a discard frees is soon taken again,
    // and a write waits for space only until the next commits free it.
    let (env, pool) = Env::new(u64::from(VOLUMES) * BLOCKS, queue_options());
    for v in 0..VOLUMES {
        pool.create_volume(&format!("v{v}"), BLOCKS * BLOCK)
            .unwrap();
    }
    let stop = Arc::new(AtomicBool::new(false));
    let operations = Arc::new(AtomicU64::new(0));
    // One writer per volume (each block's last write is known), two readers over all.
    let writers: Vec<_> = (0..VOLUMES)
        .map(|v| {
            let volume = pool.volume(&format!("v{v}")).unwrap();
            let (stop, operations) = (stop.clone(), operations.clone());
            let mut rng = StdRng::seed_from_u64(report.seed() ^ u64::from(v + 1));
            std::thread::spawn(move || {
                let mut last = vec![None; BLOCKS as usize];
                let mut generation = 0;
                while !stop.load(Ordering::Acquire) {
                    generation += 1;
                    let block = rng.gen_range(0..BLOCKS);
                    if rng.gen_bool(0.4) {
                        volume.discard(block * BLOCK, BLOCK).expect("discard");
                        last[block as usize] = None;
                    } else {
                        volume
                            .write(block * BLOCK, &block_of(v + 1, block, generation), false)
                            .expect("write");
                        last[block as usize] = Some(generation);
                    }
                    operations.fetch_add(1, Ordering::Relaxed);
                }
                (volume, last)
            })
        })
        .collect();
    let readers: Vec<_> = (0..2u64)
        .map(|t| {
            let volumes: Vec<Volume> = (0..VOLUMES)
                .map(|v| pool.volume(&format!("v{v}")).unwrap())
                .collect();
            let stop = stop.clone();
            let mut rng = StdRng::seed_from_u64(report.seed() ^ (t + 100));
            std::thread::spawn(move || {
                let mut reads = 0u64;
                while !stop.load(Ordering::Acquire) {
                    let v = rng.gen_range(0..VOLUMES);
                    let block = rng.gen_range(0..BLOCKS);
                    if let Some(h) = read_block(&volumes[v as usize], block) {
                        assert_eq!(
                            (h.tag, h.block),
                            (v + 1, block),
                            "v{v} block {block} returned another block's data"
                        );
                    }
                    reads += 1;
                }
                reads
            })
        })
        .collect();
    // The rounds are commits; the writers and readers run between them.
    let rounds = run_rounds(
        "discard_and_reprovision_race_with_other_volumes",
        4000,
        |_| {
            pool.commit().unwrap();
            std::thread::yield_now();
        },
    );
    stop.store(true, Ordering::Release);
    let mut reads = 0;
    for reader in readers {
        reads += reader.join().expect("a reader saw another volume's data");
    }
    let mut finals = Vec::new();
    for writer in writers {
        finals.push(writer.join().expect("writer"));
    }
    eprintln!(
        "discard_and_reprovision_race_with_other_volumes: {rounds} commits, {} writes and \
         discards, {reads} reads",
        operations.load(Ordering::Relaxed)
    );
    for (v, (volume, last)) in finals.iter().enumerate() {
        for block in 0..BLOCKS {
            let seen = read_block(volume, block).map(|h| (h.tag, h.block, h.generation));
            let expected = last[block as usize].map(|g| (v as u32 + 1, block, g));
            assert_eq!(seen, expected, "v{v} block {block}");
        }
    }
    drop(finals);
    pool.verify_index().unwrap();
    drop(pool);
    env.reopen().expect("reopen");
    env.check();
}

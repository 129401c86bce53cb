//! Goal: running out of data or metadata space behaves as dm-thin does (spec §10.5):
//! `error_if_no_space` fails writes that need a block with ENOSPC at once; the queue policy
//! makes them wait up to the no-space timeout, then ENOSPC, and growing the data device lets
//! waiting writes complete; out of metadata space the pool is in `OutOfMetadataSpace` mode
//! until the metadata device grows. Nothing acknowledged is lost on the way, and the
//! metadata passes the checkers afterwards.
//! Method: tiny pools (a few data blocks, or a small metadata device over a large sparse
//! data device), filled to the limit, then grown.

mod engine_kit;

use engine_kit::{check_metadata, BlockHeader, SparseDataDevice};
use persistent_data::MemoryDevice;
use std::sync::Arc;
use std::time::{Duration, Instant};
use testkit::scratch::ScratchDir;
use testkit::tools::ThinTools;
use thin_pool::catalog::MemoryCatalog;
use thin_pool::testing::{MemoryParts, PoolParts};
use thin_pool::{Error, Pool, PoolMode, PoolOptions};

const BLOCK: u64 = 65536;

fn block(tag: u32, b: u64, generation: u64) -> Vec<u8> {
    BlockHeader {
        tag,
        block: b,
        generation,
    }
    .bytes(BLOCK as usize)
}

fn read_block(pool: &Pool, name: &str, b: u64) -> Option<BlockHeader> {
    let mut buf = vec![0u8; BLOCK as usize];
    pool.volume(name)
        .unwrap()
        .read(b * BLOCK, &mut buf)
        .unwrap();
    BlockHeader::decode(&buf).unwrap_or_else(|e| panic!("{name} block {b}: {e}"))
}

struct Small {
    parts: MemoryParts,
    pool: Pool,
}

fn small_pool(data_blocks: u64, options: PoolOptions) -> Small {
    let parts = MemoryParts::new(512, data_blocks * BLOCK);
    let pool = parts.format(BLOCK, options);
    pool.create_volume("v", 32 * BLOCK).unwrap();
    Small { parts, pool }
}

fn base_options() -> PoolOptions {
    PoolOptions {
        commit_interval: None,
        ..PoolOptions::default()
    }
}

#[test]
fn error_if_no_space_fails_at_once_then_growth_resumes() {
    let s = small_pool(
        8,
        PoolOptions {
            error_if_no_space: true,
            ..base_options()
        },
    );
    let v = s.pool.volume("v").unwrap();
    for b in 0..8 {
        v.write(b * BLOCK, &block(1, b, 1), false).unwrap();
    }
    let start = Instant::now();
    let e = v.write(8 * BLOCK, &block(1, 8, 1), false).unwrap_err();
    assert!(matches!(e, Error::OutOfDataSpace { .. }), "{e}");
    assert_eq!(e.errno(), libc::ENOSPC);
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "error_if_no_space must not wait ({:?})",
        start.elapsed()
    );
    assert_eq!(s.pool.mode(), PoolMode::OutOfDataSpace);
    assert_eq!(s.pool.status().mode.as_str(), "out_of_data_space");
    // Reads, overwrites of unshared blocks and flushes go on.
    v.write(3 * BLOCK, &block(1, 3, 2), false).unwrap();
    v.flush().unwrap();
    assert_eq!(read_block(&s.pool, "v", 3).unwrap().generation, 2);
    assert_eq!(read_block(&s.pool, "v", 8), None);
    // A discard frees a block for the next write (the allocation commits first).
    v.discard(0, BLOCK).unwrap();
    v.write(8 * BLOCK, &block(1, 8, 1), false).unwrap();
    assert_eq!(s.pool.mode(), PoolMode::Write);
    assert!(v.write(9 * BLOCK, &block(1, 9, 1), false).is_err());
    // Growth.
    s.parts.data.grow(12 * BLOCK);
    assert_eq!(s.pool.grow_data(12 * BLOCK).unwrap(), 12);
    assert_eq!(s.pool.mode(), PoolMode::Write);
    for b in 9..13 {
        v.write(b * BLOCK, &block(1, b, 1), false).unwrap();
    }
    v.flush().unwrap();
    assert_eq!(s.pool.status().data_used_blocks, 12);
    drop(v);
    s.pool.verify_index().unwrap();
    s.pool.close().unwrap();
    check_metadata(s.parts.metadata.clone(), None).unwrap();
    let reopened = s.parts.reopen(base_options());
    assert_eq!(read_block(&reopened, "v", 0), None);
    assert_eq!(read_block(&reopened, "v", 3).unwrap().generation, 2);
    for b in (1..13).filter(|&b| b != 3) {
        assert_eq!(read_block(&reopened, "v", b).unwrap().block, b);
    }
}

#[test]
fn queued_writes_fail_after_the_no_space_timeout() {
    let timeout = Duration::from_millis(400);
    let s = small_pool(
        4,
        PoolOptions {
            error_if_no_space: false,
            no_space_timeout: timeout,
            ..base_options()
        },
    );
    let v = s.pool.volume("v").unwrap();
    for b in 0..4 {
        v.write(b * BLOCK, &block(1, b, 1), false).unwrap();
    }
    let start = Instant::now();
    let e = v.write(4 * BLOCK, &block(1, 4, 1), false).unwrap_err();
    let waited = start.elapsed();
    assert!(matches!(e, Error::OutOfDataSpace { .. }), "{e}");
    assert!(
        waited >= timeout,
        "failed after {waited:?}, before the timeout"
    );
    assert!(waited < timeout * 20, "waited {waited:?}");
    assert_eq!(s.pool.mode(), PoolMode::OutOfDataSpace);
    assert!(!s.pool.status().error_if_no_space);
}

#[test]
fn growing_the_data_device_completes_queued_writes() {
    let s = small_pool(
        4,
        PoolOptions {
            error_if_no_space: false,
            no_space_timeout: Duration::from_secs(60),
            ..base_options()
        },
    );
    let v = s.pool.volume("v").unwrap();
    for b in 0..4 {
        v.write(b * BLOCK, &block(1, b, 1), false).unwrap();
    }
    let writers: Vec<_> = (4..7)
        .map(|b| {
            let v = v.clone();
            std::thread::spawn(move || {
                let start = Instant::now();
                v.write(b * BLOCK, &block(1, b, 1), false)
                    .map(|()| start.elapsed())
            })
        })
        .collect();
    // Wait until the pool has noticed (the writers are queued).
    let deadline = Instant::now() + Duration::from_secs(30);
    while s.pool.mode() != PoolMode::OutOfDataSpace {
        assert!(Instant::now() < deadline, "writers never ran out of space");
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        writers.iter().all(|w| !w.is_finished()),
        "queued writes wait"
    );
    s.parts.data.grow(8 * BLOCK);
    s.pool.grow_data(8 * BLOCK).unwrap();
    for w in writers {
        let waited = w
            .join()
            .unwrap()
            .expect("a queued write completes after growth");
        assert!(waited < Duration::from_secs(30), "{waited:?}");
    }
    assert_eq!(s.pool.mode(), PoolMode::Write);
    v.flush().unwrap();
    for b in 0..7 {
        assert_eq!(read_block(&s.pool, "v", b).unwrap().block, b);
    }
    drop(v);
    s.pool.verify_index().unwrap();
    s.pool.close().unwrap();
    check_metadata(s.parts.metadata.clone(), None).unwrap();
}

#[test]
fn out_of_metadata_space_until_the_metadata_device_grows() {
    let parts = PoolParts::on(
        Arc::new(MemoryDevice::new(160)),
        Arc::new(SparseDataDevice::new(1 << 36)),
        Arc::new(MemoryCatalog::default()),
    );
    let metadata = &parts.metadata;
    let options = PoolOptions {
        zero_new_blocks: false,
        error_if_no_space: true,
        ..base_options()
    };
    let pool = parts.format(BLOCK, options.clone());
    pool.create_volume("v", 1 << 34).unwrap();
    let v = pool.volume("v").unwrap();
    let sector = |b: u64| block(1, b, 1)[..512].to_vec();
    let mut written = 0u64;
    let mut flushed = 0u64;
    let error = loop {
        assert!(written < 1_000_000, "metadata never ran out");
        if let Err(e) = v.write(written * BLOCK, &sector(written), false) {
            break e;
        }
        written += 1;
        if written.is_multiple_of(64) {
            match v.flush() {
                Ok(()) => flushed = written,
                Err(e) => break e,
            }
        }
    };
    assert!(matches!(error, Error::OutOfMetadataSpace { .. }), "{error}");
    assert_eq!(pool.mode(), PoolMode::OutOfMetadataSpace);
    assert_eq!(pool.status().mode.as_str(), "ro");
    assert!(!pool.status().needs_check);
    assert!(
        pool.create_volume("w", BLOCK).is_err(),
        "no management while out of metadata space"
    );
    assert!(
        flushed > 0,
        "the first flushes fit ({written} blocks written)"
    );
    // Reads still work, and so do overwrites of provisioned blocks.
    let mut buf = vec![0u8; 512];
    v.read(0, &mut buf).unwrap();
    assert_eq!(buf, sector(0));
    v.write(0, &sector(0), false).unwrap();
    // Grow the metadata device: back to write mode, the writes acknowledged meanwhile commit.
    metadata.grow(512);
    pool.grow_metadata(None).unwrap();
    assert_eq!(pool.mode(), PoolMode::Write);
    for b in written..written + 100 {
        v.write(b * BLOCK, &sector(b), false).unwrap();
    }
    written += 100;
    v.flush().unwrap();
    drop(v);
    pool.verify_index().unwrap();
    pool.close().unwrap();
    drop(pool);
    let dir = ScratchDir::new("engine-space-metadata");
    let tools = ThinTools::all();
    check_metadata(metadata.clone(), Some((&tools[..], &dir.join("metadata")))).unwrap();
    let pool = parts.reopen(options);
    let v = pool.volume("v").unwrap();
    for b in (0..written).step_by(7).chain([written - 1]) {
        v.read(b * BLOCK, &mut buf).unwrap();
        assert!(buf == sector(b), "block {b} of {written} lost");
    }
    assert_eq!(pool.info("v").unwrap().mapped_blocks, written);
}

//! The load generators of the vhost-user-blk section: one timed run of a [`Workload`] against
//! a vhost-user-blk socket (the `blkio` crate's `virtio-blk-vhost-user` driver, a complete
//! userspace virtio-blk front end), against the data file with `pread` (the limit), or
//! against an NBD export (fio's nbd engine, as `scripts/bench-compare` measures NBD).
//!
//! blkio: one connection per run, `queues` queues, each driven by its own thread keeping
//! `depth` reads in flight; buffers in one memfd-backed region shared with the backend
//! (`alloc_mem_region` + `map_mem_region`). Event-driven queues by default (the completion
//! eventfd, as a VM with interrupts), poll queues with `poll`. Before the timed run the first
//! and last 4 KiB of the device are read and compared with the file, so a row never measures
//! a backend that serves other bytes. The buffers are only ever read back through the memfd
//! (`/proc/self/fd/N`, `pread`): no `unsafe` here — blkio's request calls take the buffer
//! address as a plain value.
//!
//! Latency is the mean time from submission to the completion being seen; CPU is this
//! process's user + system time over the run (the generator's threads only do this work).

use anyhow::{bail, ensure, Context};
use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::fs::File;
use std::mem::MaybeUninit;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::{Duration, Instant};

/// The offsets a run reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pattern {
    /// Uniformly random, aligned to the request size (a fixed seed per queue).
    Random,
    /// In order; each queue reads its own slice of the device, wrapping around.
    Sequential,
}

/// One load: request size, requests in flight per queue, queues, pattern.
#[derive(Clone, Copy, Debug)]
pub struct Workload {
    pub pattern: Pattern,
    pub request_bytes: usize,
    pub depth: usize,
    pub queues: usize,
}

impl Workload {
    /// `4 KiB random QD32 ×2q`.
    pub fn describe(&self) -> String {
        let size = if self.request_bytes >= 1 << 20 {
            format!("{} MiB", self.request_bytes >> 20)
        } else {
            format!("{} KiB", self.request_bytes >> 10)
        };
        let pattern = match self.pattern {
            Pattern::Random => "random",
            Pattern::Sequential => "sequential",
        };
        format!("{size} {pattern} QD{} ×{}q", self.depth, self.queues)
    }
}

/// What one run did, summed over its queues.
#[derive(Clone, Copy, Debug, Default)]
pub struct RunResult {
    pub ios: u64,
    pub bytes: u64,
    pub seconds: f64,
    /// Sum of per-request latencies.
    pub latency_sum_s: f64,
    /// The client's CPU time (this process, or fio's own figure).
    pub client_cpu_s: f64,
}

/// Offsets for one queue.
struct Offsets {
    pattern: Pattern,
    request_bytes: u64,
    /// Requests that fit in the device (random reads cover all of it).
    total: u64,
    /// The queue's slice for sequential reads: `[first, first + slots)` in requests.
    first: u64,
    slots: u64,
    next: u64,
    rng: SmallRng,
}

impl Offsets {
    fn new(workload: &Workload, queue: usize, device_bytes: u64, seed: u64) -> Offsets {
        let request_bytes = workload.request_bytes as u64;
        let total = device_bytes / request_bytes;
        let queues = workload.queues as u64;
        assert!(
            total >= queues,
            "the device is smaller than a request per queue"
        );
        let slots = total / queues;
        Offsets {
            pattern: workload.pattern,
            request_bytes,
            total,
            first: slots * queue as u64,
            slots,
            next: 0,
            rng: SmallRng::seed_from_u64(seed ^ ((queue as u64) << 32)),
        }
    }

    fn next(&mut self) -> u64 {
        let slot = match self.pattern {
            Pattern::Random => self.rng.gen_range(0..self.total),
            Pattern::Sequential => {
                let slot = self.first + self.next;
                self.next = (self.next + 1) % self.slots;
                slot
            }
        };
        slot * self.request_bytes
    }
}

/// The vhost-user driver's name in libblkio.
const DRIVER: &str = "virtio-blk-vhost-user";
/// The size of the read-back check at both ends of the device.
const CHECK_BYTES: usize = 4096;

fn blkio_context<T>(result: blkio::Result<T>, what: &str) -> anyhow::Result<T> {
    result.map_err(|e| anyhow::anyhow!("blkio: {what}: {e} (errno {})", e.errno()))
}

/// A connected, started libblkio client with its buffers mapped for the backend.
struct Client {
    blkio: Blkio,
    queues: Vec<Blkioq>,
    region: MemoryRegion,
    /// The buffer memfd, opened again through `/proc/self/fd` to read buffers back.
    memfd: File,
    capacity: u64,
}

impl Client {
    fn connect(socket: &Path, workload: &Workload, poll: bool) -> anyhow::Result<Client> {
        let mut blkio = blkio_context(Blkio::new(DRIVER), "new")?;
        let path = socket.to_str().context("socket path is not UTF-8")?;
        blkio_context(blkio.set_str("path", path), "path")?;
        blkio_context(blkio.connect(), &format!("connecting to {path}"))?;
        let queues = i32::try_from(workload.queues).context("queues")?;
        let (events, polled) = if poll { (0, queues) } else { (queues, 0) };
        blkio_context(blkio.set_i32("num-queues", events), "num-queues")?;
        blkio_context(blkio.set_i32("num-poll-queues", polled), "num-poll-queues")?;
        let started = blkio_context(blkio.start(), "start")?;
        let queues = if poll {
            started.poll_queues
        } else {
            started.queues
        };
        ensure!(
            queues.len() == workload.queues,
            "blkio started {} queues",
            queues.len()
        );
        let capacity = blkio_context(blkio.get_u64("capacity"), "capacity")?;
        let alignment = blkio_context(blkio.get_u64("mem-region-alignment"), "alignment")?;
        let bytes = (workload.queues * workload.depth * workload.request_bytes) as u64;
        let length = bytes.div_ceil(alignment) * alignment;
        let region = blkio_context(blkio.alloc_mem_region(length as usize), "alloc_mem_region")?;
        blkio_context(blkio.map_mem_region(&region), "map_mem_region")?;
        let memfd = File::open(format!("/proc/self/fd/{}", region.fd))
            .context("opening the buffer memfd again")?;
        Ok(Client {
            blkio,
            queues,
            region,
            memfd,
            capacity,
        })
    }

    /// Reads `CHECK_BYTES` at the start and the end of the device through queue 0 and
    /// compares them with `file`'s.
    fn check_against(&mut self, file: &File) -> anyhow::Result<()> {
        let file_bytes = file.metadata().context("data file")?.len();
        ensure!(
            self.capacity == file_bytes,
            "the device has {} bytes, the file {file_bytes}",
            self.capacity
        );
        for offset in [0, self.capacity - CHECK_BYTES as u64] {
            let buffer = std::ptr::with_exposed_provenance_mut::<u8>(self.region.addr);
            let queue = &mut self.queues[0];
            queue.read(offset, buffer, CHECK_BYTES, 0, ReqFlags::empty());
            let mut completions = completion_slots(1);
            let done = blkio_context(queue.do_io(&mut completions, 1, None, None), "do_io")?;
            ensure!(done == 1, "the check read did not complete");
            let ret = completion_results(&completions, done)[0].1;
            ensure!(
                ret == 0,
                "the check read at {offset} failed: errno {}",
                -ret
            );
            let mut device = vec![0u8; CHECK_BYTES];
            self.memfd
                .read_exact_at(&mut device, 0)
                .context("reading the buffer")?;
            let mut expected = vec![0u8; CHECK_BYTES];
            file.read_exact_at(&mut expected, offset)
                .context("reading the file")?;
            ensure!(
                device == expected,
                "the device's bytes at {offset} are not the file's"
            );
        }
        Ok(())
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.queues.clear();
        self.blkio.unmap_mem_region(&self.region);
        self.blkio.free_mem_region(&self.region);
    }
}

fn completion_slots(count: usize) -> Vec<MaybeUninit<Completion>> {
    (0..count).map(|_| MaybeUninit::uninit()).collect()
}

/// `(user_data, ret)` of the first `done` completions, which `do_io` has just written.
#[allow(unsafe_code)]
fn completion_results(completions: &[MaybeUninit<Completion>], done: usize) -> Vec<(usize, i32)> {
    assert!(
        done <= completions.len(),
        "do_io reported more completions than slots"
    );
    completions[..done]
        .iter()
        .map(|slot| {
            // SAFETY: `Blkioq::do_io` returns how many completions it wrote, and it writes
            // them to the start of the slice it was given: the first `done` slots are
            // initialized (libblkio's contract for blkioq_do_io). `Completion` is plain data
            // (its `error_msg` pointer is not followed here).
            let completion = unsafe { slot.assume_init_ref() };
            (completion.user_data, completion.ret)
        })
        .collect()
}

/// One timed run of `workload` against the vhost-user-blk server on `socket`, after checking
/// that it serves `file`'s bytes.
pub fn run_vhost(
    socket: &Path,
    file: &File,
    workload: &Workload,
    duration: Duration,
    poll: bool,
    seed: u64,
) -> anyhow::Result<RunResult> {
    let mut client = Client::connect(socket, workload, poll)
        .with_context(|| format!("vhost-user-blk client of {}", socket.display()))?;
    client.check_against(file)?;
    let capacity = client.capacity;
    let region_addr = client.region.addr;
    let per_queue = workload.depth * workload.request_bytes;
    let cpu_before = crate::vhost_servers::cpu_seconds(None)?;
    let started = Instant::now();
    let deadline = started + duration;
    let results: Vec<anyhow::Result<QueueTotals>> = std::thread::scope(|scope| {
        let handles: Vec<_> = client
            .queues
            .iter_mut()
            .enumerate()
            .map(|(index, queue)| {
                let offsets = Offsets::new(workload, index, capacity, seed);
                let buffers = region_addr + index * per_queue;
                scope.spawn(move || drive(queue, buffers, workload, offsets, deadline))
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| handle.join().expect("a queue thread panicked"))
            .collect()
    });
    let seconds = started.elapsed().as_secs_f64();
    let client_cpu_s = crate::vhost_servers::cpu_seconds(None)? - cpu_before;
    let mut result = RunResult {
        seconds,
        client_cpu_s,
        ..RunResult::default()
    };
    for totals in results {
        let totals = totals?;
        result.ios += totals.ios;
        result.latency_sum_s += totals.latency_sum_s;
    }
    result.bytes = result.ios * workload.request_bytes as u64;
    Ok(result)
}

#[derive(Default)]
struct QueueTotals {
    ios: u64,
    latency_sum_s: f64,
}

/// Keeps `depth` reads in flight on `queue` until `deadline`, then waits for the last ones.
fn drive(
    queue: &mut Blkioq,
    buffers: usize,
    workload: &Workload,
    mut offsets: Offsets,
    deadline: Instant,
) -> anyhow::Result<QueueTotals> {
    let size = workload.request_bytes;
    let submit = |queue: &mut Blkioq, slot: usize, offset: u64| {
        let buffer = std::ptr::with_exposed_provenance_mut::<u8>(buffers + slot * size);
        queue.read(offset, buffer, size, slot, ReqFlags::empty());
    };
    let mut submitted_at = vec![Instant::now(); workload.depth];
    for (slot, at) in submitted_at.iter_mut().enumerate() {
        *at = Instant::now();
        submit(queue, slot, offsets.next());
    }
    let mut in_flight = workload.depth;
    let mut completions = completion_slots(workload.depth);
    let mut totals = QueueTotals::default();
    let mut more = true;
    while in_flight > 0 {
        let done = blkio_context(queue.do_io(&mut completions, 1, None, None), "do_io")?;
        let now = Instant::now();
        more = more && now < deadline;
        for (slot, ret) in completion_results(&completions, done) {
            if ret != 0 {
                bail!("a {size}-byte read failed: errno {}", -ret);
            }
            totals.ios += 1;
            totals.latency_sum_s += now.duration_since(submitted_at[slot]).as_secs_f64();
            if more {
                submitted_at[slot] = Instant::now();
                submit(queue, slot, offsets.next());
            } else {
                in_flight -= 1;
            }
        }
    }
    Ok(totals)
}

/// One timed run of `workload` as `pread`s of `file`: a thread per queue, one request at a
/// time each (`depth` does not apply: a synchronous read has one in flight).
pub fn run_pread(
    file: &File,
    workload: &Workload,
    duration: Duration,
    seed: u64,
) -> anyhow::Result<RunResult> {
    let capacity = file.metadata().context("data file")?.len();
    let cpu_before = crate::vhost_servers::cpu_seconds(None)?;
    let started = Instant::now();
    let deadline = started + duration;
    let results: Vec<std::io::Result<QueueTotals>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workload.queues)
            .map(|queue| {
                let mut offsets = Offsets::new(workload, queue, capacity, seed);
                scope.spawn(move || {
                    let mut buffer = vec![0u8; workload.request_bytes];
                    let mut totals = QueueTotals::default();
                    loop {
                        let at = Instant::now();
                        if at >= deadline {
                            return Ok(totals);
                        }
                        file.read_exact_at(&mut buffer, offsets.next())?;
                        totals.ios += 1;
                        totals.latency_sum_s += at.elapsed().as_secs_f64();
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| handle.join().expect("a pread thread panicked"))
            .collect()
    });
    let seconds = started.elapsed().as_secs_f64();
    let client_cpu_s = crate::vhost_servers::cpu_seconds(None)? - cpu_before;
    let mut result = RunResult {
        seconds,
        client_cpu_s,
        ..RunResult::default()
    };
    for totals in results {
        let totals = totals.context("pread of the data file")?;
        result.ios += totals.ios;
        result.latency_sum_s += totals.latency_sum_s;
    }
    result.bytes = result.ios * workload.request_bytes as u64;
    Ok(result)
}

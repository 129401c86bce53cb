//! A backend killed with requests in flight, and started again (issue 23 item 2:
//! `VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD`): every write the front end posted completes
//! exactly once, and the disk holds what a model says.
//!
//! Method: the backend is this test binary run again as a child process (`CHILD_SOCKET` set:
//! it serves a plain file through `VhostBlkServer`, as `thinpool serve` does, until it is
//! killed). The test plays qemu with vhost's `Frontend` and memfd guest memory: it
//! negotiates INFLIGHT_SHMFD, gets the inflight fd and sets it, posts writes and kicks.
//!
//! - Held: the child's target holds the write to one offset forever (it prints `held` when
//!   the write reaches it), so that write is provably in flight, with two completed before it
//!   and three more not yet taken off the ring; the child is killed (SIGKILL by its pid).
//! - Anywhere: no gate; the child is killed as soon as a few writes completed, wherever it is
//!   (between taking a chain off the ring, serving it and putting it on the used ring), three
//!   rounds over one region and one set of rings.
//!
//! A fresh child then gets the same inflight fd (SET_INFLIGHT_FD before the rings, as qemu
//! sends it on reconnect) and the rings with base = the used index (what qemu restores when
//! GET_VRING_BASE fails on a dead backend), and a kick. The held scenario runs again with
//! base = the available index: our queues serve in order, so with the used index a backend
//! could also recover by popping the ring again; with the available index only the region
//! says where to go on. Checked: the used ring holds each
//! posted head exactly once with status OK, the held write after those completed before it
//! and before those never taken, and the file holds every write's bytes.
//!
//! `harness = false` (Cargo.toml): `main` runs both scenarios, or the child.

mod guest;

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::sync::Arc;
use std::time::{Duration, Instant};

use thinpool_frontend::{Extent, FileTarget, Geometry, Target, TargetError, ZeroMode};
use thinpool_vhost::{ServerOptions, VhostBlkServer};
use vhost::vhost_user::message::{VhostUserHeaderFlag, VhostUserInflight};
use vhost::vhost_user::{Frontend, VhostUserFrontend, VhostUserProtocolFeatures};
use vhost::VhostBackend;
use vmm_sys_util::eventfd::EventFd;

use guest::*;

const CHILD_SOCKET: &str = "INFLIGHT_TEST_SOCKET";
const CHILD_DISK: &str = "INFLIGHT_TEST_DISK";
const CHILD_GATE: &str = "INFLIGHT_TEST_GATE";

const MIB: u64 = 1 << 20;
const DISK_BYTES: u64 = 4 * MIB;
const QUEUE: u16 = 256;
/// Guest-physical layout, in one 8 MiB memfd.
const GUEST_BYTES: u64 = 8 * MIB;
const HEADERS: u64 = 0x1_0000;
const STATUS: u64 = 0x2_0000;
const DATA: u64 = MIB;
/// Bytes each write carries.
const WRITE_BYTES: u64 = 16 << 10;
/// Requests the ring holds at once (3 descriptors each).
const SLOTS: u16 = QUEUE / 3;
const FILL: u8 = 0xee;
const T_OUT: u32 = 1;
/// A bound for waits that should end at once, so a broken backend fails instead of hanging.
const PATIENCE: Duration = Duration::from_secs(60);

fn main() {
    if let Ok(socket) = std::env::var(CHILD_SOCKET) {
        let disk = std::env::var(CHILD_DISK).expect("the disk");
        let gate = std::env::var(CHILD_GATE)
            .ok()
            .map(|g| g.parse().expect("offset"));
        serve_until_killed(Path::new(&socket), Path::new(&disk), gate);
    }
    a_write_held_in_flight_at_the_kill_is_resubmitted_once_after_restart(Base::UsedIndex);
    println!("test a_write_held_in_flight_at_the_kill_is_resubmitted_once_after_restart ... ok");
    a_write_held_in_flight_at_the_kill_is_resubmitted_once_after_restart(Base::AvailIndex);
    println!("test the_inflight_region_not_the_base_says_where_the_ring_goes_on ... ok");
    writes_in_flight_anywhere_at_a_kill_complete_exactly_once_after_restart();
    println!("test writes_in_flight_anywhere_at_a_kill_complete_exactly_once_after_restart ... ok");
}

/// A file target whose writes at `gate` never return (after saying so on stdout).
struct Gated {
    inner: FileTarget,
    gate: Option<u64>,
}

impl Target for Gated {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn geometry(&self) -> Geometry {
        self.inner.geometry()
    }
    fn read(&self, offset: u64, buffer: &mut [u8]) -> Result<(), TargetError> {
        self.inner.read(offset, buffer)
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), TargetError> {
        if Some(offset) == self.gate {
            println!("held {offset}");
            loop {
                std::thread::park();
            }
        }
        self.inner.write(offset, data, fua)
    }
    fn write_zeroes(&self, offset: u64, length: u64, mode: ZeroMode) -> Result<(), TargetError> {
        self.inner.write_zeroes(offset, length, mode)
    }
    fn discard(&self, offset: u64, length: u64, fua: bool) -> Result<(), TargetError> {
        self.inner.discard(offset, length, fua)
    }
    fn flush(&self) -> Result<(), TargetError> {
        self.inner.flush()
    }
    fn block_status(
        &self,
        offset: u64,
        length: u64,
        extents_max: usize,
    ) -> Result<Vec<Extent>, TargetError> {
        self.inner.block_status(offset, length, extents_max)
    }
}

/// The child: serves `disk` on `socket` with one queue until killed.
fn serve_until_killed(socket: &Path, disk: &Path, gate: Option<u64>) -> ! {
    let inner = FileTarget::open("disk", disk, false).expect("the disk");
    let target = Arc::new(Gated { inner, gate });
    let options = ServerOptions {
        queues: 1,
        poll: Duration::ZERO,
    };
    let _server = VhostBlkServer::start_with(target, socket, options).expect("serve");
    println!("ready");
    loop {
        std::thread::park();
    }
}

/// A backend child and the lines it prints.
struct Backend {
    child: Child,
    lines: Receiver<String>,
}

impl Backend {
    fn start(socket: &Path, disk: &Path, gate: Option<u64>) -> Backend {
        let mut command = Command::new(std::env::current_exe().expect("this binary"));
        command
            .env(CHILD_SOCKET, socket)
            .env(CHILD_DISK, disk)
            .stdout(Stdio::piped());
        if let Some(gate) = gate {
            command.env(CHILD_GATE, gate.to_string());
        }
        let mut child = command.spawn().expect("spawn the backend");
        let stdout = child.stdout.take().expect("piped");
        let (send, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if send.send(line).is_err() {
                    break;
                }
            }
        });
        let backend = Backend { child, lines };
        backend.expect_line("ready");
        backend
    }

    fn expect_line(&self, wanted: &str) {
        let line = self
            .lines
            .recv_timeout(PATIENCE)
            .unwrap_or_else(|e| panic!("backend said nothing ({e}), waiting for {wanted:?}"));
        assert_eq!(line, wanted);
    }

    /// SIGKILL, by the child's pid.
    fn kill(mut self) {
        self.child.kill().expect("kill the backend");
        self.child.wait().expect("reap the backend");
    }
}

/// A failing check unwinds through here: the child goes too (a killed child's second kill
/// is a no-op).
impl Drop for Backend {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The bytes write `n` puts on the disk.
fn payload(n: u16) -> Vec<u8> {
    (0..WRITE_BYTES)
        .map(|i| (u64::from(n) * 37 + i / 512) as u8)
        .collect()
}

/// The disk offset of write `n` (apart from every other write of its round).
fn offset(n: u16) -> u64 {
    (u64::from(n) * WRITE_BYTES) % (DISK_BYTES - WRITE_BYTES)
}

/// Writes request `n` (head 3 × (n mod SLOTS): header, data, status) into guest memory and
/// makes it the available ring's entry `n`.
fn post_write(guest: &File, n: u16) {
    let slot = n % SLOTS;
    let header_at = HEADERS + u64::from(slot) * 16;
    let data_at = DATA + u64::from(slot) * WRITE_BYTES;
    let mut header = [0u8; 16];
    header[..4].copy_from_slice(&T_OUT.to_le_bytes());
    header[8..].copy_from_slice(&(offset(n) / 512).to_le_bytes());
    put(guest, header_at, &header);
    put(guest, data_at, &payload(n));
    put(guest, STATUS + u64::from(slot), &[FILL]);
    let head = slot * 3;
    let descs = [
        (header_at, 16u32, NEXT),
        (data_at, WRITE_BYTES as u32, NEXT),
        (STATUS + u64::from(slot), 1, WRITE),
    ];
    post_chain(guest, QUEUE, n, head, &descs);
}

fn wait_used(guest: &File, at_least: u16) -> u16 {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let idx = used_idx(guest);
        if idx.wrapping_sub(at_least) < 0x8000 {
            return idx;
        }
        assert!(Instant::now() < deadline, "used index stuck at {idx}");
        // Not a sleep: the second scenario kills the backend as soon as it gets here.
        std::thread::yield_now();
    }
}

/// The head of used ring entry `n`, after checking its length (the status byte only).
fn used_head(guest: &File, n: u16) -> u16 {
    let (id, len) = used_entry(guest, QUEUE, n);
    assert_eq!(
        len, 1,
        "used entry {n} (head {id}): a write writes its status only"
    );
    u16::try_from(id).expect("a head")
}

/// The front end's connection, as qemu keeps it across backend restarts: guest memory, the
/// inflight region's fd, the eventfds.
struct Guest {
    memory: File,
    inflight: Option<(VhostUserInflight, File)>,
    kick: EventFd,
    call: EventFd,
}

impl Guest {
    fn new() -> Guest {
        let memory = memfd("guest", GUEST_BYTES);
        Guest {
            memory,
            inflight: None,
            kick: EventFd::new(0).unwrap(),
            call: EventFd::new(0).unwrap(),
        }
    }

    /// Connects and starts the ring: the first time it asks for the inflight region, then
    /// (every time) sets it before the ring, with base `base`, and kicks.
    fn connect(&mut self, socket: &Path, base: u16) -> Frontend {
        let mut frontend = Frontend::connect(socket, 1).expect("connect");
        negotiate_features(&mut frontend);
        let offered = frontend.get_protocol_features().unwrap();
        assert!(
            offered.contains(VhostUserProtocolFeatures::INFLIGHT_SHMFD),
            "INFLIGHT_SHMFD offered: {offered:?}"
        );
        frontend
            .set_protocol_features(
                VhostUserProtocolFeatures::REPLY_ACK | VhostUserProtocolFeatures::INFLIGHT_SHMFD,
            )
            .unwrap();
        frontend.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
        if self.inflight.is_none() {
            let asked = VhostUserInflight::new(0, 0, 1, QUEUE);
            self.inflight = Some(frontend.get_inflight_fd(&asked).expect("GET_INFLIGHT_FD"));
        }
        let (description, file) = self.inflight.as_ref().expect("got");
        frontend
            .set_inflight_fd(description, file.as_raw_fd())
            .expect("SET_INFLIGHT_FD");
        frontend
            .set_mem_table(&[region(&self.memory, 0, GUEST_BYTES)])
            .unwrap();
        start_queue(&mut frontend, QUEUE, base, &self.call, &self.kick);
        // qemu kicks every queue once it started them, for what is already in the ring.
        self.kick.write(1).unwrap();
        frontend
    }
}

/// The inflight region as qemu keeps it, read through its fd: the heads marked in flight
/// (checking the queue header's layout on the way: version 1, `desc_num`, and `used_idx` if
/// given; a kill between the used ring's update and the log's leaves it one behind).
fn marked_in_flight(guest: &Guest, used_idx: Option<u16>) -> Vec<u16> {
    let (_, region) = guest.inflight.as_ref().expect("an inflight region");
    assert_eq!(u16_at(region, 8), 1, "version");
    assert_eq!(u16_at(region, 10), QUEUE, "desc_num");
    if let Some(used_idx) = used_idx {
        assert_eq!(u16_at(region, 14), used_idx, "used_idx");
    }
    (0..QUEUE)
        .filter(|&head| get(region, 16 + u64::from(head) * 16, 1)[0] == 1)
        .collect()
}

/// A scratch directory with an empty disk file.
fn scratch(name: &str) -> (PathBuf, PathBuf, PathBuf) {
    let dir = std::env::temp_dir().join(format!("vhost-inflight-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let disk = dir.join("disk");
    File::create(&disk).unwrap().set_len(DISK_BYTES).unwrap();
    let socket = dir.join("sock");
    (dir, socket, disk)
}

/// Checks that used entries `from..to` are the heads of requests `from..to` in some order,
/// each once, with status OK, and returns them in ring order.
fn used_once(guest: &File, from: u16, to: u16) -> Vec<u16> {
    let heads: Vec<u16> = (from..to).map(|n| used_head(guest, n)).collect();
    let mut sorted = heads.clone();
    sorted.sort_unstable();
    let mut expected: Vec<u16> = (from..to).map(|n| (n % SLOTS) * 3).collect();
    expected.sort_unstable();
    assert_eq!(sorted, expected, "each posted head used exactly once");
    for n in from..to {
        let status = get(guest, STATUS + u64::from(n % SLOTS), 1)[0];
        assert_eq!(status, 0, "request {n}: status");
    }
    heads
}

/// Checks the disk holds every write `0..count` (a later round's win where they overlap).
fn disk_matches(disk: &Path, count: u16) {
    let mut model = vec![0u8; DISK_BYTES as usize];
    for n in 0..count {
        let at = offset(n) as usize;
        model[at..at + WRITE_BYTES as usize].copy_from_slice(&payload(n));
    }
    let bytes = std::fs::read(disk).unwrap();
    assert!(bytes == model, "the disk holds what the writes put there");
}

/// The ring base a reconnecting front end sends.
#[derive(Clone, Copy, Debug)]
enum Base {
    /// The used index: what qemu restores when GET_VRING_BASE fails on a dead backend. A
    /// backend that serves a queue in order could recover from the available ring with it.
    UsedIndex,
    /// The available index: every posted chain counted as taken. Only the inflight region
    /// tells where the ring goes on (the spec: used index + chains in flight), so this fails
    /// without it.
    AvailIndex,
}

fn a_write_held_in_flight_at_the_kill_is_resubmitted_once_after_restart(base: Base) {
    let (dir, socket, disk) = scratch(&format!("held-{base:?}"));
    let mut guest = Guest::new();
    let backend = Backend::start(&socket, &disk, Some(offset(2)));
    let frontend = guest.connect(&socket, 0);
    for n in 0..6 {
        post_write(&guest.memory, n);
    }
    publish(&guest.memory, &guest.kick, 6);
    backend.expect_line(&format!("held {}", offset(2)));
    // One queue thread serves in ring order: 0 and 1 are done, 2 is held, 3 to 5 wait.
    assert_eq!(wait_used(&guest.memory, 2), 2);
    backend.kill();
    drop(frontend);
    assert_eq!(
        used_idx(&guest.memory),
        2,
        "nothing completed after the kill"
    );
    assert_eq!(
        marked_in_flight(&guest, Some(2)),
        vec![6],
        "the held write's head is marked"
    );

    let backend = Backend::start(&socket, &disk, None);
    let base = match base {
        Base::UsedIndex => used_idx(&guest.memory),
        Base::AvailIndex => 6,
    };
    let frontend = guest.connect(&socket, base);
    wait_used(&guest.memory, 6);
    let heads = used_once(&guest.memory, 0, 6);
    assert_eq!(
        heads,
        vec![0, 3, 6, 9, 12, 15],
        "resubmitted before the ring goes on"
    );
    disk_matches(&disk, 6);
    drop(frontend);
    backend.kill();
    std::fs::remove_dir_all(dir).unwrap();
}

fn writes_in_flight_anywhere_at_a_kill_complete_exactly_once_after_restart() {
    let (dir, socket, disk) = scratch("anywhere");
    let mut guest = Guest::new();
    let mut posted = 0u16;
    for _round in 0..3 {
        let base = used_idx(&guest.memory);
        let backend = Backend::start(&socket, &disk, None);
        let frontend = guest.connect(&socket, base);
        // The last round's writes, each once, before this round reuses their slots.
        wait_used(&guest.memory, posted);
        used_once(&guest.memory, posted.saturating_sub(SLOTS), posted);
        let first = posted;
        for n in first..first + SLOTS {
            post_write(&guest.memory, n);
        }
        posted += SLOTS;
        publish(&guest.memory, &guest.kick, posted);
        wait_used(&guest.memory, first + 2);
        backend.kill();
        drop(frontend);
        let used = used_idx(&guest.memory);
        println!(
            "killed with {} of {SLOTS} writes used, {} marked in flight",
            used - first,
            marked_in_flight(&guest, None).len()
        );
    }
    let base = used_idx(&guest.memory);
    let backend = Backend::start(&socket, &disk, None);
    let frontend = guest.connect(&socket, base);
    wait_used(&guest.memory, posted);
    used_once(&guest.memory, posted - SLOTS, posted);
    assert_eq!(used_idx(&guest.memory), posted, "no completion twice");
    disk_matches(&disk, posted);
    drop(frontend);
    backend.kill();
    std::fs::remove_dir_all(dir).unwrap();
}

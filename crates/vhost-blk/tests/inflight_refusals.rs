//! Malformed inflight messages (GET_INFLIGHT_FD / SET_INFLIGHT_FD) are refused: the
//! backend ends that connection (as it does with any message it refuses), never panics, and
//! serves the next front end. Method: a raw vhost-user front end on the served socket, one
//! connection per bad message (not negotiated, wrong size, too many queues, queues longer
//! than the ring's maximum, no fd, an fd that could shrink under the mapping, a region too
//! small), then a well-formed GET and SET on one connection that goes on, then a blkio client
//! that reads.

mod common;
mod wire;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::{Client, Op};
use rustix::fs::{ftruncate, memfd_create, MemfdFlags};
use thin_pool::testing::memory_pool;
use thinpool_frontend::VolumeTarget;
use thinpool_vhost::VhostBlkServer;
use wire::*;

static PANICS: AtomicUsize = AtomicUsize::new(0);

/// Connects and negotiates REPLY_ACK and INFLIGHT_SHMFD.
fn negotiated(path: &Path) -> Front {
    let mut front = Front::connect(path);
    front.send(GET_PROTOCOL_FEATURES, 0, &[], None);
    let offered = front.reply_u64(GET_PROTOCOL_FEATURES);
    assert_ne!(offered & PF_INFLIGHT_SHMFD, 0, "INFLIGHT_SHMFD offered");
    let acked = PF_REPLY_ACK | PF_INFLIGHT_SHMFD;
    front.send(SET_PROTOCOL_FEATURES, 0, &acked.to_le_bytes(), None);
    front
}

fn description(mmap_size: u64, mmap_offset: u64, num_queues: u16, queue_size: u16) -> Vec<u8> {
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&mmap_size.to_le_bytes());
    bytes.extend_from_slice(&mmap_offset.to_le_bytes());
    bytes.extend_from_slice(&num_queues.to_le_bytes());
    bytes.extend_from_slice(&queue_size.to_le_bytes());
    bytes.extend_from_slice(&[0; 4]);
    bytes
}

#[test]
fn malformed_inflight_messages_end_the_connection_and_the_next_front_end_is_served() {
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, Ordering::SeqCst);
        default_hook(info);
    }));
    let dir: PathBuf =
        std::env::temp_dir().join(format!("vhost-inflight-bad-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("sock");
    let pool = memory_pool();
    pool.create_volume("disk", 1 << 22).unwrap();
    let target = Arc::new(VolumeTarget::new(pool.volume("disk").unwrap()));
    let server = VhostBlkServer::start(target, &path, 1).expect("serve");

    let front = Front::connect(&path);
    front.send(GET_INFLIGHT_FD, 0, &description(0, 0, 1, 128), None);
    front.refused("GET_INFLIGHT_FD without INFLIGHT_SHMFD negotiated");

    let front = negotiated(&path);
    front.send(GET_INFLIGHT_FD, 0, &description(0, 0, 1, 128)[..16], None);
    front.refused("a 16-byte inflight description");

    let front = negotiated(&path);
    front.send(GET_INFLIGHT_FD, 0, &description(0, 0, 2, 128), None);
    front.refused("two queues of a one-queue device");

    let front = negotiated(&path);
    front.send(GET_INFLIGHT_FD, 0, &description(0, 0, 1, 2048), None);
    front.refused("queues of 2048, past the ring's 1024");

    let front = negotiated(&path);
    front.send(
        SET_INFLIGHT_FD,
        NEED_REPLY,
        &description(4112, 0, 1, 256),
        None,
    );
    front.refused("SET_INFLIGHT_FD without an fd");

    let unsealed = std::fs::File::from(memfd_create("unsealed", MemfdFlags::CLOEXEC).unwrap());
    ftruncate(&unsealed, 1 << 16).unwrap();
    let front = negotiated(&path);
    let bad = description(4112, 0, 1, 256);
    front.send(SET_INFLIGHT_FD, NEED_REPLY, &bad, Some(&unsealed));
    front.refused("a region that could shrink under the mapping");

    // A region made by the backend, handed back claiming more queue than it has.
    let mut front = negotiated(&path);
    front.send(GET_INFLIGHT_FD, 0, &description(0, 0, 1, 128), None);
    let (answer, mut fds) = front.reply(GET_INFLIGHT_FD);
    assert_eq!(
        answer,
        description(16 + 16 * 128, 0, 1, 128),
        "the region's description"
    );
    assert_eq!(fds.len(), 1, "the region's fd");
    let region = std::fs::File::from(fds.remove(0));
    front.send(
        SET_INFLIGHT_FD,
        NEED_REPLY,
        &description(16 + 16 * 128, 0, 1, 256),
        Some(&region),
    );
    front.refused("a region too small for its queue size");

    // Well-formed: acked, and the connection goes on.
    let mut front = negotiated(&path);
    front.send(SET_INFLIGHT_FD, NEED_REPLY, &answer, Some(&region));
    let (ack, _) = front.reply(SET_INFLIGHT_FD);
    assert_eq!(ack, 0u64.to_le_bytes(), "SET_INFLIGHT_FD acked");
    front.send(GET_FEATURES, 0, &[], None);
    assert_eq!(front.reply(GET_FEATURES).0.len(), 8, "still serving");
    drop(front);

    let mut client = Client::connect(&path, 1).expect("the next front end");
    let (ret, bytes) = client.run(
        0,
        &Op::Read {
            offset: 0,
            len: 4096,
        },
    );
    assert_eq!(ret, 0);
    assert!(bytes.iter().all(|&b| b == 0));
    drop(client);
    server.stop();
    assert_eq!(
        PANICS.load(Ordering::SeqCst),
        0,
        "a backend thread panicked"
    );
    pool.close().unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

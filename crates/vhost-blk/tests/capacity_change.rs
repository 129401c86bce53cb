//! Goal: a volume grown while a front end is attached over vhost-user-blk is announced to
//! it. The backend request socket the front end gave with `SET_BACKEND_REQ_FD` receives
//! `VHOST_USER_BACKEND_CONFIG_CHANGE_MSG` (request 2, flags = version 1 without
//! `NEED_REPLY`, no payload), and GET_CONFIG then answers the new capacity.
//!
//! Method: vhost's `Frontend` plays the front end on the served socket (features, protocol
//! features `BACKEND_REQ | CONFIG | REPLY_ACK`, the channel one end of a socket pair it
//! keeps the other end of). The volume grows through the pool (what `thinpool volume
//! resize` does in the server) and the server's `CapacityNotifier` is called, as the daemon
//! does after every resize. Also: nothing is sent while the size is what the front end was
//! told; a front end that gave no channel is told nothing (`NoChannel`); once it is gone,
//! `NoFrontEnd`.

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use thin_pool::testing::memory_pool;
use thin_pool::Shrink;
use thinpool_frontend::VolumeTarget;
use thinpool_vhost::{CapacityNotice, VhostBlkServer};
use vhost::vhost_user::message::{VhostUserConfigFlags, VhostUserHeaderFlag};
use vhost::vhost_user::{Frontend, VhostUserFrontend, VhostUserProtocolFeatures};
use vhost::VhostBackend;

const MIB: u64 = 1 << 20;
const VIRTIO_F_VERSION_1: u64 = 1 << 32;
const F_PROTOCOL_FEATURES: u64 = 1 << 30;

/// A front end through feature negotiation, with `protocol` acked.
fn negotiate(path: &Path, protocol: VhostUserProtocolFeatures) -> Frontend {
    let mut frontend = Frontend::connect(path, 1).expect("connect");
    frontend.set_owner().expect("SET_OWNER");
    let features = frontend.get_features().expect("GET_FEATURES");
    assert!(features & F_PROTOCOL_FEATURES != 0);
    frontend
        .set_features(VIRTIO_F_VERSION_1 | F_PROTOCOL_FEATURES)
        .expect("SET_FEATURES");
    let offered = frontend
        .get_protocol_features()
        .expect("GET_PROTOCOL_FEATURES");
    assert!(
        offered.contains(protocol),
        "offered {offered:?}, wanted {protocol:?}"
    );
    frontend
        .set_protocol_features(protocol)
        .expect("SET_PROTOCOL_FEATURES");
    frontend
}

/// The capacity GET_CONFIG answers, in sectors.
fn capacity_sectors(frontend: &mut Frontend) -> u64 {
    let (_, payload) = frontend
        .get_config(0, 8, VhostUserConfigFlags::empty(), &[0; 8])
        .expect("GET_CONFIG");
    u64::from_le_bytes(payload[..8].try_into().expect("8 bytes"))
}

fn socket_path(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("vhost-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("test directory");
    dir.join("sock")
}

#[test]
fn a_grown_volume_sends_config_change_and_get_config_shows_the_new_capacity() {
    let pool = memory_pool();
    pool.create_volume("disk", 4 * MIB).unwrap();
    let target = Arc::new(VolumeTarget::new(pool.volume("disk").unwrap()));
    let path = socket_path("capacity");
    let server = VhostBlkServer::start(target, &path, 1).unwrap();
    let notifier = server.capacity_notifier();
    assert_eq!(notifier.name(), "disk");
    assert_eq!(notifier.notify().unwrap(), CapacityNotice::NoFrontEnd);

    let wanted = VhostUserProtocolFeatures::BACKEND_REQ
        | VhostUserProtocolFeatures::CONFIG
        | VhostUserProtocolFeatures::REPLY_ACK;
    let mut frontend = negotiate(&path, wanted);
    let (channel, mut ours) = UnixStream::pair().unwrap();
    // Answered before it returns: the backend has the channel then.
    frontend.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
    frontend
        .set_backend_request_fd(&channel)
        .expect("SET_BACKEND_REQ_FD");
    frontend.set_hdr_flags(VhostUserHeaderFlag::empty());
    drop(channel);
    assert_eq!(capacity_sectors(&mut frontend), 4 * MIB / 512);
    assert_eq!(notifier.notify().unwrap(), CapacityNotice::Unchanged);

    pool.resize_volume("disk", 12 * MIB, Shrink::KeepData)
        .unwrap();
    assert_eq!(
        notifier.notify().unwrap(),
        CapacityNotice::Sent {
            size_bytes: 12 * MIB
        }
    );
    ours.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut header = [0u8; 12];
    ours.read_exact(&mut header).expect("CONFIG_CHANGE_MSG");
    let word = |i: usize| u32::from_le_bytes(header[i * 4..i * 4 + 4].try_into().unwrap());
    assert_eq!(word(0), 2, "VHOST_USER_BACKEND_CONFIG_CHANGE_MSG");
    assert_eq!(word(1), 1, "version 1, no reply wanted");
    assert_eq!(word(2), 0, "no payload");
    assert_eq!(capacity_sectors(&mut frontend), 12 * MIB / 512);
    // Told once: a second notice for the same size sends nothing.
    assert_eq!(notifier.notify().unwrap(), CapacityNotice::Unchanged);
    ours.set_nonblocking(true).unwrap();
    let mut more = [0u8; 1];
    assert_eq!(
        ours.read(&mut more).map_err(|e| e.kind()),
        Err(std::io::ErrorKind::WouldBlock),
        "nothing more on the channel"
    );

    drop(frontend);
    server.stop();
    assert_eq!(notifier.notify().unwrap(), CapacityNotice::NoFrontEnd);
}

#[test]
fn a_front_end_without_a_backend_request_channel_is_told_nothing() {
    let pool = memory_pool();
    pool.create_volume("disk", 4 * MIB).unwrap();
    let target = Arc::new(VolumeTarget::new(pool.volume("disk").unwrap()));
    let path = socket_path("capacity-nochannel");
    let server = VhostBlkServer::start(target, &path, 1).unwrap();
    let notifier = server.capacity_notifier();
    let mut frontend = negotiate(&path, VhostUserProtocolFeatures::CONFIG);
    assert_eq!(capacity_sectors(&mut frontend), 4 * MIB / 512);
    pool.resize_volume("disk", 8 * MIB, Shrink::KeepData)
        .unwrap();
    assert_eq!(notifier.notify().unwrap(), CapacityNotice::NoChannel);
    // It still reads the new capacity when it asks.
    assert_eq!(capacity_sectors(&mut frontend), 8 * MIB / 512);
    drop(frontend);
    server.stop();
}

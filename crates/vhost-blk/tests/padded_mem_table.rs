//! A front end speaking raw vhost-user on the served socket, the way Linux 6.1's UML
//! `virtio_uml` does: its SET_MEM_TABLE carries one region in a payload padded with a zeroed
//! second one (size 72). The backend must take it (ack 0) and keep serving the connection.

mod wire;

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use rustix::fs::{ftruncate, memfd_create, MemfdFlags};
use thin_pool::testing::memory_pool;
use thinpool_frontend::VolumeTarget;
use thinpool_vhost::VhostBlkServer;
use wire::*;

const REGION_BYTES: u64 = 1 << 20;

fn padded_mem_table() -> Vec<u8> {
    let mut payload = Vec::new();
    payload.extend_from_slice(&1u32.to_le_bytes()); // num_regions
    payload.extend_from_slice(&0u32.to_le_bytes()); // padding
                                                    // guest_phys_addr, memory_size, userspace_addr, mmap_offset
    for field in [0u64, REGION_BYTES, 0x7f00_0000_0000, 0] {
        payload.extend_from_slice(&field.to_le_bytes());
    }
    payload.extend_from_slice(&[0u8; 32]); // the zeroed second region
    assert_eq!(payload.len(), 72);
    payload
}

#[test]
fn a_mem_table_padded_like_virtio_umls_is_acked_and_the_connection_goes_on() {
    let dir: PathBuf = std::env::temp_dir().join(format!("vhost-pad-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("sock");
    let pool = memory_pool();
    pool.create_volume("pad", 1 << 24).unwrap();
    let target = Arc::new(VolumeTarget::new(pool.volume("pad").unwrap()));
    let server = VhostBlkServer::start(target, &path, 1).expect("serve");
    let mut front = Front::connect(&path);
    front.send(GET_FEATURES, 0, &[], None);
    let features = front.reply_u64(GET_FEATURES);
    assert_ne!(features & F_PROTOCOL_FEATURES, 0);
    front.send(GET_PROTOCOL_FEATURES, 0, &[], None);
    let protocol = front.reply_u64(GET_PROTOCOL_FEATURES);
    assert_ne!(protocol & PF_REPLY_ACK, 0, "REPLY_ACK offered");
    let acked = protocol & (PF_REPLY_ACK | PF_CONFIG);
    front.send(SET_PROTOCOL_FEATURES, 0, &acked.to_le_bytes(), None);
    front.send(SET_FEATURES, 0, &features.to_le_bytes(), None);

    let memory = memfd_create("guest", MemfdFlags::CLOEXEC).expect("memfd");
    ftruncate(&memory, REGION_BYTES).expect("size the memfd");
    let memory = std::fs::File::from(memory);
    front.send(
        SET_MEM_TABLE,
        NEED_REPLY,
        &padded_mem_table(),
        Some(&memory),
    );
    assert_eq!(front.reply_u64(SET_MEM_TABLE), 0, "SET_MEM_TABLE acked");

    // Still serving: the config space comes back (offset 0, 60 bytes, flags 0, then room).
    let mut config = Vec::new();
    for word in [0u32, 60, 0] {
        config.extend_from_slice(&word.to_le_bytes());
    }
    config.extend_from_slice(&[0u8; 60]);
    front.send(GET_CONFIG, 0, &config, None);
    let (got, _) = front.reply(GET_CONFIG);
    assert_eq!(got.len(), 72);
    let capacity = u64::from_le_bytes(got[12..20].try_into().unwrap());
    assert_eq!(capacity, (1 << 24) / 512, "capacity in sectors");
    front.sock.flush().unwrap();
    drop(front);
    server.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

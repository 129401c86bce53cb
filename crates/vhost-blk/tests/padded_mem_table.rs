//! A front end speaking raw vhost-user on the served socket, the way Linux 6.1's UML
//! `virtio_uml` does: its SET_MEM_TABLE carries one region in a payload padded with a zeroed
//! second one (size 72). The backend must take it (ack 0) and keep serving the connection.

use std::io::{IoSlice, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;

use rustix::fs::{ftruncate, memfd_create, MemfdFlags};
use rustix::net::{sendmsg, SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
use thin_pool::testing::memory_pool;
use thinpool_frontend::VolumeTarget;
use thinpool_vhost::VhostBlkServer;

const GET_FEATURES: u32 = 1;
const SET_FEATURES: u32 = 2;
const SET_OWNER: u32 = 3;
const SET_MEM_TABLE: u32 = 5;
const GET_PROTOCOL_FEATURES: u32 = 15;
const SET_PROTOCOL_FEATURES: u32 = 16;
const GET_CONFIG: u32 = 24;
const VERSION: u32 = 1;
const NEED_REPLY: u32 = 1 << 3;
const REPLY: u32 = 1 << 2;
const F_PROTOCOL_FEATURES: u64 = 1 << 30;
const PF_REPLY_ACK: u64 = 1 << 3;
const PF_CONFIG: u64 = 1 << 9;
const REGION_BYTES: u64 = 1 << 20;

struct Front {
    sock: UnixStream,
}

impl Front {
    fn send(&mut self, request: u32, flags: u32, payload: &[u8], fd: Option<&std::fs::File>) {
        let mut bytes = Vec::new();
        for word in [request, VERSION | flags, payload.len() as u32] {
            bytes.extend_from_slice(&word.to_le_bytes());
        }
        bytes.extend_from_slice(payload);
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        let fds = fd.map(|f| [f.as_fd()]);
        if let Some(fds) = &fds {
            assert!(control.push(SendAncillaryMessage::ScmRights(fds)));
        }
        let sent = sendmsg(
            &self.sock,
            &[IoSlice::new(&bytes)],
            &mut control,
            SendFlags::empty(),
        )
        .expect("sendmsg");
        assert_eq!(sent, bytes.len());
    }

    fn reply(&mut self, request: u32) -> Vec<u8> {
        let mut header = [0u8; 12];
        self.sock.read_exact(&mut header).expect("reply header");
        let word = |i: usize| u32::from_le_bytes(header[i..i + 4].try_into().unwrap());
        assert_eq!(word(0), request, "reply to the request sent");
        assert_eq!(word(4) & REPLY, REPLY, "a reply");
        let mut payload = vec![0; word(8) as usize];
        self.sock.read_exact(&mut payload).expect("reply payload");
        payload
    }

    fn reply_u64(&mut self, request: u32) -> u64 {
        let payload = self.reply(request);
        u64::from_le_bytes(payload.try_into().expect("a u64 reply"))
    }
}

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
    let mut front = Front {
        sock: UnixStream::connect(&path).expect("connect"),
    };
    front.send(SET_OWNER, 0, &[], None);
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
    let got = front.reply(GET_CONFIG);
    assert_eq!(got.len(), 72);
    let capacity = u64::from_le_bytes(got[12..20].try_into().unwrap());
    assert_eq!(capacity, (1 << 24) / 512, "capacity in sectors");
    front.sock.flush().unwrap();
    drop(front);
    server.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

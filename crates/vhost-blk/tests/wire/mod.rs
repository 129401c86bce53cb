//! A front end that speaks raw vhost-user on the served socket, for the tests that send what
//! vhost's `Frontend` will not (a padded memory table, malformed messages): each message is
//! the 12-byte header (request, flags with the version, payload size; little endian), the
//! payload and at most one fd.

#![allow(dead_code)]

use std::io::{IoSlice, Read};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;

use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

pub const GET_FEATURES: u32 = 1;
pub const SET_FEATURES: u32 = 2;
pub const SET_OWNER: u32 = 3;
pub const SET_MEM_TABLE: u32 = 5;
pub const GET_PROTOCOL_FEATURES: u32 = 15;
pub const SET_PROTOCOL_FEATURES: u32 = 16;
pub const GET_CONFIG: u32 = 24;
pub const GET_INFLIGHT_FD: u32 = 31;
pub const SET_INFLIGHT_FD: u32 = 32;
pub const VERSION: u32 = 1;
pub const REPLY: u32 = 1 << 2;
pub const NEED_REPLY: u32 = 1 << 3;
pub const F_PROTOCOL_FEATURES: u64 = 1 << 30;
pub const PF_REPLY_ACK: u64 = 1 << 3;
pub const PF_CONFIG: u64 = 1 << 9;
pub const PF_INFLIGHT_SHMFD: u64 = 1 << 12;

pub struct Front {
    pub sock: UnixStream,
}

impl Front {
    /// Connects and takes the backend (SET_OWNER).
    pub fn connect(path: &Path) -> Front {
        let front = Front {
            sock: UnixStream::connect(path).expect("connect"),
        };
        front.send(SET_OWNER, 0, &[], None);
        front
    }

    pub fn send(&self, request: u32, flags: u32, payload: &[u8], fd: Option<&std::fs::File>) {
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
            SendFlags::NOSIGNAL,
        )
        .expect("sendmsg");
        assert_eq!(sent, bytes.len());
    }

    /// The reply to `request`: its payload and the fds that came with it.
    pub fn reply(&mut self, request: u32) -> (Vec<u8>, Vec<OwnedFd>) {
        let mut header = [0u8; 12];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let got = recvmsg(
            &self.sock,
            &mut [std::io::IoSliceMut::new(&mut header)],
            &mut control,
            RecvFlags::WAITALL,
        )
        .expect("reply header");
        assert_eq!(got.bytes, 12, "a whole header");
        let mut fds = Vec::new();
        for message in control.drain() {
            if let RecvAncillaryMessage::ScmRights(received) = message {
                fds.extend(received);
            }
        }
        let word = |i: usize| u32::from_le_bytes(header[i..i + 4].try_into().unwrap());
        assert_eq!(word(0), request, "reply to the request sent");
        assert_eq!(word(4) & REPLY, REPLY, "a reply");
        let mut payload = vec![0; word(8) as usize];
        self.sock.read_exact(&mut payload).expect("reply payload");
        (payload, fds)
    }

    /// The reply to `request`, a u64.
    pub fn reply_u64(&mut self, request: u32) -> u64 {
        let (payload, _) = self.reply(request);
        u64::from_le_bytes(payload.try_into().expect("a u64 reply"))
    }

    /// The backend ended the connection: nothing but the end of the stream comes.
    pub fn refused(mut self, what: &str) {
        let mut byte = [0u8; 1];
        match self.sock.read(&mut byte) {
            Ok(0) | Err(_) => {}
            Ok(_) => panic!("{what}: the backend answered instead of ending the connection"),
        }
    }
}

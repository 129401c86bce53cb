//! A shim between the accepted front end and the vhost-user handler: a compatibility fix, and
//! the inflight side of the protocol, which the handler (vhost-user-backend 0.24) refuses.
//!
//! The fix: Linux's UML `virtio_uml` front end (seen with 6.1) sends `VHOST_USER_SET_MEM_TABLE`
//! with its payload padded to a fixed two-region struct: the header's size is
//! 8 + 2 × 32 = 72 bytes while `num_regions` is 1 and the second region is all zeros. vhost
//! 0.18's `BackendReqHandler::set_mem_table` requires size == 8 + num_regions × 32 and answers
//! an error, so the kernel's virtio-blk probe fails with EIO. The crates offer no hook to
//! accept it (the handler parses the socket itself), so the connection runs through this relay:
//! a SET_MEM_TABLE whose payload is longer than its regions need and whose excess is all zeros
//! is trimmed (and its size fixed) before the handler sees it. Anything else odd goes through
//! untouched for the handler to judge.
//!
//! Inflight I/O tracking (`VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD`, [`crate::inflight`]): the
//! relay adds the feature to the handler's GET_PROTOCOL_FEATURES reply, takes it out of
//! SET_PROTOCOL_FEATURES on the way in (noting whether the front end acknowledged it), and
//! answers GET_INFLIGHT_FD (a new region's fd) and SET_INFLIGHT_FD (the region mapped and
//! handed to the backend's queues, acknowledged if asked) itself. A malformed or
//! unnegotiated inflight message ends the connection, as the handler does with the messages
//! it refuses. Everything else is forwarded unchanged (header, payload and `SCM_RIGHTS` fds),
//! and replies go back byte for byte; the relay's own answers and the handler's replies
//! share one lock on the front end's socket so that they never interleave.
//!
//! It also shows each front-end message to the connection's
//! [`BackendChannel`](crate::capacity::BackendChannel), which keeps the acked protocol
//! features and a duplicate of the backend request socket, the one way to send
//! CONFIG_CHANGE_MSG with vhost 0.18 (see `capacity`). The message itself is forwarded as is.
//!
//! Messages are framed by the 12-byte header (request u32, flags u32, size u32, all little
//! endian), then `size` bytes of payload; fds ride with the message's bytes.

use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::net::Shutdown;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags,
    SendAncillaryBuffer, SendAncillaryMessage, SendFlags,
};

use crate::backend::BlkBackend;
use crate::capacity::BackendChannel;
use crate::inflight;

/// `VHOST_USER_SET_MEM_TABLE`.
const SET_MEM_TABLE: u32 = 5;
/// `VHOST_USER_GET_PROTOCOL_FEATURES`, `VHOST_USER_SET_PROTOCOL_FEATURES`.
const GET_PROTOCOL_FEATURES: u32 = 15;
const SET_PROTOCOL_FEATURES: u32 = 16;
/// Header flags: the version (1), a reply, the front end wants an answer.
const FLAG_VERSION: u32 = 1;
const FLAG_REPLY: u32 = 1 << 2;
const FLAG_NEED_REPLY: u32 = 1 << 3;
const HEADER_BYTES: usize = 12;
/// The mem table payload: `num_regions` u32, padding u32, then the regions.
const MEM_TABLE_HEAD_BYTES: usize = 8;
const REGION_BYTES: usize = 32;
/// vhost's own bound on attached fds per message.
const FDS_MAX: usize = 32;
/// Far above any vhost-user message (vhost 0.18 caps them at 4 KiB): a larger size is a
/// broken peer, and the relay drops the connection rather than buffer it.
const PAYLOAD_MAX: usize = 1 << 16;

/// One vhost-user message as read off a socket.
struct Message {
    header: [u8; HEADER_BYTES],
    payload: Vec<u8>,
    fds: Vec<OwnedFd>,
}

impl Message {
    fn request(&self) -> u32 {
        u32::from_le_bytes(self.header[0..4].try_into().expect("4 bytes"))
    }

    fn flags(&self) -> u32 {
        u32::from_le_bytes(self.header[4..8].try_into().expect("4 bytes"))
    }

    /// The front end asked for an answer (`NEED_REPLY`, with REPLY_ACK negotiated).
    fn need_reply(&self) -> bool {
        self.flags() & FLAG_NEED_REPLY != 0
    }

    /// A reply to this message carrying `payload`.
    fn reply(&self, payload: Vec<u8>) -> Message {
        let mut header = [0; HEADER_BYTES];
        header[0..4].copy_from_slice(&self.request().to_le_bytes());
        header[4..8].copy_from_slice(&(FLAG_VERSION | FLAG_REPLY).to_le_bytes());
        let mut reply = Message {
            header,
            payload,
            fds: Vec::new(),
        };
        reply.set_size(reply.payload.len());
        reply
    }

    fn set_size(&mut self, size: usize) {
        let size = u32::try_from(size).expect("payload bounded by PAYLOAD_MAX");
        self.header[8..12].copy_from_slice(&size.to_le_bytes());
    }
}

fn header_size(header: &[u8; HEADER_BYTES]) -> usize {
    u32::from_le_bytes(header[8..12].try_into().expect("4 bytes")) as usize
}

/// Trims a SET_MEM_TABLE payload padded with zeroed regions past `num_regions` (see the
/// module doc). Returns whether it changed the message.
fn trim_padded_mem_table(msg: &mut Message) -> bool {
    if msg.request() != SET_MEM_TABLE || msg.payload.len() < MEM_TABLE_HEAD_BYTES {
        return false;
    }
    let regions = u32::from_le_bytes(msg.payload[0..4].try_into().expect("4 bytes")) as usize;
    let Some(needed) = regions
        .checked_mul(REGION_BYTES)
        .and_then(|b| b.checked_add(MEM_TABLE_HEAD_BYTES))
    else {
        return false;
    };
    if msg.payload.len() <= needed || msg.payload[needed..].iter().any(|&b| b != 0) {
        return false;
    }
    msg.payload.truncate(needed);
    msg.set_size(needed);
    true
}

/// Receives exactly `buf.len()` bytes, collecting the fds that come with them. `Ok(false)`:
/// the peer closed before the first byte.
fn recv_exact(sock: &UnixStream, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<bool> {
    let mut done = 0;
    while done < buf.len() {
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(FDS_MAX))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let mut iov = [IoSliceMut::new(&mut buf[done..])];
        let got = match recvmsg(sock, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC) {
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
            Ok(got) => got,
        };
        for message in control.drain() {
            if let RecvAncillaryMessage::ScmRights(received) = message {
                fds.extend(received);
            }
        }
        if got.flags.contains(ReturnFlags::CTRUNC) {
            return Err(io::Error::other("vhost-user message with too many fds"));
        }
        if got.bytes == 0 {
            if done == 0 {
                return Ok(false);
            }
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        done += got.bytes;
    }
    Ok(true)
}

/// The next message, or `None` at a clean end of the stream.
fn recv_message(sock: &UnixStream) -> io::Result<Option<Message>> {
    let mut header = [0; HEADER_BYTES];
    let mut fds = Vec::new();
    if !recv_exact(sock, &mut header, &mut fds)? {
        return Ok(None);
    }
    let size = header_size(&header);
    if size > PAYLOAD_MAX {
        return Err(io::Error::other(format!(
            "vhost-user message of {size} bytes"
        )));
    }
    let mut payload = vec![0; size];
    if !recv_exact(sock, &mut payload, &mut fds)? && size > 0 {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(Some(Message {
        header,
        payload,
        fds,
    }))
}

/// Sends `msg` whole, its fds with its first bytes.
fn send_message(sock: &UnixStream, msg: &Message) -> io::Result<()> {
    let bytes = [&msg.header[..], &msg.payload[..]].concat();
    let borrowed: Vec<BorrowedFd<'_>> = msg.fds.iter().map(AsFd::as_fd).collect();
    let mut sent = 0;
    while sent < bytes.len() {
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(FDS_MAX))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        if sent == 0 && !borrowed.is_empty() {
            let pushed = control.push(SendAncillaryMessage::ScmRights(&borrowed));
            assert!(pushed, "{} fds fit a {FDS_MAX}-fd buffer", borrowed.len());
        }
        let iov = [IoSlice::new(&bytes[sent..])];
        match sendmsg(sock, &iov, &mut control, SendFlags::NOSIGNAL) {
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
            Ok(n) => sent += n,
        }
    }
    Ok(())
}

/// What the relay does with a front end's message.
enum Handling {
    /// Pass it to the handler.
    Forward,
    /// Answered here: send this back to the front end (`None`: no answer wanted).
    Answered(Option<Message>),
}

/// What both directions share: the front end's socket for writing (replies from the handler
/// and the relay's own answers never interleave), and the inflight side of the protocol.
struct Shared {
    front_writes: Mutex<()>,
    /// The backend whose queues get the inflight region; `None`: the relay only forwards
    /// (INFLIGHT_SHMFD not offered).
    backend: Option<BlkBackend>,
    /// The front end acknowledged INFLIGHT_SHMFD (SET_PROTOCOL_FEATURES).
    inflight_acked: AtomicBool,
    /// Sees every front-end message: keeps the acked protocol features and the backend
    /// request socket, for the capacity-change message (`capacity`).
    channel: Arc<BackendChannel>,
}

impl Shared {
    fn send_front(&self, front: &UnixStream, msg: &Message) -> io::Result<()> {
        let _guard = self
            .front_writes
            .lock()
            .map_err(|_| io::Error::other("a relay thread panicked"))?;
        send_message(front, msg)
    }

    /// A front end's message: the inflight ones are answered here, SET_PROTOCOL_FEATURES
    /// loses the bit the handler does not know. An error ends the connection.
    fn handle(&self, msg: &mut Message) -> io::Result<Handling> {
        let Some(backend) = &self.backend else {
            return Ok(Handling::Forward);
        };
        match msg.request() {
            SET_PROTOCOL_FEATURES if msg.payload.len() == 8 => {
                let features = u64::from_le_bytes(msg.payload[..8].try_into().expect("8"));
                let acked = features & inflight::PROTOCOL_FEATURE != 0;
                self.inflight_acked.store(acked, Ordering::Release);
                let masked = features & !inflight::PROTOCOL_FEATURE;
                msg.payload.copy_from_slice(&masked.to_le_bytes());
                Ok(Handling::Forward)
            }
            inflight::GET_INFLIGHT_FD => {
                self.check_acked("GET_INFLIGHT_FD")?;
                let asked = inflight::Description::parse(&msg.payload)?;
                let (answer, file) = inflight::create(&asked, backend.queues())?;
                tracing::debug!(?answer, "vhost-user-blk: inflight region made");
                let mut reply = msg.reply(answer.encode().to_vec());
                reply.fds.push(file.into());
                Ok(Handling::Answered(Some(reply)))
            }
            inflight::SET_INFLIGHT_FD => {
                self.check_acked("SET_INFLIGHT_FD")?;
                let given = inflight::Description::parse(&msg.payload)?;
                if msg.fds.len() != 1 {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("SET_INFLIGHT_FD with {} fds", msg.fds.len()),
                    ));
                }
                let file = std::fs::File::from(msg.fds.remove(0));
                let region = inflight::open(&given, file, backend.queues())?;
                backend.install_inflight(&region)?;
                tracing::debug!(?given, "vhost-user-blk: inflight region set");
                let ack = msg
                    .need_reply()
                    .then(|| msg.reply(0u64.to_le_bytes().to_vec()));
                Ok(Handling::Answered(ack))
            }
            _ => Ok(Handling::Forward),
        }
    }

    fn check_acked(&self, what: &str) -> io::Result<()> {
        if self.inflight_acked.load(Ordering::Acquire) {
            Ok(())
        } else {
            Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{what} without INFLIGHT_SHMFD negotiated"),
            ))
        }
    }

    /// A handler's reply on its way to the front end: GET_PROTOCOL_FEATURES's gains
    /// INFLIGHT_SHMFD, which the relay implements.
    fn patch_reply(&self, msg: &mut Message) {
        if self.backend.is_some()
            && msg.request() == GET_PROTOCOL_FEATURES
            && msg.payload.len() == 8
        {
            let features = u64::from_le_bytes(msg.payload[..8].try_into().expect("8"));
            let offered = features | inflight::PROTOCOL_FEATURE;
            msg.payload.copy_from_slice(&offered.to_le_bytes());
        }
    }
}

/// Ends both sockets, so the other direction ends too.
fn shut(a: &UnixStream, b: &UnixStream) {
    let _ = a.shutdown(Shutdown::Both);
    let _ = b.shutdown(Shutdown::Both);
}

/// The front end's messages to the handler, padded mem tables fixed, the inflight ones
/// answered here.
fn pump_requests(front: &UnixStream, handler: &UnixStream, shared: &Shared) -> io::Result<()> {
    let result = (|| {
        while let Some(mut msg) = recv_message(front)? {
            if trim_padded_mem_table(&mut msg) {
                tracing::debug!("vhost-user SET_MEM_TABLE: zero padding past its regions trimmed");
            }
            shared
                .channel
                .observe(msg.request(), &msg.payload, &msg.fds);
            match shared.handle(&mut msg)? {
                Handling::Forward => send_message(handler, &msg)?,
                Handling::Answered(Some(reply)) => shared.send_front(front, &reply)?,
                Handling::Answered(None) => {}
            }
        }
        Ok(())
    })();
    shut(front, handler);
    result
}

/// The handler's replies to the front end.
fn pump_replies(handler: &UnixStream, front: &UnixStream, shared: &Shared) -> io::Result<()> {
    let result = (|| {
        while let Some(mut msg) = recv_message(handler)? {
            shared.patch_reply(&mut msg);
            shared.send_front(front, &msg)?;
        }
        Ok(())
    })();
    shut(handler, front);
    result
}

/// A running relay: two threads, one per direction.
pub(crate) struct Relay {
    threads: Vec<std::thread::JoinHandle<io::Result<()>>>,
}

impl Relay {
    /// Relays between `front` (the front end's connection) and `handler` (the vhost-user
    /// handler's end) until either closes or is shut down, showing the front end's messages
    /// to `channel`; with `backend`, it implements INFLIGHT_SHMFD for it.
    pub(crate) fn start(
        front: UnixStream,
        handler: UnixStream,
        backend: Option<BlkBackend>,
        channel: Arc<BackendChannel>,
    ) -> io::Result<Self> {
        let (front2, handler2) = (front.try_clone()?, handler.try_clone()?);
        let shared = Arc::new(Shared {
            front_writes: Mutex::new(()),
            backend,
            inflight_acked: AtomicBool::new(false),
            channel,
        });
        let shared2 = Arc::clone(&shared);
        let requests = std::thread::Builder::new()
            .name("vhost-relay-req".into())
            .spawn(move || pump_requests(&front, &handler, &shared))?;
        // Should this spawn fail, the dropped clones leave the request thread running until
        // the caller's shutdown of the handler's connection ends it.
        let replies = std::thread::Builder::new()
            .name("vhost-relay-rep".into())
            .spawn(move || pump_replies(&handler2, &front2, &shared2))?;
        Ok(Relay {
            threads: vec![requests, replies],
        })
    }

    /// Waits for both directions to end; the first error, if any.
    pub(crate) fn join(self) -> io::Result<()> {
        let mut first = Ok(());
        for thread in self.threads {
            let result = thread
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("vhost relay thread panicked")));
            if first.is_ok() {
                first = result;
            }
        }
        first
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capacity::{config_change_header, Delivery};
    use std::io::Read;

    fn mem_table(regions: u32, region_slots: usize, tail: u8) -> Message {
        let mut payload = vec![0u8; MEM_TABLE_HEAD_BYTES + region_slots * REGION_BYTES];
        payload[0..4].copy_from_slice(&regions.to_le_bytes());
        for b in &mut payload[MEM_TABLE_HEAD_BYTES..MEM_TABLE_HEAD_BYTES + REGION_BYTES] {
            *b = 0xab;
        }
        *payload.last_mut().expect("non-empty") = tail;
        let mut header = [0u8; HEADER_BYTES];
        header[0..4].copy_from_slice(&SET_MEM_TABLE.to_le_bytes());
        header[4..8].copy_from_slice(&1u32.to_le_bytes());
        header[8..12].copy_from_slice(&(payload.len() as u32).to_le_bytes());
        Message {
            header,
            payload,
            fds: Vec::new(),
        }
    }

    #[test]
    fn zero_padded_mem_table_is_trimmed_to_its_regions() {
        let mut msg = mem_table(1, 2, 0);
        assert!(trim_padded_mem_table(&mut msg));
        assert_eq!(msg.payload.len(), 40);
        assert_eq!(header_size(&msg.header), 40);
        assert!(msg.payload[8..40].iter().all(|&b| b == 0xab));
    }

    #[test]
    fn exact_or_nonzero_padded_or_other_messages_pass_unchanged() {
        let mut exact = mem_table(1, 1, 0xab);
        assert!(!trim_padded_mem_table(&mut exact));
        assert_eq!(header_size(&exact.header), 40);
        let mut dirty = mem_table(1, 2, 7);
        assert!(!trim_padded_mem_table(&mut dirty));
        assert_eq!(dirty.payload.len(), 72);
        let mut other = mem_table(1, 2, 0);
        other.header[0..4].copy_from_slice(&6u32.to_le_bytes());
        assert!(!trim_padded_mem_table(&mut other));
        assert_eq!(header_size(&other.header), 72);
    }

    #[test]
    fn messages_and_fds_cross_the_relay() {
        let (front_peer, front) = UnixStream::pair().expect("pair");
        let (handler, handler_peer) = UnixStream::pair().expect("pair");
        let relay = Relay::start(front, handler, None, Arc::default()).expect("relay");
        let file = std::fs::File::open("/dev/null").expect("open");
        let mut msg = mem_table(1, 2, 0);
        msg.fds.push(file.into());
        send_message(&front_peer, &msg).expect("send");
        let got = recv_message(&handler_peer)
            .expect("recv")
            .expect("a message");
        assert_eq!(got.payload.len(), 40);
        assert_eq!(header_size(&got.header), 40);
        assert_eq!(got.fds.len(), 1);
        let mut reply = mem_table(0, 1, 0);
        reply.header[0..4].copy_from_slice(&6u32.to_le_bytes());
        send_message(&handler_peer, &reply).expect("reply");
        let back = recv_message(&front_peer).expect("recv").expect("a reply");
        assert_eq!(back.header, reply.header);
        drop(front_peer);
        assert!(recv_message(&handler_peer).expect("eof").is_none());
        relay.join().expect("clean end");
    }

    #[test]
    fn the_backend_request_socket_is_forwarded_and_kept_for_config_changes() {
        let (front_peer, front) = UnixStream::pair().expect("pair");
        let (handler, handler_peer) = UnixStream::pair().expect("pair");
        let channel = Arc::<BackendChannel>::default();
        let relay = Relay::start(front, handler, None, Arc::clone(&channel)).expect("relay");
        let message = |request: u32, payload: Vec<u8>, fds: Vec<OwnedFd>| {
            let mut header = [0u8; HEADER_BYTES];
            header[0..4].copy_from_slice(&request.to_le_bytes());
            header[4..8].copy_from_slice(&1u32.to_le_bytes());
            header[8..12].copy_from_slice(&(payload.len() as u32).to_le_bytes());
            Message {
                header,
                payload,
                fds,
            }
        };
        // BACKEND_REQ (bit 5) and CONFIG (bit 9) acked.
        let features = ((1u64 << 5) | (1 << 9)).to_le_bytes().to_vec();
        send_message(&front_peer, &message(16, features.clone(), Vec::new())).expect("send");
        let (ours, mut theirs) = UnixStream::pair().expect("pair");
        send_message(&front_peer, &message(21, Vec::new(), vec![ours.into()])).expect("send");
        let got = recv_message(&handler_peer)
            .expect("recv")
            .expect("features");
        assert_eq!(got.payload, features);
        let got = recv_message(&handler_peer)
            .expect("recv")
            .expect("fd message");
        assert_eq!(
            (got.request(), got.fds.len()),
            (21, 1),
            "forwarded with its fd"
        );
        drop(got);
        assert_eq!(channel.send_config_change().expect("send"), Delivery::Sent);
        let mut header = [0u8; HEADER_BYTES];
        theirs.read_exact(&mut header).expect("the message");
        assert_eq!(header, config_change_header());
        drop(front_peer);
        assert!(recv_message(&handler_peer).expect("eof").is_none());
        relay.join().expect("clean end");
    }
}

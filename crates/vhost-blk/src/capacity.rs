//! Capacity-change notification: after the target grows, the connected front end is sent
//! `VHOST_USER_BACKEND_CONFIG_CHANGE_MSG` (backend request 2; once `SLAVE_CONFIG_CHANGE_MSG`)
//! on its backend request channel, so the guest's virtio-blk driver reads the config space
//! again (GET_CONFIG, answered live by [`crate::config`]) and sees the new capacity without
//! reattaching.
//!
//! Why the message is not sent through vhost's `Backend`: vhost 0.18's `Backend` (what the
//! handler gives [`crate::BlkBackend`] at `VHOST_USER_SET_BACKEND_REQ_FD`) sends only the
//! shared-object and shared-memory requests, has no public sender for CONFIG_CHANGE_MSG, and
//! does not give its socket back. The [`crate::relay`] already sees every front-end message
//! with its fds, so it shows each one to this connection's [`BackendChannel`]: the protocol
//! features the front end acked (`SET_PROTOCOL_FEATURES`) and a duplicate of the socket of
//! `SET_BACKEND_REQ_FD` (the original goes on to the handler unchanged). The message is a
//! bare 12-byte header (request 2, flags = version 1, size 0) without `NEED_REPLY`, so the
//! front end answers nothing and nothing is ever read here; vhost's `Backend` holds the
//! same socket but is never asked to send, so no two writers interleave.
//!
//! Sent only when both `VHOST_USER_PROTOCOL_F_BACKEND_REQ` and `_CONFIG` were acked (the
//! spec ties the message to the config space), and only when the capacity differs from the
//! one the front end was last told of (at connect, or by an earlier message). The send never
//! blocks (`MSG_DONTWAIT`; a front end that stops reading its channel gets an error, not a
//! stuck caller) and never raises SIGPIPE.
//!
//! Who calls it: the server attaches a connection's channel while the front end is
//! connected ([`Slot`]); anyone holding a [`CapacityNotifier`] (the daemon, after a resize)
//! calls [`CapacityNotifier::notify`].

use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

use rustix::net::{send, SendFlags};
use thinpool_frontend::Target;
use vhost::vhost_user::message::VhostUserProtocolFeatures;

/// `VHOST_USER_SET_PROTOCOL_FEATURES`.
const SET_PROTOCOL_FEATURES: u32 = 16;
/// `VHOST_USER_SET_BACKEND_REQ_FD`.
const SET_BACKEND_REQ_FD: u32 = 21;
/// `VHOST_USER_BACKEND_CONFIG_CHANGE_MSG`, a backend request.
pub(crate) const CONFIG_CHANGE_MSG: u32 = 2;
/// Header flags: protocol version 1, no reply wanted.
const VERSION: u32 = 1;

/// The protocol features a CONFIG_CHANGE_MSG needs acked.
fn needed() -> u64 {
    (VhostUserProtocolFeatures::BACKEND_REQ | VhostUserProtocolFeatures::CONFIG).bits()
}

/// The header of a CONFIG_CHANGE_MSG: request, flags, payload size (little endian).
pub(crate) fn config_change_header() -> [u8; 12] {
    let mut header = [0u8; 12];
    header[0..4].copy_from_slice(&CONFIG_CHANGE_MSG.to_le_bytes());
    header[4..8].copy_from_slice(&VERSION.to_le_bytes());
    header
}

/// One connection's backend request channel, as the relay saw it set up.
#[derive(Debug, Default)]
pub(crate) struct BackendChannel {
    state: Mutex<ChannelState>,
}

#[derive(Debug, Default)]
struct ChannelState {
    /// The last `SET_PROTOCOL_FEATURES`.
    acked_protocol_features: u64,
    /// Our duplicate of the last `SET_BACKEND_REQ_FD`'s socket.
    socket: Option<UnixStream>,
}

/// What a send on the channel did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Delivery {
    Sent,
    /// No channel given, or BACKEND_REQ and CONFIG not both acked.
    NoChannel,
}

impl BackendChannel {
    /// Looks at one front-end message (`request`, its payload and fds) on its way to the
    /// handler; keeps what a later notification needs. Never changes the message.
    pub(crate) fn observe(&self, request: u32, payload: &[u8], fds: &[OwnedFd]) {
        match request {
            SET_PROTOCOL_FEATURES => {
                let Some(bytes) = payload.get(0..8) else {
                    return; // the handler refuses it
                };
                let features = u64::from_le_bytes(bytes.try_into().expect("8 bytes"));
                self.lock().acked_protocol_features = features;
            }
            SET_BACKEND_REQ_FD => {
                let socket = match fds {
                    [fd] => fd.try_clone().map(UnixStream::from),
                    _ => Err(io::Error::other(format!("{} fds", fds.len()))),
                };
                let socket = socket
                    .inspect_err(|e| {
                        tracing::warn!("vhost-user backend request channel not kept: {e}")
                    })
                    .ok();
                self.lock().socket = socket;
            }
            _ => {}
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ChannelState> {
        // The state is two plain fields, each written whole: a panic elsewhere cannot
        // leave them half-changed.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Sends CONFIG_CHANGE_MSG if the front end gave a channel and acked what it needs.
    /// A failed or short send drops the channel (its stream could be mid-message now).
    pub(crate) fn send_config_change(&self) -> io::Result<Delivery> {
        let mut state = self.lock();
        if state.acked_protocol_features & needed() != needed() {
            return Ok(Delivery::NoChannel);
        }
        let Some(socket) = &state.socket else {
            return Ok(Delivery::NoChannel);
        };
        let header = config_change_header();
        let sent = loop {
            match send(socket, &header, SendFlags::NOSIGNAL | SendFlags::DONTWAIT) {
                Err(rustix::io::Errno::INTR) => continue,
                other => break other,
            }
        };
        match sent {
            Ok(n) if n == header.len() => Ok(Delivery::Sent),
            Ok(n) => {
                state.socket = None;
                Err(io::Error::other(format!(
                    "backend request channel took {n} of {} bytes",
                    header.len()
                )))
            }
            Err(e) => {
                state.socket = None;
                let e = io::Error::from(e);
                Err(io::Error::new(
                    e.kind(),
                    format!("backend request channel: {e}"),
                ))
            }
        }
    }
}

/// The connected front end, as notifiers see it: set by the server for each connection.
#[derive(Debug, Default)]
pub(crate) struct Slot {
    current: Mutex<Option<Attached>>,
}

#[derive(Debug)]
struct Attached {
    channel: Arc<BackendChannel>,
    /// The capacity the front end was last told of (at connect, or by a notification).
    announced_bytes: u64,
}

impl Slot {
    /// A front end connected whose target's capacity is `size_bytes`.
    pub(crate) fn attach(&self, channel: Arc<BackendChannel>, size_bytes: u64) {
        *self.lock() = Some(Attached {
            channel,
            announced_bytes: size_bytes,
        });
    }

    /// The front end went away.
    pub(crate) fn detach(&self) {
        *self.lock() = None;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Attached>> {
        // Each write replaces the value or one integer in it whole.
        self.current
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// What [`CapacityNotifier::notify`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CapacityNotice {
    /// The front end was sent CONFIG_CHANGE_MSG for this capacity.
    Sent {
        /// The target's size now.
        size_bytes: u64,
    },
    /// The front end already knows this capacity: nothing sent.
    Unchanged,
    /// No front end is connected (the next one reads the capacity when it attaches).
    NoFrontEnd,
    /// The front end gave no backend request channel or did not ack `BACKEND_REQ` and
    /// `CONFIG`: it sees the capacity only when it next reads the config space by itself.
    NoChannel,
}

/// Tells the front end connected to one [`crate::VhostBlkServer`] that its target's
/// capacity changed. Cheap to clone; outlives the server harmlessly (then
/// [`CapacityNotice::NoFrontEnd`]).
#[derive(Clone)]
pub struct CapacityNotifier {
    target: Arc<dyn Target>,
    slot: Arc<Slot>,
}

impl CapacityNotifier {
    pub(crate) fn new(target: Arc<dyn Target>, slot: Arc<Slot>) -> Self {
        CapacityNotifier { target, slot }
    }

    /// The served target's name.
    pub fn name(&self) -> &str {
        self.target.name()
    }

    /// Sends CONFIG_CHANGE_MSG if the target's size differs from what the connected front
    /// end was last told of. An error is the channel's (it is dropped then: later notices
    /// say [`CapacityNotice::NoChannel`]); the device keeps serving either way.
    pub fn notify(&self) -> io::Result<CapacityNotice> {
        let size_bytes = self.target.geometry().size_bytes;
        let mut current = self.slot.lock();
        let Some(attached) = current.as_mut() else {
            return Ok(CapacityNotice::NoFrontEnd);
        };
        if attached.announced_bytes == size_bytes {
            return Ok(CapacityNotice::Unchanged);
        }
        match attached.channel.send_config_change()? {
            Delivery::NoChannel => Ok(CapacityNotice::NoChannel),
            Delivery::Sent => {
                attached.announced_bytes = size_bytes;
                Ok(CapacityNotice::Sent { size_bytes })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn features(bits: u64) -> Vec<u8> {
        bits.to_le_bytes().to_vec()
    }

    #[test]
    fn a_channel_sends_a_bare_config_change_header_once_negotiated() {
        let channel = BackendChannel::default();
        let (ours, mut front) = UnixStream::pair().expect("pair");
        channel.observe(SET_BACKEND_REQ_FD, &[], &[OwnedFd::from(ours)]);
        assert_eq!(channel.send_config_change().unwrap(), Delivery::NoChannel);
        let config_only = VhostUserProtocolFeatures::CONFIG.bits();
        channel.observe(SET_PROTOCOL_FEATURES, &features(config_only), &[]);
        assert_eq!(channel.send_config_change().unwrap(), Delivery::NoChannel);
        channel.observe(SET_PROTOCOL_FEATURES, &features(needed()), &[]);
        assert_eq!(channel.send_config_change().unwrap(), Delivery::Sent);
        let mut got = [0u8; 12];
        front.read_exact(&mut got).expect("the message");
        assert_eq!(got, config_change_header());
        assert_eq!(&got[0..4], &2u32.to_le_bytes());
        assert_eq!(&got[4..8], &1u32.to_le_bytes(), "version 1, no NEED_REPLY");
        assert_eq!(&got[8..12], &0u32.to_le_bytes());
    }

    #[test]
    fn a_closed_channel_is_an_error_then_no_channel() {
        let channel = BackendChannel::default();
        let (ours, front) = UnixStream::pair().expect("pair");
        channel.observe(SET_PROTOCOL_FEATURES, &features(needed()), &[]);
        channel.observe(SET_BACKEND_REQ_FD, &[], &[OwnedFd::from(ours)]);
        drop(front);
        assert!(channel.send_config_change().is_err());
        assert_eq!(channel.send_config_change().unwrap(), Delivery::NoChannel);
    }
}

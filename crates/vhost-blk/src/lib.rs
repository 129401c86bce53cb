//! vhost-user-blk: a VM's virtio-blk driver (qemu, Cloud Hypervisor, crosvm, the UML kernel's
//! `virtio_uml`) reaches a [`thinpool_frontend::Target`] through shared memory, with no
//! socket round trip per request.
//!
//! Built on the rust-vmm crates: `vhost` (the protocol), `vhost-user-backend` (the daemon
//! skeleton: a thread for the socket's messages, one epoll thread per queue), `virtio-queue`
//! (descriptor chains, bounded walks, event idx), `vm-memory` (the memory table, every access
//! bounds-checked). This crate holds what is virtio-blk's:
//!
//! - `config`: features (flush, discard, write-zeroes, multiqueue, event idx, indirect
//!   descriptors, read-only, `seg_max`/`size_max`, block size and topology) and the config
//!   space, read live so a grown volume shows its capacity at the next GET_CONFIG;
//! - `request`: one request, served through the front-end seam (`Target`: the same calls
//!   NBD makes), the errno turned into `VIRTIO_BLK_S_IOERR` / `_UNSUPP`;
//! - `backend`: [`BlkBackend`], the queues (each its own thread; notifications off while a
//!   thread serves, event-idx suppression of calls, an optional poll of the ring before it
//!   sleeps: [`ServerOptions::poll`], `THINPOOL_VHOST_POLL_US`);
//! - `server`: [`VhostBlkServer`], the socket (0600, one front end at a time, reconnects);
//! - `relay`: a shim each connection passes through on its way to the handler: it trims the
//!   zero padding Linux's UML `virtio_uml` puts after the regions of its SET_MEM_TABLE, which
//!   vhost 0.18 rejects, implements `VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD`, which
//!   vhost-user-backend 0.24 refuses (GET_INFLIGHT_FD / SET_INFLIGHT_FD), and shows the front
//!   end's messages to `capacity`;
//! - `capacity`: the capacity-change message. After the target grows, a
//!   [`CapacityNotifier`] (from [`VhostBlkServer::capacity_notifier`]; the daemon calls it
//!   after a resize) sends `VHOST_USER_BACKEND_CONFIG_CHANGE_MSG` on the backend request
//!   channel the front end gave (`BACKEND_REQ` and `CONFIG` acked), so the guest's driver
//!   reads the config space again and sees the new capacity without reattaching. vhost
//!   0.18's backend request sender cannot send that message, so the relay keeps a duplicate
//!   of the channel's socket and the message is written there;
//! - `inflight`: that region's format and bookkeeping: each queue logs the chains it took off
//!   the ring until they are on the used ring, so a backend started again after a crash
//!   resubmits exactly those (in the order they were taken) to a front end that reconnects
//!   with the same region (qemu's `reconnect=`): none lost, none completed twice; `replay`
//!   turns the logged heads back into descriptor chains.
//!
//! Not done: inflight tracking of packed rings (not offered).
//!
//! One module has `unsafe`: `guest_io`, the `preadv` / `pwritev` of a lent request straight
//! between the file and guest memory (its soundness argued there; every block has a
//! `// SAFETY:` comment, which clippy is told to require). Reads of a target that lends
//! ([`thinpool_frontend::Target::read_lent`]: a thin volume on a file, a plain file), and
//! the in-place part of its writes ([`thinpool_frontend::Target::write_lent`]), so cost no
//! copy of ours; the rust-vmm crates hold the mapping of guest memory and every other access
//! (checked, volatile). The rest (blocks a write provisions or copies, a target that cannot
//! lend) passes through a worker's buffer (the engine takes `&[u8]`, which guest memory
//! cannot safely be). Nothing else is allocated per request: a worker's segment lists and
//! buffer are reused.

#![deny(unsafe_code)]
#![deny(clippy::undocumented_unsafe_blocks)]

mod backend;
mod capacity;
pub mod config;
mod guest_io;
mod inflight;
mod relay;
mod replay;
mod request;
mod server;

pub use backend::{BlkBackend, Memory};
pub use capacity::{CapacityNotice, CapacityNotifier};
pub use request::CHUNK_BYTES;
pub use server::{ServerOptions, VhostBlkServer, POLL_ENV, POLL_MAX};

//! What the control socket's [`Target`] knows of the server holding the pool
//! ([`Served`]): what `status` reports of it (its pid, connections per front end) and whom
//! a resize tells (the vhost-user-blk sockets, which announce a grown volume to their
//! guests: `serve/vhost.rs`).

use std::sync::Arc;

use thin_pool::Pool;
use thinpool_vhost::VhostBlkServer;

use super::vhost;
use crate::control::{Served, ServedProbe, ServedRecord, Target};
use crate::export::PoolRegistry;
use crate::pool_dir::StoredOptions;

/// The control socket's target: the pool, its options, the raw exports' names, what
/// `status` says of this server and whom a resize tells (`sockets`).
pub(super) fn control_target(
    pool: &Pool,
    options: StoredOptions,
    registry: &PoolRegistry,
    servers: &[nbd::Server],
    sockets: &[VhostBlkServer],
) -> Arc<Target> {
    let served = Served {
        probe: served_probe(servers, sockets.len()),
        resized: vhost::resize_hook(sockets),
    };
    Arc::new(Target {
        pool: pool.clone(),
        options,
        reserved_names: registry.raw_names(),
        served: Some(served),
    })
}

/// What `status` reports of this server: its pid and its connections per front end (the
/// first NBD server is the Unix socket's, a second one TCP's).
fn served_probe(servers: &[nbd::Server], vhost_sockets: usize) -> ServedProbe {
    let handles: Vec<nbd::ShutdownHandle> =
        servers.iter().map(nbd::Server::shutdown_handle).collect();
    Arc::new(move || {
        let count = |index: usize| {
            handles
                .get(index)
                .map_or(0, |h| h.connection_count() as u64)
        };
        ServedRecord {
            pid: std::process::id(),
            nbd_unix_connections: count(0),
            nbd_tcp_connections: count(1),
            vhost_user_blk_sockets: vhost_sockets as u64,
        }
    })
}

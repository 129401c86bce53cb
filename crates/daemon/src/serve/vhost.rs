//! `serve --vhost-user-blk VOLUME=PATH[,queues=N]`: each volume named is attached to a
//! vhost-user-blk socket at PATH (mode 0600, one front end at a time, reconnects accepted)
//! with N queues (default `--vhost-queues`, itself 1), served through the front-end seam
//! ([`thinpool_frontend::VolumeTarget`], the same one NBD uses) by `thinpool_vhost`.
//!
//! Invariant: each socket holds its volume's handle from start to stop, so an attached
//! volume counts as open (delete, revert and shrink are refused with EBUSY, as for a volume
//! an NBD client has open). The sockets stop before the pool's final commit.
//!
//! A grow while attached (`thinpool volume resize` through the control socket) reaches the
//! guest: the control target calls [`resize_hook`]'s closure after every resize, and each
//! socket whose volume's size changed sends its front end the capacity-change message
//! (`thinpool_vhost::CapacityNotifier`), so the driver rereads the config space.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context};
use thin_pool::Pool;
use thinpool_frontend::VolumeTarget;
use thinpool_vhost::config::QUEUES_MAX;
use thinpool_vhost::{CapacityNotice, CapacityNotifier, VhostBlkServer};

use crate::control::ResizeHook;

/// One `--vhost-user-blk` argument, parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VhostSpec {
    /// The volume.
    pub volume: String,
    /// The socket to create.
    pub path: PathBuf,
    /// Queues, if given for this volume.
    pub queues: Option<u16>,
}

/// Parses `VOLUME=PATH` or `VOLUME=PATH,queues=N`.
pub fn parse_vhost_spec(text: &str) -> anyhow::Result<VhostSpec> {
    let Some((volume, rest)) = text.split_once('=') else {
        bail!("--vhost-user-blk {text:?}: expected VOLUME=PATH[,queues=N]");
    };
    let (path, queues) = match rest.rsplit_once(",queues=") {
        Some((path, queues)) => (path, Some(parse_queues(queues)?)),
        None => (rest, None),
    };
    if volume.is_empty() || path.is_empty() {
        bail!("--vhost-user-blk {text:?}: expected VOLUME=PATH[,queues=N]");
    }
    Ok(VhostSpec {
        volume: volume.to_string(),
        path: PathBuf::from(path),
        queues,
    })
}

/// Parses a queue count, 1 to 64.
pub fn parse_queues(text: &str) -> anyhow::Result<u16> {
    match text.parse::<u16>() {
        Ok(n) if (1..=QUEUES_MAX).contains(&n) => Ok(n),
        _ => bail!("queues {text:?}: a number from 1 to {QUEUES_MAX}"),
    }
}

/// Starts a socket per spec, each with its volume open; stops those started if one fails.
pub(super) fn start(
    pool: &Pool,
    specs: &[VhostSpec],
    default_queues: u16,
) -> anyhow::Result<Vec<VhostBlkServer>> {
    let mut servers = Vec::new();
    for spec in specs {
        if servers
            .iter()
            .any(|server: &VhostBlkServer| server.path() == spec.path)
        {
            bail!("--vhost-user-blk: {} is given twice", spec.path.display());
        }
        let volume = pool
            .volume(&spec.volume)
            .with_context(|| format!("--vhost-user-blk: cannot open volume {:?}", spec.volume))?;
        super::remove_stale_socket(&spec.path)?;
        let queues = spec.queues.unwrap_or(default_queues);
        let server = VhostBlkServer::start(Arc::new(VolumeTarget::new(volume)), &spec.path, queues)
            .with_context(|| format!("cannot listen on {}", spec.path.display()))?;
        tracing::info!(
            volume = spec.volume,
            socket = %spec.path.display(),
            queues,
            "vhost-user-blk socket"
        );
        println!(
            "thinpool: vhost-user-blk {} on {} ({queues} queue{})",
            spec.volume,
            spec.path.display(),
            if queues == 1 { "" } else { "s" }
        );
        servers.push(server);
    }
    Ok(servers)
}

/// What a resize tells the sockets: each whose volume's size changed tells its front end.
/// The sockets compare sizes themselves (a cheap read), so no name has to match: a socket
/// keeps its volume whatever the volume is called now.
pub(super) fn resize_hook(servers: &[VhostBlkServer]) -> ResizeHook {
    let notifiers: Vec<CapacityNotifier> = servers
        .iter()
        .map(VhostBlkServer::capacity_notifier)
        .collect();
    Arc::new(move |resized: &str| {
        for notifier in &notifiers {
            announce(notifier, resized);
        }
    })
}

/// One socket's notice after `resized` was resized, logged when it concerned the socket.
fn announce(notifier: &CapacityNotifier, resized: &str) {
    match notifier.notify() {
        Ok(CapacityNotice::Sent { size_bytes }) => tracing::info!(
            volume = resized,
            size_bytes,
            "vhost-user-blk capacity change sent to the front end"
        ),
        Ok(CapacityNotice::NoChannel) => tracing::info!(
            volume = resized,
            "vhost-user-blk front end gave no backend request channel: \
             it sees the new capacity when it next reads the config space"
        ),
        Ok(CapacityNotice::Unchanged | CapacityNotice::NoFrontEnd) => {}
        Err(error) => tracing::warn!(
            volume = resized,
            "vhost-user-blk capacity change not sent: {error}"
        ),
    }
}

/// Stops every socket (front ends disconnected, volumes closed).
pub(super) fn stop(servers: Vec<VhostBlkServer>) {
    let count = servers.len();
    for server in servers {
        server.stop();
    }
    if count > 0 {
        tracing::info!("vhost-user-blk sockets closed ({count})");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_with_and_without_queues() {
        let plain = parse_vhost_spec("disk=/run/vm/disk.sock").unwrap();
        assert_eq!(plain.volume, "disk");
        assert_eq!(plain.path, PathBuf::from("/run/vm/disk.sock"));
        assert_eq!(plain.queues, None);
        let queued = parse_vhost_spec("db=/tmp/a=b.sock,queues=4").unwrap();
        assert_eq!(queued.path, PathBuf::from("/tmp/a=b.sock"));
        assert_eq!(queued.queues, Some(4));
        for bad in [
            "disk",
            "=x",
            "disk=",
            "disk=/s,queues=0",
            "disk=/s,queues=65",
        ] {
            assert!(parse_vhost_spec(bad).is_err(), "{bad}");
        }
    }
}

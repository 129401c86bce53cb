//! The table of live connections: who each belongs to, which are in the handshake, and the
//! admission of new ones against the server's and each peer's limits.
//!
//! Admission of a connection from peer P, in order:
//! 1. the server holds `connections_max` connections: refused;
//! 2. P has `handshakes_per_peer_max` connections in the handshake: P's oldest handshake is
//!    evicted (a client that never finishes its handshakes holds at most that many);
//! 3. otherwise P holds `connections_per_peer_max` connections: P's connection idle the
//!    longest (in transmission, no request in flight) is evicted, or, if none is idle, the
//!    new one is refused.
//!
//! So connections that only sit there (handshaking or idle) never keep P's next client
//! out; only P's busy connections do. An evicted connection's socket is shut both ways at
//! once (its client sees the connection close; an idle one has nothing in flight to lose)
//! and it stops counting towards P's limits, though its entry stays until its threads end,
//! so that shutdown still reaches it and `connections_max` still counts it.
//!
//! Invariants: `per_peer[p].ids` holds exactly the ids of P's entries not evicted, and
//! `per_peer[p].handshaking` how many of those have no export yet; a peer with no such
//! entry has no `per_peer` entry.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::net::{IpAddr, Shutdown};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::session::Activity;
use crate::stream::Stream;

/// Where a connection comes from, for the per-peer limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Peer {
    /// The uid of a Unix socket peer.
    User(u32),
    /// A TCP peer's IPv4 address, or its IPv6 address cut to the /64 (one host usually
    /// has a whole /64).
    Address(IpAddr),
    /// A peer whose identity could not be read; all such count as one.
    Unknown,
}

impl Peer {
    pub(super) fn of_tcp(address: IpAddr) -> Self {
        match address {
            IpAddr::V4(_) => Peer::Address(address),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => Peer::Address(IpAddr::V4(v4)),
                None => {
                    let prefix = u128::from(v6) & !((1u128 << 64) - 1);
                    Peer::Address(IpAddr::V6(prefix.into()))
                }
            },
        }
    }
}

impl fmt::Display for Peer {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Peer::User(uid) => write!(formatter, "uid {uid}"),
            Peer::Address(IpAddr::V6(prefix)) => write!(formatter, "address {prefix}/64"),
            Peer::Address(address) => write!(formatter, "address {address}"),
            Peer::Unknown => formatter.write_str("unknown peer"),
        }
    }
}

/// The limits admission applies.
#[derive(Clone, Copy, Debug)]
pub(super) struct Limits {
    pub(super) connections_max: usize,
    pub(super) connections_per_peer_max: usize,
    pub(super) handshakes_per_peer_max: usize,
}

/// Why a new connection was closed at accept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Refusal {
    /// The server holds `connections_max` connections.
    ServerFull { connections_max: usize },
    /// The peer holds `connections_per_peer_max` connections and none is idle.
    PeerBusy { connections_per_peer_max: usize },
    /// The socket could not be duplicated for the table.
    NoSocket,
}

impl fmt::Display for Refusal {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::ServerFull { connections_max } => {
                write!(
                    formatter,
                    "the server has {connections_max} connections (connections_max)"
                )
            }
            Refusal::PeerBusy {
                connections_per_peer_max,
            } => write!(
                formatter,
                "the peer has {connections_per_peer_max} connections (connections_per_peer_max), \
                 none of them idle"
            ),
            Refusal::NoSocket => formatter.write_str("the socket could not be duplicated"),
        }
    }
}

/// A connection closed to make room for a newer one of its peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Eviction {
    pub(super) connection: u64,
    pub(super) reason: EvictionReason,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum EvictionReason {
    /// The peer's oldest handshake, past `handshakes_per_peer_max`.
    OldestHandshake {
        handshakes_per_peer_max: usize,
        age: Duration,
    },
    /// The peer's connection idle the longest, past `connections_per_peer_max`.
    LongestIdle {
        connections_per_peer_max: usize,
        idle: Duration,
    },
}

impl fmt::Display for EvictionReason {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EvictionReason::OldestHandshake {
                handshakes_per_peer_max,
                age,
            } => write!(
                formatter,
                "the peer's oldest of {handshakes_per_peer_max} handshakes \
                 (handshakes_per_peer_max), {:.1} s old",
                age.as_secs_f64()
            ),
            EvictionReason::LongestIdle {
                connections_per_peer_max,
                idle,
            } => write!(
                formatter,
                "the peer's connection idle the longest of {connections_per_peer_max} \
                 (connections_per_peer_max), idle {:.1} s",
                idle.as_secs_f64()
            ),
        }
    }
}

/// One live connection.
struct Entry {
    /// A clone of the connection's socket, to shut it at eviction or shutdown.
    stream: Stream,
    peer: Peer,
    opened: Instant,
    activity: Arc<Activity>,
    /// The export it serves (as quoted for logs), once in transmission.
    export: Option<String>,
    /// Closed to make room; no longer counted towards its peer's limits.
    evicted: bool,
}

/// A peer's connections that count towards its limits.
#[derive(Default)]
struct PeerConnections {
    ids: HashSet<u64>,
    handshaking: usize,
}

/// Live connections and how many each peer has.
pub(super) struct Table {
    limits: Limits,
    entries: HashMap<u64, Entry>,
    per_peer: HashMap<Peer, PeerConnections>,
}

impl Table {
    /// A table admitting by `limits`; a `handshakes_per_peer_max` of 0 counts as 1.
    pub(super) fn new(mut limits: Limits) -> Self {
        limits.handshakes_per_peer_max = limits.handshakes_per_peer_max.max(1);
        Table {
            limits,
            entries: HashMap::new(),
            per_peer: HashMap::new(),
        }
    }

    /// Live connections, evicted ones still closing included.
    pub(super) fn len(&self) -> usize {
        self.entries.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Admits connection `id` of `peer` (in the handshake), evicting one of the peer's
    /// connections if it is at a limit (module doc); `stream` is its socket.
    pub(super) fn admit(
        &mut self,
        id: u64,
        peer: Peer,
        stream: &Stream,
        activity: Arc<Activity>,
    ) -> Result<Option<Eviction>, Refusal> {
        assert!(
            !self.entries.contains_key(&id),
            "connection {id} admitted twice"
        );
        if self.entries.len() >= self.limits.connections_max {
            return Err(Refusal::ServerFull {
                connections_max: self.limits.connections_max,
            });
        }
        let eviction = self.make_room(peer)?;
        let control = stream.try_clone().map_err(|_| Refusal::NoSocket)?;
        if let Some(eviction) = eviction {
            self.evict(eviction.connection);
        }
        self.entries.insert(
            id,
            Entry {
                stream: control,
                peer,
                opened: Instant::now(),
                activity,
                export: None,
                evicted: false,
            },
        );
        let connections = self.per_peer.entry(peer).or_default();
        connections.ids.insert(id);
        connections.handshaking += 1;
        self.check_peer(peer);
        Ok(eviction)
    }

    /// Which of `peer`'s connections to evict for a new one, if any.
    fn make_room(&self, peer: Peer) -> Result<Option<Eviction>, Refusal> {
        let busy = Refusal::PeerBusy {
            connections_per_peer_max: self.limits.connections_per_peer_max,
        };
        if self.limits.connections_per_peer_max == 0 {
            return Err(busy);
        }
        let Some(connections) = self.per_peer.get(&peer) else {
            return Ok(None);
        };
        let mine = || connections.ids.iter().map(|id| (*id, &self.entries[id]));
        if connections.handshaking >= self.limits.handshakes_per_peer_max {
            let (connection, entry) = mine()
                .filter(|(_, entry)| entry.export.is_none())
                .min_by_key(|(id, entry)| (entry.opened, *id))
                .expect("a peer counting handshakes has one");
            return Ok(Some(Eviction {
                connection,
                reason: EvictionReason::OldestHandshake {
                    handshakes_per_peer_max: self.limits.handshakes_per_peer_max,
                    age: entry.opened.elapsed(),
                },
            }));
        }
        if connections.ids.len() < self.limits.connections_per_peer_max {
            return Ok(None);
        }
        let longest_idle = mine()
            .filter(|(_, entry)| entry.export.is_some())
            .filter_map(|(id, entry)| entry.activity.idle_for().map(|idle| (idle, id)))
            .max_by_key(|(idle, id)| (*idle, std::cmp::Reverse(*id)));
        match longest_idle {
            Some((idle, connection)) => Ok(Some(Eviction {
                connection,
                reason: EvictionReason::LongestIdle {
                    connections_per_peer_max: self.limits.connections_per_peer_max,
                    idle,
                },
            })),
            None => Err(busy),
        }
    }

    /// Shuts connection `id`'s socket and stops counting it towards its peer's limits.
    fn evict(&mut self, id: u64) {
        let entry = self
            .entries
            .get_mut(&id)
            .expect("evicting a live connection");
        assert!(!entry.evicted, "connection {id} evicted twice");
        entry.evicted = true;
        let _ = entry.stream.shutdown(Shutdown::Both);
        let (peer, handshaking) = (entry.peer, entry.export.is_none());
        self.forget(peer, id, handshaking);
    }

    /// Removes `id` from its peer's counts.
    fn forget(&mut self, peer: Peer, id: u64, handshaking: bool) {
        let connections = self
            .per_peer
            .get_mut(&peer)
            .expect("peer of a counted connection");
        assert!(connections.ids.remove(&id), "connection {id} not counted");
        if handshaking {
            connections.handshaking -= 1;
        }
        if connections.ids.is_empty() {
            assert_eq!(
                connections.handshaking, 0,
                "handshakes of a peer with no connection"
            );
            self.per_peer.remove(&peer);
        } else {
            self.check_peer(peer);
        }
    }

    /// Connection `id` finished its handshake and serves `export` (as quoted for logs).
    pub(super) fn serving(&mut self, id: u64, export: String) {
        let Some(entry) = self.entries.get_mut(&id) else {
            return;
        };
        assert!(
            entry.export.is_none(),
            "connection {id} started transmission twice"
        );
        entry.export = Some(export);
        if !entry.evicted {
            let connections = self
                .per_peer
                .get_mut(&entry.peer)
                .expect("peer of a connection");
            connections.handshaking -= 1;
        }
    }

    /// The export connection `id` serves, if it is in transmission.
    pub(super) fn export(&self, id: u64) -> Option<String> {
        self.entries.get(&id).and_then(|entry| entry.export.clone())
    }

    /// Removes connection `id`, whose last thread has ended.
    pub(super) fn remove(&mut self, id: u64) {
        let Some(entry) = self.entries.remove(&id) else {
            return;
        };
        if !entry.evicted {
            self.forget(entry.peer, id, entry.export.is_none());
        }
    }

    /// Shuts every connection's socket `how`.
    pub(super) fn shutdown_all(&self, how: Shutdown) {
        for entry in self.entries.values() {
            let _ = entry.stream.shutdown(how);
        }
    }

    /// "#3 \"disk\", #4 (handshake)": the live connections, for the shutdown log line.
    pub(super) fn describe(&self) -> String {
        let mut ids: Vec<u64> = self.entries.keys().copied().collect();
        ids.sort_unstable();
        let described: Vec<String> = ids
            .iter()
            .map(|id| match &self.entries[id].export {
                Some(export) => format!("#{id} {export}"),
                None => format!("#{id} (handshake)"),
            })
            .collect();
        described.join(", ")
    }

    /// The per-peer invariants (module doc) for `peer`; O(its connections) in debug builds.
    fn check_peer(&self, peer: Peer) {
        let connections = &self.per_peer[&peer];
        assert!(connections.handshaking <= connections.ids.len());
        assert!(connections.ids.len() <= self.limits.connections_per_peer_max);
        if cfg!(debug_assertions) {
            let handshaking = connections
                .ids
                .iter()
                .filter(|id| {
                    let entry = &self.entries[id];
                    assert!(entry.peer == peer && !entry.evicted);
                    entry.export.is_none()
                })
                .count();
            assert_eq!(handshaking, connections.handshaking);
        }
    }
}

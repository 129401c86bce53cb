//! One connection's life on the server side: admission to the table, its thread, the
//! handshake within its deadline, the session, and its removal from the table (by a drop
//! guard, however the connection ends).
//!
//! On the event loop a connection in the handshake costs no thread while it waits for the
//! client ([`Handshaking`]): the accept loop sends the greeting (18 bytes, which a new
//! socket's buffer takes at once) and parks the connection in the reactor; a worker runs the
//! handshake when the client's first bytes arrive, within the same deadline from the accept,
//! and the reactor's sweep ends a parked one past that deadline. A client that stalls in the
//! middle of its options holds the worker (the reactor replaces it) until the deadline, as a
//! connection thread would be held.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use rustix::net::SendFlags;

use super::table::{Eviction, Peer, Refusal};
use super::{Event, Shared, SpliceReads};
use crate::error::{Error, Result};
use crate::handshake::{self, Outcome};
use crate::protocol;
use crate::session::{self, Activity, Guest, Limits, Reactor, Scratch};
use crate::stream::{Deadline, Stream};
use crate::sync;
use crate::tls::{PumpSettings, ServerTransport, TlsFailure};

/// Removes a connection from the table when its last thread ends, however it ends.
struct ConnectionGuard {
    shared: Arc<Shared>,
    id: u64,
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        sync::lock(&self.shared.connections).remove(self.id);
        self.shared.connection_ended.notify_all();
    }
}

impl Shared {
    /// Admits `stream` from `peer` (`name` for its logs) and starts its thread, or closes
    /// it; logs (rate-limited) and reports a refusal or the eviction it caused.
    pub(super) fn start_connection(self: &Arc<Self>, stream: Stream, peer: Peer, name: String) {
        let id = self.next_connection.fetch_add(1, Ordering::SeqCst);
        let activity = Arc::new(Activity::new());
        let admitted =
            sync::lock(&self.connections).admit(id, peer, &stream, Arc::clone(&activity));
        match admitted {
            Ok(None) => {}
            Ok(Some(eviction)) => self.report_eviction(peer, eviction),
            Err(refusal) => return self.report_refusal(peer, &name, refusal),
        }
        let guard = ConnectionGuard {
            shared: Arc::clone(self),
            id,
        };
        let deadline = Instant::now() + self.config.handshake_timeout;
        if let Some(reactor) = &self.reactor {
            return self.park_handshake(reactor, id, stream, guard, activity, name, deadline);
        }
        let spawned = std::thread::Builder::new()
            .name(format!("nbd-conn-{id}"))
            .stack_size(self.config.thread_stack_bytes)
            .spawn(move || {
                // Every line logged for this connection, on any of its threads, names it.
                let span = tracing::info_span!("conn", conn = id, peer = %name);
                let _entered = span.enter();
                tracing::info!("connection opened");
                let shared = Arc::clone(&guard.shared);
                shared.emit(Event::Connected {
                    connection: id,
                    peer: name,
                });
                shared.run_connection(id, stream, guard, activity, deadline, false);
            });
        // If the thread could not start, the closure (and its guard) was dropped already.
        drop(spawned);
    }

    fn report_refusal(&self, peer: Peer, name: &str, refusal: Refusal) {
        if let Some(suppressed) = self.log_limit.admit(Instant::now()) {
            tracing::warn!(%peer, socket = %name, reason = %refusal, suppressed, "connection refused");
        }
        self.emit(Event::Refused {
            peer: peer.to_string(),
            reason: refusal.to_string(),
        });
    }

    fn report_eviction(&self, peer: Peer, eviction: Eviction) {
        if let Some(suppressed) = self.log_limit.admit(Instant::now()) {
            tracing::warn!(
                %peer,
                conn = eviction.connection,
                reason = %eviction.reason,
                suppressed,
                "connection closed to make room for a new one of its peer"
            );
        }
        self.emit(Event::Evicted {
            connection: eviction.connection,
            peer: peer.to_string(),
            reason: eviction.reason.to_string(),
        });
    }

    /// On the event loop: sends the greeting and parks the connection until the client
    /// answers it (see the module doc).
    #[allow(
        clippy::too_many_arguments,
        reason = "one connection's parts, moved in once"
    )]
    fn park_handshake(
        self: &Arc<Self>,
        reactor: &Arc<Reactor>,
        id: u64,
        stream: Stream,
        guard: ConnectionGuard,
        activity: Arc<Activity>,
        name: String,
        deadline: Instant,
    ) {
        let span = tracing::info_span!("conn", conn = id, peer = %name);
        let entered = span.enter();
        tracing::info!("connection opened");
        self.emit(Event::Connected {
            connection: id,
            peer: name,
        });
        let greeting = protocol::encode_greeting();
        let sent = if self.shutting_down.load(Ordering::SeqCst) {
            Ok(None)
        } else {
            match rustix::net::send(
                &stream,
                &greeting,
                SendFlags::DONTWAIT | SendFlags::NOSIGNAL,
            ) {
                Ok(count) if count == greeting.len() => Ok(Some(())),
                Ok(count) => Err(Error::io(
                    format!("send greeting: the socket took {count} of its bytes"),
                    std::io::ErrorKind::WouldBlock.into(),
                )),
                Err(error) => Err(Error::io("send greeting", error.into())),
            }
        };
        match sent {
            Ok(Some(())) => {}
            ended => {
                let result = ended.map(|_| ());
                log_end(None, 0, &result);
                self.emit(Event::Disconnected {
                    connection: id,
                    error: result.err().map(|error| error.to_string()),
                });
                return drop(guard);
            }
        }
        drop(entered);
        let handshaking = Arc::new(Handshaking {
            shared: Arc::clone(self),
            id,
            stream,
            deadline,
            span,
            rest: Mutex::new(Some((guard, activity))),
        });
        let guest: Arc<dyn Guest> = Arc::clone(&handshaking) as Arc<dyn Guest>;
        reactor.park(id, &handshaking.stream, guest, false);
    }

    /// Runs the handshake (its greeting sent already if `greeted`), within `deadline`,
    /// then the session; the guard (and the Disconnected event) goes with the connection's
    /// last thread.
    fn run_connection(
        self: &Arc<Self>,
        id: u64,
        stream: Stream,
        guard: ConnectionGuard,
        activity: Arc<Activity>,
        deadline: Instant,
        greeted: bool,
    ) {
        let splice_reads = self.config.tls.is_none()
            && match self.config.splice_reads {
                SpliceReads::Never => false,
                SpliceReads::TcpOnly => matches!(stream, Stream::Tcp(_)),
                SpliceReads::Always => true,
            };
        // A TLS pump holds the guard too, until its last record is out.
        let guard = Arc::new(guard);
        let keep_alive = Arc::clone(&guard);
        let end = {
            let shared = Arc::clone(self);
            move |result: Result<()>, requests: u64| {
                let export = sync::lock(&shared.connections).export(id);
                log_end(export.as_deref(), requests, &result);
                shared.emit(Event::Disconnected {
                    connection: id,
                    error: result.err().map(|error| error.to_string()),
                });
                drop(guard);
            }
        };
        let (negotiated, reader, tls_failure) =
            match self.negotiate(id, stream, keep_alive, deadline, greeted) {
                Ok(Some(transmission)) => transmission,
                Ok(None) => return end(Ok(()), 0),
                Err(error) => return end(Err(error), 0),
            };
        let export = handshake::quoted(&negotiated.requested_name);
        tracing::info!(export = %export, read_only = negotiated.export.capabilities().read_only, "serving export");
        sync::lock(&self.connections).serving(id, export);
        self.emit(Event::Serving {
            connection: id,
            export: negotiated.requested_name.clone(),
        });
        // A TLS failure (a bad record, say) is why the session's socket ended.
        let end = move |result: Result<()>, requests: u64| {
            let failure = sync::lock(&tls_failure).take();
            end(failure.map_or(result, Err), requests)
        };
        let writer = match reader.try_clone() {
            Ok(writer) => writer,
            Err(error) => return end(Err(Error::io("clone connection", error)), 0),
        };
        let limits = self.session_limits(id, splice_reads, activity);
        session::serve(negotiated, reader, writer, limits, Box::new(end));
    }

    /// The limits of connection `id`'s session.
    fn session_limits(&self, id: u64, splice_reads: bool, activity: Arc<Activity>) -> Limits {
        Limits {
            threads: self.config.workers_per_connection,
            requests_in_flight_max: self.config.requests_in_flight_max,
            bytes_in_flight_max: self.config.bytes_in_flight_max,
            server_bytes: Arc::clone(&self.server_bytes),
            idle_timeout: self.config.idle_timeout,
            stack_bytes: self.config.thread_stack_bytes,
            thread_name: format!("nbd-conn-{id}"),
            // A TLS session's socket leads to the pump, which copies anyway.
            splice_reads,
            spin_max: self.config.spin_max,
            batch_replies: self.config.batch_replies,
            activity,
            reactor: self.reactor.clone(),
            key: id,
        }
    }

    /// The handshake, within `deadline` (`handshake_timeout` after the accept); `None` if
    /// the client left. After STARTTLS, `stream` becomes the session's end of the TLS
    /// pump's socketpair, and a failure of the pump during the handshake is what the
    /// handshake returns.
    fn negotiate(
        &self,
        id: u64,
        mut stream: Stream,
        keep_alive: Arc<ConnectionGuard>,
        deadline: Instant,
        greeted: bool,
    ) -> Result<Option<(handshake::Negotiated, Stream, TlsFailure)>> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Ok(None);
        }
        let mut transport = ServerTransport::new(
            Deadline::new(&mut stream, deadline, self.config.write_timeout),
            PumpSettings {
                stack_bytes: self.config.thread_stack_bytes,
                thread_name: format!("nbd-conn-{id}"),
                stall_timeout: self.config.write_timeout,
                keep_alive,
            },
        );
        let negotiate = if greeted {
            handshake::negotiate_after_greeting
        } else {
            handshake::negotiate
        };
        let negotiated = negotiate(
            &mut transport,
            self.registry.as_ref(),
            &self.shutting_down,
            self.config.tls.as_ref(),
        );
        let failure_slot = transport.failure_slot();
        let tls_failure = sync::lock(&failure_slot).take();
        drop(transport);
        let outcome = match (negotiated, tls_failure) {
            (Ok(Outcome::Transmission(negotiated)), _) => Outcome::Transmission(negotiated),
            (_, Some(failure)) => return Err(failure),
            (Ok(outcome), None) => outcome,
            (Err(_), None) if Instant::now() >= deadline => {
                return Err(Error::io(
                    format!(
                        "handshake not finished within {} s",
                        self.config.handshake_timeout.as_secs_f64()
                    ),
                    std::io::ErrorKind::TimedOut.into(),
                ))
            }
            (Err(error), None) => return Err(error),
        };
        match outcome {
            Outcome::Closed => Ok(None),
            Outcome::Transmission(negotiated) => {
                stream
                    .set_write_timeout(Some(self.config.write_timeout))
                    .map_err(|e| Error::io("set write timeout", e))?;
                Ok(Some((negotiated, stream, failure_slot)))
            }
        }
    }
}

/// A connection in the handshake, parked on the event loop until its client's bytes come.
struct Handshaking {
    shared: Arc<Shared>,
    id: u64,
    /// The socket, watched while parked; the visit runs the handshake on a clone of it.
    stream: Stream,
    /// `handshake_timeout` after the accept.
    deadline: Instant,
    /// The connection's `conn` span, entered by the visit.
    span: tracing::Span,
    /// Taken by the one visit.
    rest: Mutex<Option<(ConnectionGuard, Arc<Activity>)>>,
}

impl Guest for Handshaking {
    /// Runs the handshake, then the session, on the visiting worker; past the deadline the
    /// handshake's first read fails and the connection ends with the timeout error.
    fn visit(self: Arc<Self>, _scratch: &mut Scratch, _expired: bool) {
        let Some((guard, activity)) = sync::lock(&self.rest).take() else {
            return;
        };
        let _entered = self.span.enter();
        let shared = &self.shared;
        if let Some(reactor) = &shared.reactor {
            // The session parks the clone; this socket's watch ends with it.
            reactor.forget(&self.stream);
        }
        match self.stream.try_clone() {
            Ok(stream) => {
                shared.run_connection(self.id, stream, guard, activity, self.deadline, true);
            }
            Err(error) => {
                let result = Err(Error::io("clone connection", error));
                log_end(None, 0, &result);
                shared.emit(Event::Disconnected {
                    connection: self.id,
                    error: result.err().map(|error| error.to_string()),
                });
                drop(guard);
            }
        }
    }

    fn expired(&self, _since: Instant) -> bool {
        Instant::now() >= self.deadline
    }
}

/// The connection's closing line: info, or warn when the client broke the protocol.
fn log_end(export: Option<&str>, requests: u64, result: &Result<()>) {
    let export = export.unwrap_or("(none)");
    match result {
        Ok(()) => tracing::info!(export = %export, requests, "connection closed"),
        Err(error @ (Error::Protocol { .. } | Error::BadMagic { .. } | Error::TooLong { .. })) => {
            tracing::warn!(export = %export, requests, %error, "connection closed: protocol violation")
        }
        Err(error) => tracing::info!(export = %export, requests, %error, "connection closed"),
    }
}

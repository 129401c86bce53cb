//! One connection's life on the server side: admission to the table, its thread, the
//! handshake within its deadline, the session, and its removal from the table (by a drop
//! guard, however the connection ends).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use super::table::{Eviction, Peer, Refusal};
use super::{Event, Shared, SpliceReads};
use crate::error::{Error, Result};
use crate::handshake::{self, Outcome};
use crate::session::{self, Activity, Limits};
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
                shared.run_connection(id, stream, guard, activity);
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

    /// Runs the handshake, then the session; the guard (and the Disconnected event) goes
    /// with the connection's last thread.
    fn run_connection(
        self: &Arc<Self>,
        id: u64,
        stream: Stream,
        guard: ConnectionGuard,
        activity: Arc<Activity>,
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
        let (negotiated, reader, tls_failure) = match self.negotiate(id, stream, keep_alive) {
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

    /// The handshake, within `handshake_timeout` of now; `None` if the client left.
    /// After STARTTLS, `stream` becomes the session's end of the TLS pump's socketpair, and
    /// a failure of the pump during the handshake is what the handshake returns.
    fn negotiate(
        &self,
        id: u64,
        mut stream: Stream,
        keep_alive: Arc<ConnectionGuard>,
    ) -> Result<Option<(handshake::Negotiated, Stream, TlsFailure)>> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Ok(None);
        }
        let deadline = Instant::now() + self.config.handshake_timeout;
        let mut transport = ServerTransport::new(
            Deadline::new(&mut stream, deadline, self.config.write_timeout),
            PumpSettings {
                stack_bytes: self.config.thread_stack_bytes,
                thread_name: format!("nbd-conn-{id}"),
                stall_timeout: self.config.write_timeout,
                keep_alive,
            },
        );
        let negotiated = handshake::negotiate(
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

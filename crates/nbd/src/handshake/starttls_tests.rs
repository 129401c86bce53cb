//! The STARTTLS option state machine, driven through a scripted transport: the client's
//! bytes are fixed in advance, the server's replies are parsed back, and "TLS" is a marker
//! of where in the server's output the switch happened (no encryption: what is tested here
//! is which option gets which answer before and after it, not rustls).
// NBD is big-endian on the wire.
#![allow(clippy::big_endian_bytes)]

use std::io::{self, Cursor, Read, Write};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::ServerConfig;

use super::{negotiate, Outcome};
use crate::error::{Error, Result};
use crate::export::{ExportMap, MemoryExport};
use crate::protocol::{
    info, option, reply, ExportRequest, MetaContextRequest, OptionHeader, GREETING_SIZE,
};
use crate::tls::{Tls, TlsMode, Transport};

/// Client bytes in, server bytes out; `start_tls` only records where it happened.
struct Scripted {
    input: Cursor<Vec<u8>>,
    output: Vec<u8>,
    /// Server output length when TLS started, if it did.
    tls_started_at: Option<usize>,
}

impl Read for Scripted {
    fn read(&mut self, buffer: &mut [u8]) -> io::Result<usize> {
        self.input.read(buffer)
    }
}

impl Write for Scripted {
    fn write(&mut self, buffer: &[u8]) -> io::Result<usize> {
        self.output.extend_from_slice(buffer);
        Ok(buffer.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Transport for Scripted {
    fn start_tls(&mut self, _config: &Arc<ServerConfig>) -> Result<()> {
        assert!(self.tls_started_at.is_none(), "TLS started twice");
        self.tls_started_at = Some(self.output.len());
        Ok(())
    }
}

/// A certificate resolver with no certificate: the configuration is never used for a real
/// handshake here.
#[derive(Debug)]
struct NoCertificate;

impl ResolvesServerCert for NoCertificate {
    fn resolve(&self, _client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        None
    }
}

fn tls(mode: TlsMode) -> Tls {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(NoCertificate));
    Tls::new(mode, Arc::new(config))
}

/// Client flags (fixed newstyle, no zeroes) followed by `options`.
fn client(options: &[(u32, Vec<u8>)]) -> Vec<u8> {
    let mut bytes = vec![0, 0, 0, 3];
    for (code, data) in options {
        let header = OptionHeader {
            code: *code,
            length: data.len() as u32,
        };
        bytes.extend_from_slice(&header.encode());
        bytes.extend_from_slice(data);
    }
    bytes
}

fn go(code: u32, name: &str) -> (u32, Vec<u8>) {
    let request = ExportRequest {
        name: name.to_string(),
        info_requests: vec![info::BLOCK_SIZE],
    };
    (code, request.encode())
}

fn set_meta_context(name: &str) -> (u32, Vec<u8>) {
    let request = MetaContextRequest {
        export_name: name.to_string(),
        queries: vec!["base:allocation".to_string()],
    };
    (option::SET_META_CONTEXT, request.encode())
}

/// One option reply as the server sent it.
#[derive(Debug, PartialEq, Eq)]
struct Reply {
    option: u32,
    reply_type: u32,
    /// Sent after TLS started.
    in_tls: bool,
}

struct Run {
    result: Result<Outcome>,
    replies: Vec<Reply>,
    tls_started: bool,
}

fn run(tls: Option<&Tls>, options: &[(u32, Vec<u8>)]) -> Run {
    let exports = ExportMap::new();
    exports.insert(Arc::new(MemoryExport::new("disk", 1 << 20)));
    let mut transport = Scripted {
        input: Cursor::new(client(options)),
        output: Vec::new(),
        tls_started_at: None,
    };
    let result = negotiate(&mut transport, &exports, &AtomicBool::new(false), tls);
    let output = &transport.output;
    let mut replies = Vec::new();
    let mut at = GREETING_SIZE;
    while at + 20 <= output.len() {
        let field = |offset: usize| {
            u32::from_be_bytes(output[at + offset..at + offset + 4].try_into().unwrap())
        };
        let length = field(16) as usize;
        replies.push(Reply {
            option: field(8),
            reply_type: field(12),
            in_tls: transport.tls_started_at.is_some_and(|start| at >= start),
        });
        at += 20 + length;
    }
    Run {
        result,
        replies,
        tls_started: transport.tls_started_at.is_some(),
    }
}

/// The reply types, in order, that answered `code`.
fn answers(run: &Run, code: u32) -> Vec<(u32, bool)> {
    run.replies
        .iter()
        .filter(|reply| reply.option == code)
        .map(|reply| (reply.reply_type, reply.in_tls))
        .collect()
}

#[test]
fn require_refuses_every_option_but_starttls_and_abort_before_tls() {
    let tls = tls(TlsMode::Require);
    let run = run(
        Some(&tls),
        &[
            (option::LIST, vec![]),
            (option::STRUCTURED_REPLY, vec![]),
            go(option::INFO, "disk"),
            go(option::GO, "disk"),
            (option::ABORT, vec![]),
        ],
    );
    assert!(matches!(run.result, Ok(Outcome::Closed)));
    assert!(!run.tls_started);
    for code in [
        option::LIST,
        option::STRUCTURED_REPLY,
        option::INFO,
        option::GO,
    ] {
        assert_eq!(
            answers(&run, code),
            [(reply::ERR_TLS_REQD, false)],
            "option {code}"
        );
    }
    assert_eq!(answers(&run, option::ABORT), [(reply::ACK, false)]);
}

#[test]
fn require_closes_on_export_name_without_tls() {
    let tls = tls(TlsMode::Require);
    let run = run(Some(&tls), &[(option::EXPORT_NAME, b"disk".to_vec())]);
    assert!(matches!(run.result, Err(Error::Protocol { .. })));
    assert!(run.replies.is_empty());
}

#[test]
fn require_serves_after_starttls() {
    let tls = tls(TlsMode::Require);
    let run = run(
        Some(&tls),
        &[
            (option::LIST, vec![]),
            (option::STARTTLS, vec![]),
            (option::LIST, vec![]),
            go(option::GO, "disk"),
        ],
    );
    let Ok(Outcome::Transmission(negotiated)) = &run.result else {
        panic!("no transmission")
    };
    assert_eq!(negotiated.requested_name, "disk");
    assert!(run.tls_started);
    // The ACK goes out in plaintext; TLS starts right after it.
    assert_eq!(answers(&run, option::STARTTLS), [(reply::ACK, false)]);
    assert_eq!(
        answers(&run, option::LIST),
        [
            (reply::ERR_TLS_REQD, false),
            (reply::SERVER, true),
            (reply::ACK, true)
        ]
    );
    assert_eq!(answers(&run, option::GO).last(), Some(&(reply::ACK, true)));
}

#[test]
fn starttls_inside_tls_is_invalid_and_data_is_refused() {
    let tls = tls(TlsMode::On);
    let run = run(
        Some(&tls),
        &[
            (option::STARTTLS, vec![1]),
            (option::STARTTLS, vec![]),
            (option::STARTTLS, vec![]),
            (option::ABORT, vec![]),
        ],
    );
    assert!(matches!(run.result, Ok(Outcome::Closed)));
    assert_eq!(
        answers(&run, option::STARTTLS),
        [
            (reply::ERR_INVALID, false),
            (reply::ACK, false),
            (reply::ERR_INVALID, true)
        ]
    );
}

#[test]
fn starttls_forgets_what_was_negotiated_before() {
    let tls = tls(TlsMode::On);
    let run = run(
        Some(&tls),
        &[
            (option::STRUCTURED_REPLY, vec![]),
            set_meta_context("disk"),
            (option::STARTTLS, vec![]),
            // Structured replies were agreed before TLS only: this must now be refused.
            set_meta_context("disk"),
            go(option::GO, "disk"),
        ],
    );
    let Ok(Outcome::Transmission(negotiated)) = &run.result else {
        panic!("no transmission")
    };
    assert_eq!(negotiated.style, super::ReplyStyle::Simple);
    assert!(negotiated.contexts.is_empty());
    assert_eq!(
        answers(&run, option::SET_META_CONTEXT),
        [
            (reply::META_CONTEXT, false),
            (reply::ACK, false),
            (reply::ERR_INVALID, true)
        ]
    );
}

#[test]
fn on_lets_plaintext_clients_through() {
    let tls = tls(TlsMode::On);
    let run = run(Some(&tls), &[(option::EXPORT_NAME, b"disk".to_vec())]);
    assert!(matches!(run.result, Ok(Outcome::Transmission(_))));
    assert!(!run.tls_started);
}

#[test]
fn without_tls_starttls_is_unsupported() {
    let run = run(None, &[(option::STARTTLS, vec![]), go(option::GO, "disk")]);
    assert!(matches!(run.result, Ok(Outcome::Transmission(_))));
    assert!(!run.tls_started);
    assert_eq!(answers(&run, option::STARTTLS), [(reply::ERR_UNSUP, false)]);
}

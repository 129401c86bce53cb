//! Goal: no byte stream a client sends makes the server panic, hang, leak a connection, send
//! a malformed handshake reply or touch another export; and the parsers never panic.
//!
//! Method: random bytes almost never get past the first magic, so every case starts from a
//! VALID session (client flags; informational options; a reply-mode option; a meta context;
//! GO or EXPORT_NAME; READ/WRITE/FLUSH/TRIM/WRITE_ZEROES/CACHE/BLOCK_STATUS requests in the
//! negotiated framing; DISC), built with testkit's client encoders (independent of the
//! crate's codec), then mutates it a few times: flip a bit, set a length field to a boundary
//! value, change flags, change an option code or command, truncate a message or the whole
//! stream, duplicate, drop or swap messages. The stream goes to the server on one thread
//! while replies are read on another; then the client half-closes and the server must close
//! within a deadline. Replies are decoded to measure how far each case got (the options
//! answered, the transmission phase, the requests answered) and printed. One case in ten is
//! left valid, and must then succeed completely. At the end no connection is left, a good
//! client is still served and the export no session names is untouched. A second test feeds
//! mutated valid encodings straight to the `nbd::protocol` parsers.
//!
//! Bounded: `THINPOOL_CASES` cases (default 2000 sessions, 20000 parser inputs) or 60 s, whichever comes first; seeded by
//! testkit (`THINPOOL_SEED`, printed on failure).
#![allow(clippy::big_endian_bytes)]

mod common;

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use nbd::protocol::{
    parse_client_flags, ExportRequest, HeaderStyle, MetaContextRequest, OptionHeader, Request,
};
use nbd::{Export, MemoryExport};
use rand::rngs::StdRng;
use rand::Rng;

/// Size of the export sessions use ("fuzz") and of the one they never name ("keep").
const EXPORT_SIZE: u64 = 1 << 20;
/// The longest a single case may take before it counts as a hang.
const CASE_DEADLINE: Duration = Duration::from_secs(20);
/// Wall-clock budget of the whole run (the case count is the other bound).
const RUN_BUDGET: Duration = Duration::from_secs(60);
/// Reply bytes kept per case for decoding; the rest is read and dropped.
const KEPT_REPLY_BYTES: usize = 4 << 20;

/// What one message of a session is, and where its mutable fields are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// The 4-byte client flags.
    ClientFlags,
    /// An option: header (magic, code at 8, length at 12) and data.
    Option,
    /// A request: header (flags at 4, command at 6, length at 24) and payload.
    Request { extended: bool },
}

#[derive(Clone, Debug)]
struct Message {
    kind: Kind,
    bytes: Vec<u8>,
}

/// A valid session, and what its requests were (for decoding replies).
struct Session {
    messages: Vec<Message>,
    /// cookie → (command, length) of each request sent.
    requests: HashMap<u64, (u16, u64)>,
    /// Requests expected to be answered if the session is sent unchanged.
    answered_expected: usize,
    /// Whether the handshake ends in transmission (GO or EXPORT_NAME, not ABORT).
    transmits: bool,
}

fn session(rng: &mut StdRng) -> Session {
    let mut messages = vec![Message {
        kind: Kind::ClientFlags,
        bytes: CLIENT_FLAGS.to_be_bytes().to_vec(),
    }];
    let option = |code: u32, data: &[u8]| Message {
        kind: Kind::Option,
        bytes: option_bytes(code, data),
    };
    // Informational options, any number, in any order; each gets a final reply.
    for _ in 0..rng.gen_range(0..4) {
        messages.push(match rng.gen_range(0..5) {
            0 => option(OPT_LIST, &[]),
            1 => option(OPT_INFO, &export_request("fuzz", &random_infos(rng))),
            2 => option(
                OPT_LIST_META_CONTEXT,
                &meta_request("fuzz", &[["base:", "base:allocation"][rng.gen_range(0..2)]]),
            ),
            3 => option(OPT_STARTTLS, &[]),
            _ => option(rng.gen_range(12..64), &[]),
        });
    }
    let mode = [Mode::Simple, Mode::Structured, Mode::Extended][rng.gen_range(0..3)];
    match mode {
        Mode::Simple => {}
        Mode::Structured => messages.push(option(OPT_STRUCTURED_REPLY, &[])),
        Mode::Extended => messages.push(option(OPT_EXTENDED_HEADERS, &[])),
    }
    let meta = mode != Mode::Simple && rng.gen_bool(0.5);
    if meta {
        messages.push(option(
            OPT_SET_META_CONTEXT,
            &meta_request("fuzz", &["base:allocation"]),
        ));
    }
    let mut requests = HashMap::new();
    let ending = rng.gen_range(0..20);
    if ending == 0 {
        messages.push(option(OPT_ABORT, &[]));
        return Session {
            messages,
            requests,
            answered_expected: 0,
            transmits: false,
        };
    }
    if ending < 4 && mode != Mode::Extended {
        messages.push(option(OPT_EXPORT_NAME, b"fuzz"));
    } else {
        messages.push(option(OPT_GO, &export_request("fuzz", &random_infos(rng))));
    }
    let extended = mode == Mode::Extended;
    let count = rng.gen_range(1..=10u64);
    for cookie in 1..=count {
        let (command, flags, offset, length) = random_request(rng, meta, mode);
        let mut bytes = request_header(mode, command, flags, cookie, offset, length);
        if command == CMD_WRITE {
            bytes.extend_from_slice(&pattern(cookie, length as usize));
        }
        requests.insert(cookie, (command, length));
        messages.push(Message {
            kind: Kind::Request { extended },
            bytes,
        });
    }
    if rng.gen_bool(0.7) {
        messages.push(Message {
            kind: Kind::Request { extended },
            bytes: request_header(mode, CMD_DISC, 0, count + 1, 0, 0),
        });
    }
    Session {
        messages,
        requests,
        answered_expected: count as usize,
        transmits: true,
    }
}

fn random_infos(rng: &mut StdRng) -> Vec<u16> {
    (0..rng.gen_range(0..4))
        .map(|_| rng.gen_range(0..4))
        .collect()
}

/// A valid request for a 1 MiB export: (command, flags, offset, length).
fn random_request(rng: &mut StdRng, meta: bool, mode: Mode) -> (u16, u16, u64, u64) {
    let offset = rng.gen_range(0..EXPORT_SIZE / 512) * 512;
    let length = (rng.gen_range(1..=128u64) * 512).min(EXPORT_SIZE - offset);
    // BLOCK_STATUS (last) needs a meta context.
    let commands = [
        CMD_READ,
        CMD_WRITE,
        CMD_FLUSH,
        CMD_TRIM,
        CMD_WRITE_ZEROES,
        CMD_CACHE,
        CMD_BLOCK_STATUS,
    ];
    let usable = if meta {
        commands.len()
    } else {
        commands.len() - 1
    };
    let command = commands[rng.gen_range(0..usable)];
    let flags = match command {
        CMD_WRITE | CMD_WRITE_ZEROES | CMD_TRIM if rng.gen_bool(0.3) => FLAG_FUA,
        CMD_READ if mode != Mode::Simple && rng.gen_bool(0.3) => FLAG_DF,
        CMD_BLOCK_STATUS if rng.gen_bool(0.3) => FLAG_REQ_ONE,
        _ => 0,
    };
    match command {
        CMD_FLUSH => (command, flags, 0, 0),
        _ => (command, flags, offset, length),
    }
}

/// Length values that sit on the server's limits.
fn boundary_length(rng: &mut StdRng, actual: u64) -> u64 {
    let choices = [
        0,
        1,
        actual.saturating_sub(1),
        actual + 1,
        u64::from(u32::MAX),
        64 * 1024 + 1,
        32 * MIB,
        32 * MIB + 1,
        EXPORT_SIZE,
        rng.gen(),
    ];
    choices[rng.gen_range(0..choices.len())]
}

/// A flags value of `bits` bits: any value, or one bit set.
fn random_flags(rng: &mut StdRng, bits: u32) -> u64 {
    if rng.gen_bool(0.5) {
        rng.gen::<u64>() & ((1 << bits) - 1)
    } else {
        1 << rng.gen_range(0..bits)
    }
}

/// An option code or command: mostly one of the first `known` (the defined ones and a few
/// more), sometimes any value.
fn random_type(rng: &mut StdRng, known: u64) -> u64 {
    if rng.gen_bool(0.8) {
        rng.gen_range(0..known)
    } else {
        rng.gen()
    }
}

/// A header field a mutation may rewrite.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Field {
    Length,
    Flags,
    Type,
}

/// Where `field` sits in a message of `kind`: (byte offset, width in bytes).
fn field_place(kind: Kind, field: Field) -> Option<(usize, usize)> {
    match (kind, field) {
        (Kind::ClientFlags, Field::Flags) => Some((0, 4)),
        (Kind::Option, Field::Type) => Some((8, 4)),
        (Kind::Option, Field::Length) => Some((12, 4)),
        (Kind::Request { .. }, Field::Flags) => Some((4, 2)),
        (Kind::Request { .. }, Field::Type) => Some((6, 2)),
        (Kind::Request { extended }, Field::Length) => Some((24, if extended { 8 } else { 4 })),
        _ => None,
    }
}

/// Rewrites `field` of `message` (if it has it, whole) with a value chosen to probe it: a
/// boundary length, random or single-bit flags, a near-valid or random type.
fn set_field(rng: &mut StdRng, message: &mut Message, field: Field) -> &'static str {
    let Some((at, width)) = field_place(message.kind, field) else {
        return "none";
    };
    if message.bytes.len() < at + width {
        return "none";
    }
    let mut current = [0u8; 8];
    current[8 - width..].copy_from_slice(&message.bytes[at..at + width]);
    let value = match field {
        Field::Length => boundary_length(rng, u64::from_be_bytes(current)),
        Field::Flags => random_flags(rng, 8 * width as u32),
        Field::Type if message.kind == Kind::Option => random_type(rng, 16),
        Field::Type => random_type(rng, 12),
    };
    message.bytes[at..at + width].copy_from_slice(&value.to_be_bytes()[8 - width..]);
    match field {
        Field::Length => "length",
        Field::Flags => "flags",
        Field::Type => "type",
    }
}

/// Applies one mutation; returns its name (for the statistics).
fn mutate(rng: &mut StdRng, messages: &mut Vec<Message>) -> &'static str {
    if messages.is_empty() {
        return "none";
    }
    let index = rng.gen_range(0..messages.len());
    match rng.gen_range(0..9) {
        0 => {
            let message = &mut messages[index];
            if message.bytes.is_empty() {
                return "none";
            }
            let bit = rng.gen_range(0..message.bytes.len() * 8);
            message.bytes[bit / 8] ^= 1 << (bit % 8);
            "flip bit"
        }
        1 => set_field(rng, &mut messages[index], Field::Length),
        2 => set_field(rng, &mut messages[index], Field::Flags),
        3 => set_field(rng, &mut messages[index], Field::Type),
        4 => {
            let message = &mut messages[index];
            let keep = rng.gen_range(0..=message.bytes.len());
            message.bytes.truncate(keep);
            "truncate message"
        }
        5 => {
            let copy = messages[index].clone();
            messages.insert(index, copy);
            "duplicate"
        }
        6 => {
            messages.remove(index);
            "drop"
        }
        7 if index + 1 < messages.len() => {
            messages.swap(index, index + 1);
            "swap"
        }
        _ => {
            // Truncate the whole stream: drop everything after a cut inside this message.
            messages.truncate(index + 1);
            let message = &mut messages[index];
            let keep = rng.gen_range(0..=message.bytes.len());
            message.bytes.truncate(keep);
            "truncate stream"
        }
    }
}

/// How far one case (or, summed, the run) got, decoded from the server's replies.
#[derive(Debug, Default)]
struct Reach {
    /// Option code → final replies received.
    options: BTreeMap<u32, usize>,
    /// Cases whose handshake ended in transmission (GO acknowledged or EXPORT_NAME
    /// answered).
    transmission: usize,
    /// Transmission replies completed, and those with error 0.
    answered: usize,
    succeeded: usize,
    /// Command (as sent) → replies completed.
    commands: BTreeMap<u16, usize>,
    /// Cases where decoding stopped before the end of the replies (a mutated length
    /// desynchronised it).
    lost_sync: usize,
}

impl Reach {
    fn add(&mut self, other: &Reach) {
        for (&option, &count) in &other.options {
            *self.options.entry(option).or_default() += count;
        }
        self.transmission += other.transmission;
        self.answered += other.answered;
        self.succeeded += other.succeeded;
        for (&command, &count) in &other.commands {
            *self.commands.entry(command).or_default() += count;
        }
        self.lost_sync += other.lost_sync;
    }
}

/// Decodes the server's replies; fails the test on a malformed handshake reply.
fn decode(bytes: &[u8], session: &Session, context: &str) -> Reach {
    let mut reach = Reach::default();
    assert!(bytes.len() >= 18, "{context}: no greeting");
    assert_eq!(be64(bytes), NBDMAGIC, "{context}: greeting");
    let mut at = 18;
    // Option replies, up to GO's ACK or an EXPORT_NAME answer (size, flags).
    let mut structured = false;
    let mut extended = false;
    loop {
        let rest = &bytes[at..];
        if rest.is_empty() {
            return reach;
        }
        if rest.len() >= 8 && be64(rest) == OPTION_REPLY_MAGIC {
            assert!(rest.len() >= 20, "{context}: option reply header cut short");
            let option = be32(&rest[8..]);
            let reply_type = be32(&rest[12..]);
            let length = be32(&rest[16..]) as usize;
            assert!(
                length <= 64 * 1024,
                "{context}: option reply of {length} bytes"
            );
            assert!(
                rest.len() >= 20 + length,
                "{context}: option reply data cut short"
            );
            at += 20 + length;
            let reply = OptionReply {
                option,
                reply_type,
                data: Vec::new(),
            };
            if reply.is_final() {
                *reach.options.entry(option).or_default() += 1;
            }
            match (option, reply_type) {
                (OPT_STRUCTURED_REPLY, REP_ACK) => structured = true,
                (OPT_EXTENDED_HEADERS, REP_ACK) => extended = true,
                (OPT_GO, REP_ACK) => break,
                _ => {}
            }
            continue;
        }
        // Otherwise only an EXPORT_NAME answer may follow: size (8), flags (2), and 124
        // zero bytes unless the client asked for none.
        assert!(
            rest.len() >= 10 && be64(rest) == EXPORT_SIZE,
            "{context}: neither an option reply nor an EXPORT_NAME answer at byte {at}"
        );
        *reach.options.entry(OPT_EXPORT_NAME).or_default() += 1;
        at += 10;
        if bytes.len() >= at + 124 && bytes[at..at + 124].iter().all(|&b| b == 0) {
            at += 124;
        }
        break;
    }
    reach.transmission = 1;
    let mode = if extended {
        Mode::Extended
    } else if structured {
        Mode::Structured
    } else {
        Mode::Simple
    };
    decode_transmission(&bytes[at..], mode, session, &mut reach);
    reach
}

/// Counts the transmission replies until the bytes end or decoding loses its place.
fn decode_transmission(mut rest: &[u8], mode: Mode, session: &Session, reach: &mut Reach) {
    let mut errors: HashMap<u64, u32> = HashMap::new();
    while rest.len() >= 4 {
        let magic = be32(rest);
        let header = match magic {
            SIMPLE_REPLY_MAGIC => 16,
            STRUCTURED_REPLY_MAGIC if mode == Mode::Structured => 20,
            EXTENDED_REPLY_MAGIC if mode == Mode::Extended => 32,
            _ => {
                reach.lost_sync = 1;
                return;
            }
        };
        if rest.len() < header {
            return;
        }
        let (cookie, done, error, payload) = if magic == SIMPLE_REPLY_MAGIC {
            let error = be32(&rest[4..]);
            let cookie = be64(&rest[8..]);
            let payload = match session.requests.get(&cookie) {
                Some(&(CMD_READ, length)) if error == 0 && mode == Mode::Simple => length,
                _ => 0,
            };
            (cookie, true, error, payload as usize)
        } else {
            let flags = be16(&rest[4..]);
            let chunk_type = be16(&rest[6..]);
            let cookie = be64(&rest[8..]);
            let length = if magic == EXTENDED_REPLY_MAGIC {
                be64(&rest[24..])
            } else {
                u64::from(be32(&rest[16..]))
            };
            let error = if chunk_type & 0x8000 != 0 && rest.len() >= header + 4 {
                be32(&rest[header..])
            } else {
                0
            };
            (cookie, flags & CHUNK_FLAG_DONE != 0, error, length as usize)
        };
        if rest.len() < header + payload {
            return;
        }
        rest = &rest[header + payload..];
        if error != 0 {
            errors.insert(cookie, error);
        }
        if done {
            reach.answered += 1;
            if !errors.contains_key(&cookie) {
                reach.succeeded += 1;
            }
            if let Some(&(command, _)) = session.requests.get(&cookie) {
                *reach.commands.entry(command).or_default() += 1;
            }
        }
    }
}

/// Sends `bytes` on a thread while reading every reply; then half-closes and waits for the
/// server to close. Returns the replies (the first [`KEPT_REPLY_BYTES`]).
fn exchange(socket: &Path, bytes: Vec<u8>, context: &str) -> Vec<u8> {
    let mut stream = UnixStream::connect(socket).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("read timeout");
    let mut writer = stream.try_clone().expect("clone the socket");
    let sender = std::thread::spawn(move || {
        // The server may close early (a protocol violation): a failed write ends the case.
        let _ = writer.write_all(&bytes);
        let _ = writer.shutdown(std::net::Shutdown::Write);
    });
    let started = Instant::now();
    let mut replies = Vec::new();
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        assert!(
            started.elapsed() < CASE_DEADLINE,
            "{context}: the server neither finished nor closed within {CASE_DEADLINE:?}"
        );
        match stream.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => {
                let keep = n.min(KEPT_REPLY_BYTES.saturating_sub(replies.len()));
                replies.extend_from_slice(&buffer[..keep]);
            }
            Err(error) if error.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(error)
                if matches!(
                    error.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) => {}
            Err(error) => panic!("{context}: reading replies: {error}"),
        }
    }
    sender.join().expect("sender thread");
    replies
}

#[derive(Default)]
struct Totals {
    cases: usize,
    valid_cases: usize,
    mutations: BTreeMap<&'static str, usize>,
    reach: Reach,
}

impl Totals {
    fn print(&self) {
        let reach = &self.reach;
        eprintln!(
            "protocol fuzz: {} cases ({} left valid); {} reached transmission; {} replies to \
             requests ({} successful); decoding lost its place in {} cases",
            self.cases,
            self.valid_cases,
            reach.transmission,
            reach.answered,
            reach.succeeded,
            reach.lost_sync
        );
        let mut options: BTreeMap<&str, usize> = BTreeMap::new();
        for (&code, &count) in &reach.options {
            *options.entry(option_name(code)).or_default() += count;
        }
        eprintln!("  final option replies, by option: {options:?}");
        eprintln!("  replies by command (as sent): {:?}", reach.commands);
        eprintln!("  mutations applied: {:?}", self.mutations);
    }
}

fn option_name(code: u32) -> &'static str {
    match code {
        OPT_EXPORT_NAME => "EXPORT_NAME",
        OPT_ABORT => "ABORT",
        OPT_LIST => "LIST",
        OPT_STARTTLS => "STARTTLS",
        OPT_INFO => "INFO",
        OPT_GO => "GO",
        OPT_STRUCTURED_REPLY => "STRUCTURED_REPLY",
        OPT_LIST_META_CONTEXT => "LIST_META_CONTEXT",
        OPT_SET_META_CONTEXT => "SET_META_CONTEXT",
        OPT_EXTENDED_HEADERS => "EXTENDED_HEADERS",
        _ => "unknown",
    }
}

#[test]
fn mutated_valid_sessions_never_break_the_server() {
    let (report, mut rng) = testkit::seeded_rng();
    let cases = testkit::case_count(2000);
    let fuzz = Arc::new(MemoryExport::new("fuzz", EXPORT_SIZE));
    let keep = Arc::new(MemoryExport::new("keep", EXPORT_SIZE));
    let kept = pattern(report.seed(), EXPORT_SIZE as usize);
    keep.write_at(0, &kept, false).unwrap();
    let config = nbd::Config {
        handshake_timeout: Duration::from_secs(5),
        ..Default::default()
    };
    let server = TestServer::start_with(vec![fuzz, keep.clone()], config);
    let started = Instant::now();
    let mut totals = Totals::default();
    for case in 0..cases {
        if started.elapsed() > RUN_BUDGET {
            eprintln!("protocol fuzz: time budget reached after {case} cases");
            break;
        }
        let session = session(&mut rng);
        let mut messages = session.messages.clone();
        let valid = rng.gen_range(0..10) == 0;
        if valid {
            totals.valid_cases += 1;
        } else {
            for _ in 0..rng.gen_range(1..=3) {
                let name = mutate(&mut rng, &mut messages);
                *totals.mutations.entry(name).or_default() += 1;
            }
        }
        let bytes: Vec<u8> = messages.iter().flat_map(|m| m.bytes.clone()).collect();
        let context = format!("case {case} ({} bytes, valid: {valid})", bytes.len());
        let replies = exchange(&server.socket, bytes, &context);
        let reach = decode(&replies, &session, &context);
        if valid {
            let transmits = usize::from(session.transmits);
            assert_eq!(reach.transmission, transmits, "{context}: {reach:?}");
            assert_eq!(reach.lost_sync, 0, "{context}: {reach:?}");
            assert_eq!(
                reach.succeeded, session.answered_expected,
                "{context}: every valid request succeeds: {reach:?}"
            );
        }
        totals.cases += 1;
        totals.reach.add(&reach);
    }
    totals.print();
    // Nothing left behind, and the server still serves.
    wait_for("fuzz connections to close", Duration::from_secs(10), || {
        server.server.as_ref().unwrap().connection_count() == 0
    });
    let (mut client, _, _, _) = Client::negotiate(&server.socket, "keep", Mode::Structured, false);
    assert!(client.read(0, EXPORT_SIZE) == kept, "export `keep` changed");
    client.disconnect();
    if totals.cases >= 100 {
        // The point of starting from valid sessions: most cases get past the handshake.
        assert!(
            totals.reach.transmission * 2 > totals.cases,
            "only {} of {} cases reached transmission",
            totals.reach.transmission,
            totals.cases
        );
    }
}

/// Applies 1 to 3 byte-level mutations (bit flips, truncation, a duplicated byte run, a
/// random byte) to a valid encoding.
fn mutate_bytes(rng: &mut StdRng, bytes: &mut Vec<u8>) {
    for _ in 0..rng.gen_range(1..=3) {
        match rng.gen_range(0..4) {
            0 if !bytes.is_empty() => {
                let bit = rng.gen_range(0..bytes.len() * 8);
                bytes[bit / 8] ^= 1 << (bit % 8);
            }
            1 => {
                let keep = rng.gen_range(0..=bytes.len());
                bytes.truncate(keep);
            }
            2 if !bytes.is_empty() => {
                let start = rng.gen_range(0..bytes.len());
                let end = rng.gen_range(start..=bytes.len());
                let run = bytes[start..end].to_vec();
                bytes.splice(end..end, run);
            }
            _ if !bytes.is_empty() => {
                let at = rng.gen_range(0..bytes.len());
                bytes[at] = rng.gen();
            }
            _ => {}
        }
    }
}

#[test]
fn mutated_valid_encodings_never_panic_the_parsers() {
    let (_report, mut rng) = testkit::seeded_rng();
    let cases = testkit::case_count(20_000);
    // Successful parses of mutated input, per parser: how far mutation-based inputs reach.
    let mut parsed = [0usize; 6];
    for _ in 0..cases {
        let name: String = (0..rng.gen_range(0..8))
            .map(|_| char::from(rng.gen_range(b'a'..=b'z')))
            .collect();
        let infos = random_infos(&mut rng);
        let export = export_request(&name, &infos);
        let parsed_export = ExportRequest::parse(&export).expect("a valid export request");
        assert_eq!(
            (&parsed_export.name, &parsed_export.info_requests),
            (&name, &infos)
        );

        let queries = ["base:allocation", "base:", "qemu:dirty-bitmap:x"];
        let query_list = &queries[..rng.gen_range(0..=queries.len())];
        let meta = meta_request(&name, query_list);
        let parsed_meta = MetaContextRequest::parse(&meta).expect("a valid meta request");
        assert_eq!(parsed_meta.export_name, name);
        assert_eq!(parsed_meta.queries, query_list);

        let mode = [Mode::Simple, Mode::Extended][rng.gen_range(0..2)];
        let style = if mode == Mode::Extended {
            HeaderStyle::Extended
        } else {
            HeaderStyle::Compact
        };
        let (command, flags, offset, length) = random_request(&mut rng, true, mode);
        let cookie: u64 = rng.gen();
        let header = request_header(mode, command, flags, cookie, offset, length);
        let request = Request::parse(style, &header).expect("a valid request header");
        assert_eq!(
            (
                request.command,
                request.flags,
                request.cookie,
                request.offset,
                request.length
            ),
            (command, flags, cookie, offset, length)
        );

        let option = option_bytes(rng.gen_range(0..16), &export);
        let client_flags = CLIENT_FLAGS.to_be_bytes().to_vec();

        let mut inputs = [export, meta, header.clone(), header, option, client_flags];
        for input in &mut inputs {
            mutate_bytes(&mut rng, input);
        }
        let [export, meta, compact, extended, option, client_flags] = inputs;
        parsed[0] += usize::from(ExportRequest::parse(&export).is_ok());
        parsed[1] += usize::from(MetaContextRequest::parse(&meta).is_ok());
        parsed[2] += usize::from(Request::parse(HeaderStyle::Compact, &compact).is_ok());
        parsed[3] += usize::from(Request::parse(HeaderStyle::Extended, &extended).is_ok());
        if let Ok(option_header) = <[u8; 16]>::try_from(&option[..option.len().min(16)]) {
            parsed[4] += usize::from(OptionHeader::parse(&option_header).is_ok());
        }
        if let Ok(flags) = <[u8; 4]>::try_from(&client_flags[..]) {
            parsed[5] += usize::from(parse_client_flags(flags).is_ok());
        }
    }
    eprintln!(
        "parsers, {cases} mutated inputs each: export request {}, meta context request {}, \
         compact request {}, extended request {}, option header {}, client flags {} parsed",
        parsed[0], parsed[1], parsed[2], parsed[3], parsed[4], parsed[5]
    );
}

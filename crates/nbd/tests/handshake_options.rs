//! Goal: every handshake path answers as the protocol requires.
//! Method: a raw client (tests/common) drives greeting, client-flag variants, each option
//! (LIST, INFO, GO, EXPORT_NAME with and without NO_ZEROES, ABORT, STRUCTURED_REPLY,
//! EXTENDED_HEADERS, LIST/SET_META_CONTEXT, STARTTLS, unknown) and checks each reply byte
//! layout, then checks the server still serves a fresh connection.
#![allow(clippy::big_endian_bytes)]

mod common;

use std::sync::Arc;

use common::*;
use nbd::MemoryExport;

fn server() -> TestServer {
    let disk = MemoryExport::new("disk", 8 * MIB).with_description("scratch disk");
    let ro = MemoryExport::new("ro", MIB).with_read_only(true);
    let server = TestServer::start(vec![Arc::new(disk), Arc::new(ro)]);
    server.exports.set_default(Some("disk".into()));
    server
}

#[test]
fn list_returns_every_export_then_ack() {
    let server = server();
    let mut client = Client::start(&server.socket);
    let replies = client.option(OPT_LIST, &[]);
    assert_eq!(replies.len(), 3);
    let mut names = Vec::new();
    for reply in &replies[..2] {
        assert_eq!(reply.reply_type, REP_SERVER);
        let length = be32(&reply.data) as usize;
        names.push(String::from_utf8(reply.data[4..4 + length].to_vec()).unwrap());
        if names.last().unwrap() == "disk" {
            assert_eq!(&reply.data[4 + length..], b"scratch disk");
        }
    }
    names.sort();
    assert_eq!(names, ["disk", "ro"]);
    assert_eq!(replies[2].reply_type, REP_ACK);
    // LIST with data is invalid, and the loop goes on.
    let replies = client.option(OPT_LIST, b"x");
    assert_eq!(replies[0].reply_type, REP_ERR_INVALID);
    let replies = client.option(OPT_ABORT, &[]);
    assert_eq!(replies[0].reply_type, REP_ACK);
    assert!(client.is_closed());
}

#[test]
fn info_answers_all_four_items_and_stays_in_negotiation() {
    let server = server();
    let mut client = Client::start(&server.socket);
    let replies = client.option(OPT_INFO, &export_request("disk", &[1, 2, 3, 99]));
    let infos: Vec<_> = replies
        .iter()
        .filter(|r| r.reply_type == REP_INFO)
        .collect();
    assert_eq!(infos.len(), 4, "{replies:?}");
    assert_eq!(replies.last().unwrap().reply_type, REP_ACK);
    let export = infos.iter().find(|r| be16(&r.data) == 0).unwrap();
    assert_eq!(be64(&export.data[2..]), 8 * MIB);
    let flags = be16(&export.data[10..]);
    for flag in [
        TF_HAS_FLAGS,
        TF_SEND_FLUSH,
        TF_SEND_FUA,
        TF_SEND_TRIM,
        TF_SEND_WRITE_ZEROES,
        TF_SEND_FAST_ZERO,
        TF_CAN_MULTI_CONN,
        TF_SEND_CACHE,
    ] {
        assert_ne!(flags & flag, 0, "flag {flag:#x} missing from {flags:#x}");
    }
    assert_eq!(flags & TF_READ_ONLY, 0);
    assert_eq!(flags & TF_SEND_DF, 0, "DF only with structured replies");
    let name = infos.iter().find(|r| be16(&r.data) == 1).unwrap();
    assert_eq!(&name.data[2..], b"disk");
    let description = infos.iter().find(|r| be16(&r.data) == 2).unwrap();
    assert_eq!(&description.data[2..], b"scratch disk");
    let block = infos.iter().find(|r| be16(&r.data) == 3).unwrap();
    assert_eq!(block.data.len(), 14);
    assert_eq!(be32(&block.data[2..]), 512);
    assert_eq!(be32(&block.data[6..]), 4096);
    assert_eq!(be32(&block.data[10..]), 32 * MIB as u32);
    // Unknown export and malformed request.
    let replies = client.option(OPT_INFO, &export_request("nope", &[]));
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].reply_type, REP_ERR_UNKNOWN);
    let replies = client.option(OPT_INFO, &[0, 0, 0, 9, b'a']);
    assert_eq!(replies[0].reply_type, REP_ERR_INVALID);
    // Read-only export flags; then GO to the default export (empty name) works.
    let replies = client.option(OPT_INFO, &export_request("ro", &[]));
    let flags = be16(&replies[0].data[10..]);
    assert_ne!(flags & TF_READ_ONLY, 0);
    assert_eq!(
        flags & (TF_SEND_TRIM | TF_SEND_WRITE_ZEROES | TF_SEND_FAST_ZERO),
        0
    );
    let (size, _) = client.go("");
    assert_eq!(size, 8 * MIB);
    client.write(0, &[1u8; 512]);
    client.disconnect();
}

#[test]
fn export_name_with_and_without_zero_padding() {
    let server = server();
    for (client_flags, reply_length) in [(3u32, 10usize), (1, 134)] {
        let mut client = Client::connect(&server.socket);
        client.send(&client_flags.to_be_bytes());
        client.send_option(OPT_EXPORT_NAME, b"disk");
        let reply = client.read_bytes(reply_length);
        assert_eq!(be64(&reply), 8 * MIB);
        assert!(reply[10..].iter().all(|&b| b == 0));
        client.write(4096, &[7u8; 4096]);
        assert_eq!(client.read(4096, 4096), vec![7u8; 4096]);
        client.disconnect();
    }
    // An unknown name cannot be reported: the server hangs up.
    let mut client = Client::start(&server.socket);
    client.send_option(OPT_EXPORT_NAME, b"missing");
    assert!(client.is_closed());
}

#[test]
fn client_flags_are_validated() {
    let server = server();
    // Unknown bit: close.
    let mut client = Client::connect(&server.socket);
    client.send(&0x10u32.to_be_bytes());
    assert!(client.is_closed());
    // No FIXED_NEWSTYLE: only EXPORT_NAME is allowed, anything else closes.
    let mut client = Client::connect(&server.socket);
    client.send(&0u32.to_be_bytes());
    client.send_option(OPT_LIST, &[]);
    assert!(client.is_closed());
    let mut client = Client::connect(&server.socket);
    client.send(&0u32.to_be_bytes());
    client.send_option(OPT_EXPORT_NAME, b"disk");
    let reply = client.read_bytes(134);
    assert_eq!(be64(&reply), 8 * MIB);
}

#[test]
fn unknown_and_unsupported_options_are_refused_and_loop_continues() {
    let server = server();
    let mut client = Client::start(&server.socket);
    for code in [4u32, 12, 0x7fff_ffff, OPT_STARTTLS] {
        let replies = client.option(code, b"some data");
        assert_eq!(replies.len(), 1);
        assert_eq!(replies[0].reply_type, REP_ERR_UNSUP, "option {code}");
    }
    let replies = client.option(OPT_STRUCTURED_REPLY, b"x");
    assert_eq!(replies[0].reply_type, REP_ERR_INVALID);
    let replies = client.option(OPT_EXTENDED_HEADERS, b"x");
    assert_eq!(replies[0].reply_type, REP_ERR_INVALID);
    let (size, _) = client.go("disk");
    assert_eq!(size, 8 * MIB);
}

#[test]
fn meta_contexts_follow_list_and_set_rules() {
    let server = server();
    let mut client = Client::start(&server.socket);
    // SET before structured replies is invalid; LIST is allowed.
    let replies = client.option(
        OPT_SET_META_CONTEXT,
        &meta_request("disk", &["base:allocation"]),
    );
    assert_eq!(replies[0].reply_type, REP_ERR_INVALID);
    assert_eq!(
        client.option(OPT_STRUCTURED_REPLY, &[])[0].reply_type,
        REP_ACK
    );
    for queries in [&[][..], &["base:"][..], &["base:allocation", "qemu:x"][..]] {
        let replies = client.option(OPT_LIST_META_CONTEXT, &meta_request("disk", queries));
        assert_eq!(replies.len(), 2, "{queries:?}: {replies:?}");
        assert_eq!(replies[0].reply_type, REP_META_CONTEXT);
        assert_eq!(be32(&replies[0].data), 0);
        assert_eq!(&replies[0].data[4..], b"base:allocation");
    }
    // Unknown leaf and namespace select nothing; "base:" selects nothing in SET.
    for queries in [
        &["base:foo"][..],
        &["x-other:thing"][..],
        &["base:"][..],
        &[][..],
    ] {
        let replies = client.option(OPT_SET_META_CONTEXT, &meta_request("disk", queries));
        assert_eq!(replies.len(), 1, "{queries:?}");
        assert_eq!(replies[0].reply_type, REP_ACK);
    }
    let replies = client.option(
        OPT_SET_META_CONTEXT,
        &meta_request("missing", &["base:allocation"]),
    );
    assert_eq!(replies[0].reply_type, REP_ERR_UNKNOWN);
    let replies = client.option(OPT_SET_META_CONTEXT, &[0, 0, 0, 4, b'd']);
    assert_eq!(replies[0].reply_type, REP_ERR_INVALID);
    // Select for "ro" but GO to "disk": BLOCK_STATUS must be refused.
    let replies = client.option(
        OPT_SET_META_CONTEXT,
        &meta_request("ro", &["base:allocation"]),
    );
    assert_eq!(replies[0].reply_type, REP_META_CONTEXT);
    let (_, flags) = client.go("disk");
    assert_ne!(flags & TF_SEND_DF, 0);
    client.mode = Mode::Structured;
    let reply = client.request(CMD_BLOCK_STATUS, 0, 0, 4096, &[]);
    assert_eq!(reply.error, EINVAL);
}

#[test]
fn extended_headers_forbid_structured_and_export_name() {
    let server = server();
    let mut client = Client::start(&server.socket);
    assert_eq!(
        client.option(OPT_EXTENDED_HEADERS, &[])[0].reply_type,
        REP_ACK
    );
    let replies = client.option(OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(replies[0].reply_type, REP_ERR_EXT_HEADER_REQD);
    client.send_option(OPT_EXPORT_NAME, b"disk");
    assert!(client.is_closed());
}

#[test]
fn oversize_option_gets_too_big_then_close() {
    let server = server();
    let mut client = Client::start(&server.socket);
    client.send(&option_header(OPT_GO, u32::MAX));
    let reply = client.read_option_reply();
    assert_eq!(reply.reply_type, REP_ERR_TOO_BIG);
    assert!(client.is_closed());
    // Bad option magic closes too.
    let mut client = Client::start(&server.socket);
    client.send(&[0u8; 16]);
    assert!(client.is_closed());
    // The server is still fine.
    let mut client = Client::start(&server.socket);
    client.go("disk");
}

#[test]
fn abort_is_acknowledged_even_with_data() {
    let server = server();
    let mut client = Client::start(&server.socket);
    let replies = client.option(OPT_ABORT, b"ignored");
    assert_eq!(replies[0].reply_type, REP_ACK);
    assert!(client.is_closed());
    // Hanging up without reading the ACK is tolerated.
    let mut client = Client::start(&server.socket);
    client.send_option(OPT_ABORT, &[]);
    drop(client);
    let mut client = Client::start(&server.socket);
    client.go("disk");
}

#[test]
fn info_with_thousands_of_duplicate_requests_answers_each_item_once() {
    let server = server();
    let mut client = Client::start(&server.socket);
    let requests: Vec<u16> = (0..30_000).map(|index| [3, 1, 7][index % 3]).collect();
    let started = std::time::Instant::now();
    let replies = client.option(OPT_INFO, &export_request("disk", &requests));
    assert!(started.elapsed() < std::time::Duration::from_secs(1));
    let types: Vec<u16> = replies
        .iter()
        .filter(|reply| reply.reply_type == REP_INFO)
        .map(|reply| be16(&reply.data))
        .collect();
    assert_eq!(types, vec![0, 3, 1]);
}

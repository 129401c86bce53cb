//! Goal: metadata contexts beyond `base:allocation` follow the protocol: LIST answers
//! wildcards (`namespace:` and longer prefixes ending in `:`) and exact names, SET selects
//! exact names only, each selected context gets its own id and its own chunk in every
//! BLOCK_STATUS reply (the last one flagged DONE), unknown contexts are simply not returned,
//! a failing context fails that one request and the connection goes on, and a SET that
//! selects too many contexts (or a LIST or SET with too many queries) gets `ERR_TOO_BIG`.
//! Method: the raw client (tests/common) against `MemoryExport::with_test_contexts`, whose
//! contexts report its block map; the expected extents come from what the test wrote. Then
//! `nbdinfo --map=x-memory:data` as a real client.
#![allow(clippy::big_endian_bytes)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use nbd::{Export, MemoryExport, MetaContext, StatusExtent, ZeroOptions};

const SIZE: u64 = 8 * MIB;
const TIMEOUT: Duration = Duration::from_secs(60);

fn server() -> (TestServer, Arc<MemoryExport>) {
    let disk = Arc::new(MemoryExport::new("disk", SIZE).with_test_contexts());
    let plain = Arc::new(MemoryExport::new("plain", MIB));
    let server = TestServer::start(vec![disk.clone(), plain]);
    (server, disk)
}

/// Names in the META_CONTEXT replies of `replies`, which must end with one ACK.
fn context_names(replies: &[OptionReply]) -> Vec<String> {
    let (last, contexts) = replies.split_last().expect("a final reply");
    assert_eq!(last.reply_type, REP_ACK, "{replies:?}");
    contexts
        .iter()
        .map(|reply| {
            assert_eq!(reply.reply_type, REP_META_CONTEXT, "{replies:?}");
            String::from_utf8(reply.data[4..].to_vec()).unwrap()
        })
        .collect()
}

fn list(client: &mut Client, export: &str, queries: &[&str]) -> Vec<String> {
    let replies = client.option(OPT_LIST_META_CONTEXT, &meta_request(export, queries));
    for reply in &replies[..replies.len() - 1] {
        assert_eq!(be32(&reply.data), 0, "LIST ids are zero");
    }
    let mut names = context_names(&replies);
    names.sort();
    names
}

#[test]
fn list_answers_wildcards_and_exact_names() {
    let (server, _) = server();
    let mut client = Client::start(&server.socket);
    let all = [
        "base:allocation",
        "x-memory:data",
        "x-memory:failing",
        "x-memory:zeroed",
    ];
    assert_eq!(list(&mut client, "disk", &[]), all);
    assert_eq!(list(&mut client, "disk", &["x-memory:"]), &all[1..]);
    assert_eq!(
        list(&mut client, "disk", &["x-memory:data", "base:"]),
        ["base:allocation", "x-memory:data"]
    );
    // Duplicates are answered once; a prefix without the colon is no wildcard.
    assert_eq!(
        list(
            &mut client,
            "disk",
            &["x-memory:data", "x-memory:", "x-memory:d"]
        ),
        &all[1..]
    );
    for unknown in [
        "x-memory:nothing",
        "x-memory:d",
        "x-other:",
        "qemu:dirty-bitmap:",
    ] {
        assert!(
            list(&mut client, "disk", &[unknown]).is_empty(),
            "{unknown}"
        );
    }
    // An export without extra contexts offers base:allocation only.
    assert_eq!(list(&mut client, "plain", &[]), ["base:allocation"]);
    assert!(list(&mut client, "plain", &["x-memory:"]).is_empty());
}

/// Selects `queries` on "disk" in `mode` and GOes; returns the client and the (id, name)
/// pairs the server selected.
fn select(server: &TestServer, mode: Mode, queries: &[&str]) -> (Client, Vec<(u32, String)>) {
    let mut client = Client::start(&server.socket);
    let code = match mode {
        Mode::Extended => OPT_EXTENDED_HEADERS,
        _ => OPT_STRUCTURED_REPLY,
    };
    assert_eq!(client.option(code, &[])[0].reply_type, REP_ACK);
    let replies = client.option(OPT_SET_META_CONTEXT, &meta_request("disk", queries));
    let names = context_names(&replies);
    let selected: Vec<(u32, String)> = replies
        .iter()
        .zip(names)
        .map(|(reply, name)| (be32(&reply.data), name))
        .collect();
    client.go("disk");
    client.mode = mode;
    (client, selected)
}

#[test]
fn set_selects_exact_names_with_one_chunk_per_context() {
    let (server, disk) = server();
    disk.write_at(MIB, &[7u8; 128 * 1024], false).unwrap();
    let no_hole = ZeroOptions {
        may_trim: false,
        ..ZeroOptions::default()
    };
    disk.write_zeroes(4 * MIB, 64 * 1024, no_hole).unwrap();
    for mode in [Mode::Structured, Mode::Extended] {
        let (mut client, selected) = select(
            &server,
            mode,
            &[
                "x-memory:data",
                "base:allocation",
                "x-memory:zeroed",
                "x-memory:data",
                "x-memory:",
                "x-memory:nothing",
                "qemu:dirty-bitmap:x",
                "base:",
            ],
        );
        let names: Vec<&str> = selected.iter().map(|(_, name)| name.as_str()).collect();
        assert_eq!(
            names,
            ["x-memory:data", "base:allocation", "x-memory:zeroed"],
            "{mode:?}"
        );
        let mut ids: Vec<u32> = selected.iter().map(|(id, _)| *id).collect();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), 3, "ids are unique: {selected:?}");
        let id_of = |name: &str| selected.iter().find(|(_, n)| n == name).unwrap().0;

        let reply = client.request(CMD_BLOCK_STATUS, 0, 0, SIZE, &[]);
        assert_eq!(reply.error, 0, "{reply:?}");
        assert_eq!(reply.chunk_types.len(), 3, "{reply:?}");
        let extents = |id: u32| {
            reply
                .block_status
                .iter()
                .find(|(context, _)| *context == id)
                .unwrap_or_else(|| panic!("no chunk for context {id}: {reply:?}"))
                .1
                .clone()
        };
        assert_eq!(
            extents(id_of("x-memory:data")),
            [(MIB, 0), (128 * 1024, 1), (SIZE - MIB - 128 * 1024, 0)]
        );
        assert_eq!(
            extents(id_of("x-memory:zeroed")),
            [
                (4 * MIB, 0),
                (64 * 1024, 1),
                (SIZE - 4 * MIB - 64 * 1024, 0)
            ]
        );
        assert_eq!(
            extents(id_of("base:allocation")),
            [
                (MIB, 3),
                (128 * 1024, 0),
                (3 * MIB - 128 * 1024, 3),
                (64 * 1024, 2),
                (4 * MIB - 64 * 1024, 3)
            ]
        );
        // REQ_ONE: one extent per context, none longer than the request.
        let reply = client.request(CMD_BLOCK_STATUS, FLAG_REQ_ONE, MIB - 4096, 8192, &[]);
        assert_eq!(reply.block_status.len(), 3, "{reply:?}");
        for (id, extents) in &reply.block_status {
            let expected = if *id == id_of("base:allocation") {
                (4096, 3)
            } else if *id == id_of("x-memory:data") {
                (4096, 0)
            } else {
                (8192, 0)
            };
            assert_eq!(extents, &[expected], "context {id}");
        }
    }
}

#[test]
fn a_failing_context_fails_the_request_and_the_connection_goes_on() {
    let (server, disk) = server();
    disk.write_at(0, &[1u8; 4096], false).unwrap();
    let (mut client, selected) = select(
        &server,
        Mode::Structured,
        &["base:allocation", "x-memory:failing"],
    );
    assert_eq!(selected.len(), 2);
    let reply = client.request(CMD_BLOCK_STATUS, 0, 0, MIB, &[]);
    assert_eq!(reply.error, EIO, "{reply:?}");
    assert!(reply.block_status.is_empty(), "{reply:?}");
    assert!(reply.error_message.contains("failing"), "{reply:?}");
    assert_eq!(client.read(0, 4096), vec![1u8; 4096]);
    let reply = client.request(CMD_BLOCK_STATUS, 0, 0, MIB, &[]);
    assert_eq!(reply.error, EIO);
}

#[test]
fn a_selection_of_unknown_contexts_only_leaves_block_status_refused() {
    let (server, _) = server();
    let (mut client, selected) = select(&server, Mode::Structured, &["x-memory:nothing"]);
    assert!(selected.is_empty());
    let reply = client.request(CMD_BLOCK_STATUS, 0, 0, MIB, &[]);
    assert_eq!(reply.error, EINVAL);
    assert_eq!(client.read(0, 512).len(), 512);
}

/// An export offering many contexts, to reach the selection limit.
struct ManyContexts(MemoryExport);

struct Constant(u32);

impl MetaContext for Constant {
    fn block_status(
        &self,
        _offset: u64,
        length: u64,
        _extents_max: usize,
    ) -> nbd::Result<Vec<StatusExtent>> {
        Ok(vec![StatusExtent {
            length_bytes: length,
            flags: self.0,
        }])
    }
}

impl Export for ManyContexts {
    fn name(&self) -> &str {
        "many"
    }
    fn size_bytes(&self) -> u64 {
        self.0.size_bytes()
    }
    fn read_at(&self, offset: u64, buffer: &mut [u8]) -> nbd::Result<()> {
        self.0.read_at(offset, buffer)
    }
    fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> nbd::Result<()> {
        self.0.write_at(offset, data, fua)
    }
    fn flush(&self) -> nbd::Result<()> {
        Ok(())
    }
    fn meta_contexts(&self, prefix: &str) -> Vec<String> {
        (0..100)
            .map(|n| format!("x-many:{n}"))
            .filter(|name| name.starts_with(prefix))
            .collect()
    }
    fn meta_context(&self, name: &str) -> Option<Arc<dyn MetaContext>> {
        let n: u32 = name.strip_prefix("x-many:")?.parse().ok()?;
        (n < 100).then(|| Arc::new(Constant(n)) as Arc<dyn MetaContext>)
    }
}

#[test]
fn selecting_more_than_the_limit_is_too_big_and_clears_the_selection() {
    let (server, _) = server();
    server
        .exports
        .insert(Arc::new(ManyContexts(MemoryExport::new("many", MIB))));
    let mut client = Client::start(&server.socket);
    assert_eq!(
        client.option(OPT_STRUCTURED_REPLY, &[])[0].reply_type,
        REP_ACK
    );
    assert_eq!(list(&mut client, "many", &["x-many:"]).len(), 100);
    // More queries than 64 are refused before any lookup, for LIST and SET.
    let many: Vec<String> = (0..65).map(|n| format!("x-many:{n}")).collect();
    let many: Vec<&str> = many.iter().map(String::as_str).collect();
    for code in [OPT_LIST_META_CONTEXT, OPT_SET_META_CONTEXT] {
        let replies = client.option(code, &meta_request("many", &many));
        assert_eq!(replies.len(), 1, "{replies:?}");
        assert_eq!(replies[0].reply_type, REP_ERR_TOO_BIG);
    }
    assert_eq!(list(&mut client, "many", &many[..64]).len(), 64);
    let names: Vec<String> = (0..17).map(|n| format!("x-many:{n}")).collect();
    let queries: Vec<&str> = names.iter().map(String::as_str).collect();
    let replies = client.option(OPT_SET_META_CONTEXT, &meta_request("many", &queries));
    assert_eq!(replies.len(), 1, "{replies:?}");
    assert_eq!(replies[0].reply_type, REP_ERR_TOO_BIG);
    // Sixteen are fine, and each answers with its own flags.
    let replies = client.option(OPT_SET_META_CONTEXT, &meta_request("many", &queries[1..]));
    let selected = context_names(&replies);
    assert_eq!(selected.len(), 16);
    let ids: Vec<(u32, u32)> = replies[..16]
        .iter()
        .zip(&selected)
        .map(|(reply, name)| {
            (
                be32(&reply.data),
                name.strip_prefix("x-many:").unwrap().parse().unwrap(),
            )
        })
        .collect();
    client.go("many");
    client.mode = Mode::Structured;
    let reply = client.request(CMD_BLOCK_STATUS, 0, 0, 4096, &[]);
    assert_eq!(reply.block_status.len(), 16, "{reply:?}");
    for (id, flags) in ids {
        let extents = &reply
            .block_status
            .iter()
            .find(|(context, _)| *context == id)
            .unwrap()
            .1;
        assert_eq!(extents, &[(4096, u64::from(flags))]);
    }
}

#[test]
fn nbdinfo_maps_an_extra_context() {
    require_tool("nbdinfo", "libnbd-bin");
    let (server, disk) = server();
    disk.write_at(2 * MIB, &[9u8; 192 * 1024], false).unwrap();
    let output = run_ok(
        "nbdinfo",
        &["--map=x-memory:data", &server.uri("disk")],
        TIMEOUT,
    );
    let rows: Vec<Vec<&str>> = output
        .lines()
        .map(|line| line.split_whitespace().collect())
        .collect();
    let expected = [
        (0, 2 * MIB, 0),
        (2 * MIB, 192 * 1024, 1),
        (2 * MIB + 192 * 1024, SIZE - 2 * MIB - 192 * 1024, 0),
    ];
    assert_eq!(rows.len(), expected.len(), "{output}");
    for (row, (offset, length, flags)) in rows.iter().zip(expected) {
        assert_eq!(row[0], offset.to_string(), "{output}");
        assert_eq!(row[1], length.to_string(), "{output}");
        assert_eq!(row[2], flags.to_string(), "{output}");
    }
    let listing = run_ok("nbdinfo", &["--list", &server.uri("")], TIMEOUT);
    assert!(listing.contains("x-memory:data"), "{listing}");
}

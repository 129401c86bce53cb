//! Goal: every transmission command behaves as the protocol requires in each reply mode
//! (simple, structured, extended headers), including error replies that keep the connection
//! usable, and several requests in flight answered by cookie.
//! Method: the raw client from tests/common negotiates each mode, runs each command with
//! good and bad arguments, and checks error values, chunk types, data and the MemoryExport's
//! allocation map.
#![allow(clippy::big_endian_bytes)]

mod common;

use std::sync::Arc;

use common::*;
use nbd::{ErrorKind, Export, MemoryExport};

const SIZE: u64 = 16 * MIB;

fn setup(mode: Mode, meta: bool) -> (TestServer, Arc<MemoryExport>, Client, u32) {
    let disk = Arc::new(MemoryExport::new("disk", SIZE));
    let ro = Arc::new(MemoryExport::new("ro", MIB).with_read_only(true));
    let server = TestServer::start(vec![disk.clone(), ro]);
    let (client, size, flags, context) = Client::negotiate(&server.socket, "disk", mode, meta);
    assert_eq!(size, SIZE);
    assert_eq!(flags & TF_SEND_DF != 0, mode != Mode::Simple);
    (server, disk, client, context)
}

fn expect_error(client: &mut Client, reply: Completed, error: u32, what: &str) {
    assert_eq!(reply.error, error, "{what}: {reply:?}");
    if client.mode != Mode::Simple {
        assert!(reply.chunk_types.contains(&CHUNK_ERROR), "{what}");
        assert!(!reply.error_message.is_empty(), "{what}");
    }
    // The connection still works.
    assert_eq!(client.read(0, 512).len(), 512, "after {what}");
}

fn exercise(mode: Mode) {
    let (_server, disk, mut client, _) = setup(mode, false);
    // WRITE, READ, FUA, FLUSH.
    let data = pattern(1, 256 * 1024);
    client.write(MIB, &data);
    assert_eq!(client.read(MIB, 256 * 1024), data);
    let reply = client.request(CMD_WRITE, FLAG_FUA, 0, 4096, &[9u8; 4096]);
    assert_eq!(reply.error, 0);
    let flushes = disk.flush_count();
    assert_eq!(client.request(CMD_FLUSH, 0, 0, 0, &[]).error, 0);
    assert_eq!(disk.flush_count(), flushes + 1);
    // Reply framing for non-read commands.
    let reply = client.request(CMD_CACHE, 0, 0, MIB, &[]);
    assert_eq!(reply.error, 0);
    match mode {
        Mode::Extended => assert_eq!(reply.chunk_types, vec![CHUNK_NONE]),
        _ => assert!(reply.chunk_types.is_empty(), "simple reply expected"),
    }
    // READ framing: one data chunk in structured modes; DF accepted.
    let reply = client.request(CMD_READ, FLAG_DF, MIB, 4096, &[]);
    assert_eq!(reply.data, data[..4096]);
    if mode != Mode::Simple {
        assert_eq!(reply.chunk_types, vec![CHUNK_OFFSET_DATA]);
    }
    // Zero-length requests succeed.
    assert_eq!(client.request(CMD_READ, 0, 0, 0, &[]).error, 0);
    assert_eq!(client.request(CMD_WRITE, 0, 0, 0, &[]).error, 0);
    // TRIM unmaps whole 64 KiB blocks; WRITE_ZEROES with and without NO_HOLE.
    client.write(2 * MIB, &vec![5u8; 512 * 1024]);
    assert_eq!(
        client.request(CMD_TRIM, 0, 2 * MIB, 128 * 1024, &[]).error,
        0
    );
    let reply = client.request(CMD_WRITE_ZEROES, 0, 2 * MIB + 128 * 1024, 128 * 1024, &[]);
    assert_eq!(reply.error, 0);
    let reply = client.request(
        CMD_WRITE_ZEROES,
        FLAG_NO_HOLE,
        2 * MIB + 256 * 1024,
        128 * 1024,
        &[],
    );
    assert_eq!(reply.error, 0);
    let extents = disk.block_status(2 * MIB, 512 * 1024, 16).unwrap();
    assert!(
        extents[0].hole && extents[0].length_bytes == 256 * 1024,
        "{extents:?}"
    );
    assert!(!extents[1].hole && extents[1].zero, "{extents:?}");
    assert!(!extents[2].hole && !extents[2].zero, "{extents:?}");
    assert_eq!(client.read(2 * MIB, 384 * 1024), vec![0u8; 384 * 1024]);
    // FAST_ZERO: fails with ENOTSUP on a partial data block and changes nothing.
    let reply = client.request(CMD_WRITE_ZEROES, FLAG_FAST_ZERO, MIB, 512, &[]);
    expect_error(&mut client, reply, ENOTSUP, "fast zero");
    assert_eq!(client.read(MIB, 512), data[..512]);
    let reply = client.request(CMD_WRITE_ZEROES, FLAG_FAST_ZERO, 4 * MIB, MIB, &[]);
    assert_eq!(reply.error, 0);
    // Out of range, unaligned, oversize READ, unknown command, bad flags.
    let reply = client.request(CMD_READ, 0, SIZE - 512, 1024, &[]);
    expect_error(&mut client, reply, EINVAL, "read past end");
    let reply = client.request(CMD_READ, 0, u64::MAX - 511, 1024, &[]);
    expect_error(&mut client, reply, EINVAL, "read offset overflow");
    let reply = client.request(CMD_WRITE, 0, SIZE, 4096, &[1u8; 4096]);
    expect_error(&mut client, reply, ENOSPC, "write past end");
    let reply = client.request(CMD_WRITE_ZEROES, 0, SIZE - 512, 4096, &[]);
    expect_error(&mut client, reply, ENOSPC, "zero past end");
    let reply = client.request(CMD_TRIM, 0, SIZE, 512, &[]);
    expect_error(&mut client, reply, EINVAL, "trim past end");
    let reply = client.request(CMD_WRITE, 0, 100, 512, &[1u8; 512]);
    expect_error(&mut client, reply, EINVAL, "unaligned write");
    let reply = client.request(CMD_READ, 0, 0, 100, &[]);
    expect_error(&mut client, reply, EINVAL, "unaligned read");
    let reply = client.request(CMD_READ, 0, 0, 32 * MIB + 512, &[]);
    expect_error(
        &mut client,
        reply,
        EINVAL,
        "read past end of a small export",
    );
    let reply = client.request(42, 0, 0, 0, &[]);
    expect_error(&mut client, reply, EINVAL, "unknown command");
    let reply = client.request(CMD_READ, FLAG_NO_HOLE, 0, 512, &[]);
    expect_error(&mut client, reply, EINVAL, "NO_HOLE on READ");
    let reply = client.request(CMD_WRITE, 0x8000, 0, 512, &[0u8; 512]);
    expect_error(&mut client, reply, EINVAL, "unknown flag on WRITE");
    let reply = client.request(CMD_BLOCK_STATUS, 0, 0, 4096, &[]);
    expect_error(&mut client, reply, EINVAL, "block status without context");
    // Export failures map through the one errno function.
    for (kind, error) in [
        (ErrorKind::NoSpace, ENOSPC),
        (ErrorKind::Io, EIO),
        (ErrorKind::PermissionDenied, EPERM),
    ] {
        disk.set_fault(Some(kind));
        let reply = client.request(CMD_WRITE, 0, 0, 512, &[0u8; 512]);
        disk.set_fault(None);
        expect_error(&mut client, reply, error, "injected fault");
    }
    disk.set_fault(Some(ErrorKind::Io));
    let reply = client.request(CMD_READ, 0, 0, 4096, &[]);
    disk.set_fault(None);
    assert_eq!(reply.error, EIO);
    assert!(reply.data.is_empty());
    // Largest READ and WRITE.
    let big = pattern(2, 32 * MIB as usize);
    let disk_big = Arc::new(MemoryExport::new("big", 64 * MIB));
    _server.exports.insert(disk_big);
    client.disconnect();
    let (mut client, _, _, _) = Client::negotiate(&_server.socket, "big", mode, false);
    client.write(0, &big);
    assert!(client.read(0, 32 * MIB) == big);
    let reply = client.request(CMD_READ, 0, 0, 32 * MIB + 512, &[]);
    expect_error(&mut client, reply, EOVERFLOW, "read above the maximum");
    client.disconnect();
}

#[test]
fn every_command_with_simple_replies() {
    exercise(Mode::Simple);
}

#[test]
fn every_command_with_structured_replies() {
    exercise(Mode::Structured);
}

#[test]
fn every_command_with_extended_headers() {
    exercise(Mode::Extended);
}

#[test]
fn read_only_export_refuses_writes_with_eperm() {
    let disk = Arc::new(MemoryExport::new("ro", MIB).with_read_only(true));
    let server = TestServer::start(vec![disk]);
    let (mut client, _, flags, _) =
        Client::negotiate(&server.socket, "ro", Mode::Structured, false);
    assert_ne!(flags & TF_READ_ONLY, 0);
    let reply = client.request(CMD_WRITE, 0, 0, 4096, &[1u8; 4096]);
    expect_error(&mut client, reply, EPERM, "write");
    let reply = client.request(CMD_TRIM, 0, 0, 4096, &[]);
    expect_error(&mut client, reply, EPERM, "trim");
    let reply = client.request(CMD_WRITE_ZEROES, 0, 0, 4096, &[]);
    expect_error(&mut client, reply, EPERM, "write zeroes");
    assert_eq!(client.request(CMD_FLUSH, 0, 0, 0, &[]).error, 0);
}

#[test]
fn block_status_reports_allocation_with_and_without_req_one() {
    for mode in [Mode::Structured, Mode::Extended] {
        let (_server, disk, mut client, context) = setup(mode, true);
        disk.write_at(MIB, &[1u8; 128 * 1024], false).unwrap();
        disk.write_zeroes(
            4 * MIB,
            64 * 1024,
            nbd::ZeroOptions {
                may_trim: false,
                ..Default::default()
            },
        )
        .unwrap();
        let reply = client.request(CMD_BLOCK_STATUS, 0, 0, 8 * MIB, &[]);
        assert_eq!(reply.error, 0);
        let expected_type = if mode == Mode::Extended {
            CHUNK_BLOCK_STATUS_EXT
        } else {
            CHUNK_BLOCK_STATUS
        };
        assert_eq!(reply.chunk_types, vec![expected_type]);
        let (id, extents) = &reply.block_status[0];
        assert_eq!(*id, context);
        assert_eq!(
            extents,
            &vec![
                (MIB, 3),
                (128 * 1024, 0),
                (3 * MIB - 128 * 1024, 3),
                (64 * 1024, 2),
                (4 * MIB - 64 * 1024, 3),
            ]
        );
        // REQ_ONE: exactly one extent, not longer than the request.
        let reply = client.request(CMD_BLOCK_STATUS, FLAG_REQ_ONE, MIB - 4096, 8192, &[]);
        assert_eq!(reply.block_status[0].1, vec![(4096, 3)]);
        let reply = client.request(CMD_BLOCK_STATUS, FLAG_REQ_ONE, MIB, 8 * MIB, &[]);
        assert_eq!(reply.block_status[0].1, vec![(128 * 1024, 0)]);
        // Unaligned, past the end, and zero length are EINVAL.
        for (offset, length) in [(100, 512), (SIZE - 512, 1024), (0, 0)] {
            let reply = client.request(CMD_BLOCK_STATUS, 0, offset, length, &[]);
            expect_error(&mut client, reply, EINVAL, "bad block status");
        }
        // A read over data and holes is still one data chunk.
        let reply = client.request(CMD_READ, 0, MIB - 4096, 8192, &[]);
        assert_eq!(&reply.data[..4096], &[0u8; 4096]);
        assert_eq!(&reply.data[4096..], &[1u8; 4096]);
    }
}

#[test]
fn pipelined_requests_are_answered_by_cookie() {
    let (_server, _disk, mut client, _) = setup(Mode::Structured, false);
    let mut writes = std::collections::HashMap::new();
    for index in 0..200u64 {
        let data = pattern(index, 16 * 1024);
        let cookie = client.send_request(CMD_WRITE, 0, index * 16 * 1024, 16 * 1024, &data);
        writes.insert(cookie, index);
    }
    for _ in 0..200 {
        let reply = client.read_completed();
        assert_eq!(reply.error, 0);
        assert!(writes.remove(&reply.cookie).is_some());
    }
    let mut reads = std::collections::HashMap::new();
    for index in 0..200u64 {
        let cookie = client.send_request(CMD_READ, 0, index * 16 * 1024, 16 * 1024, &[]);
        reads.insert(cookie, index);
    }
    for _ in 0..200 {
        let reply = client.read_completed();
        let index = reads.remove(&reply.cookie).expect("known cookie");
        assert_eq!(reply.data, pattern(index, 16 * 1024));
    }
    client.disconnect();
}

#[test]
fn extended_headers_carry_64_bit_lengths_and_payload_flag() {
    let big = Arc::new(MemoryExport::new("huge", 8 << 30));
    let server = TestServer::start(vec![big.clone()]);
    let (mut client, size, _, _) = Client::negotiate(&server.socket, "huge", Mode::Extended, true);
    assert_eq!(size, 8 << 30);
    client.write(0, &[1u8; 65536]);
    client.write((6 << 30) - 65536, &[2u8; 65536]);
    // One block-status request over more than 4 GiB, answered in 64-bit descriptors.
    let reply = client.request(CMD_BLOCK_STATUS, 0, 0, 6 << 30, &[]);
    assert_eq!(
        reply.block_status[0].1,
        vec![(65536, 0), ((6 << 30) - 2 * 65536, 3), (65536, 0)]
    );
    // A 6 GiB WRITE_ZEROES in one request.
    let reply = client.request(CMD_WRITE_ZEROES, 0, 0, 6 << 30, &[]);
    assert_eq!(reply.error, 0);
    assert_eq!(big.allocated_block_count(), 0);
    // WRITE with PAYLOAD_LEN, as qemu sends it.
    let reply = client.request(CMD_WRITE, FLAG_PAYLOAD_LEN, 4096, 4096, &[3u8; 4096]);
    assert_eq!(reply.error, 0);
    assert_eq!(client.read(4096, 4096), vec![3u8; 4096]);
    // PAYLOAD_LEN on a command without payload: payload skipped, EINVAL, connection fine.
    let reply = client.request(CMD_FLUSH, FLAG_PAYLOAD_LEN, 0, 100, &[7u8; 100]);
    expect_error(&mut client, reply, EINVAL, "payload on flush");
    client.disconnect();
}

//! Unit tests for protocol.rs: every encoder against hand-written bytes, every parser against
//! good, truncated, oversize and garbage input.
#![allow(clippy::big_endian_bytes)]

use super::*;

#[test]
fn greeting_has_both_magics_and_our_flags() {
    let greeting = encode_greeting();
    assert_eq!(&greeting[0..8], b"NBDMAGIC");
    assert_eq!(&greeting[8..16], b"IHAVEOPT");
    assert_eq!(&greeting[16..18], &[0, 3]);
}

#[test]
fn client_flags_accept_known_bits_and_reject_others() {
    let flags = parse_client_flags([0, 0, 0, 3]).unwrap();
    assert!(flags.fixed_newstyle && flags.no_zeroes);
    let flags = parse_client_flags([0, 0, 0, 0]).unwrap();
    assert!(!flags.fixed_newstyle && !flags.no_zeroes);
    assert!(parse_client_flags([0, 0, 0, 4]).is_err());
    assert!(parse_client_flags([0x80, 0, 0, 1]).is_err());
}

#[test]
fn option_header_round_trips_and_checks_magic() {
    let header = OptionHeader {
        code: option::GO,
        length: 77,
    };
    let bytes = header.encode();
    assert_eq!(&bytes[0..8], b"IHAVEOPT");
    assert_eq!(&bytes[8..16], &[0, 0, 0, 7, 0, 0, 0, 77]);
    assert_eq!(OptionHeader::parse(&bytes).unwrap(), header);
    let mut bad = bytes;
    bad[0] = b'X';
    assert!(matches!(
        OptionHeader::parse(&bad),
        Err(Error::BadMagic { .. })
    ));
}

#[test]
fn option_reply_layout() {
    let bytes = encode_option_reply(option::LIST, reply::ERR_UNSUP, b"hi");
    assert_eq!(&bytes[0..8], &OPTION_REPLY_MAGIC.to_be_bytes());
    assert_eq!(&bytes[8..12], &3u32.to_be_bytes());
    assert_eq!(&bytes[12..16], &0x8000_0001u32.to_be_bytes());
    assert_eq!(&bytes[16..20], &2u32.to_be_bytes());
    assert_eq!(&bytes[20..], b"hi");
}

#[test]
fn export_request_round_trips() {
    let request = ExportRequest {
        name: "vol0".into(),
        info_requests: vec![info::NAME, info::BLOCK_SIZE],
    };
    let bytes = request.encode();
    assert_eq!(bytes.len(), 4 + 4 + 2 + 4);
    assert_eq!(ExportRequest::parse(&bytes).unwrap(), request);
}

#[test]
fn export_request_rejects_bad_lengths() {
    // Name length larger than the data.
    let mut bytes = ExportRequest {
        name: "ab".into(),
        info_requests: vec![],
    }
    .encode();
    bytes[3] = 200;
    assert!(ExportRequest::parse(&bytes).is_err());
    // Count that disagrees with the data.
    let mut bytes = ExportRequest {
        name: "ab".into(),
        info_requests: vec![1],
    }
    .encode();
    bytes[7] = 9;
    assert!(ExportRequest::parse(&bytes).is_err());
    // Trailing byte.
    let mut bytes = ExportRequest {
        name: String::new(),
        info_requests: vec![],
    }
    .encode();
    bytes.push(0);
    assert!(ExportRequest::parse(&bytes).is_err());
    // Empty and tiny inputs.
    for length in 0..6 {
        assert!(ExportRequest::parse(&vec![0u8; length]).is_err());
    }
    // Name longer than the string limit.
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&5000u32.to_be_bytes());
    bytes.extend_from_slice(&[b'a'; 5000]);
    bytes.extend_from_slice(&[0, 0]);
    assert!(matches!(
        ExportRequest::parse(&bytes),
        Err(Error::TooLong { .. })
    ));
}

#[test]
fn strings_must_be_utf8_without_nul() {
    assert_eq!(parse_string(b"abc").unwrap(), "abc");
    assert!(parse_string(b"a\0c").is_err());
    assert!(parse_string(&[0xff, 0xfe]).is_err());
    assert!(parse_string(&[b'x'; STRING_LENGTH_MAX + 1]).is_err());
    assert!(parse_string(&[b'x'; STRING_LENGTH_MAX]).is_ok());
}

#[test]
fn meta_context_request_round_trips() {
    let request = MetaContextRequest {
        export_name: "e".into(),
        queries: vec!["base:allocation".into(), "qemu:".into()],
    };
    assert_eq!(
        MetaContextRequest::parse(&request.encode()).unwrap(),
        request
    );
    let empty = MetaContextRequest {
        export_name: String::new(),
        queries: vec![],
    };
    assert_eq!(MetaContextRequest::parse(&empty.encode()).unwrap(), empty);
}

#[test]
fn meta_context_request_rejects_huge_counts_without_allocating() {
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&0u32.to_be_bytes());
    bytes.extend_from_slice(&u32::MAX.to_be_bytes());
    assert!(MetaContextRequest::parse(&bytes).is_err());
    // A query whose length runs past the data.
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&0u32.to_be_bytes());
    bytes.extend_from_slice(&1u32.to_be_bytes());
    bytes.extend_from_slice(&100u32.to_be_bytes());
    bytes.extend_from_slice(b"base:");
    assert!(MetaContextRequest::parse(&bytes).is_err());
}

#[test]
fn info_items_have_spec_lengths() {
    let export = encode_info_export(1 << 30, 0x1234);
    assert_eq!(export.len(), 12);
    assert_eq!(&export[0..2], &[0, 0]);
    assert_eq!(&export[2..10], &(1u64 << 30).to_be_bytes());
    assert_eq!(&export[10..12], &[0x12, 0x34]);
    let block = encode_info_block_size(512, 4096, 32 << 20);
    assert_eq!(block.len(), 14);
    assert_eq!(&block[0..2], &[0, 3]);
    assert_eq!(&block[2..6], &512u32.to_be_bytes());
    let name = encode_info_string(info::NAME, "abc");
    assert_eq!(name, vec![0, 1, b'a', b'b', b'c']);
    let long = "é".repeat(3000);
    let truncated = encode_info_string(info::DESCRIPTION, &long);
    assert!(truncated.len() - 2 <= STRING_LENGTH_MAX);
    assert!(std::str::from_utf8(&truncated[2..]).is_ok());
}

#[test]
fn server_and_meta_context_replies() {
    assert_eq!(
        encode_server_reply("ab", "d"),
        vec![0, 0, 0, 2, b'a', b'b', b'd']
    );
    assert_eq!(
        encode_meta_context_reply(7, "base:allocation")[..4],
        [0, 0, 0, 7]
    );
}

#[test]
fn export_name_reply_padding_depends_on_no_zeroes() {
    assert_eq!(encode_export_name_reply(1, 1, true).len(), 10);
    let padded = encode_export_name_reply(1, 1, false);
    assert_eq!(padded.len(), 134);
    assert!(padded[10..].iter().all(|&b| b == 0));
}

#[test]
fn compact_request_round_trips() {
    let request = Request {
        flags: command_flags::FUA,
        command: command::WRITE,
        cookie: 0xdead_beef_0000_0001,
        offset: 4096,
        length: 512,
    };
    let bytes = request.encode(HeaderStyle::Compact);
    assert_eq!(bytes.len(), COMPACT_REQUEST_SIZE);
    assert_eq!(&bytes[0..4], &[0x25, 0x60, 0x95, 0x13]);
    assert_eq!(
        Request::parse(HeaderStyle::Compact, &bytes).unwrap(),
        request
    );
}

#[test]
fn extended_request_round_trips_with_64_bit_length() {
    let request = Request {
        flags: 0,
        command: command::TRIM,
        cookie: 9,
        offset: 1 << 40,
        length: 1 << 33,
    };
    let bytes = request.encode(HeaderStyle::Extended);
    assert_eq!(bytes.len(), EXTENDED_REQUEST_SIZE);
    assert_eq!(&bytes[0..4], &[0x21, 0xe4, 0x1c, 0x71]);
    assert_eq!(
        Request::parse(HeaderStyle::Extended, &bytes).unwrap(),
        request
    );
}

#[test]
fn request_with_wrong_magic_or_size_is_rejected() {
    let request = Request {
        flags: 0,
        command: 0,
        cookie: 0,
        offset: 0,
        length: 0,
    };
    let compact = request.encode(HeaderStyle::Compact);
    assert!(Request::parse(HeaderStyle::Extended, &compact).is_err());
    let extended = request.encode(HeaderStyle::Extended);
    assert!(matches!(
        Request::parse(HeaderStyle::Compact, &extended[..28]),
        Err(Error::BadMagic { .. })
    ));
    assert!(Request::parse(HeaderStyle::Compact, &compact[..27]).is_err());
}

#[test]
fn simple_reply_layout() {
    let bytes = encode_simple_reply(errno::EINVAL, 0x0102_0304_0506_0708);
    assert_eq!(&bytes[0..4], &[0x67, 0x44, 0x66, 0x98]);
    assert_eq!(&bytes[4..8], &[0, 0, 0, 22]);
    assert_eq!(&bytes[8..16], &[1, 2, 3, 4, 5, 6, 7, 8]);
}

#[test]
fn chunk_headers_in_both_styles() {
    let header = ChunkHeader {
        flags: REPLY_FLAG_DONE,
        chunk_type: chunk::OFFSET_DATA,
        cookie: 5,
        offset: 1024,
        payload_length: 8 + 512,
    };
    let compact = header.encode(HeaderStyle::Compact);
    assert_eq!(compact.as_slice().len(), 20);
    assert_eq!(&compact.as_slice()[0..4], &[0x66, 0x8e, 0x33, 0xef]);
    assert_eq!(&compact.as_slice()[4..8], &[0, 1, 0, 1]);
    assert_eq!(&compact.as_slice()[16..20], &520u32.to_be_bytes());
    let extended = header.encode(HeaderStyle::Extended);
    assert_eq!(extended.as_slice().len(), 32);
    assert_eq!(&extended.as_slice()[0..4], &[0x6e, 0x8a, 0x27, 0x8c]);
    assert_eq!(&extended.as_slice()[16..24], &1024u64.to_be_bytes());
    assert_eq!(&extended.as_slice()[24..32], &520u64.to_be_bytes());
}

#[test]
fn error_payload_truncates_long_messages() {
    let payload = encode_error_payload(errno::EIO, "bad");
    assert_eq!(payload, vec![0, 0, 0, 5, 0, 3, b'b', b'a', b'd']);
    let long = "x".repeat(10_000);
    let payload = encode_error_payload(errno::EIO, &long);
    assert_eq!(payload.len(), 6 + STRING_LENGTH_MAX);
}

#[test]
fn block_status_payloads() {
    let descriptors = [
        Descriptor {
            length: 4096,
            flags: state::HOLE | state::ZERO,
        },
        Descriptor {
            length: 512,
            flags: 0,
        },
    ];
    let compact = encode_block_status(HeaderStyle::Compact, 1, &descriptors);
    assert_eq!(
        compact,
        vec![0, 0, 0, 1, 0, 0, 16, 0, 0, 0, 0, 3, 0, 0, 2, 0, 0, 0, 0, 0]
    );
    let extended = encode_block_status(HeaderStyle::Extended, 1, &descriptors);
    assert_eq!(extended.len(), 8 + 32);
    assert_eq!(&extended[4..8], &2u32.to_be_bytes());
    assert_eq!(&extended[8..16], &4096u64.to_be_bytes());
    assert_eq!(&extended[16..24], &3u64.to_be_bytes());
}

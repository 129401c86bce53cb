//! Unit tests for nbd_client.rs: the bytes the encoders produce.

use super::*;

#[test]
fn request_headers_have_the_documented_layout() {
    let compact = request_header(Mode::Simple, CMD_WRITE, FLAG_FUA, 7, 4096, 512);
    assert_eq!(compact.len(), 28);
    assert_eq!(be32(&compact), REQUEST_MAGIC);
    assert_eq!(be16(&compact[4..]), FLAG_FUA);
    assert_eq!(be16(&compact[6..]), CMD_WRITE);
    assert_eq!(be64(&compact[8..]), 7);
    assert_eq!(be64(&compact[16..]), 4096);
    assert_eq!(be32(&compact[24..]), 512);
    let extended = request_header(Mode::Extended, CMD_READ, 0, 9, 0, 1 << 40);
    assert_eq!(extended.len(), 32);
    assert_eq!(be32(&extended), EXTENDED_REQUEST_MAGIC);
    assert_eq!(be64(&extended[24..]), 1 << 40);
}

#[test]
fn option_and_export_request_bytes() {
    let option = option_bytes(OPT_GO, &export_request("ab", &[INFO_BLOCK_SIZE]));
    assert_eq!(be64(&option), IHAVEOPT);
    assert_eq!(be32(&option[8..]), OPT_GO);
    assert_eq!(be32(&option[12..]), 10);
    assert_eq!(&option[16..], &[0, 0, 0, 2, b'a', b'b', 0, 1, 0, 3]);
}

//! Goal: what the event loop saves per visit works as claimed. Method: inputs on socket
//! pairs. The input buffer a worker takes from a parked connection is lent to the next one
//! it visits, which reads only its own bytes (`Input::release_buffer`, `lend_buffer`); a
//! look for more requests that finds nothing, or does not look, says that nothing is
//! expected (`Input::nothing_expected`, which lets the loop park without a `recv`).

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use super::{Input, INPUT_BUFFER_BYTES};
use crate::stream::Stream;

/// An input on one end of a socket pair, and the client's end.
fn input() -> (Input, UnixStream) {
    let (server, client) = UnixStream::pair().unwrap();
    (
        Input::new(Arc::new(Stream::Unix(server)), 4, Duration::ZERO),
        client,
    )
}

/// Receives what the client sent, waiting for it.
fn receive_all(input: &mut Input, length: usize) {
    input.fill(length, false, true).unwrap();
    assert_eq!(input.buffered(), length);
}

#[test]
fn a_parked_connections_buffer_is_lent_to_the_next_connection_visited() {
    let mut spare = Vec::new();
    let (mut first, mut first_client) = input();
    first_client.write_all(b"first connection's bytes").unwrap();
    receive_all(&mut first, 24);
    first.consume(24);
    let first_buffer = first.buffer.as_ptr();
    first.release_buffer(&mut spare);
    assert!(
        first.buffer.is_empty(),
        "a parked connection holds no buffer"
    );
    assert_eq!(spare.len(), INPUT_BUFFER_BYTES);
    assert_eq!(spare.as_ptr(), first_buffer, "the worker keeps the buffer");

    // A second connection parked meanwhile: the worker holds one spare already, so its
    // buffer is freed.
    let (mut second, mut second_client) = input();
    second.release_buffer(&mut spare);
    assert!(second.buffer.is_empty());
    assert_eq!(spare.as_ptr(), first_buffer);

    // Visited: it gets the spare, and sees only its own client's bytes.
    second.lend_buffer(&mut spare);
    assert!(spare.is_empty());
    assert_eq!(second.buffer.as_ptr(), first_buffer);
    second_client.write_all(b"second").unwrap();
    receive_all(&mut second, 6);
    assert_eq!(second.consume(6), b"second");

    // With no spare, a visited connection allocates its own again.
    first.lend_buffer(&mut spare);
    first_client.write_all(b"again").unwrap();
    receive_all(&mut first, 5);
    assert_eq!(first.consume(5), b"again");
}

#[test]
fn a_buffer_holding_part_of_a_request_stays_with_its_connection() {
    let mut spare = Vec::new();
    let (mut input, mut client) = input();
    client.write_all(b"half a header").unwrap();
    receive_all(&mut input, 13);
    input.release_buffer(&mut spare);
    assert!(spare.is_empty(), "the worker took a buffer holding bytes");
    assert_eq!(input.consume(13), b"half a header");
}

#[test]
fn nothing_is_expected_after_a_look_for_more_finds_nothing() {
    let (mut input, mut client) = input();
    // The probe has no score yet: it skips, expecting nothing.
    assert!(!input.receive_more());
    assert!(input.nothing_expected);
    // Once tries find bytes, they go on, and one that finds nothing says so.
    input.more.record(true);
    client.write_all(b"more").unwrap();
    assert!(input.receive_more(), "the bytes sent were not found");
    assert!(!input.nothing_expected);
    input.consume(4);
    assert!(!input.receive_more());
    assert!(input.nothing_expected);
}

//! Goal: the server never serves more than `connections_max` connections at once, and a
//! refused connection frees nothing it should not: the served ones keep working and a slot
//! freed by a disconnect is reused.
//! Method: a limit of two; a third connection must be closed without a greeting; after one
//! served client disconnects, a new one gets through.

mod common;

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use nbd::{Config, MemoryExport};

#[test]
fn connections_beyond_the_limit_are_closed() {
    let config = Config {
        connections_max: 2,
        ..Default::default()
    };
    let server = TestServer::start_with(vec![Arc::new(MemoryExport::new("disk", MIB))], config);
    let (mut first, _, _, _) = Client::negotiate(&server.socket, "disk", Mode::Simple, false);
    let second = Client::start(&server.socket);
    let mut third = UnixStream::connect(&server.socket).unwrap();
    third
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut buffer = [0u8; 18];
    assert_eq!(
        third.read(&mut buffer).unwrap(),
        0,
        "third connection served"
    );
    first.write(0, &[1u8; 512]);
    drop(second);
    wait_for(
        "the second connection's slot to be freed",
        Duration::from_secs(5),
        || server.server.as_ref().unwrap().connection_count() <= 1,
    );
    let (mut fourth, _, _, _) = Client::negotiate(&server.socket, "disk", Mode::Simple, false);
    assert_eq!(fourth.read(0, 512), vec![1u8; 512]);
    first.disconnect();
    fourth.disconnect();
}

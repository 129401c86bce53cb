//! Goal: graceful shutdown stops accepting, answers requests already read, closes every
//! connection (in handshake or transmission), removes the socket file, and returns promptly;
//! the Unix socket is created with mode 0600; connection events are reported.
//! Method: connect clients in different phases, pipeline writes, shut the server down from
//! another thread, and check what each client sees and what reached the export.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use nbd::{Config, Event, Export, ExportMap, MemoryExport, Server};

#[test]
fn socket_is_private_and_shutdown_closes_everything() {
    let disk = Arc::new(MemoryExport::new("disk", 8 * MIB));
    let events = Arc::new(Mutex::new(Vec::new()));
    let config = Config {
        on_event: Some({
            let events = events.clone();
            Arc::new(move |event: &Event| events.lock().unwrap().push(event.clone()))
        }),
        ..Default::default()
    };
    let mut server = TestServer::start_with(vec![disk.clone()], config);
    let mode = std::fs::metadata(&server.socket)
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "socket mode {mode:o}");

    let (mut serving, _, _, _) = Client::negotiate(&server.socket, "disk", Mode::Simple, false);
    serving.write(0, &[1u8; 4096]);
    let mut handshaking = Client::start(&server.socket);
    // Pipeline writes, then shut down while they may still be in flight.
    for index in 0..32u64 {
        serving.send_request(CMD_WRITE, 0, index * 4096, 4096, &[2u8; 4096]);
    }
    let started = Instant::now();
    let stopper = {
        let server = server.server.take().unwrap();
        std::thread::spawn(move || server.shutdown())
    };
    // Every reply that arrives is a success for a write that reached the export.
    let mut answered = 0;
    loop {
        let mut magic = [0u8; 16];
        match std::io::Read::read_exact(&mut serving.stream, &mut magic) {
            Ok(()) => {
                assert_eq!(be32(&magic[4..]), 0, "error reply during shutdown");
                answered += 1;
            }
            Err(_) => break,
        }
    }
    assert!(answered <= 32);
    assert!(handshaking.is_closed());
    stopper.join().unwrap();
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(!server.socket.exists(), "socket file left behind");
    assert!(std::os::unix::net::UnixStream::connect(&server.socket).is_err());
    let mut buffer = vec![0u8; 4096];
    disk.read_at(0, &mut buffer).unwrap();
    assert!(buffer.iter().all(|&b| b == 1 || b == 2));
    let events = events.lock().unwrap();
    assert!(events
        .iter()
        .any(|event| matches!(event, Event::Serving { export, .. } if export == "disk")));
    let connected = events
        .iter()
        .filter(|event| matches!(event, Event::Connected { .. }))
        .count();
    let disconnected = events
        .iter()
        .filter(|event| matches!(event, Event::Disconnected { .. }))
        .count();
    assert_eq!(connected, disconnected, "{events:?}");
}

#[test]
fn shutdown_handle_and_drop_stop_the_server() {
    let dir = ScratchDir::new("nbd-shutdown-handle");
    let exports = Arc::new(ExportMap::new());
    exports.insert(Arc::new(MemoryExport::new("disk", MIB)));
    let mut server = Server::new(exports.clone(), Config::default());
    let socket = dir.join("a.sock");
    server.listen_unix(&socket).unwrap();
    let address = server.listen_tcp("127.0.0.1:0").unwrap();
    // A second listener on the same path fails cleanly.
    let mut other = Server::new(exports, Config::default());
    assert!(other.listen_unix(&socket).is_err());
    drop(other);
    let (mut client, _, _, _) = Client::negotiate(&socket, "disk", Mode::Structured, false);
    client.write(0, &[3u8; 512]);
    let handle = server.shutdown_handle();
    handle.request();
    assert!(client.is_closed());
    drop(server);
    assert!(!socket.exists());
    assert!(std::net::TcpStream::connect(address).is_err());
}

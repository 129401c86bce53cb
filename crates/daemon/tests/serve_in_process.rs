//! Goal: the daemon runs in-process as the library its binary calls: `Serving::start` serves
//! a pool's volumes on a Unix socket and its control socket; writes through NBD read back,
//! also on a volume created through the control socket while serving (the management path
//! `thinpool volume create` takes when a server holds the pool); `Serving::stop` commits, so
//! the data is there when the pool is opened again.
//!
//! Method: a pool made with `create::create_pool` in a scratch directory, a volume made with
//! `control::perform` (the pool is not held yet, so it opens it directly), `serve::Args`
//! parsed from the same words `thinpool serve` takes; the raw test client of `testkit`
//! speaks NBD to it. No process is spawned and no signal is sent.

use std::process::ExitCode;

use clap::Parser;
use testkit::nbd_client::Client;
use testkit::scratch::ScratchDir;
use thin_pool::{CreateOptions, Pool};
use thinpool_daemon::control::{self, Outcome, Request};
use thinpool_daemon::create::create_pool;
use thinpool_daemon::pool_dir::{PoolArg, StoredOptions};
use thinpool_daemon::serve::{Args, Serving};

const MIB: u64 = 1 << 20;

/// `thinpool serve`'s arguments, parsed as the binary parses them.
#[derive(Parser)]
struct ServeCommand {
    #[command(flatten)]
    serve: Args,
}

fn pattern(seed: u8, length: usize) -> Vec<u8> {
    (0..length)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn serving_in_process_writes_read_back_and_survive_stop() {
    let scratch = ScratchDir::new("daemon-in-process");
    let pool_path = scratch.join("pool");
    let dir = PoolArg {
        pool: Some(pool_path.clone()),
        allow_shared_dir: false,
    }
    .resolve();
    let create = CreateOptions {
        data_size_bytes: 64 * MIB,
        block_size_bytes: 64 << 10,
        metadata_size_bytes: None,
    };
    create_pool(&dir, &create, StoredOptions::default()).expect("create the pool");
    let made = control::ask(
        &dir,
        &Request::CreateVolume {
            name: "first".into(),
            size_bytes: 8 * MIB,
        },
    )
    .expect("create a volume with no server");
    assert!(
        matches!(made, Outcome::Volume(ref v) if v.name == "first"),
        "{made:?}"
    );

    let args = ServeCommand::try_parse_from(["serve", "--pool", pool_path.to_str().unwrap()])
        .expect("serve's arguments parse")
        .serve;
    let serving = Serving::start(&args, Vec::new()).expect("start serving");
    assert_eq!(serving.nbd_socket(), pool_path.join("nbd.sock"));
    assert!(serving.tcp_address().is_none());

    let first = pattern(1, 128 << 10);
    let mut client = Client::open(serving.nbd_socket(), "first");
    client.write(MIB, &first);
    client.flush();
    assert_eq!(client.read(MIB, first.len() as u64), first);

    // Held by the server, the pool is managed through its control socket.
    let made = control::ask(
        &dir,
        &Request::CreateVolume {
            name: "second".into(),
            size_bytes: 4 * MIB,
        },
    )
    .expect("create a volume through the server");
    assert!(
        matches!(made, Outcome::Volume(ref v) if v.name == "second"),
        "{made:?}"
    );
    let listed = control::call(serving.control_socket(), &Request::List)
        .expect("reach the control socket")
        .expect("list");
    let Outcome::Volumes(volumes) = listed else {
        panic!("list answered {listed:?}");
    };
    let mut names: Vec<&str> = volumes.iter().map(|v| v.name.as_str()).collect();
    names.sort_unstable();
    assert_eq!(names, ["first", "second"]);
    let second = pattern(2, 64 << 10);
    let mut other = Client::open(serving.nbd_socket(), "second");
    other.write(0, &second);
    assert_eq!(other.read(0, second.len() as u64), second);
    other.disconnect();
    client.disconnect();

    assert_eq!(serving.stop(), ExitCode::SUCCESS);
    assert!(
        !pool_path.join("control.sock").exists(),
        "control socket left"
    );

    let pool = Pool::open(&pool_path, StoredOptions::default().pool_options()).expect("reopen");
    let mut read = vec![0; first.len()];
    pool.volume("first").unwrap().read(MIB, &mut read).unwrap();
    assert_eq!(read, first);
    let mut read = vec![0; second.len()];
    pool.volume("second").unwrap().read(0, &mut read).unwrap();
    assert_eq!(read, second);
    pool.close().unwrap();
}

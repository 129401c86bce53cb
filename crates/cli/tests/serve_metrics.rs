//! Goal: `serve --metrics` answers `GET /metrics` with every metric the README lists, and
//! its counts are what the clients did: bytes and requests exactly as nbdcopy and fio report
//! them, mapped bytes as written, one mode at 1, the connection gauge up while clients are
//! connected and back to 0 after; bad requests get 4xx and the listener keeps serving.
//!
//! Method: a pool served with `--metrics 127.0.0.1:0` (the banner gives the address); curl
//! scrapes it before any I/O, after nbdcopy writes a known 8 MiB and reads the whole volume
//! back (`--no-extents`, so every byte is read), during and after a fio run on two
//! connections (fio's JSON gives the bytes and requests it completed), and after a series
//! of hostile requests sent by hand (garbage, oversize, silent).

mod e2e_support;

use e2e_support::*;
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Every metric name the README promises (histograms by their `_count` series).
const NAMES: [&str; 15] = [
    "thinpool_data_size_bytes",
    "thinpool_data_used_bytes",
    "thinpool_metadata_size_bytes",
    "thinpool_metadata_used_bytes",
    "thinpool_mode",
    "thinpool_needs_check",
    "thinpool_transaction_id",
    "thinpool_commits_total",
    "thinpool_commit_duration_seconds_count",
    "thinpool_volume_mapped_bytes",
    "thinpool_volume_read_bytes_total",
    "thinpool_volume_written_bytes_total",
    "thinpool_volume_requests_total",
    "thinpool_request_duration_seconds_count",
    "thinpool_nbd_connections",
];

const VOLUME_BYTES: u64 = 64 * MIB;

/// One scrape: series (name with labels, as printed) → value.
#[derive(Debug)]
struct Scrape(BTreeMap<String, f64>);

impl Scrape {
    fn parse(text: &str) -> Scrape {
        let mut series = BTreeMap::new();
        for line in text.lines().filter(|line| !line.starts_with('#')) {
            let (name, value) = line
                .rsplit_once(' ')
                .unwrap_or_else(|| panic!("bad line {line:?}"));
            let value: f64 = value
                .parse()
                .unwrap_or_else(|_| panic!("bad value in {line:?}"));
            assert!(
                series.insert(name.to_string(), value).is_none(),
                "{name} twice"
            );
        }
        Scrape(series)
    }

    #[track_caller]
    fn value(&self, series: &str) -> f64 {
        *self
            .0
            .get(series)
            .unwrap_or_else(|| panic!("no series {series} in {:#?}", self.0))
    }

    fn volume(&self, name: &str, volume: &str) -> u64 {
        self.value(&format!("{name}{{volume=\"{volume}\"}}")) as u64
    }

    fn requests(&self, volume: &str, op: &str) -> u64 {
        self.value(&format!(
            "thinpool_volume_requests_total{{volume=\"{volume}\",op=\"{op}\"}}"
        )) as u64
    }

    fn connections(&self) -> u64 {
        self.value("thinpool_nbd_connections") as u64
    }
}

/// `curl URL` and the answer's status code and body.
fn curl(args: &[&str]) -> (u16, String) {
    let mut all = vec!["-sS", "--max-time", "30", "-w", "\n%{http_code}"];
    all.extend_from_slice(args);
    let out = run_ok("curl", &all, Duration::from_secs(60));
    let (body, code) = out.rsplit_once('\n').expect("curl printed a status");
    (code.parse().expect("a status code"), body.to_string())
}

fn scrape(url: &str) -> Scrape {
    let (code, body) = curl(&[url]);
    assert_eq!(code, 200, "{body}");
    Scrape::parse(&body)
}

fn metrics_url(served: &Served) -> String {
    served
        .banner
        .lines()
        .find_map(|line| line.trim().strip_prefix("metrics:"))
        .unwrap_or_else(|| panic!("no metrics line in the banner:\n{}", served.banner))
        .trim()
        .to_string()
}

/// What fio did: `(read bytes, write bytes, read requests, write requests)`.
fn fio_load(uri: &str) -> (u64, u64, u64, u64) {
    let uri_arg = format!("--uri={uri}");
    let args = [
        "--name=load",
        "--ioengine=nbd",
        uri_arg.as_str(),
        "--rw=randrw",
        "--bs=4k",
        "--size=32m",
        "--offset_increment=32m",
        "--numjobs=2",
        "--iodepth=8",
        "--time_based",
        "--runtime=3",
        "--randseed=77",
        "--group_reporting",
        "--output-format=json",
    ];
    let out = run_ok("fio", &args, Duration::from_secs(120));
    let json: serde_json::Value = serde_json::from_str(&out[out.find('{').expect("json")..])
        .unwrap_or_else(|e| panic!("fio's JSON: {e}\n{out}"));
    let job = &json["jobs"][0];
    let field = |direction: &str, name: &str| {
        job[direction][name]
            .as_u64()
            .unwrap_or_else(|| panic!("no {direction}.{name} in {job}"))
    };
    (
        field("read", "io_bytes"),
        field("write", "io_bytes"),
        field("read", "total_ios"),
        field("write", "total_ios"),
    )
}

/// Sends `request` on a new connection and returns what the server answered.
fn raw_request(address: &str, request: &[u8]) -> String {
    let mut stream = TcpStream::connect(address).expect("connect to the metrics listener");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    // The server may answer (and close) before taking all of an oversize request.
    let _ = stream.write_all(request);
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    String::from_utf8_lossy(&answer).into_owned()
}

#[test]
fn metrics_count_what_clients_did() {
    require_tool("curl", "curl");
    require_tool("fio", "fio");
    require_tool("nbdcopy", "libnbd-bin");
    let temp = ScratchDir::new("serve-metrics");
    let pool = temp.join("pool");
    create_pool(&pool, &["--data-size", "256M"]);
    create_volume(&pool, "m", "64M");
    let served = serve(&pool, &["--metrics", "127.0.0.1:0"]);
    let url = metrics_url(&served);
    let uri = served.uri("m");

    // Before any I/O: every name, one mode, nothing counted.
    let (code, body) = curl(&[&url]);
    assert_eq!(code, 200);
    for name in NAMES {
        assert!(
            body.lines().any(|line| line.starts_with(name)),
            "{name} missing:\n{body}"
        );
    }
    let first = Scrape::parse(&body);
    let modes: Vec<(&String, &f64)> = first
        .0
        .iter()
        .filter(|(series, _)| series.starts_with("thinpool_mode{"))
        .collect();
    assert_eq!(modes.len(), 5, "{modes:?}");
    assert_eq!(
        modes.iter().filter(|(_, value)| **value == 1.0).count(),
        1,
        "{modes:?}"
    );
    assert_eq!(first.value("thinpool_mode{mode=\"rw\"}"), 1.0);
    assert_eq!(first.value("thinpool_needs_check"), 0.0);
    assert_eq!(first.value("thinpool_data_size_bytes"), (256 * MIB) as f64);
    assert_eq!(first.connections(), 0);
    assert_eq!(first.volume("thinpool_volume_mapped_bytes", "m"), 0);
    assert_eq!(first.volume("thinpool_volume_written_bytes_total", "m"), 0);
    let commits_before = first.value("thinpool_commits_total");

    // nbdcopy: a known 8 MiB written, then all 64 MiB read back.
    let source = temp.join("source");
    std::fs::write(&source, pattern(11, 8 * MIB as usize)).unwrap();
    run_ok(
        "nbdcopy",
        &["--flush", source.to_str().unwrap(), &uri],
        Duration::from_secs(60),
    );
    let copy = temp.join("copy");
    run_ok(
        "nbdcopy",
        &["--no-extents", &uri, copy.to_str().unwrap()],
        Duration::from_secs(60),
    );
    assert_eq!(
        std::fs::read(&copy).unwrap()[..8 * MIB as usize],
        std::fs::read(&source).unwrap()[..]
    );
    wait_for(
        "nbdcopy's connections to end",
        Duration::from_secs(10),
        || scrape(&url).connections() == 0,
    );
    let copied = scrape(&url);
    assert_eq!(
        copied.volume("thinpool_volume_written_bytes_total", "m"),
        8 * MIB
    );
    assert_eq!(
        copied.volume("thinpool_volume_read_bytes_total", "m"),
        VOLUME_BYTES
    );
    assert_eq!(copied.volume("thinpool_volume_mapped_bytes", "m"), 8 * MIB);
    assert!(copied.requests("m", "write") >= 1);
    assert!(copied.requests("m", "read") >= 1);
    assert!(
        copied.requests("m", "flush") >= 1,
        "nbdcopy --flush flushes at the end"
    );
    assert_eq!(copied.requests("m", "trim"), 0);
    let commits = copied.value("thinpool_commits_total");
    assert!(commits > commits_before, "the flush committed");
    assert_eq!(
        copied.value("thinpool_commit_duration_seconds_count"),
        commits
    );
    assert!(copied.value("thinpool_data_used_bytes") >= (8 * MIB) as f64);
    for op in ["read", "write", "flush"] {
        let total: u64 = ["m"].iter().map(|volume| copied.requests(volume, op)).sum();
        assert_eq!(
            copied.value(&format!(
                "thinpool_request_duration_seconds_count{{op=\"{op}\"}}"
            )) as u64,
            total,
            "{op}"
        );
    }

    // fio on two connections, scraped while it runs.
    let fio = std::thread::spawn({
        let uri = uri.clone();
        move || fio_load(&uri)
    });
    let mut connections_seen = 0;
    let mut written_seen = copied.volume("thinpool_volume_written_bytes_total", "m");
    let deadline = Instant::now() + Duration::from_secs(120);
    while !fio.is_finished() {
        assert!(Instant::now() < deadline, "fio did not finish");
        let during = scrape(&url);
        connections_seen = connections_seen.max(during.connections());
        let written = during.volume("thinpool_volume_written_bytes_total", "m");
        assert!(written >= written_seen, "a counter went down");
        written_seen = written;
        std::thread::sleep(Duration::from_millis(100));
    }
    let (read_bytes, write_bytes, read_ios, write_ios) = fio.join().unwrap();
    assert!(read_bytes > 0 && write_bytes > 0, "fio did nothing");
    assert_eq!(connections_seen, 2, "fio's two connections were never seen");
    wait_for("fio's connections to end", Duration::from_secs(10), || {
        scrape(&url).connections() == 0
    });
    let after = scrape(&url);
    let delta = |name: &str| after.volume(name, "m") - copied.volume(name, "m");
    assert_eq!(delta("thinpool_volume_read_bytes_total"), read_bytes);
    assert_eq!(delta("thinpool_volume_written_bytes_total"), write_bytes);
    assert_eq!(
        after.requests("m", "read") - copied.requests("m", "read"),
        read_ios
    );
    assert_eq!(
        after.requests("m", "write") - copied.requests("m", "write"),
        write_ios
    );

    // Bad requests: refused, and the listener goes on serving.
    let address = url
        .strip_prefix("http://")
        .and_then(|rest| rest.strip_suffix("/metrics"))
        .expect("http://ADDR/metrics");
    assert_eq!(curl(&[&format!("http://{address}/other")]).0, 404);
    assert_eq!(curl(&["-X", "POST", &url]).0, 405);
    let answer = raw_request(address, b"\x00\x01garbage\r\n\r\n");
    assert!(answer.starts_with("HTTP/1.1 400 "), "{answer:?}");
    let huge = format!("GET /metrics HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(16384));
    let answer = raw_request(address, huge.as_bytes());
    assert!(answer.starts_with("HTTP/1.1 431 "), "{answer:?}");
    // A client that sends nothing holds the listener only until its timeout.
    let silent = TcpStream::connect(address).unwrap();
    let last = scrape(&url);
    drop(silent);
    assert_eq!(
        last.volume("thinpool_volume_read_bytes_total", "m"),
        after.volume("thinpool_volume_read_bytes_total", "m")
    );
    served.stop();
}

#[test]
fn metrics_stay_off_unless_asked() {
    let temp = ScratchDir::new("serve-metrics-off");
    let pool = temp.join("pool");
    create_pool(&pool, &["--data-size", "64M"]);
    let served = serve(&pool, &[]);
    assert!(!served.banner.contains("metrics:"), "{}", served.banner);
    served.stop();
    let help = thinpool_ok(&["serve", "--help"]);
    assert!(help.contains("--metrics <ADDR:PORT>"), "{help}");
    assert!(
        help.contains("curl http://127.0.0.1:9100/metrics"),
        "{help}"
    );
}

/// Issue 20, finding 9: the listener served one connection at a time, each up to its 5 s
/// deadline, so idle connections delayed a scrape by 5 s each (10 of them by 51 s, 40 by
/// 205 s). Now each connection has a thread, and one past the bound closes the oldest: a
/// scrape behind 40 idle connections is answered well within one connection's deadline
/// several times over (curl's limit below is 4 deadlines; serving them in turn takes 40).
/// At shutdown the listener stops and closes its connections.
#[test]
fn idle_connections_do_not_delay_a_scrape() {
    require_tool("curl", "curl");
    let temp = ScratchDir::new("serve-metrics-idle");
    let pool = temp.join("pool");
    create_pool(&pool, &["--data-size", "64M"]);
    create_volume(&pool, "m", "16M");
    let served = serve(&pool, &["--metrics", "127.0.0.1:0"]);
    let url = metrics_url(&served);
    let address = url
        .strip_prefix("http://")
        .and_then(|rest| rest.strip_suffix("/metrics"))
        .expect("http://ADDR/metrics")
        .to_string();
    for round in [10, 40] {
        let idle: Vec<TcpStream> = (0..round)
            .map(|_| TcpStream::connect(&address).expect("connect"))
            .collect();
        let out = run_ok(
            "curl",
            &["-sS", "--max-time", "20", "-w", "\n%{http_code}", &url],
            Duration::from_secs(60),
        );
        let (body, code) = out.rsplit_once('\n').expect("curl printed a status");
        assert_eq!(code, "200", "{round} idle connections: {body}");
        assert!(
            Scrape::parse(body).value("thinpool_mode{mode=\"rw\"}") == 1.0,
            "{round}: {body}"
        );
        drop(idle);
    }
    // Idle connections open at shutdown are closed with the listener.
    let _idle: Vec<TcpStream> = (0..5)
        .map(|_| TcpStream::connect(&address).expect("connect"))
        .collect();
    let (status, log) = served.stop_with_log();
    assert!(status.success(), "{log}");
    assert!(log.contains("metrics listener closed"), "{log}");
}

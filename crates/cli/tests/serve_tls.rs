//! Goal: `serve --tls` speaks NBD_OPT_STARTTLS the way real clients expect, on TCP and on the
//! Unix socket: libnbd (`nbdinfo`, `nbdcopy`) and qemu (`qemu-img`, `qemu-io` with a
//! `tls-creds-x509` object) read and write through TLS; under `--tls=require` a plaintext
//! client is refused with `NBD_REP_ERR_TLS_REQD` while the server goes on serving others;
//! under `--tls-verify-peer` a client whose certificate another CA signed, or that has none,
//! is refused; `--tls=on` lets both kinds in; bad certificate directories stop start-up;
//! the start-up banner's connect commands use TLS (none plaintext under `--tls=require`)
//! and work once given the client's certificate directory.
//!
//! Method: certificates made in the test with `openssl` (a CA, a server certificate for
//! 127.0.0.1 and localhost, a client certificate, and a second CA with a client certificate
//! the server must not trust), laid out as nbdkit, libnbd and qemu expect
//! (`ca-cert.pem`, `server-cert.pem`, `server-key.pem`; `client-cert.pem`,
//! `client-key.pem`); data written through TLS is compared byte for byte with what is read
//! back through TLS.

mod e2e_support;

use e2e_support::*;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;
use testkit::certificates::{make_ca, make_leaf};

const TOOL_TIMEOUT: Duration = Duration::from_secs(60);

/// Certificate directories for one test.
struct Certificates {
    /// The server's: `ca-cert.pem`, `server-cert.pem`, `server-key.pem`.
    server: PathBuf,
    /// A trusted client's: the CA and a client certificate the CA signed.
    client: PathBuf,
    /// A client that trusts the server but whose certificate another CA signed.
    untrusted: PathBuf,
    /// A client with no certificate of its own (only the CA, to check the server).
    anonymous: PathBuf,
}

impl Certificates {
    fn generate(root: &Path) -> Certificates {
        let ca = root.join("ca");
        let other_ca = root.join("other-ca");
        make_ca(&ca, "thinpool test CA");
        make_ca(&other_ca, "another CA");
        let certificates = Certificates {
            server: root.join("server"),
            client: root.join("client"),
            untrusted: root.join("untrusted"),
            anonymous: root.join("anonymous"),
        };
        make_leaf(
            &ca,
            &certificates.server,
            "server",
            "127.0.0.1",
            "extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost",
        );
        make_leaf(
            &ca,
            &certificates.client,
            "client",
            "trusted client",
            "extendedKeyUsage=clientAuth",
        );
        make_leaf(
            &other_ca,
            &certificates.untrusted,
            "client",
            "intruder",
            "extendedKeyUsage=clientAuth",
        );
        std::fs::create_dir_all(&certificates.anonymous).unwrap();
        for dir in [
            &certificates.server,
            &certificates.client,
            &certificates.untrusted,
            &certificates.anonymous,
        ] {
            std::fs::copy(ca.join("ca-cert.pem"), dir.join("ca-cert.pem")).unwrap();
        }
        certificates
    }
}

/// `nbds://` (TCP) or `nbds+unix://` URI of `export` with the client directory `dir`.
fn tls_uri(served: &Served, export: &str, dir: &Path) -> String {
    match &served.tcp {
        Some(address) => format!(
            "nbds://{address}/{export}?tls-certificates={}",
            dir.display()
        ),
        None => format!(
            "nbds+unix:///{export}?socket={}&tls-certificates={}",
            served.socket.display(),
            dir.display()
        ),
    }
}

/// `nbdinfo` with libnbd's debug log, so a refusal shows the server's reason.
fn nbdinfo(uri: &str) -> Output {
    run_tool_in(
        "nbdinfo",
        &[uri],
        TOOL_TIMEOUT,
        None,
        &[("LIBNBD_DEBUG", "1")],
    )
}

#[track_caller]
fn nbdinfo_ok(uri: &str) -> String {
    let output = nbdinfo(uri);
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "nbdinfo {uri} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// Runs nbdinfo, which must fail; returns its stderr (with libnbd's debug log).
#[track_caller]
fn nbdinfo_refused(uri: &str) -> String {
    let output = nbdinfo(uri);
    assert!(
        !output.status.success(),
        "nbdinfo {uri} was let in:\n{}",
        String::from_utf8_lossy(&output.stdout)
    );
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// qemu's `--object` and `--image-opts` for `export` on TCP `address` with TLS from `dir`.
fn qemu_tls_args(address: &str, export: &str, dir: &Path) -> (String, String) {
    let (host, port) = address.rsplit_once(':').unwrap();
    (
        format!(
            "tls-creds-x509,id=tls0,endpoint=client,dir={}",
            dir.display()
        ),
        format!("driver=nbd,host={host},port={port},export={export},tls-creds=tls0"),
    )
}

#[test]
fn require_with_verified_peers_serves_tls_clients_and_refuses_the_rest() {
    require_tool("nbdinfo", "libnbd-bin");
    require_tool("nbdcopy", "libnbd-bin");
    require_tool("qemu-img", "qemu-utils");
    require_tool("qemu-io", "qemu-utils");
    let temp = ScratchDir::new("serve-tls-require");
    let certificates = Certificates::generate(temp.path());
    let pool = temp.join("pool");
    create_pool(&pool, &["--data-size", "256M"]);
    create_volume(&pool, "vol", "16M");
    let server_dir = certificates.server.to_str().unwrap();
    let served = serve(
        &pool,
        &[
            "--tcp",
            "0",
            "--tls=require",
            "--tls-certificates",
            server_dir,
            "--tls-verify-peer",
        ],
    );
    let address = served.tcp.clone().unwrap();

    // A trusted client reads through TLS, on TCP and on the Unix socket.
    let info = nbdinfo_ok(&tls_uri(&served, "vol", &certificates.client));
    assert!(info.contains("with TLS"), "{info}");
    assert!(info.contains("export-size: 16777216"), "{info}");
    let unix_uri = format!(
        "nbds+unix:///vol?socket={}&tls-certificates={}",
        served.socket.display(),
        certificates.client.display()
    );
    let info = nbdinfo_ok(&unix_uri);
    assert!(info.contains("with TLS"), "{info}");

    // Plaintext clients get ERR_TLS_REQD for everything, on both sockets.
    let refusal = nbdinfo_refused(&format!("nbd://{address}/vol"));
    assert!(
        refusal.contains("this server requires TLS"),
        "no TLS_REQD reason:\n{refusal}"
    );
    let refusal = nbdinfo_refused(&served.uri("vol"));
    assert!(refusal.contains("this server requires TLS"), "{refusal}");

    // A certificate another CA signed, or none at all, is refused under --tls-verify-peer.
    nbdinfo_refused(&tls_uri(&served, "vol", &certificates.untrusted));
    nbdinfo_refused(&tls_uri(&served, "vol", &certificates.anonymous));
    let stderr = served.stderr();
    assert!(
        stderr
            .lines()
            .any(|line| line.contains("connection closed") && line.contains("error=TLS")),
        "the TLS refusals are not logged:\n{stderr}"
    );

    // qemu: info, then a write and a read of the pattern through TLS.
    let (object, image) = qemu_tls_args(&address, "vol", &certificates.client);
    let info = run_ok(
        "qemu-img",
        &["info", "--object", &object, "--image-opts", &image],
        TOOL_TIMEOUT,
    );
    assert!(info.contains("virtual size: 16 MiB"), "{info}");
    let output = run_ok(
        "qemu-io",
        &[
            "--object",
            &object,
            "--image-opts",
            &image,
            "-c",
            "write -P 0xa5 1M 3M",
            "-c",
            "flush",
            "-c",
            "read -P 0xa5 1M 3M",
            "-c",
            "read -P 0 0 1M",
        ],
        TOOL_TIMEOUT,
    );
    assert!(
        !output.contains("failed") && output.matches("read ").count() == 2,
        "{output}"
    );

    // Bulk both ways: qemu-img convert writes an image in, nbdcopy reads it back out
    // (several connections, requests in flight, payloads of megabytes through the pump).
    let source = temp.join("source.img");
    let data = pattern(7, 16 * MIB as usize);
    std::fs::write(&source, &data).unwrap();
    run_ok(
        "qemu-img",
        &[
            "convert",
            "-n",
            "--object",
            &object,
            "-f",
            "raw",
            source.to_str().unwrap(),
            "--target-image-opts",
            &image,
        ],
        TOOL_TIMEOUT,
    );
    let back = temp.join("back.img");
    run_ok(
        "nbdcopy",
        &[
            &tls_uri(&served, "vol", &certificates.client),
            back.to_str().unwrap(),
        ],
        TOOL_TIMEOUT,
    );
    assert!(
        std::fs::read(&back).unwrap() == data,
        "nbdcopy read back other bytes"
    );

    // The refusals left the server serving.
    nbdinfo_ok(&tls_uri(&served, "vol", &certificates.client));
    // The banner's commands connect (TLS, with the client's directory), none plaintext.
    run_banner_commands(&served.banner, &certificates.client, true, 16 << 20);
    assert!(served.stop().success());
}

/// Runs the `nbdinfo` and `qemu-img` commands of `serve`'s start-up banner (issue 25 item
/// 8: under `--tls=require` it printed plaintext URIs, which the server then refused), with
/// the client's certificate directory `client` for its placeholder; under `required`, no
/// command may be plaintext. Each must show the export's size, `size_bytes`.
fn run_banner_commands(banner: &str, client: &Path, required: bool, size_bytes: u64) {
    let start = banner
        .find("connect with")
        .expect("the banner's connect lines");
    let end = banner
        .find("manage with")
        .expect("the banner's management line");
    let section = banner[start..end].replace("\\\n", " ");
    assert!(section.contains("CLIENT-TLS-DIR"), "{section}");
    if required {
        assert!(
            !section.contains("nbd://") && !section.contains("nbd+unix://"),
            "a plaintext URI in the banner of --tls=require:\n{section}"
        );
        assert!(section.contains("TLS is required"), "{section}");
    }
    let section = section.replace("CLIENT-TLS-DIR", client.to_str().unwrap());
    let commands: Vec<&str> = section
        .lines()
        .map(str::trim)
        .filter(|line| line.starts_with("nbdinfo ") || line.starts_with("qemu-img "))
        .collect();
    assert!(commands.len() >= 3, "{section}");
    for command in commands {
        let output = run_tool("bash", &["-e", "-c", command], TOOL_TIMEOUT);
        assert!(
            output.status.success(),
            "the banner's `{command}` failed:\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(stdout.contains(&size_bytes.to_string()), "{stdout}");
    }
}

#[test]
fn on_lets_plaintext_and_tls_clients_in() {
    require_tool("nbdinfo", "libnbd-bin");
    require_tool("qemu-io", "qemu-utils");
    let temp = ScratchDir::new("serve-tls-on");
    let certificates = Certificates::generate(temp.path());
    let pool = temp.join("pool");
    create_pool(&pool, &["--data-size", "256M"]);
    create_volume(&pool, "vol", "8M");
    // A private key others can read is served, with a warning.
    use std::os::unix::fs::PermissionsExt;
    let key = certificates.server.join("server-key.pem");
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let served = serve(
        &pool,
        &[
            "--tcp",
            "0",
            "--tls=on",
            "--tls-certificates",
            certificates.server.to_str().unwrap(),
        ],
    );
    let address = served.tcp.clone().unwrap();
    // Without --tls-verify-peer a TLS client needs no certificate of its own.
    let info = nbdinfo_ok(&tls_uri(&served, "vol", &certificates.anonymous));
    assert!(info.contains("with TLS"), "{info}");
    let info = nbdinfo_ok(&format!("nbd://{address}/vol"));
    assert!(info.contains("without TLS"), "{info}");
    let info = nbdinfo_ok(&served.uri("vol"));
    assert!(info.contains("without TLS"), "{info}");
    // What a TLS client writes, a plaintext client reads: one export either way.
    let (object, image) = qemu_tls_args(&address, "vol", &certificates.anonymous);
    run_ok(
        "qemu-io",
        &[
            "--object",
            &object,
            "--image-opts",
            &image,
            "-c",
            "write -P 0x3c 0 64K",
        ],
        TOOL_TIMEOUT,
    );
    let output = run_ok(
        "qemu-io",
        &["-f", "raw", "-c", "read -P 0x3c 0 64K", &served.uri("vol")],
        TOOL_TIMEOUT,
    );
    assert!(!output.contains("failed"), "{output}");
    let stderr = served.stderr();
    assert!(
        stderr.contains("does not require TLS"),
        "no warning for optional TLS on TCP:\n{stderr}"
    );
    assert!(
        stderr.contains("server-key.pem has mode 644"),
        "no warning for a readable key:\n{stderr}"
    );
    run_banner_commands(&served.banner, &certificates.anonymous, false, 8 << 20);
    assert!(served.stop().success());
}

#[test]
fn bad_certificate_directories_stop_start_up() {
    let temp = ScratchDir::new("serve-tls-bad");
    let certificates = Certificates::generate(temp.path());
    let pool = temp.join("pool");
    create_pool(&pool, &[]);
    let pool = pool.to_str().unwrap();
    let serve_err = |extra: &[&str]| {
        let mut args = vec!["serve", "--pool", pool];
        args.extend_from_slice(extra);
        thinpool_err(&args)
    };

    let error = serve_err(&["--tls=require"]);
    assert!(
        error.contains("--tls-certificates DIR is needed"),
        "{error}"
    );
    let server = certificates.server.to_str().unwrap();
    let error = serve_err(&["--tls-certificates", server]);
    assert!(error.contains("need --tls=on or --tls=require"), "{error}");

    let missing = temp.join("missing");
    let error = serve_err(&["--tls=on", "--tls-certificates", missing.to_str().unwrap()]);
    assert!(error.contains("server-cert.pem"), "{error}");

    // A key that does not belong to the certificate.
    let mismatched = temp.join("mismatched");
    std::fs::create_dir_all(&mismatched).unwrap();
    std::fs::copy(
        certificates.server.join("server-cert.pem"),
        mismatched.join("server-cert.pem"),
    )
    .unwrap();
    std::fs::copy(
        certificates.client.join("client-key.pem"),
        mismatched.join("server-key.pem"),
    )
    .unwrap();
    let error = serve_err(&[
        "--tls=on",
        "--tls-certificates",
        mismatched.to_str().unwrap(),
    ]);
    assert!(
        error.contains("do not make a usable certificate"),
        "{error}"
    );

    // Not PEM at all.
    std::fs::write(mismatched.join("server-cert.pem"), "not a certificate\n").unwrap();
    let error = serve_err(&[
        "--tls=on",
        "--tls-certificates",
        mismatched.to_str().unwrap(),
    ]);
    assert!(error.contains("no certificate in"), "{error}");

    // --tls-verify-peer needs the CA.
    let no_ca = temp.join("no-ca");
    std::fs::create_dir_all(&no_ca).unwrap();
    for file in ["server-cert.pem", "server-key.pem"] {
        std::fs::copy(certificates.server.join(file), no_ca.join(file)).unwrap();
    }
    let error = serve_err(&[
        "--tls=require",
        "--tls-verify-peer",
        "--tls-certificates",
        no_ca.to_str().unwrap(),
    ]);
    assert!(error.contains("ca-cert.pem"), "{error}");

    // TLS without client certificates still lets every client in: a non-loopback address
    // needs --insecure (refused before anything is bound).
    let error = serve_err(&[
        "--tcp",
        "0.0.0.0:0",
        "--tls=require",
        "--tls-certificates",
        server,
    ]);
    assert!(error.contains("--tls-verify-peer"), "{error}");

    let help = thinpool_ok(&["serve", "--help"]);
    assert!(
        help.contains("--tls=require")
            && help.contains("nbds://")
            && help.contains("tls-creds-x509"),
        "no TLS example in serve --help:\n{help}"
    );
}

//! X.509 certificates for TLS tests, made with the real `openssl` command: a CA and leaf
//! certificates it signs, in nbdkit's and qemu's file layout (`ca-cert.pem`,
//! `{prefix}-cert.pem`, `{prefix}-key.pem`). P-256 keys unless asked for others
//! ([`make_leaf_with_key`]), valid for two days.

use crate::process::{require_tool, run_ok};
use std::path::Path;
use std::time::Duration;

const OPENSSL_TIMEOUT: Duration = Duration::from_secs(60);

fn openssl(args: &[&str]) {
    run_ok("openssl", args, OPENSSL_TIMEOUT);
}

fn text(path: &Path) -> &str {
    path.to_str().expect("a UTF-8 test path")
}

/// A self-signed CA in `dir` (`ca-cert.pem`, `ca-key.pem`), named `name`.
pub fn make_ca(dir: &Path, name: &str) {
    require_tool("openssl", "openssl");
    std::fs::create_dir_all(dir).unwrap();
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
        "-days",
        "2",
        "-subj",
        &format!("/CN={name}"),
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
        "-keyout",
        text(&dir.join("ca-key.pem")),
        "-out",
        text(&dir.join("ca-cert.pem")),
    ]);
}

/// `{prefix}-cert.pem` and `{prefix}-key.pem` in `dir`, signed by the CA made in `ca` by
/// [`make_ca`], with the subject `name` and the extra X.509v3 `extensions` (one per line,
/// e.g. `extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1`). The key usage includes
/// keyEncipherment, which qemu wants in the certificates it loads.
pub fn make_leaf(ca: &Path, dir: &Path, prefix: &str, name: &str, extensions: &str) {
    make_leaf_with_key(ca, dir, prefix, name, extensions, LeafKey::Ec("P-256"));
}

/// The key of a leaf certificate ([`make_leaf_with_key`]).
#[derive(Clone, Copy, Debug)]
pub enum LeafKey {
    /// RSA with a modulus of this many bits.
    Rsa(u32),
    /// ECDSA on the named curve ("P-256", "P-384", "P-521").
    Ec(&'static str),
    /// Ed25519.
    Ed25519,
}

/// [`make_leaf`] with a key of the given kind.
pub fn make_leaf_with_key(
    ca: &Path,
    dir: &Path,
    prefix: &str,
    name: &str,
    extensions: &str,
    key: LeafKey,
) {
    std::fs::create_dir_all(dir).unwrap();
    let key_arguments: Vec<String> = match key {
        LeafKey::Rsa(bits) => vec!["-newkey".into(), format!("rsa:{bits}")],
        LeafKey::Ec(curve) => vec![
            "-newkey".into(),
            "ec".into(),
            "-pkeyopt".into(),
            format!("ec_paramgen_curve:{curve}"),
        ],
        LeafKey::Ed25519 => vec!["-newkey".into(), "ed25519".into()],
    };
    let request = dir.join(format!("{prefix}.csr"));
    let extension_file = dir.join(format!("{prefix}.ext"));
    let subject = format!("/CN={name}");
    let key_file = dir.join(format!("{prefix}-key.pem"));
    let mut arguments: Vec<&str> = vec!["req"];
    arguments.extend(key_arguments.iter().map(String::as_str));
    arguments.extend(["-nodes", "-subj", &subject, "-keyout", text(&key_file)]);
    arguments.extend(["-out", text(&request)]);
    openssl(&arguments);
    std::fs::write(
        &extension_file,
        format!(
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n{extensions}\n"
        ),
    )
    .unwrap();
    openssl(&[
        "x509",
        "-req",
        "-days",
        "2",
        "-in",
        text(&request),
        "-CA",
        text(&ca.join("ca-cert.pem")),
        "-CAkey",
        text(&ca.join("ca-key.pem")),
        "-CAcreateserial",
        "-extfile",
        text(&extension_file),
        "-out",
        text(&dir.join(format!("{prefix}-cert.pem"))),
    ]);
}

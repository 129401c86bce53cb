//! The banner `serve` prints on stdout once it listens: the pool, its sockets, and the
//! commands that connect to it. With TLS those commands use TLS (`nbds+unix://`,
//! `nbds://`, qemu's `tls-creds-x509` object) with the placeholder [`CLIENT_DIR`] for the
//! client's certificate directory; under `--tls=require` no plaintext command is printed
//! (the server refuses them).

use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;

use thin_pool::Pool;

use crate::export::DEFAULT_VOLUME;
use crate::pool_dir::PoolDir;

/// What the banner's commands name the client's certificate directory (`ca-cert.pem`, and
/// `client-cert.pem` with `client-key.pem` when the server verifies peers).
pub const CLIENT_DIR: &str = "CLIENT-TLS-DIR";

/// TLS as the banner shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct BannerTls {
    /// `--tls=require`: plaintext clients are refused.
    pub required: bool,
    /// `--tls-verify-peer`: clients need a certificate of their own.
    pub verify_peer: bool,
}

/// Percent-encodes an export name for the path of an NBD URI.
fn uri_escape(name: &str) -> String {
    let mut out = String::new();
    for byte in name.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// Prints the banner on stdout: where the pool is served and how to connect.
pub(super) fn print(
    dir: &PoolDir,
    pool: &Pool,
    nbd_socket: &Path,
    control_socket: &Path,
    tcp: Option<(SocketAddr, Option<&[String]>)>,
    metrics: Option<SocketAddr>,
    tls: Option<BannerTls>,
) -> anyhow::Result<()> {
    let absolute = |path: &Path| std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let pool_path = absolute(&dir.path);
    let socket = absolute(nbd_socket);
    let volumes: Vec<String> = pool.list().into_iter().map(|info| info.name).collect();
    let example = if volumes.iter().any(|name| name == DEFAULT_VOLUME) {
        DEFAULT_VOLUME.to_string()
    } else {
        volumes
            .first()
            .cloned()
            .unwrap_or_else(|| "NAME".to_string())
    };
    let unix_uri = unix_uri(&example, &socket, tls);
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "thinpool: serving pool {} ({} volume{}: {})",
        pool_path.display(),
        volumes.len(),
        if volumes.len() == 1 { "" } else { "s" },
        if volumes.is_empty() {
            "none yet".to_string()
        } else {
            volumes.join(", ")
        }
    )?;
    writeln!(out, "  NBD socket:     {}", socket.display())?;
    if let Some((address, exports)) = tcp {
        writeln!(out, "  NBD TCP:        {address}")?;
        if let Some(names) = exports {
            writeln!(out, "  TCP exports:    {}", names.join(", "))?;
        }
    }
    writeln!(
        out,
        "  control socket: {}",
        absolute(control_socket).display()
    )?;
    if let Some(address) = metrics {
        writeln!(out, "  metrics:        http://{address}/metrics")?;
    }
    connect_lines(&mut out, &example, &unix_uri, tcp, tls, &socket)?;
    writeln!(
        out,
        "manage with: thinpool volume create|snapshot|delete|resize ... --pool {}",
        pool_path.display()
    )?;
    writeln!(out, "thinpool: ready (SIGINT or SIGTERM stops)")?;
    out.flush()?;
    Ok(())
}

/// The URI of export `example` on the Unix socket `socket`.
fn unix_uri(example: &str, socket: &Path, tls: Option<BannerTls>) -> String {
    match tls {
        None => format!(
            "nbd+unix:///{}?socket={}",
            uri_escape(example),
            socket.display()
        ),
        Some(_) => format!(
            "nbds+unix:///{}?socket={}&tls-certificates={CLIENT_DIR}",
            uri_escape(example),
            socket.display()
        ),
    }
}

/// The commands that connect to export `example`: on the Unix socket (`unix_uri`), and on
/// TCP if served (an export TCP serves).
fn connect_lines(
    out: &mut impl Write,
    example: &str,
    unix_uri: &str,
    tcp: Option<(SocketAddr, Option<&[String]>)>,
    tls: Option<BannerTls>,
    socket: &Path,
) -> std::io::Result<()> {
    writeln!(out, "connect with (every volume is an export of its name):")?;
    writeln!(out, "  nbdinfo '{unix_uri}'")?;
    match tls {
        None => writeln!(out, "  qemu-img info '{unix_uri}'")?,
        Some(_) => writeln!(
            out,
            "  qemu-img info --object tls-creds-x509,id=tls0,endpoint=client,dir={CLIENT_DIR} \\\n      --image-opts driver=nbd,server.type=unix,server.path={},export={example},tls-creds=tls0,tls-hostname=localhost",
            socket.display()
        )?,
    }
    writeln!(
        out,
        "  mkdir -p /tmp/{0} && nbdfuse /tmp/{0} '{unix_uri}'",
        uri_escape(example)
    )?;
    if let Some((address, exports)) = tcp {
        let example = match exports {
            Some(names) if !names.iter().any(|name| name == example) => names[0].as_str(),
            _ => example,
        };
        let host = match address {
            SocketAddr::V6(v6) => format!("[{}]", v6.ip()),
            SocketAddr::V4(v4) => v4.ip().to_string(),
        };
        let (scheme, query) = match tls {
            None => ("nbd", String::new()),
            Some(_) => ("nbds", format!("?tls-certificates={CLIENT_DIR}")),
        };
        writeln!(
            out,
            "  nbdinfo '{scheme}://{host}:{}/{}{query}'",
            address.port(),
            uri_escape(example)
        )?;
    }
    if let Some(tls) = tls {
        writeln!(
            out,
            "  ({CLIENT_DIR}: the client's directory with ca-cert.pem{}; qemu checks the name in tls-hostname against the server's certificate; {})",
            if tls.verify_peer {
                ", client-cert.pem and client-key.pem"
            } else {
                ""
            },
            if tls.required {
                "TLS is required: clients without it are refused"
            } else {
                "clients without TLS are let in too (--tls=on)"
            }
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn export_names_are_escaped_in_uris() {
        assert_eq!(uri_escape("disk-1.img"), "disk-1.img");
        assert_eq!(uri_escape("a b/c?"), "a%20b%2Fc%3F");
    }
}

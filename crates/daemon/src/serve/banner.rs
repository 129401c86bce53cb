//! The banner `serve` prints on stdout once it listens: the pool, its sockets, and the
//! commands that connect to it.

use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;

use thin_pool::Pool;

use crate::export::DEFAULT_VOLUME;
use crate::pool_dir::PoolDir;

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
    let unix_uri = format!(
        "nbd+unix:///{}?socket={}",
        uri_escape(&example),
        socket.display()
    );
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
    connect_lines(&mut out, &example, &unix_uri, tcp)?;
    writeln!(
        out,
        "manage with: thinpool volume create|snapshot|delete|resize ... --pool {}",
        pool_path.display()
    )?;
    writeln!(out, "thinpool: ready (SIGINT or SIGTERM stops)")?;
    out.flush()?;
    Ok(())
}

/// The commands that connect to export `example`: on the Unix socket (`unix_uri`), and on
/// TCP if served (an export TCP serves).
fn connect_lines(
    out: &mut impl Write,
    example: &str,
    unix_uri: &str,
    tcp: Option<(SocketAddr, Option<&[String]>)>,
) -> std::io::Result<()> {
    writeln!(out, "connect with (every volume is an export of its name):")?;
    writeln!(out, "  nbdinfo '{unix_uri}'")?;
    writeln!(out, "  qemu-img info '{unix_uri}'")?;
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
        writeln!(
            out,
            "  nbdinfo 'nbd://{host}:{}/{}'",
            address.port(),
            uri_escape(example)
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

//! Who a TCP listener lets in: the `--tcp` address syntax, the exposure check (a
//! non-loopback address without TLS client certificates needs `--insecure`) and the `--tcp-export` allow-list.

use std::collections::BTreeSet;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;

use anyhow::{bail, Context};
use nbd::{Export, ExportListing, ExportRegistry};

use super::NBD_PORT;

/// Who can reach the volumes through a TCP listener without TLS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum TcpExposure {
    /// Bound to a loopback address: every local user.
    LocalUsers,
    /// Bound to another address, allowed with `--insecure`: every host that reaches it.
    Network,
}

impl TcpExposure {
    /// The start-up warning; `exports` is the `--tcp-export` list, if any.
    /// `posture` says what TLS does here ("has no TLS and no authentication", ...).
    pub(super) fn warning(
        self,
        bound: SocketAddr,
        exports: Option<&[String]>,
        posture: &str,
    ) -> String {
        let what = match exports {
            Some(names) => format!("the exports {}", names.join(", ")),
            None => "every volume".to_string(),
        };
        match self {
            TcpExposure::LocalUsers => format!(
                "NBD on TCP {bound} {posture}: every local user can read and write {what} (the Unix socket is private to its owner)"
            ),
            TcpExposure::Network => format!(
                "NBD on TCP {bound} {posture} (--insecure): every local user and every host that reaches this address can read and write {what}"
            ),
        }
    }
}

/// The exports of another registry whose names are on a list (`--tcp-export`): others are
/// neither listed nor opened, exactly as if they did not exist, nor offered as the base of
/// a diff context (`may_open`).
pub(super) struct AllowList {
    inner: Arc<dyn ExportRegistry>,
    names: BTreeSet<String>,
}

impl AllowList {
    pub(super) fn new(inner: Arc<dyn ExportRegistry>, names: &[String]) -> Self {
        AllowList {
            inner,
            names: names.iter().cloned().collect(),
        }
    }
}

impl ExportRegistry for AllowList {
    fn list(&self) -> Vec<ExportListing> {
        let mut listing = self.inner.list();
        listing.retain(|export| self.names.contains(&export.name));
        listing
    }

    fn open(&self, name: &str) -> nbd::Result<Option<Arc<dyn Export>>> {
        // A name off the list is not even opened (opening a volume counts as a user of it).
        if !name.is_empty() && !self.names.contains(name) {
            return Ok(None);
        }
        // The empty name means the default export, allowed only if its own name is listed.
        Ok(self
            .inner
            .open(name)?
            .filter(|export| self.names.contains(export.name())))
    }

    fn may_open(&self, name: &str) -> bool {
        self.names.contains(name) && self.inner.may_open(name)
    }
}

/// Decides whether a TCP listener on `address` may be opened, before it is bound, when some
/// client can get in without a certificate (anything but `--tls=require --tls-verify-peer`,
/// which skips this check): only loopback addresses are allowed unless `insecure`; the
/// wildcard addresses (0.0.0.0, ::) are not loopback.
pub(super) fn tcp_exposure(address: SocketAddr, insecure: bool) -> anyhow::Result<TcpExposure> {
    if address.ip().to_canonical().is_loopback() {
        return Ok(TcpExposure::LocalUsers);
    }
    if insecure {
        return Ok(TcpExposure::Network);
    }
    bail!(
        "--tcp {address}: refusing to serve every volume without TLS or authentication on a non-loopback address; \
         use a loopback address (127.0.0.1, ::1), authenticate clients with --tls=require --tls-verify-peer, or add --insecure if every host that reaches {} may read and write every volume",
        address.ip()
    )
}

/// Parses `--tcp`: `PORT` (on 127.0.0.1), `ADDR:PORT`, `[V6]:PORT`, or `ADDR` (port 10809).
pub fn parse_tcp_address(text: &str) -> anyhow::Result<SocketAddr> {
    if let Ok(port) = text.parse::<u16>() {
        return Ok(SocketAddr::from(([127, 0, 0, 1], port)));
    }
    if let Some(port) = text.strip_prefix(':') {
        let port: u16 = port
            .parse()
            .with_context(|| format!("--tcp {text:?}: bad port"))?;
        return Ok(SocketAddr::from(([127, 0, 0, 1], port)));
    }
    if let Ok(address) = text.parse::<SocketAddr>() {
        return Ok(address);
    }
    if let Ok(ip) = text.parse::<std::net::IpAddr>() {
        return Ok(SocketAddr::new(ip, NBD_PORT));
    }
    let with_port = if text.contains(':') {
        text.to_string()
    } else {
        format!("{text}:{NBD_PORT}")
    };
    with_port
        .to_socket_addrs()
        .with_context(|| format!("--tcp {text:?}: cannot resolve"))?
        .next()
        .with_context(|| format!("--tcp {text:?}: no address"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_addresses_default_to_loopback() {
        assert_eq!(
            parse_tcp_address("10810").unwrap(),
            "127.0.0.1:10810".parse().unwrap()
        );
        assert_eq!(
            parse_tcp_address(":0").unwrap(),
            "127.0.0.1:0".parse().unwrap()
        );
        assert_eq!(
            parse_tcp_address("0.0.0.0:99").unwrap(),
            "0.0.0.0:99".parse().unwrap()
        );
        assert_eq!(
            parse_tcp_address("[::1]:5").unwrap(),
            "[::1]:5".parse().unwrap()
        );
        assert_eq!(
            parse_tcp_address("127.0.0.2").unwrap(),
            "127.0.0.2:10809".parse().unwrap()
        );
    }

    #[test]
    fn tcp_off_loopback_needs_insecure() {
        let exposure = |text: &str, insecure| tcp_exposure(text.parse().unwrap(), insecure);
        for loopback in [
            "127.0.0.1:1",
            "127.1.2.3:1",
            "[::1]:1",
            "[::ffff:127.0.0.1]:1",
        ] {
            assert_eq!(exposure(loopback, false).unwrap(), TcpExposure::LocalUsers);
        }
        for open in ["0.0.0.0:1", "[::]:1", "192.0.2.1:1", "[2001:db8::1]:1"] {
            let error = exposure(open, false).unwrap_err().to_string();
            assert!(error.contains("--insecure"), "{open}: {error}");
            assert_eq!(exposure(open, true).unwrap(), TcpExposure::Network);
        }
    }
}

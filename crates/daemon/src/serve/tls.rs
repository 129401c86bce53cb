//! `serve --tls=off|on|require --tls-certificates DIR [--tls-verify-peer]`: TLS on both NBD
//! sockets (the Unix socket and TCP), through NBD_OPT_STARTTLS.
//!
//! The certificate directory has nbdkit's and qemu's layout: `server-cert.pem` (chain, leaf
//! first), `server-key.pem`, and `ca-cert.pem` (the CA that client certificates must chain
//! to, needed with `--tls-verify-peer`). Everything is loaded and checked before anything is
//! bound, so a missing, unreadable or mismatched file stops `serve` at start-up with the
//! file's name. X.509 only: rustls has no TLS-PSK.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

/// Shown at the end of `thinpool serve --help`.
pub(super) const EXAMPLES: &str = "\
TLS example (nbdkit's certificate layout: ca-cert.pem, server-cert.pem, server-key.pem):
  thinpool serve --tcp 10809 --tls=require --tls-certificates /etc/thinpool/tls --tls-verify-peer
  nbdinfo 'nbds://127.0.0.1:10809/disk?tls-certificates=/etc/thinpool/client-tls'
  qemu-img info --object tls-creds-x509,id=tls0,endpoint=client,dir=/etc/thinpool/client-tls \\
      --image-opts driver=nbd,host=127.0.0.1,port=10809,export=disk,tls-creds=tls0";

/// TLS modes of `--tls`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TlsSetting {
    /// No TLS: STARTTLS is answered "unsupported".
    Off,
    /// Clients may start TLS or go on without it.
    On,
    /// Every client must start TLS before anything else (no plaintext export, no downgrade).
    Require,
}

/// The TLS arguments of `serve`.
#[derive(clap::Args, Debug)]
pub struct TlsArgs {
    /// TLS on the NBD sockets (Unix and TCP): off, on (the client chooses) or require.
    #[arg(long = "tls", value_enum, value_name = "MODE", default_value_t = TlsSetting::Off)]
    tls: TlsSetting,
    /// Directory holding server-cert.pem, server-key.pem and (for --tls-verify-peer)
    /// ca-cert.pem: nbdkit's and qemu's layout. Needed with --tls=on or --tls=require.
    #[arg(long = "tls-certificates", value_name = "DIR")]
    tls_certificates: Option<PathBuf>,
    /// Accept only TLS clients whose certificate is signed by DIR/ca-cert.pem.
    #[arg(long = "tls-verify-peer")]
    tls_verify_peer: bool,
}

impl TlsArgs {
    /// The server's TLS set-up (`None` for `--tls=off`), loaded and checked now.
    pub fn load(&self) -> anyhow::Result<Option<nbd::Tls>> {
        let mode = match self.tls {
            TlsSetting::Off => {
                if self.tls_certificates.is_some() || self.tls_verify_peer {
                    bail!(
                        "--tls-certificates and --tls-verify-peer need --tls=on or --tls=require"
                    );
                }
                return Ok(None);
            }
            TlsSetting::On => nbd::TlsMode::On,
            TlsSetting::Require => nbd::TlsMode::Require,
        };
        let Some(directory) = &self.tls_certificates else {
            bail!(
                "--tls={}: --tls-certificates DIR is needed (with {}, {} and, for --tls-verify-peer, {})",
                self.mode_name(),
                nbd::tls::SERVER_CERT_FILE,
                nbd::tls::SERVER_KEY_FILE,
                nbd::tls::CA_CERT_FILE,
            );
        };
        let tls = nbd::Tls::from_directory(directory, mode, self.tls_verify_peer)
            .map_err(|error| anyhow::anyhow!("{}", error.report()))
            .with_context(|| format!("cannot set up TLS from {}", directory.display()))?;
        warn_if_key_is_shared(&directory.join(nbd::tls::SERVER_KEY_FILE));
        Ok(Some(tls))
    }

    /// Every TLS client is authenticated and no client goes without TLS: `require` with
    /// `--tls-verify-peer`.
    pub fn authenticates_clients(&self) -> bool {
        self.tls == TlsSetting::Require && self.tls_verify_peer
    }

    /// How a TCP warning describes this set-up.
    pub fn posture(&self) -> &'static str {
        match (self.tls, self.tls_verify_peer) {
            (TlsSetting::Off, _) => "has no TLS and no authentication",
            (TlsSetting::On, _) => "does not require TLS (--tls=on) and has no authentication",
            (TlsSetting::Require, false) => {
                "requires TLS but no client certificate (no --tls-verify-peer), so has no authentication"
            }
            (TlsSetting::Require, true) => "requires TLS and client certificates",
        }
    }

    /// What the start-up banner adds about TLS, if it is on.
    pub fn banner_line(&self) -> Option<String> {
        let directory = self.tls_certificates.as_ref()?;
        Some(format!(
            "TLS {} (certificates in {}{}): clients use nbds+unix:// or nbds:// URIs with ?tls-certificates=DIR",
            self.mode_name(),
            directory.display(),
            if self.tls_verify_peer {
                ", client certificates verified"
            } else {
                ""
            }
        ))
    }

    /// TLS as the start-up banner's commands need it (`None`: off).
    pub(super) fn banner(&self) -> Option<super::banner::BannerTls> {
        (self.tls != TlsSetting::Off).then_some(super::banner::BannerTls {
            required: self.tls == TlsSetting::Require,
            verify_peer: self.tls_verify_peer,
        })
    }

    fn mode_name(&self) -> &'static str {
        match self.tls {
            TlsSetting::Off => "off",
            TlsSetting::On => "on",
            TlsSetting::Require => "require",
        }
    }
}

/// Warns (nbdkit and qemu do not) when users other than its owner can read or change the
/// server's private key: whoever reads it can pose as this server.
fn warn_if_key_is_shared(key: &Path) {
    let Ok(metadata) = std::fs::metadata(key) else {
        return;
    };
    let mode = metadata.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        eprintln!(
            "thinpool: warning: {} has mode {mode:03o}: other users can read or change the server's private key (chmod 600 it)",
            key.display()
        );
    }
}

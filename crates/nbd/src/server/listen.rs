//! The listening sockets: binding or adopting them, their accept loops, and waking those
//! loops at shutdown.

use std::fmt;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::table::Peer;
use super::Server;
use crate::error::{Error, Result};
use crate::stream::Stream;
use crate::sync;

/// Pause after a failed accept (EMFILE and the like) so the loop does not spin.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(50);
/// Longest wait for the accept loops to notice shutdown.
pub(super) const ACCEPT_STOP_WAIT: Duration = Duration::from_secs(2);

/// How to wake a listener blocked in accept.
#[derive(Clone, Debug)]
pub(super) enum Listening {
    /// A Unix socket: its path if it has one (a passed socket may not), and whether the
    /// server made it (and so removes it at shutdown) or was given it.
    Unix {
        path: Option<PathBuf>,
        owned: bool,
    },
    Tcp(SocketAddr),
}

impl fmt::Display for Listening {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Listening::Unix {
                path: Some(path), ..
            } => write!(formatter, "{}", path.display()),
            Listening::Unix { path: None, .. } => formatter.write_str("unnamed unix socket"),
            Listening::Tcp(address) => write!(formatter, "tcp {address}"),
        }
    }
}

impl Listening {
    /// Wakes the accept loop of this listener with a throwaway connection; it sees the
    /// shutdown flag and stops.
    pub(super) fn wake(&self) {
        match self {
            Listening::Unix {
                path: Some(path), ..
            } => drop(UnixStream::connect(path)),
            // Nothing to connect to: the loop ends at its next accept.
            Listening::Unix { path: None, .. } => {}
            Listening::Tcp(address) => {
                let mut target = *address;
                if target.ip().is_unspecified() {
                    target.set_ip(match target {
                        SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                        SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
                    });
                }
                drop(TcpStream::connect_timeout(&target, Duration::from_secs(1)));
            }
        }
    }
}

impl Server {
    /// Listens on a new Unix socket at `path` (mode 0600). Fails if `path` exists.
    pub fn listen_unix(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref().to_path_buf();
        let listener = UnixListener::bind(&path)
            .map_err(|e| Error::io(format!("bind unix socket {}", path.display()), e))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| Error::io(format!("chmod 0600 {}", path.display()), e))?;
        self.accept_unix(listener, Some(path), true)
    }

    /// Serves on a Unix socket listening already (one passed by systemd's socket
    /// activation, say). Its file, if any, is left in place at shutdown: whoever made it owns
    /// it. Returns the socket's path, if it has one.
    pub fn serve_unix_listener(&mut self, listener: UnixListener) -> Result<Option<PathBuf>> {
        let path = listener
            .local_addr()
            .map_err(|e| Error::io("unix listener address", e))?
            .as_pathname()
            .map(Path::to_path_buf);
        self.accept_unix(listener, path.clone(), false)?;
        Ok(path)
    }

    fn accept_unix(
        &mut self,
        listener: UnixListener,
        path: Option<PathBuf>,
        owned: bool,
    ) -> Result<()> {
        let listening = Listening::Unix { path, owned };
        let socket = listening.to_string();
        tracing::info!(socket = %listening, "NBD listening");
        sync::lock(&self.shared.listening).push(listening);
        let shared = Arc::clone(&self.shared);
        let thread = std::thread::Builder::new()
            .name("nbd-accept-unix".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    if shared.shutting_down.load(Ordering::SeqCst) {
                        break;
                    }
                    match stream {
                        Ok(stream) => {
                            let peer = rustix::net::sockopt::socket_peercred(&stream)
                                .map_or(Peer::Unknown, |credentials| {
                                    Peer::User(credentials.uid.as_raw())
                                });
                            let name = match peer {
                                Peer::User(uid) => format!("{socket} (uid {uid})"),
                                _ => socket.clone(),
                            };
                            shared.start_connection(Stream::Unix(stream), peer, name)
                        }
                        Err(_) => std::thread::sleep(ACCEPT_ERROR_PAUSE),
                    }
                }
            })
            .map_err(|e| Error::io("spawn accept thread", e))?;
        self.accept_threads.push(thread);
        Ok(())
    }

    /// Listens on TCP `address` (port 0 picks a free port); returns the bound address.
    pub fn listen_tcp(&mut self, address: impl ToSocketAddrs) -> Result<SocketAddr> {
        let listener = TcpListener::bind(address).map_err(|e| Error::io("bind tcp listener", e))?;
        self.serve_tcp_listener(listener)
    }

    /// Serves on a TCP socket listening already (one passed by systemd's socket activation,
    /// say); returns its address.
    pub fn serve_tcp_listener(&mut self, listener: TcpListener) -> Result<SocketAddr> {
        let bound = listener
            .local_addr()
            .map_err(|e| Error::io("tcp listener address", e))?;
        tracing::info!(socket = %Listening::Tcp(bound), "NBD listening");
        sync::lock(&self.shared.listening).push(Listening::Tcp(bound));
        let shared = Arc::clone(&self.shared);
        let thread = std::thread::Builder::new()
            .name("nbd-accept-tcp".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    if shared.shutting_down.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(stream) = stream else {
                        std::thread::sleep(ACCEPT_ERROR_PAUSE);
                        continue;
                    };
                    // Replies are whole messages; Nagle would only delay them.
                    let _ = stream.set_nodelay(true);
                    let (peer, name) = match stream.peer_addr() {
                        Ok(address) => (Peer::of_tcp(address.ip()), address.to_string()),
                        Err(_) => (Peer::Unknown, String::new()),
                    };
                    shared.start_connection(Stream::Tcp(stream), peer, name);
                }
            })
            .map_err(|e| Error::io("spawn accept thread", e))?;
        self.accept_threads.push(thread);
        Ok(bound)
    }
}

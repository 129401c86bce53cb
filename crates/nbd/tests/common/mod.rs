//! Shared helpers for the `nbd` tests: a server on a Unix socket in a scratch directory. The
//! raw client, seeds, process helpers and scratch directories are testkit's; they are
//! re-exported here so each test needs one `use common::*`.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;

use nbd::{Config, ExportMap, MemoryExport, Server};

#[allow(unused_imports)]
pub use testkit::nbd_client::*;
#[allow(unused_imports)]
pub use testkit::process::{require_tool, run_ok, run_tool, wait_for, ChildGuard};
#[allow(unused_imports)]
pub use testkit::{pattern, seed_report, ScratchDir};

pub const MIB: u64 = 1024 * 1024;

/// A server on a Unix socket serving an [`ExportMap`].
pub struct TestServer {
    pub server: Option<Server>,
    pub exports: Arc<ExportMap>,
    pub socket: PathBuf,
    pub dir: ScratchDir,
}

impl TestServer {
    pub fn start(exports: Vec<Arc<MemoryExport>>) -> Self {
        Self::start_with(exports, Config::default())
    }

    pub fn start_with(exports: Vec<Arc<MemoryExport>>, config: Config) -> Self {
        let map = Arc::new(ExportMap::new());
        for export in exports {
            map.insert(export);
        }
        Self::start_registry(map, config)
    }

    /// A server for the exports in `map`.
    pub fn start_registry(map: Arc<ExportMap>, config: Config) -> Self {
        let dir = ScratchDir::new("nbd-server");
        let socket = dir.join("nbd.sock");
        let mut server = Server::new(map.clone(), config);
        server.listen_unix(&socket).unwrap();
        TestServer {
            server: Some(server),
            exports: map,
            socket,
            dir,
        }
    }

    /// libnbd/qemu URI for export `name` on this server.
    pub fn uri(&self, name: &str) -> String {
        format!("nbd+unix:///{name}?socket={}", self.socket.display())
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(server) = self.server.take() {
            server.shutdown();
        }
    }
}

//! Server side of the NBD (network block device) protocol, serving any [`Export`].
//!
//! Layers, from the wire up: [`protocol`] parses and encodes every structure without I/O;
//! `handshake` runs fixed-newstyle negotiation (with STARTTLS, see [`tls`]); `session` runs the transmission phase with
//! one to a few threads per connection that each read, serve and answer requests; [`server`]
//! owns listeners, connection threads and the per-connection, per-peer and server-wide
//! limits that keep one client from starving the others. The crate never depends on the pool: the binary implements [`Export`]
//! and [`ExportRegistry`] for its volumes. [`MemoryExport`] and [`ExportMap`] are complete
//! in-memory implementations used by the tests.
//!
//! ```no_run
//! use std::sync::Arc;
//! let exports = Arc::new(nbd::ExportMap::new());
//! exports.insert(Arc::new(nbd::MemoryExport::new("disk", 64 << 20)));
//! let mut server = nbd::Server::new(exports, nbd::Config::default());
//! server.listen_unix("/tmp/nbd.sock").unwrap();
//! // ... later
//! server.shutdown();
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod error;
pub mod export;
mod handshake;
pub mod protocol;
pub mod server;
mod session;
mod stream;
pub mod sync;
#[cfg(feature = "testing")]
pub mod testing;
pub mod tls;

pub use error::{Error, ErrorKind, Report, Result};
pub use export::{
    Capabilities, Export, ExportListing, ExportMap, ExportRegistry, Extent, MemoryExport,
    MetaContext, ReadSource, StatusExtent, ZeroOptions,
};
pub use protocol::nbd_error_code;
pub use server::{Config, Event, EventHandler, Server, ShutdownHandle, SpliceReads};
pub use tls::{Tls, TlsMode};

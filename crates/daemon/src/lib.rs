//! The thinpool daemon as a library: `serve` (a pool's volumes over NBD, on a Unix socket and
//! optionally TCP, with TLS, systemd's conventions and Prometheus metrics), the control socket
//! and its client ([`control::perform`], which the management commands use whether or not a
//! server holds the pool), the volume → `nbd::Export` adapter, and the pool directory layout
//! and stored options every command shares. The `thinpool` binary parses arguments and calls
//! into it; tests can run it in-process.
#![forbid(unsafe_code)]

pub mod control;
pub mod create;
pub mod export;
pub mod logging;
pub mod metrics;
pub mod pool_dir;
pub mod restored;
pub mod serve;
pub mod space;
pub mod text;

//! The thinpool daemon as a library: `serve` (a pool's volumes over NBD, on a Unix socket and
//! optionally TCP, with TLS, systemd's conventions and Prometheus metrics), the control socket
//! and its client ([`control::perform`], which the management commands use whether or not a
//! server holds the pool), the volume → `nbd::Export` adapter, and the pool directory layout
//! and stored options every command shares. The `thinpool` binary parses arguments and calls
//! into it; tests can run it in-process.
//!
//! Files: `serve.rs` (`Serving::start` opens the pool, checks TCP exposure, binds and
//! announces; `Serving::stop` shuts down; `run` waits for a signal between them; `serve/` has
//! the banner, TCP, TLS, systemd, shutdown, the metrics endpoint, the vhost-user-blk sockets
//! and `served.rs`, what the control target knows of this server: `status`'s probe, whom a
//! resize tells); `export.rs`
//! (`VolumeExport`, and `PoolRegistry` with any fixed exports a caller adds; `export/` the
//! diff metadata context); `metrics.rs` (counting in `metrics/counted.rs`); `pool_dir.rs`
//! (layout, stored options, checks; `pool_dir/missing.rs` why a directory holds no pool,
//! `pool_dir/made.rs` undoing a refused create); `text.rs` (sizes, tables); `create.rs`, `restored.rs`,
//! `space.rs`; `json.rs` (the JSON contract of `--json` and the control socket, docs/json.md); `replication.rs` (`thinpool replicate`'s replica names, state file and lag);
//! `logging.rs` (the subscriber the binary installs; the library never calls it);
//! and the control socket: `control.rs` (`perform`: the pool directly, or its server),
//! `control/protocol.rs` (requests, answers, `OpError`, strict parsing; the `status` record in
//! `control/status_record.rs`), `control/target.rs`
//! (the operations on an open pool), `control/log.rs` (each management operation logged once,
//! with its result), `control/listing.rs` (the `list` answer with each volume's space),
//! `control/diff.rs` (the `diff` request and its record), `control/stream.rs` (send and
//! receive streams, partial receives), `control/progress.rs` (the progress lines a served
//! trim sends before its answer when asked) and `control/server.rs` (accept loop,
//! connections). `tests/serve_in_process.rs` serves a pool in-process.
#![forbid(unsafe_code)]

pub mod control;
pub mod create;
pub mod export;
pub mod json;
pub mod logging;
pub mod metrics;
pub mod pool_dir;
pub mod replication;
pub mod restored;
pub mod serve;
pub mod space;
pub mod text;

//! Dev-only test kit shared by every crate's tests.
//!
//! - [`certificates`]: a CA and the certificates it signs, made with `openssl`, for TLS tests.
//! - [`crash`]: a metadata device that separates durable writes from volatile ones and can
//!   simulate a power cut (drop, reorder and tear unflushed writes).
//! - [`fault`]: a wrapper that fails the Nth I/O, corrupts reads and misdirects writes.
//! - [`seed`]: seeded randomness from `THINPOOL_SEED`, printed on failure so any run replays.
//! - [`tools`]: the real thin-provisioning-tools (0.9.0 from Debian 12, 1.1.0 fetched by
//!   `scripts/test`), run with captured output and a timeout.
//! - [`fixtures`]: the thin_dump XML fixtures (committed and generated).
//! - [`scratch`]: per-test temporary directories and sized (sparse) files.
//! - [`nbd_client`]: a raw NBD client that speaks the wire protocol itself (independent of
//!   the `nbd` crate's codec), used by the `nbd` and `thinpool` tests.
//! - [`process`]: external tools with timeouts, processes killed by PID when dropped, a
//!   served pool (`thinpool serve`), polling with a deadline.
//! - [`loop_device`]: loop devices over test files, detached when dropped.
//! - [`slots`]: crash-test content (slots rewritten by generations) and its checks, and a
//!   byte comparison that names the first differing sector.
//! - [`qemu_img`]: `qemu-img` map, convert and compare as a client of our servers.
//! - [`uml`]: the real Linux kernel (User-Mode Linux, fetched by `scripts/fetch-uml`) booted
//!   with test files as disks and a script as init, killed by process group on timeout.
//!
//! Nothing here is used outside `[dev-dependencies]`.
#![forbid(unsafe_code)]

pub mod certificates;
pub mod crash;
pub mod fault;
pub mod fixtures;
pub mod loop_device;
pub mod metadata_patch;
pub mod nbd_client;
pub mod process;
pub mod qemu_img;
pub mod scratch;
pub mod seed;
pub mod slots;
pub mod tools;
pub mod uml;

pub use crash::{CrashDevice, CrashMode};
pub use fault::{FaultDevice, Ops};
pub use process::{require_tool, run_ok, run_tool, wait_for, ChildGuard, Served};
pub use scratch::{sized_file, ScratchDir};
pub use seed::{case_count, pattern, seed_report, seeded_rng, test_seed, SeedReport};
pub use tools::{ThinTools, ToolOutput, ToolVersion};

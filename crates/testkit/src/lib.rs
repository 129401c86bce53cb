//! Dev-only test kit shared by every crate's tests.
//!
//! - [`crash`]: a metadata device that separates durable writes from volatile ones and can
//!   simulate a power cut (drop, reorder and tear unflushed writes).
//! - [`fault`]: a wrapper that fails the Nth I/O, corrupts reads and misdirects writes.
//! - [`seed`]: seeded randomness from `THINPOOL_SEED`, printed on failure so any run replays.
//! - [`tools`]: the real thin-provisioning-tools (0.9.0 from Debian 12, 1.1.0 fetched by
//!   `scripts/test`), run with captured output and a timeout.
//! - [`fixtures`]: the thin_dump XML fixtures (committed and generated).
//! - [`scratch`]: per-test temporary directories.
//!
//! Nothing here is used outside `[dev-dependencies]`.
#![forbid(unsafe_code)]

pub mod crash;
pub mod fault;
pub mod fixtures;
pub mod scratch;
pub mod seed;
pub mod tools;

pub use crash::{CrashDevice, CrashMode};
pub use fault::{FaultDevice, Ops};
pub use scratch::ScratchDir;
pub use seed::{case_count, seeded_rng, test_seed, SeedReport};
pub use tools::{ThinTools, ToolOutput, ToolVersion};

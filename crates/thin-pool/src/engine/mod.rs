//! The I/O engine: a pool open for I/O and management on a metadata device, a data device
//! and the volume catalog.
//!
//! It uses `crate::format::metadata::PoolMetadata` as its one metadata writer and never
//! touches on-disk structures directly. See ARCHITECTURE.md for the read, provisioning-write
//! and commit paths and the files each crosses.

pub mod catalog;
pub mod data_device;
pub mod gate;
pub mod index;
pub mod pool;
pub mod volume;

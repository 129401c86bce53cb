//! dm-thin semantics on top of `persistent-data`: pool metadata, volumes and the I/O engine.
#![forbid(unsafe_code)]

pub mod dump;
pub mod metadata_size;

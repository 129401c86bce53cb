//! Dump formats (thin_dump XML and human-readable): in progress.

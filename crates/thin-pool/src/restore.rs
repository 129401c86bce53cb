//! Building metadata from a dump (thin_restore equivalent): being written.

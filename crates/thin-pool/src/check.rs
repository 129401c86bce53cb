//! Metadata checker (thin_check equivalent): being written.

//! Metadata size estimates (thin_metadata_size): in progress.

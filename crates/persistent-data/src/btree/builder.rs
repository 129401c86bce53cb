//! Bottom-up btree building (for restore): being written.

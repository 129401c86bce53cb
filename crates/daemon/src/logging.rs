//! The binaries' log (`thinpool`, `thinpool-bench`; the libraries never install it, they only
//! emit events): `tracing` events from every crate (the libraries only emit them),
//! written to stderr one line each, with a UTC timestamp, the level, the span that names the
//! subject (an NBD connection's number and peer) and the event's fields (export, volume,
//! operation...).
//!
//! The level: info by default; `-v` debug, `-vv` trace, `-q` warn. `RUST_LOG`, when set,
//! replaces that choice with its own directives (`RUST_LOG=info,nbd=debug`). Nothing per
//! I/O is logged above debug.
//!
//! Only diagnostics go here: what a command prints as its result (the serve banner, list,
//! status) stays on stdout as it is.

use anyhow::Context;
use tracing_subscriber::EnvFilter;

/// The level `-v` (counted) and `-q` choose.
pub fn level(verbose: u8, quiet: bool) -> &'static str {
    match (quiet, verbose) {
        (true, _) => "warn",
        (false, 0) => "info",
        (false, 1) => "debug",
        (false, _) => "trace",
    }
}

/// Installs the subscriber for the rest of the process: stderr, no colours, `RUST_LOG` if
/// set, else `level`. Called once, before anything logs.
pub fn init(level: &str) -> anyhow::Result<()> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(directives) if !directives.trim().is_empty() => EnvFilter::try_new(&directives)
            .with_context(|| format!("RUST_LOG={directives:?} is not a valid filter"))?,
        _ => EnvFilter::new(level),
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init()
        .map_err(|error| anyhow::anyhow!("cannot install the logger: {error}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_choose_the_level() {
        assert_eq!(level(0, false), "info");
        assert_eq!(level(1, false), "debug");
        assert_eq!(level(2, false), "trace");
        assert_eq!(level(3, true), "warn");
    }
}

//! Stopping `thinpool serve` within a bounded time: the control socket, then the NBD
//! servers, then the pool's commit, each step saying what it closed; a watchdog that exits at
//! once on a second signal or past [`SHUTDOWN_DEADLINE`]; and the watch that reports, once,
//! when the pool enters fail mode.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use signal_hook::consts::SIGINT;
use signal_hook::iterator::Signals;
use thin_pool::{Pool, PoolMode};

use crate::control::ControlServer;

/// Longest shutdown, commit included, before the process exits regardless. The steps are
/// bounded on their own (control socket 5 s, NBD accept 2 s plus twice the grace), so this
/// only fires if the final commit hangs in I/O.
pub(super) const SHUTDOWN_DEADLINE: Duration = Duration::from_secs(60);
/// Exit status when shutdown was cut short (second signal or deadline).
pub(super) const EXIT_FORCED: i32 = 2;

/// Closes the control socket, then the NBD servers, then commits the pool, saying what each
/// step did. Every step is bounded (see the module notes).
pub(super) fn shut_down(
    control: ControlServer,
    servers: Vec<nbd::Server>,
    pool: &Pool,
) -> ExitCode {
    let control_report = control.shutdown();
    tracing::info!(
        "control socket closed ({} client{} disconnected{})",
        control_report.clients_closed,
        plural(control_report.clients_closed),
        if control_report.requests_unfinished > 0 {
            format!(
                "; {} request{} still running after {} s",
                control_report.requests_unfinished,
                plural(control_report.requests_unfinished),
                crate::control::STOP_WAIT.as_secs()
            )
        } else {
            String::new()
        }
    );
    let nbd_connections: usize = servers.iter().map(nbd::Server::connection_count).sum();
    // Ask every server first, so their grace periods run at the same time.
    for server in &servers {
        server.shutdown_handle().request();
    }
    for server in servers {
        server.shutdown();
    }
    tracing::info!(
        "NBD listeners closed ({nbd_connections} connection{} closed)",
        plural(nbd_connections)
    );
    let close = pool.close();
    let status = pool.status();
    match close {
        Ok(()) => match status.mode {
            PoolMode::Write | PoolMode::OutOfDataSpace => {
                tracing::info!(
                    "stopped; pool committed at transaction {}",
                    status.transaction_id
                );
                ExitCode::SUCCESS
            }
            mode => {
                tracing::info!(
                    "stopped; {}: nothing committed (the pool stays at transaction {})",
                    uncommittable(mode, status.needs_check),
                    status.transaction_id
                );
                ExitCode::SUCCESS
            }
        },
        Err(error) => {
            tracing::error!(
                "stopped; commit failed: {error}; the pool stays at transaction {}",
                status.transaction_id
            );
            ExitCode::FAILURE
        }
    }
}

/// How often the server looks whether the pool failed.
pub(super) const FAIL_WATCH_INTERVAL: Duration = Duration::from_secs(1);

/// Say on stderr, once, when the pool goes to fail mode (a panic or an I/O failure inside
/// the engine): the server keeps running and answering (every I/O gets EIO), and a restart
/// opens the last committed state. The thread stops when the returned sender is dropped.
pub(super) fn start_fail_watch(
    pool: Pool,
) -> anyhow::Result<(std::sync::mpsc::Sender<()>, std::thread::JoinHandle<()>)> {
    let (stop, stopped) = std::sync::mpsc::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("fail-watch".into())
        .spawn(move || {
            while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                stopped.recv_timeout(FAIL_WATCH_INTERVAL)
            {
                let status = pool.status();
                if status.mode == PoolMode::Fail {
                    tracing::error!(
                        "the pool failed ({}): every I/O now gets EIO; the last committed state is intact on disk, restart the server to reopen it",
                        status.fail_reason.as_deref().unwrap_or("no reason recorded")
                    );
                    return;
                }
            }
        })
        .context("cannot start the fail-watch thread")?;
    Ok((stop, thread))
}

pub(super) fn signal_name(signal: i32) -> &'static str {
    if signal == SIGINT {
        "SIGINT"
    } else {
        "SIGTERM"
    }
}

pub(super) fn plural(count: usize) -> &'static str {
    if count == 1 {
        ""
    } else {
        "s"
    }
}

/// Why a pool in `mode` takes no commit.
pub(super) fn uncommittable(mode: PoolMode, needs_check: bool) -> &'static str {
    match mode {
        PoolMode::ReadOnly if needs_check => "pool read-only (needs_check)",
        PoolMode::ReadOnly => "pool read-only",
        PoolMode::OutOfMetadataSpace => "pool out of metadata space",
        PoolMode::Fail => "pool failed",
        PoolMode::Write | PoolMode::OutOfDataSpace => "pool writable",
    }
}

/// Bounds shutdown as a whole: after [`SHUTDOWN_DEADLINE`], or at a second SIGINT/SIGTERM,
/// the process exits at once, as a crash would (the pool keeps its last commit; the commit
/// protocol makes that safe at any point). Each step of shutdown is bounded on its own; this
/// covers what is not, such as a data device that stops answering during the final commit.
pub(super) fn start_shutdown_watchdog(mut signals: Signals) -> anyhow::Result<()> {
    std::thread::Builder::new()
        .name("shutdown-signals".into())
        .spawn(move || {
            if let Some(signal) = signals.forever().next() {
                tracing::warn!(
                    "{} again: exiting now; the pool keeps its last commit",
                    signal_name(signal)
                );
                std::process::exit(EXIT_FORCED);
            }
        })
        .context("cannot start the signal thread")?;
    std::thread::Builder::new()
        .name("shutdown-deadline".into())
        .spawn(move || {
            std::thread::sleep(SHUTDOWN_DEADLINE);
            tracing::error!(
                "shutdown did not finish within {} s: exiting now; the pool keeps its last commit",
                SHUTDOWN_DEADLINE.as_secs()
            );
            std::process::exit(EXIT_FORCED);
        })
        .context("cannot start the shutdown deadline thread")?;
    Ok(())
}

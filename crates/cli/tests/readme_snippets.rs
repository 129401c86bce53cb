//! Goal (issue 25 item 8): every README and docs/ block marked runnable (an HTML comment
//! `<!-- runnable -->` on a line of its own before an indented block) runs as written: the
//! README's quick start (create, volume, serve, nbdinfo, snapshot, diff, thin_check), its
//! incremental backup, autoextend on a new pool and a trim through `serve`, and
//! send/receive between pools; docs/backup.md's recipe on a scratch
//! pool, checked against a full copy; docs/replication.md's local replication.
//! Method: the marked blocks are taken from one file in order and run as one `bash -e`
//! session (as a reader pastes them one after the other) in a scratch directory that is
//! also `$HOME`, with the built `thinpool` first on `PATH` and the repository's `scripts/`
//! linked in; each file is a session of its own. Any failing command fails the test, with
//! the session's output. What the session left running in the background (a `thinpool
//! serve &`) is listed by bash when it exits (`jobs -p`), and stopped by PID here, whatever
//! happened.

mod e2e_support;

use e2e_support::*;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The marker line before a runnable block.
const MARKER: &str = "<!-- runnable -->";

/// Longest run of the whole session.
const SESSION_TIMEOUT: Duration = Duration::from_secs(300);

fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The indented blocks that follow a [`MARKER`] line in `text`, without their indent.
fn runnable_blocks(text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().collect();
    let mut blocks = Vec::new();
    for (index, line) in lines.iter().enumerate() {
        if line.trim() != MARKER {
            continue;
        }
        let mut block = Vec::new();
        for line in lines[index + 1..]
            .iter()
            .skip_while(|line| line.trim().is_empty())
        {
            if let Some(code) = line.strip_prefix("    ") {
                block.push(code);
            } else if line.trim().is_empty() {
                block.push("");
            } else {
                break;
            }
        }
        assert!(
            block.iter().any(|line| !line.trim().is_empty()),
            "line {}: {MARKER} without an indented block after it",
            index + 1
        );
        blocks.push(block.join("\n").trim_end().to_string());
    }
    blocks
}

/// Stops, by PID, the processes listed in `file` (one a line) when dropped.
struct Leftovers {
    file: PathBuf,
}

impl Drop for Leftovers {
    fn drop(&mut self) {
        let Ok(text) = std::fs::read_to_string(&self.file) else {
            return;
        };
        for pid in text.split_whitespace() {
            let proc_dir = Path::new("/proc").join(pid);
            let _ = std::process::Command::new("kill")
                .args(["-TERM", pid])
                .status();
            let deadline = Instant::now() + Duration::from_secs(10);
            while proc_dir.exists() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            if proc_dir.exists() {
                let _ = std::process::Command::new("kill")
                    .args(["-KILL", pid])
                    .status();
            }
        }
    }
}

/// What a session printed, and its home directory (kept until the scratch is dropped).
struct Session {
    stdout: String,
    scratch: ScratchDir,
}

/// Runs `blocks` (of the file `name`) as one `bash -e` session; panics with its output if
/// a command fails.
fn run_session(name: &str, blocks: &[String]) -> Session {
    let scratch = ScratchDir::new(&format!("snippets-{}", name.replace(['/', '.'], "-")));
    let home = scratch.path();
    std::os::unix::fs::symlink(repository().join("scripts"), home.join("scripts")).unwrap();
    let jobs = home.join("jobs.pids");
    let _leftovers = Leftovers { file: jobs.clone() };
    let script = format!(
        "trap 'jobs -p > {}' EXIT\n{}\n",
        jobs.display(),
        blocks.join("\n")
    );
    let script_path = home.join("session.sh");
    std::fs::write(&script_path, &script).unwrap();

    let binary_dir = Path::new(THINPOOL).parent().unwrap();
    let path = format!(
        "{}:{}",
        binary_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let output = run_tool_in(
        "bash",
        &["-e", script_path.to_str().unwrap()],
        SESSION_TIMEOUT,
        Some(home),
        &[("HOME", home.to_str().unwrap()), ("PATH", &path)],
    );
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    let log = std::fs::read_to_string(home.join("serve.log")).unwrap_or_default();
    assert!(
        output.status.success(),
        "{name}'s blocks failed:\n--- script\n{script}\n--- stdout\n{stdout}\n--- stderr\n{stderr}\n--- serve.log\n{log}"
    );
    Session { stdout, scratch }
}

/// The runnable blocks of the repository's file `name`.
fn blocks_of(name: &str) -> Vec<String> {
    let text = std::fs::read_to_string(repository().join(name)).unwrap();
    runnable_blocks(&text)
}

#[test]
fn the_runnable_readme_blocks_run() {
    for tool in ["nbdinfo", "nbdcopy"] {
        require_tool(tool, "libnbd-bin");
    }
    require_tool("thin_check", "thin-provisioning-tools");
    let blocks = blocks_of("README.md");
    assert!(blocks.len() >= 3, "only {} runnable blocks", blocks.len());
    for wanted in ["thinpool serve", "incremental-backup", "thinpool receive"] {
        assert!(
            blocks.iter().any(|block| block.contains(wanted)),
            "no runnable block with {wanted:?}"
        );
    }
    let session = run_session("README.md", &blocks);
    let stdout = &session.stdout;
    // What each block prints, as the README says it does.
    assert!(stdout.contains("export-size: 21474836480"), "{stdout}");
    assert!(stdout.contains("\"ranges\": []"), "{stdout}");
    assert!(stdout.contains("copied "), "{stdout}");
    assert!(stdout.contains("received vm0-s2"), "{stdout}");
    assert!(stdout.contains("trimmed "), "{stdout}");
    let pool2 = session.scratch.join("pool2");
    let status = thinpool_ok(&["status", "--json", "--pool", pool2.to_str().unwrap()]);
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    assert_eq!(status["autoextend"]["threshold_percent"], 70, "{status}");
    let copy = session.scratch.join("copy");
    let volumes = listed_volumes(copy.to_str().unwrap());
    let names: Vec<&str> = volumes.iter().filter_map(|v| v["name"].as_str()).collect();
    assert_eq!(names, ["vm0-s2"], "{volumes:?}");
}

/// docs/backup.md: the recipe on a scratch pool (the doc's own setup block), the image
/// compared with a full copy of the second snapshot (`cmp`, in the doc), the difference
/// looked at by hand with nbdinfo and qemu-img.
#[test]
fn the_runnable_backup_doc_blocks_run() {
    for tool in ["nbdinfo", "nbdcopy"] {
        require_tool(tool, "libnbd-bin");
    }
    require_tool("qemu-img", "qemu-utils");
    let blocks = blocks_of("docs/backup.md");
    for wanted in [
        "thinpool serve",
        "incremental-backup",
        "cmp ",
        "nbdinfo --map",
    ] {
        assert!(
            blocks.iter().any(|block| block.contains(wanted)),
            "no runnable block with {wanted:?}"
        );
    }
    let session = run_session("docs/backup.md", &blocks);
    let stdout = &session.stdout;
    assert!(
        stdout.contains("copied 1048576 bytes in 1 extents"),
        "{stdout}"
    );
}

/// docs/replication.md: replication between two pools of this machine, twice (a full
/// stream, then an increment), the replica listed on the copy and the lag in `status`.
#[test]
fn the_runnable_replication_doc_blocks_run() {
    let blocks = blocks_of("docs/replication.md");
    assert!(
        blocks
            .iter()
            .any(|block| block.contains("thinpool replicate")),
        "no runnable block with thinpool replicate"
    );
    let session = run_session("docs/replication.md", &blocks);
    let copy = session.scratch.join("repl-copy");
    let volumes = listed_volumes(copy.to_str().unwrap());
    let names: Vec<&str> = volumes.iter().filter_map(|v| v["name"].as_str()).collect();
    assert_eq!(names.len(), 2, "{volumes:?}");
    assert!(
        names.iter().all(|n| n.starts_with("vm0.repl-")),
        "{names:?}"
    );
    assert!(session.stdout.contains("replication"), "{}", session.stdout);
}

/// Every docs/ file with runnable blocks has its test above (a newly marked file fails here
/// until it gets one).
#[test]
fn every_doc_with_runnable_blocks_is_run() {
    let tested = ["backup.md", "replication.md"];
    for entry in std::fs::read_dir(repository().join("docs")).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if !name.ends_with(".md") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let marked = !runnable_blocks(&text).is_empty();
        assert_eq!(marked, tested.contains(&name.as_str()), "docs/{name}");
    }
}

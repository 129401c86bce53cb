//! Goal (issue 25 item 8): every README block marked runnable (an HTML comment
//! `<!-- runnable -->` on a line of its own before an indented block) runs as written: the
//! quick start (create, volume, serve, nbdinfo, snapshot, diff, thin_check), the incremental
//! backup and send/receive between pools.
//! Method: the marked blocks are taken from README.md in order and run as one `bash -e`
//! session (as a reader pastes them one after the other) in a scratch directory that is
//! also `$HOME`, with the built `thinpool` first on `PATH` and the repository's `scripts/`
//! linked in. Any failing command fails the test, with the session's output. What the
//! session left running in the background (the `thinpool serve &` of the quick start) is
//! listed by bash when it exits (`jobs -p`), and stopped by PID here, whatever happened.

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
            "README line {}: {MARKER} without an indented block after it",
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

#[test]
fn the_runnable_readme_blocks_run() {
    for tool in ["nbdinfo", "nbdcopy"] {
        require_tool(tool, "libnbd-bin");
    }
    require_tool("thin_check", "thin-provisioning-tools");
    let readme = std::fs::read_to_string(repository().join("README.md")).unwrap();
    let blocks = runnable_blocks(&readme);
    assert!(blocks.len() >= 3, "only {} runnable blocks", blocks.len());
    for wanted in ["thinpool serve", "incremental-backup", "thinpool receive"] {
        assert!(
            blocks.iter().any(|block| block.contains(wanted)),
            "no runnable block with {wanted:?}"
        );
    }

    let scratch = ScratchDir::new("readme-snippets");
    let home = scratch.path();
    std::os::unix::fs::symlink(repository().join("scripts"), home.join("scripts")).unwrap();
    let jobs = home.join("jobs.pids");
    let _leftovers = Leftovers { file: jobs.clone() };
    let script = format!(
        "trap 'jobs -p > {}' EXIT\n{}\n",
        jobs.display(),
        blocks.join("\n")
    );
    let script_path = home.join("readme.sh");
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
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let log = std::fs::read_to_string(home.join("serve.log")).unwrap_or_default();
    assert!(
        output.status.success(),
        "the README's blocks failed:\n--- script\n{script}\n--- stdout\n{stdout}\n--- stderr\n{stderr}\n--- serve.log\n{log}"
    );
    // What each block prints, as the README says it does.
    assert!(stdout.contains("export-size: 21474836480"), "{stdout}");
    assert!(stdout.contains("\"ranges\": []"), "{stdout}");
    assert!(stdout.contains("copied "), "{stdout}");
    assert!(stdout.contains("received vm0-s2"), "{stdout}");
    let copy = home.join("copy");
    let volumes = listed_volumes(copy.to_str().unwrap());
    let names: Vec<&str> = volumes.iter().filter_map(|v| v["name"].as_str()).collect();
    assert_eq!(names, ["vm0-s2"], "{volumes:?}");
}

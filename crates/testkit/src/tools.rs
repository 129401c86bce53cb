//! The real thin-provisioning-tools, both versions our metadata must satisfy, found through one
//! helper: [`ThinTools`].
//!
//! | version | where | how it gets there |
//! | --- | --- | --- |
//! | 0.9.0 (C++) | `/usr/sbin` | Debian 12 package `thin-provisioning-tools` |
//! | 1.1.0 (Rust) | `$THINPOOL_TOOLS_DIR`, else `<workspace>/target/tools/thin-provisioning-tools-1.1.0/usr/sbin` | `scripts/fetch-thin-tools`, run by `scripts/test` |
//!
//! A missing or wrong version is a panic naming `scripts/test`: tests that need the tools
//! must not pass vacuously. Every tool runs with captured output and a timeout
//! ([`DEFAULT_TIMEOUT`], or `THINPOOL_TOOL_TIMEOUT_SECS`); on timeout the process is killed
//! (by its PID) and waited for, and the test panics.

use std::ffi::{OsStr, OsString};
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::sync::OnceLock;
use std::time::Duration;

/// Environment variable naming the directory of the 1.1.0 binaries.
pub const TOOLS_DIR_VARIABLE: &str = "THINPOOL_TOOLS_DIR";
/// Where `scripts/fetch-thin-tools` unpacks 1.1.0, relative to the workspace root.
pub const FETCHED_TOOLS_SUBDIR: &str = "target/tools/thin-provisioning-tools-1.1.0/usr/sbin";
/// Where Debian 12 installs 0.9.0.
pub const SYSTEM_TOOLS_DIR: &str = "/usr/sbin";
/// How long one tool run may take before it is killed.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);
/// Metadata size [`ThinTools::restore`] gives a new output file: 8 MiB (2048 blocks).
pub const DEFAULT_METADATA_SIZE_BYTES: u64 = 8 << 20;

/// A thin-provisioning-tools release we test against.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ToolVersion {
    /// The C++ tools, 0.9.0 (Debian 12). Restores without shared leaves; does not check
    /// data reference counts.
    V0_9,
    /// The Rust tools, 1.1.0 (Debian 13). Dumps and restores shared leaves (`<def>`/`<ref>`),
    /// checks data reference counts.
    V1_1,
}

impl ToolVersion {
    /// Both versions, oldest first.
    pub const ALL: [ToolVersion; 2] = [ToolVersion::V0_9, ToolVersion::V1_1];

    /// What `thin_check -V` prints.
    pub fn as_str(self) -> &'static str {
        match self {
            ToolVersion::V0_9 => "0.9.0",
            ToolVersion::V1_1 => "1.1.0",
        }
    }
}

impl fmt::Display for ToolVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What one tool run produced.
#[derive(Clone, Debug)]
pub struct ToolOutput {
    /// The command line, for messages.
    pub command: String,
    /// Exit status.
    pub status: ExitStatus,
    /// Standard output (lossy UTF-8).
    pub stdout: String,
    /// Standard error (lossy UTF-8).
    pub stderr: String,
}

impl ToolOutput {
    /// Whether the tool exited with status 0.
    pub fn success(&self) -> bool {
        self.status.success()
    }

    /// Panic with the whole output unless the tool exited with status 0.
    #[track_caller]
    pub fn assert_success(&self) -> &ToolOutput {
        assert!(self.success(), "{self}");
        self
    }

    /// Panic with the whole output unless the tool failed.
    #[track_caller]
    pub fn assert_failure(&self) -> &ToolOutput {
        assert!(!self.success(), "expected failure, but {self}");
        self
    }
}

impl fmt::Display for ToolOutput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "`{}` exited with {}", self.command, self.status)?;
        writeln!(f, "--- stdout ---\n{}", self.stdout.trim_end())?;
        write!(f, "--- stderr ---\n{}", self.stderr.trim_end())
    }
}

/// One installed version of thin-provisioning-tools.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ThinTools {
    /// Which release.
    pub version: ToolVersion,
    /// Directory holding `thin_check`, `thin_dump`, ...
    pub dir: PathBuf,
}

impl ThinTools {
    /// Both versions, oldest first. Panics (naming `scripts/test`) if either is missing.
    pub fn all() -> Vec<ThinTools> {
        ToolVersion::ALL
            .iter()
            .map(|&version| ThinTools::find(version))
            .collect()
    }

    /// The given version. Panics (naming `scripts/test`) if it is missing or reports another
    /// version.
    pub fn find(version: ToolVersion) -> ThinTools {
        static FOUND: [OnceLock<Result<PathBuf, String>>; 2] = [OnceLock::new(), OnceLock::new()];
        let slot = &FOUND[version as usize];
        match slot.get_or_init(|| locate(version)) {
            Ok(dir) => ThinTools {
                version,
                dir: dir.clone(),
            },
            Err(message) => panic!("{message}"),
        }
    }

    /// 0.9.0 from `/usr/sbin`.
    pub fn v0_9() -> ThinTools {
        ThinTools::find(ToolVersion::V0_9)
    }

    /// 1.1.0 from `$THINPOOL_TOOLS_DIR` or `target/tools`.
    pub fn v1_1() -> ThinTools {
        ThinTools::find(ToolVersion::V1_1)
    }

    /// Path of one tool binary, e.g. `tool("thin_check")`.
    pub fn tool(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Run `name` with `args`, capturing output, killed after the timeout (a panic).
    pub fn run<S: AsRef<OsStr>>(&self, name: &str, args: &[S]) -> ToolOutput {
        run_with_timeout(&self.tool(name), args, timeout())
    }

    /// `thin_check <path>`.
    pub fn check(&self, path: &Path) -> ToolOutput {
        self.run("thin_check", &[path.as_os_str()])
    }

    /// `thin_check <path>` with both versions; panics, with their output, unless both pass.
    pub fn check_all(path: &Path) {
        for tools in ThinTools::all() {
            tools.check(path).assert_success();
        }
    }

    /// `thin_check <extra args> <path>`, e.g. `--clear-needs-check-flag`.
    pub fn check_with(&self, path: &Path, args: &[&str]) -> ToolOutput {
        self.run("thin_check", &with_path(args, path))
    }

    /// `thin_dump <args> <path>`, returning standard output; panics if it fails.
    pub fn dump(&self, path: &Path, args: &[&str]) -> String {
        let output = self.dump_output(path, args);
        output.assert_success();
        output.stdout
    }

    /// `thin_dump <args> <path>`, whatever the outcome.
    pub fn dump_output(&self, path: &Path, args: &[&str]) -> ToolOutput {
        self.run("thin_dump", &with_path(args, path))
    }

    /// `thin_restore -i <xml> -o <out>`. If `out` does not exist it is created with
    /// [`DEFAULT_METADATA_SIZE_BYTES`] (thin_restore needs an existing output of the final
    /// metadata size). Returns the output whatever the outcome.
    pub fn restore(&self, xml: &Path, out: &Path) -> ToolOutput {
        self.restore_sized(xml, out, DEFAULT_METADATA_SIZE_BYTES)
    }

    /// Like [`restore`](Self::restore), creating a missing `out` with `size_bytes`.
    pub fn restore_sized(&self, xml: &Path, out: &Path, size_bytes: u64) -> ToolOutput {
        if !out.exists() {
            crate::scratch::sized_file(out, size_bytes);
        }
        let args: [&OsStr; 4] = [
            "-i".as_ref(),
            xml.as_os_str(),
            "-o".as_ref(),
            out.as_os_str(),
        ];
        self.run("thin_restore", &args)
    }

    /// `thin_ls <args> <path>`.
    pub fn ls(&self, path: &Path, args: &[&str]) -> ToolOutput {
        self.run("thin_ls", &with_path(args, path))
    }

    /// `thin_delta <args> <path>`, e.g. `&["--snap1", "0", "--snap2", "1"]`.
    pub fn delta(&self, path: &Path, args: &[&str]) -> ToolOutput {
        self.run("thin_delta", &with_path(args, path))
    }
}

fn with_path(args: &[&str], path: &Path) -> Vec<OsString> {
    args.iter()
        .map(OsString::from)
        .chain([path.as_os_str().to_owned()])
        .collect()
}

fn timeout() -> Duration {
    std::env::var("THINPOOL_TOOL_TIMEOUT_SECS")
        .ok()
        .and_then(|text| text.trim().parse().ok())
        .map(Duration::from_secs)
        .unwrap_or(DEFAULT_TIMEOUT)
}

fn locate(version: ToolVersion) -> Result<PathBuf, String> {
    let dir = match version {
        ToolVersion::V0_9 => PathBuf::from(SYSTEM_TOOLS_DIR),
        ToolVersion::V1_1 => fetched_tools_dir().ok_or_else(|| {
            format!(
                "thin-provisioning-tools 1.1.0 not found: set {TOOLS_DIR_VARIABLE} or create \
                 <workspace>/{FETCHED_TOOLS_SUBDIR}; run scripts/test (it fetches them via \
                 scripts/fetch-thin-tools)"
            )
        })?,
    };
    let check = dir.join("thin_check");
    if !check.exists() {
        return Err(format!(
            "thin-provisioning-tools {version}: {} is missing; run scripts/test (it installs \
             Debian's thin-provisioning-tools and fetches 1.1.0)",
            check.display()
        ));
    }
    let output = run_with_timeout(&check, &["-V"], Duration::from_secs(30));
    let reported = output.stdout.trim();
    if !output.success() || reported != version.as_str() {
        return Err(format!(
            "{} should be thin-provisioning-tools {version} but reports {reported:?}; run \
             scripts/test\n{output}",
            check.display()
        ));
    }
    Ok(dir)
}

/// `$THINPOOL_TOOLS_DIR`, else the first `target/tools/...` found walking up from the test's
/// crate (runtime `CARGO_MANIFEST_DIR`) or, failing that, from this crate.
fn fetched_tools_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os(TOOLS_DIR_VARIABLE) {
        return Some(PathBuf::from(dir));
    }
    let starts = [
        std::env::var_os("CARGO_MANIFEST_DIR").map(PathBuf::from),
        Some(PathBuf::from(env!("CARGO_MANIFEST_DIR"))),
    ];
    for start in starts.into_iter().flatten() {
        for ancestor in start.ancestors() {
            let candidate = ancestor.join(FETCHED_TOOLS_SUBDIR);
            if candidate.join("thin_check").exists() {
                return Some(candidate);
            }
        }
    }
    None
}

/// Run `program` with `args` through [`crate::process::run_command`] (captured output,
/// killed by PID at `limit`).
fn run_with_timeout<S: AsRef<OsStr>>(program: &Path, args: &[S], limit: Duration) -> ToolOutput {
    let command = std::iter::once(program.display().to_string())
        .chain(
            args.iter()
                .map(|a| a.as_ref().to_string_lossy().into_owned()),
        )
        .collect::<Vec<_>>()
        .join(" ");
    let mut process = Command::new(program);
    process.args(args);
    let output = crate::process::run_command(process, &command, limit);
    ToolOutput {
        command,
        status: output.status,
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ScratchDir;
    use std::time::Instant;

    const XML: &str = r#"<superblock uuid="" time="1" transaction="2" version="2" data_block_size="128" nr_data_blocks="100">
  <device dev_id="0" mapped_blocks="3" transaction="0" creation_time="0" snap_time="1">
    <range_mapping origin_begin="0" data_begin="10" length="2" time="0"/>
    <single_mapping origin_block="9" data_block="50" time="0"/>
  </device>
  <device dev_id="1" mapped_blocks="2" transaction="1" creation_time="1" snap_time="1">
    <range_mapping origin_begin="0" data_begin="10" length="2" time="0"/>
  </device>
</superblock>
"#;

    #[test]
    fn both_versions_are_found_and_report_their_version() {
        let all = ThinTools::all();
        assert_eq!(all.len(), 2);
        assert_eq!(all[0].version, ToolVersion::V0_9);
        assert_eq!(all[1].version, ToolVersion::V1_1);
        for tools in all {
            let output = tools.run("thin_check", &["-V"]);
            assert_eq!(
                output.assert_success().stdout.trim(),
                tools.version.as_str()
            );
        }
    }

    #[test]
    fn restore_check_dump_ls_delta_work_with_both_versions() {
        let scratch = ScratchDir::new("tools-roundtrip");
        let xml = scratch.join("in.xml");
        std::fs::write(&xml, XML).unwrap();
        for tools in ThinTools::all() {
            let meta = scratch.join(format!("meta-{}", tools.version));
            tools.restore(&xml, &meta).assert_success();
            assert_eq!(
                std::fs::metadata(&meta).unwrap().len(),
                DEFAULT_METADATA_SIZE_BYTES
            );
            tools.check(&meta).assert_success();
            let dump = tools.dump(&meta, &[]);
            assert!(dump.contains(r#"data_begin="10" length="2""#), "{dump}");
            assert!(dump.contains(r#"data_block="50""#), "{dump}");
            tools.ls(&meta, &[]).assert_success();
            tools
                .delta(&meta, &["--snap1", "0", "--snap2", "1"])
                .assert_success();
        }
    }

    #[test]
    fn check_reports_garbage_as_failure() {
        let scratch = ScratchDir::new("tools-garbage");
        let meta = scratch.join("garbage");
        std::fs::write(&meta, vec![0xA5u8; 1 << 20]).unwrap();
        for tools in ThinTools::all() {
            tools.check(&meta).assert_failure();
        }
    }

    #[test]
    fn a_hung_tool_is_killed_at_the_timeout() {
        let started = Instant::now();
        let result = std::panic::catch_unwind(|| {
            run_with_timeout(Path::new("/bin/sleep"), &["30"], Duration::from_millis(200))
        });
        let message = *result.unwrap_err().downcast::<String>().unwrap();
        assert!(message.contains("was killed"), "{message}");
        assert!(started.elapsed() < Duration::from_secs(10));
    }
}

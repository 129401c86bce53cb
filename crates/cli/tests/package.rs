//! The Debian package: `scripts/build-deb` (cargo-deb) builds it, `dpkg -x` installs it into
//! a scratch root, and the files it installs are checked: the binary runs, the systemd units
//! start the packaged binary, the man pages and the bash, zsh and fish completions are where
//! man and the shells look, and the installed bash completion completes.
//!
//! `dpkg -x` and not `dpkg --root`: the latter needs a dpkg database in the root and runs
//! maintainer scripts chrooted there (no shell in an empty root); the package has none, so
//! unpacking is what installing does.
//!
//! Ignored by default (it runs cargo, which would wait on the lock of a workspace `cargo
//! test`, and without `THINPOOL_DEB_PROFILE=dev` builds the release binary); scripts/test runs
//! it in its "debian package" stage with the debug binary, after scripts/fetch-cargo-deb.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;
use testkit::process::{require_tool, run_ok, run_tool};
use testkit::scratch::ScratchDir;

/// Building the release binary from nothing on a busy two-core machine.
const BUILD_TIMEOUT: Duration = Duration::from_secs(3600);
const TIMEOUT: Duration = Duration::from_secs(60);

/// What the package must install (paths in the root).
const INSTALLED: [&str; 12] = [
    "usr/bin/thinpool",
    "lib/systemd/system/thinpool@.service",
    "lib/systemd/system/thinpool@.socket",
    "usr/share/man/man1/thinpool.1.gz",
    "usr/share/man/man1/thinpool-serve.1.gz",
    "usr/share/man/man1/thinpool-volume-create.1.gz",
    "usr/share/man/man1/thinpool-volume-list.1.gz",
    "usr/share/man/man1/thinpool-check.1.gz",
    "usr/share/bash-completion/completions/thinpool",
    "usr/share/zsh/vendor-completions/_thinpool",
    "usr/share/fish/vendor_completions.d/thinpool.fish",
    "usr/share/doc/thinpool/copyright",
];

/// Builds the package; returns the path of the .deb.
fn build_deb() -> String {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let script = workspace.join("scripts/build-deb");
    let stdout = run_ok(&script, &[], BUILD_TIMEOUT);
    let deb = stdout.lines().last().unwrap_or_default().trim().to_owned();
    assert!(
        deb.ends_with(".deb") && Path::new(&deb).is_file(),
        "no .deb: {stdout}"
    );
    deb
}

#[test]
#[ignore = "runs cargo and cargo-deb: scripts/test runs it in its own stage"]
fn the_debian_package_installs_a_working_thinpool() {
    require_tool("dpkg-deb", "dpkg");
    let deb = build_deb();
    let fields = run_ok(
        "dpkg-deb",
        &["--field", &deb, "Package", "Version", "Depends"],
        TIMEOUT,
    );
    assert!(fields.contains("Package: thinpool\n"), "{fields}");
    let version = env!("CARGO_PKG_VERSION");
    assert!(fields.contains(&format!("Version: {version}")), "{fields}");
    assert!(
        fields.contains("libc6"),
        "no shared-library dependency: {fields}"
    );
    let contents = run_ok("dpkg-deb", &["--contents", &deb], TIMEOUT);
    assert!(
        contents
            .lines()
            .all(|line| line.split_whitespace().nth(1) == Some("0/0")),
        "files not owned by root: {contents}"
    );

    let scratch = ScratchDir::new("package");
    let root = scratch.join("root");
    run_ok("dpkg", &["-x", &deb, root.to_str().unwrap()], TIMEOUT);
    for path in INSTALLED {
        assert!(
            root.join(path).is_file(),
            "{path} not installed:\n{contents}"
        );
    }
    let binary = root.join("usr/bin/thinpool");
    let mode = std::fs::metadata(&binary).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o755, "{mode:o}");

    check_binary(&binary);
    check_units(&root);
    check_man_pages(&root);
    check_completion(&root);
}

/// The installed binary runs and is the one just built.
fn check_binary(binary: &Path) {
    let version = run_ok(binary, &["--version"], TIMEOUT);
    assert_eq!(
        version.trim(),
        format!("thinpool {}", env!("CARGO_PKG_VERSION"))
    );
    let help = run_ok(binary, &["--help"], TIMEOUT);
    assert!(
        help.contains("THINPOOL_POOL") && help.contains("Examples:"),
        "{help}"
    );
    let help = run_ok(binary, &["volume", "list", "--help"], TIMEOUT);
    assert!(help.contains("--json"), "{help}");
}

/// The units start the packaged binary, and systemd accepts them.
fn check_units(root: &Path) {
    let service =
        std::fs::read_to_string(root.join("lib/systemd/system/thinpool@.service")).unwrap();
    assert!(
        service.contains("\nExecStart=/usr/bin/thinpool serve --pool %f\n"),
        "{service}"
    );
    assert!(!service.contains("/usr/local/bin"), "{service}");
    require_tool("systemd-analyze", "systemd");
    // Verified as instances, with ExecStart pointing into the scratch root.
    let units = root.join("units");
    std::fs::create_dir(&units).unwrap();
    let mut paths = Vec::new();
    for suffix in ["service", "socket"] {
        let text =
            std::fs::read_to_string(root.join(format!("lib/systemd/system/thinpool@.{suffix}")))
                .unwrap();
        let binary = root.join("usr/bin/thinpool");
        let text = text.replace("/usr/bin/thinpool", binary.to_str().unwrap());
        let path = units.join(format!("thinpool@var-lib-thinpool-pool.{suffix}"));
        std::fs::write(&path, text).unwrap();
        paths.push(path.to_str().unwrap().to_owned());
    }
    let output = run_tool(
        "systemd-analyze",
        &["verify", "--man=no", &paths[0], &paths[1]],
        TIMEOUT,
    );
    let complaints = String::from_utf8_lossy(&output.stderr);
    let ours: Vec<&str> = complaints
        .lines()
        .filter(|line| line.contains("thinpool"))
        .collect();
    assert!(ours.is_empty(), "systemd-analyze verify: {complaints}");
}

/// The man pages are gzipped roff with their examples, and man renders them.
fn check_man_pages(root: &Path) {
    let dir = root.join("usr/share/man/man1");
    let page = dir.join("thinpool-serve.1.gz");
    let roff = run_ok("gzip", &["-dc", page.to_str().unwrap()], TIMEOUT);
    assert!(
        roff.contains("\n.TH thinpool-serve 1 "),
        "{}",
        &roff[..200.min(roff.len())]
    );
    assert!(
        roff.contains("\n.SH EXAMPLES\n"),
        "no examples in thinpool-serve.1"
    );
    if Path::new("/usr/bin/man").exists() {
        let top = dir.join("thinpool.1.gz");
        let text = run_ok("man", &["-l", top.to_str().unwrap()], TIMEOUT);
        assert!(text.contains("THINPOOL_POOL"), "{text}");
    }
}

/// The installed bash completion completes subcommands (bash sources it by command name).
fn check_completion(root: &Path) {
    require_tool("bash", "bash");
    let script = root.join("usr/share/bash-completion/completions/thinpool");
    let program = format!(
        "source '{}'
COMP_WORDS=(thinpool volume l); COMP_CWORD=2; COMP_LINE='thinpool volume l'; COMP_POINT=17
_thinpool thinpool l volume
printf '%s\\n' \"${{COMPREPLY[@]}}\"",
        script.display()
    );
    let offered = run_ok("bash", &["--norc", "--noprofile", "-c", &program], TIMEOUT);
    assert_eq!(offered.trim(), "list", "{offered}");
    let zsh =
        std::fs::read_to_string(root.join("usr/share/zsh/vendor-completions/_thinpool")).unwrap();
    assert!(zsh.starts_with("#compdef thinpool"));
    let fish =
        std::fs::read_to_string(root.join("usr/share/fish/vendor_completions.d/thinpool.fish"))
            .unwrap();
    assert!(fish.contains("complete -c thinpool"));
}

//! The generated shell completions and man pages (`thinpool completions SHELL`,
//! `thinpool man-pages DIR`), and the command line they describe: `--pool` before the
//! subcommand, `volume list`, examples in `--help`.
//!
//! Bash completion is tested by driving the completion function as bash does on TAB: the
//! script is sourced, `COMP_WORDS`/`COMP_CWORD` are set to a partial command line, the
//! function bash registered for `thinpool` (`complete -p thinpool`) runs, and `COMPREPLY`
//! is read back. Volume names are completed from a pool no server holds, named by `--pool`
//! on the line or by `THINPOOL_POOL`, with the built binary first on `PATH`.

use std::path::{Path, PathBuf};
use std::time::Duration;
use testkit::process::{require_tool, run_ok, run_tool, run_tool_in};
use testkit::scratch::ScratchDir;

const THINPOOL: &str = env!("CARGO_BIN_EXE_thinpool");
const TIMEOUT: Duration = Duration::from_secs(60);

/// The bash completion script, written to `dir`.
fn bash_script(dir: &ScratchDir) -> PathBuf {
    let script = run_ok(THINPOOL, &["completions", "bash"], TIMEOUT);
    let path = dir.join("thinpool.bash");
    std::fs::write(&path, script).unwrap();
    path
}

/// What bash completion offers for `line` (words separated by spaces; a trailing space
/// means completing a new, empty word), with the completion script at `script`.
fn complete(script: &Path, line: &str) -> Vec<String> {
    complete_with(script, line, &[])
}

/// [`complete`] with `env` set, and the built `thinpool` first on `PATH` (the completion of
/// volume names runs it).
fn complete_with(script: &Path, line: &str, env: &[(&str, &str)]) -> Vec<String> {
    require_tool("bash", "bash");
    let mut words: Vec<&str> = line.split(' ').collect();
    if words.last() != Some(&"") && line.ends_with(' ') {
        words.push("");
    }
    let quoted: Vec<String> = words.iter().map(|word| format!("'{word}'")).collect();
    let cword = words.len() - 1;
    let program = format!(
        "source '{script}'
COMP_WORDS=({words})
COMP_CWORD={cword}
COMP_LINE='{line}'
COMP_POINT=${{#COMP_LINE}}
function=$(complete -p thinpool | sed -E 's/.* -F ([^ ]+) .*/\\1/')
\"$function\" thinpool \"${{COMP_WORDS[COMP_CWORD]}}\" \"${{COMP_WORDS[COMP_CWORD-1]}}\"
printf '%s\\n' \"${{COMPREPLY[@]}}\"",
        script = script.display(),
        words = quoted.join(" "),
    );
    let binary_dir = Path::new(THINPOOL).parent().unwrap().display().to_string();
    let path = format!("{binary_dir}:{}", std::env::var("PATH").unwrap_or_default());
    let mut env = env.to_vec();
    env.push(("PATH", &path));
    let output = run_tool_in(
        "bash",
        &["--norc", "--noprofile", "-c", &program],
        TIMEOUT,
        None,
        &env,
    );
    assert!(output.status.success(), "{output:?}");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|word| !word.is_empty())
        .map(str::to_owned)
        .collect()
}

#[track_caller]
fn assert_offers(offered: &[String], expected: &[&str]) {
    for word in expected {
        assert!(
            offered.iter().any(|w| w == word),
            "{word:?} not offered: {offered:?}"
        );
    }
}

#[test]
fn bash_completes_subcommands_options_and_values() {
    let dir = ScratchDir::new("completions");
    let script = bash_script(&dir);
    assert_eq!(complete(&script, "thinpool vol"), ["volume"]);
    let top = complete(&script, "thinpool ");
    assert_offers(
        &top,
        &[
            "check",
            "serve",
            "volume",
            "list",
            "completions",
            "man-pages",
            "--pool",
        ],
    );
    let volume = complete(&script, "thinpool volume ");
    assert_offers(&volume, &["create", "snapshot", "delete", "resize", "list"]);
    assert_eq!(complete(&script, "thinpool volume sn"), ["snapshot"]);
    let serve = complete(&script, "thinpool serve --tc");
    assert_offers(&serve, &["--tcp", "--tcp-export"]);
    assert!(serve.iter().all(|w| w.starts_with("--tc")), "{serve:?}");
    assert_offers(
        &complete(&script, "thinpool volume create vm0 --"),
        &["--size", "--pool", "--json"],
    );
    // Values of options with a fixed set.
    let shells = complete(&script, "thinpool completions ");
    assert_offers(&shells, &["bash", "zsh", "fish"]);
    let formats = complete(&script, "thinpool dump --format ");
    assert_offers(&formats, &["xml", "human_readable"]);
    // `--pool DIR` before the subcommand: its value is skipped, the subcommand still found.
    assert_offers(
        &complete(&script, "thinpool --pool /srv/pool list --"),
        &["--json", "--ids"],
    );
    // The drop-in tools take no pool directory: `--pool` is not offered there.
    let check = complete(&script, "thinpool check --");
    assert_offers(&check, &["--super-block-only", "--quiet"]);
    assert!(!check.iter().any(|w| w == "--pool"), "{check:?}");
}

/// `thinpool volume delete <TAB>` offers the pool's volumes (offline: no server holds it),
/// from `--pool` on the line or `THINPOOL_POOL`; arguments that name a new volume or take
/// a size do not.
#[test]
fn bash_completes_volume_names_of_an_offline_pool() {
    let dir = ScratchDir::new("completions-volumes");
    let script = bash_script(&dir);
    let pool = dir.join("pool");
    let pool = pool.to_str().unwrap();
    run_ok(
        THINPOOL,
        &["create", "--pool", pool, "--data-size", "64M"],
        TIMEOUT,
    );
    for name in ["vm0", "vm1", "web"] {
        let args = ["volume", "create", name, "--size", "1M", "--pool", pool];
        run_ok(THINPOOL, &args, TIMEOUT);
    }
    let by_variable = [("THINPOOL_POOL", pool)];
    let sorted = |mut words: Vec<String>| {
        words.sort();
        words
    };
    let offered = complete_with(&script, "thinpool volume delete ", &by_variable);
    assert_eq!(sorted(offered), ["vm0", "vm1", "web"]);
    let offered = complete_with(&script, "thinpool volume delete v", &by_variable);
    assert_eq!(sorted(offered), ["vm0", "vm1"]);
    let line = format!("thinpool volume delete --pool {pool} w");
    assert_eq!(complete(&script, &line), ["web"]);
    let line = format!("thinpool --pool {pool} volume delete w");
    assert_eq!(complete(&script, &line), ["web"]);
    // The second volume of a diff, a snapshot's origin, send's --base.
    let offered = complete_with(&script, "thinpool diff vm0 w", &by_variable);
    assert_eq!(offered, ["web"]);
    let offered = complete_with(&script, "thinpool volume snapshot w", &by_variable);
    assert_eq!(offered, ["web"]);
    let offered = complete_with(&script, "thinpool send vm0 --base w", &by_variable);
    assert_eq!(offered, ["web"]);
    // Not a volume: a new name, a size, options.
    for line in [
        "thinpool volume create w",
        "thinpool volume snapshot vm0 w",
        "thinpool volume resize vm0 --size w",
    ] {
        let offered = complete_with(&script, line, &by_variable);
        assert!(!offered.iter().any(|w| w == "web"), "{line}: {offered:?}");
    }
    assert_offers(
        &complete_with(&script, "thinpool volume delete --", &by_variable),
        &["--pool", "--json"],
    );
    // No pool there: nothing offered, and no error.
    let none = [("THINPOOL_POOL", "/nonexistent/pool")];
    let offered = complete_with(&script, "thinpool volume delete w", &none);
    assert!(!offered.iter().any(|w| w == "web"), "{offered:?}");
}

#[test]
fn zsh_and_fish_scripts_name_the_subcommands() {
    let zsh = run_ok(THINPOOL, &["completions", "zsh"], TIMEOUT);
    assert!(
        zsh.starts_with("#compdef thinpool"),
        "{}",
        &zsh[..80.min(zsh.len())]
    );
    let fish = run_ok(THINPOOL, &["completions", "fish"], TIMEOUT);
    for needle in ["-a \"volume\"", "-l pool", "-a \"list\"", "-l tcp-export"] {
        assert!(fish.contains(needle), "fish script lacks {needle:?}");
    }
    let unknown = run_tool(THINPOOL, &["completions", "tcsh"], TIMEOUT);
    assert_eq!(unknown.status.code(), Some(2), "{unknown:?}");
}

#[test]
fn man_pages_cover_every_command_with_its_examples() {
    let dir = ScratchDir::new("man");
    let listed = run_ok(
        THINPOOL,
        &["man-pages", dir.join("man").to_str().unwrap()],
        TIMEOUT,
    );
    let names: Vec<String> = std::fs::read_dir(dir.join("man"))
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(listed.lines().count(), names.len(), "{listed}");
    for name in [
        "thinpool.1",
        "thinpool-serve.1",
        "thinpool-check.1",
        "thinpool-volume.1",
        "thinpool-volume-create.1",
        "thinpool-volume-list.1",
        "thinpool-metadata-snap-reserve.1",
        "thinpool-completions.1",
        "thinpool-man-pages.1",
        "thinpool-man-pages.1",
    ] {
        assert!(names.iter().any(|n| n == name), "{name} missing: {names:?}");
    }
    assert!(!names.iter().any(|n| n.contains("help")), "{names:?}");
    for name in &names {
        let page = std::fs::read_to_string(dir.join("man").join(name)).unwrap();
        assert!(
            page.starts_with(".ie \\n(.g .ds Aq") || page.contains("\n.TH "),
            "{name}"
        );
        assert!(
            page.contains("\n.SH EXAMPLES\n.nf\n"),
            "{name} has no examples"
        );
        assert!(!page.contains(".SH EXTRA"), "{name}");
    }
    let top = std::fs::read_to_string(dir.join("man/thinpool.1")).unwrap();
    assert!(
        top.contains("THINPOOL_POOL"),
        "thinpool.1 does not name THINPOOL_POOL"
    );
    let serve = std::fs::read_to_string(dir.join("man/thinpool-serve.1")).unwrap();
    assert!(
        serve.contains("\\-\\-tcp\\-export"),
        "thinpool-serve.1 lacks --tcp-export"
    );
    // Rendered as a reader sees it, where man is installed.
    if Path::new("/usr/bin/man").exists() {
        let page = dir.join("man/thinpool-volume-create.1");
        let output = run_tool_in(
            "man",
            &["-l", page.to_str().unwrap()],
            TIMEOUT,
            None,
            &[("MANWIDTH", "100"), ("MAN_KEEP_FORMATTING", "0")],
        );
        let text = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "{output:?}");
        assert!(
            text.contains("thinpool volume create vm0 --size 20G --pool /srv/pool"),
            "{text}"
        );
    }
}

#[test]
fn pool_is_accepted_before_the_subcommand_and_refused_where_unused() {
    let dir = ScratchDir::new("global-pool");
    let pool = dir.join("pool");
    let pool = pool.to_str().unwrap();
    run_ok(
        THINPOOL,
        &["--pool", pool, "create", "--data-size", "64M"],
        TIMEOUT,
    );
    run_ok(
        THINPOOL,
        &["--pool", pool, "volume", "create", "vm0", "--size", "1G"],
        TIMEOUT,
    );
    run_ok(
        THINPOOL,
        &["volume", "--pool", pool, "create", "vm1", "--size", "1G"],
        TIMEOUT,
    );
    // `volume list` is `list`, wherever --pool stands.
    let listed = run_ok(THINPOOL, &["--pool", pool, "volume", "list"], TIMEOUT);
    assert_eq!(listed, run_ok(THINPOOL, &["list", "--pool", pool], TIMEOUT));
    let names: Vec<&str> = listed
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert_eq!(names, ["vm0", "vm1"], "{listed}");
    // After the subcommand wins over before it.
    let other = dir.join("other");
    let output = run_tool(
        THINPOOL,
        &["--pool", pool, "list", "--pool", other.to_str().unwrap()],
        TIMEOUT,
    );
    assert!(!output.status.success());
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("other"),
        "{output:?}"
    );
    // The drop-in tools take files, not a pool directory: --pool anywhere is a usage error.
    let metadata = format!("{pool}/metadata");
    for args in [
        vec!["--pool", pool, "check", &metadata],
        vec!["check", "--pool", pool, &metadata],
    ] {
        let output = run_tool(THINPOOL, &args, TIMEOUT);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {output:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains("takes no pool directory"),
            "{args:?}: {stderr}"
        );
    }
    run_ok(THINPOOL, &["check", &metadata], TIMEOUT);
}

#[test]
fn top_level_help_names_the_pool_variable_and_gives_examples() {
    let help = run_ok(THINPOOL, &["--help"], TIMEOUT);
    assert!(help.contains("THINPOOL_POOL"), "{help}");
    assert!(
        help.contains("Examples:\n  thinpool create --pool"),
        "{help}"
    );
    assert!(help.contains("--pool <DIR>"), "{help}");
    let volume = run_ok(THINPOOL, &["volume", "--help"], TIMEOUT);
    assert!(
        volume.contains("list ") && volume.contains("Examples:"),
        "{volume}"
    );
}

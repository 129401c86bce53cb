//! Goal (issue 25 item 3): the long commands (check, restore, dump, trim, import, diff,
//! send, receive) draw progress on stderr when it is a terminal or with `--progress`, and
//! never otherwise; never on stdout, so `--json` and the other outputs are the same with or
//! without it.
//! Method: a pool made with the binary, a volume written through the library and a
//! snapshot of it; each command run with stderr a pipe, with `--progress` (its bar, drawn
//! by indicatif, shows up on stderr: the operation's name and the line clears) and without
//! it or with `--no-progress` (no escape sequence on stderr at all), stdout compared
//! between the runs (and parsed, for `--json`). A terminal: the command run under
//! `script` (util-linux), which gives it a pseudo-terminal, draws without the flag. Import
//! runs on loop devices (skipped where they cannot be attached).

mod e2e_support;

use e2e_support::*;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use testkit::loop_device::LoopDevice;
use thin_pool::{Pool, PoolOptions};

/// What indicatif writes to clear the bar's line (each redraw, and at the end).
const CLEAR_LINE: &str = "\r\x1b[2K";

/// A pool with volume `vm` (some blocks written) and its read-only snapshot `snap`, then
/// more blocks of `vm` written (so the two differ).
fn pool_with_data(dir: &Path) {
    create_pool(dir, &["--data-size", "256M"]);
    let pool = Pool::open(dir, PoolOptions::default()).unwrap();
    pool.create_volume("vm", 64 * MIB).unwrap();
    let volume = pool.volume("vm").unwrap();
    for block in 0..64u64 {
        volume
            .write(block * 3 * 65536, &pattern(block, 65536), false)
            .unwrap();
    }
    drop(volume);
    pool.snapshot("vm", "snap", true).unwrap();
    let volume = pool.volume("vm").unwrap();
    volume.write(5 * 65536, &pattern(99, 65536), false).unwrap();
    drop(volume);
    pool.close().unwrap();
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[track_caller]
fn assert_progress(output: &Output, what: &str) {
    assert!(output.status.success(), "failed: {}", stderr(output));
    let text = stderr(output);
    assert!(text.contains(CLEAR_LINE), "no bar drawn: {text:?}");
    assert!(text.contains(what), "no {what:?} on stderr: {text:?}");
}

#[track_caller]
fn assert_no_progress(output: &Output) {
    assert!(output.status.success(), "failed: {}", stderr(output));
    let text = stderr(output);
    assert!(!text.contains('\x1b'), "progress drawn: {text:?}");
}

/// `thinpool ARGS` with `--progress`, then without it, then with `--no-progress`: progress
/// on stderr the first time only, stdout the same each time (returned).
#[track_caller]
fn with_and_without(args: &[&str], what: &str) -> Vec<u8> {
    let outputs = runs(args, what);
    assert_eq!(outputs[0], outputs[1], "stdout of {args:?} changed");
    assert_eq!(outputs[2], outputs[1], "stdout of {args:?} changed");
    outputs[1].clone()
}

/// [`with_and_without`] for a command whose answer changes from run to run (a trim gives
/// back a block once): the three stdouts.
#[track_caller]
fn runs(args: &[&str], what: &str) -> [Vec<u8>; 3] {
    let mut forced = vec!["--progress"];
    forced.extend_from_slice(args);
    let shown = thinpool(&forced);
    assert_progress(&shown, what);
    let plain = thinpool(args);
    assert_no_progress(&plain);
    let mut refused = vec!["--no-progress"];
    refused.extend_from_slice(args);
    let never = thinpool(&refused);
    assert_no_progress(&never);
    [shown.stdout, plain.stdout, never.stdout]
}

#[test]
fn offline_commands_draw_progress_only_when_asked_and_stdout_is_unchanged() {
    let scratch = ScratchDir::new("progress-offline");
    let dir = scratch.join("pool");
    pool_with_data(&dir);
    let pool = dir.to_str().unwrap();
    let metadata = dir.join("metadata");
    let metadata = metadata.to_str().unwrap();

    // check: a bar instead of thin_check's phase lines; the figures on stdout stay.
    let stdout = with_and_without(&["check", metadata], "check");
    assert!(String::from_utf8_lossy(&stdout).contains("TRANSACTION_ID="));
    let plain = thinpool(&["check", metadata]);
    assert!(stderr(&plain).contains("Checking thin metadata"));

    // dump to stdout (a pipe): the XML is the same, the bar on stderr.
    let xml = with_and_without(&["dump", metadata], "dump");
    assert!(String::from_utf8_lossy(&xml).contains("<superblock"));
    // -q silences it.
    assert_no_progress(&thinpool(&["--progress", "dump", "-q", metadata]));

    // restore of that XML into a copy of the metadata.
    let xml_path = scratch.join("pool.xml");
    std::fs::write(&xml_path, &xml).unwrap();
    let restored = scratch.join("restored");
    sized_file(&restored, 8 * MIB);
    let (xml_arg, restored_arg) = (xml_path.to_str().unwrap(), restored.to_str().unwrap());
    assert_progress(
        &thinpool(&["--progress", "restore", "-i", xml_arg, "-o", restored_arg]),
        "restore",
    );
    assert_no_progress(&thinpool(&["restore", "-i", xml_arg, "-o", restored_arg]));
    let again = thinpool(&["dump", restored_arg]);
    assert_eq!(again.stdout, xml, "the restored metadata dumps otherwise");

    // diff --json: parseable with the bar beside it, which counts the virtual blocks.
    let json = with_and_without(&["diff", "snap", "vm", "--json", "--pool", pool], "diff");
    let diff: serde_json::Value = serde_json::from_slice(&json).expect("diff --json");
    assert_eq!(diff["ranges"].as_array().map(Vec::len), Some(1), "{diff}");
    assert_progress(
        &thinpool(&["--progress", "diff", "snap", "vm", "--pool", pool]),
        "/1024 blocks",
    );

    // trim --json.
    for json in runs(&["trim", "--json", "--pool", pool], "trim") {
        let trim: serde_json::Value = serde_json::from_slice(&json).expect("trim --json");
        assert!(trim["trimmed_bytes"].is_u64(), "{trim}");
    }
    // The flag after the subcommand too (it is global), and its explicit forms.
    assert_progress(&thinpool(&["trim", "--pool", pool, "--progress"]), "trim");
    assert_progress(
        &thinpool(&["--progress=always", "trim", "--pool", pool]),
        "trim",
    );
    assert_no_progress(&thinpool(&["--progress=never", "trim", "--pool", pool]));
    assert_no_progress(&thinpool(&["--progress=auto", "trim", "--pool", pool]));

    // send to a file, receive from it into another pool (a bar of the file's bytes).
    let stream = scratch.join("snap.stream");
    let stream_arg = stream.to_str().unwrap();
    let sent = thinpool(&[
        "--progress",
        "send",
        "snap",
        "-o",
        stream_arg,
        "--pool",
        pool,
    ]);
    assert_progress(&sent, "send");
    assert!(stderr(&sent).contains("sent snap"), "{}", stderr(&sent));
    assert_no_progress(&thinpool(&[
        "send", "snap", "-o", stream_arg, "--pool", pool,
    ]));
    let copy = scratch.join("copy");
    create_pool(&copy, &["--data-size", "256M"]);
    let copy_arg = copy.to_str().unwrap();
    let received = thinpool(&[
        "--progress",
        "receive",
        "s1",
        "-i",
        stream_arg,
        "--json",
        "--pool",
        copy_arg,
    ]);
    assert_progress(&received, "receive");
    let volume: serde_json::Value = serde_json::from_slice(&received.stdout).expect("JSON");
    assert_eq!(volume["name"], "s1");
    // A stream is received once per pool (a second time is a replay): another pool.
    let other = scratch.join("other");
    create_pool(&other, &["--data-size", "256M"]);
    let other_arg = other.to_str().unwrap();
    let received = thinpool(&["receive", "s1", "-i", stream_arg, "--pool", other_arg]);
    assert_no_progress(&received);
}

/// A served trim and a served diff draw the blocks their server counts (progress lines on
/// the control connection).
#[test]
fn a_served_pool_shows_the_servers_counts() {
    let scratch = ScratchDir::new("progress-served");
    let dir = scratch.join("pool");
    pool_with_data(&dir);
    let pool = dir.to_str().unwrap();
    let served = serve(&dir, &[]);
    for json in runs(&["trim", "--json", "--pool", pool], "trim") {
        let trim: serde_json::Value = serde_json::from_slice(&json).expect("trim --json");
        assert!(trim["trimmed_bytes"].is_u64(), "{trim}");
    }
    // The bar of blocks (done/total, 4096 data blocks of 64 KiB), not the spinner.
    assert_progress(
        &thinpool(&["--progress", "trim", "--pool", pool]),
        "/4096 blocks",
    );
    let json = with_and_without(&["diff", "snap", "vm", "--json", "--pool", pool], "diff");
    let diff: serde_json::Value = serde_json::from_slice(&json).expect("diff --json");
    assert_eq!(diff["ranges"].as_array().map(Vec::len), Some(1), "{diff}");
    // The virtual blocks compared (1024 of 64 KiB), not the spinner.
    assert_progress(
        &thinpool(&["--progress", "diff", "snap", "vm", "--pool", pool]),
        "/1024 blocks",
    );
    let sent = Command::new(THINPOOL)
        .args(["--progress", "send", "snap", "--pool", pool])
        .stdout(Stdio::null())
        .output()
        .unwrap();
    assert_progress(&sent, "send");
    assert!(served.stop().success());
}

/// `thinpool ARGS` on a pseudo-terminal (`script -q -e -c`): what the terminal showed.
fn on_terminal(args: &[&str]) -> String {
    require_tool("script", "util-linux");
    let command = std::iter::once(THINPOOL)
        .chain(args.iter().copied())
        .map(|word| format!("'{word}'"))
        .collect::<Vec<_>>()
        .join(" ");
    let output = run_tool(
        "script",
        &["-q", "-e", "-c", &command, "/dev/null"],
        std::time::Duration::from_secs(60),
    );
    assert!(output.status.success(), "{command}: {}", stderr(&output));
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[test]
fn a_terminal_gets_progress_without_the_flag() {
    let scratch = ScratchDir::new("progress-terminal");
    let dir = scratch.join("pool");
    pool_with_data(&dir);
    let pool = dir.to_str().unwrap();
    let shown = on_terminal(&["trim", "--pool", pool]);
    assert!(shown.contains(CLEAR_LINE), "no bar: {shown:?}");
    assert!(
        shown.contains("trim") && shown.contains("trimmed"),
        "{shown:?}"
    );
    let plain = on_terminal(&["--no-progress", "trim", "--pool", pool]);
    assert!(!plain.contains('\x1b'), "progress drawn: {plain:?}");
    assert!(plain.contains("trimmed"), "{plain:?}");
}

#[test]
fn import_draws_the_check_of_the_devices() {
    let test = "import_draws_the_check_of_the_devices";
    let scratch = ScratchDir::new("progress-import");
    let made = scratch.join("made");
    pool_with_data(&made);
    let Some(metadata) = LoopDevice::attach(&made.join("metadata"), test) else {
        return;
    };
    let Some(data) = LoopDevice::attach(&made.join("data"), test) else {
        return;
    };
    let (metadata_arg, data_arg) = (metadata.arg(), data.arg());
    let import = |pool: &Path, flag: Option<&str>| {
        let pool = pool.to_str().unwrap();
        let mut args: Vec<&str> = flag.into_iter().collect();
        args.extend_from_slice(&[
            "import",
            "--pool",
            pool,
            "--metadata-device",
            &metadata_arg,
            "--data-device",
            &data_arg,
            "--volume",
            "0:vm:64M",
            "--volume",
            "1:snap:64M",
        ]);
        thinpool(&args)
    };
    let first = scratch.join("first");
    let shown = import(&first, Some("--progress"));
    assert_progress(&shown, "import");
    let second = scratch.join("second");
    let plain = import(&second, None);
    assert_no_progress(&plain);
    let strip = |output: &Output, dir: &Path| {
        String::from_utf8_lossy(&output.stdout).replace(dir.to_str().unwrap(), "DIR")
    };
    assert_eq!(strip(&shown, &first), strip(&plain, &second));
}

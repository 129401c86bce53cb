//! Goal: `thinpool metadata-size` prints what `thin_metadata_size` 1.1.0 prints, with the
//! same exit status, for good and refused arguments.
//! Method: run the built binary and the real tool on the same argument lists and compare
//! stdout and exit status (and that refusals write to stderr).

use std::process::{Command, Output};
use testkit::tools::ThinTools;

fn thinpool(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_thinpool"))
        .arg("metadata-size")
        .args(args)
        .output()
        .expect("run thinpool")
}

#[test]
fn answers_and_exit_codes_match_thin_metadata_size() {
    let v1 = ThinTools::v1_1();
    let cases: [&[&str]; 12] = [
        &["-b", "64k", "-s", "1t", "-m", "10"],
        &["-b", "128", "-s", "100g", "-m", "1000", "-u", "m"],
        &["-b", "1m", "-s", "10T", "-m", "3", "-n"],
        &["-b", "64k", "-s", "1t", "-m", "10", "-n=short", "-u", "g"],
        &["-b", "64k", "-s", "1t", "-m", "10", "-n=long", "-u", "k"],
        &[
            "--block-size",
            "512k",
            "--pool-size",
            "3p",
            "--max-thins",
            "1",
        ],
        &["-b", "63k", "-s", "1t", "-m", "10"],
        &["-b", "2g", "-s", "1t", "-m", "10"],
        &["-b", "1m", "-s", "512k", "-m", "1"],
        &["-b", "64k", "-s", "1x", "-m", "1"],
        &["-b", "64k", "-s", "1t"],
        &["-b", "", "-s", "1t", "-m", "1"],
    ];
    for args in cases {
        let ours = thinpool(args);
        let theirs = v1.run("thin_metadata_size", args);
        assert_eq!(
            ours.status.code(),
            theirs.status.code(),
            "{args:?}: {ours:?}"
        );
        assert_eq!(
            String::from_utf8_lossy(&ours.stdout),
            theirs.stdout,
            "{args:?}"
        );
        if !theirs.success() {
            assert!(!ours.stderr.is_empty(), "{args:?}");
        }
    }
}

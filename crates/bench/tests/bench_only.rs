//! Goal (issue 25, item 5): `thinpool-bench --only NAME` with a name that selects no
//! section is refused, naming the sections, instead of succeeding with an empty table.
//! Method: run the built binary with `--only nosuch` (refused before any pool is built, so
//! it takes no time) and check the exit status, the message and that `--dir` stays empty.

use std::process::Command;
use testkit::scratch::ScratchDir;

#[test]
fn an_unknown_section_is_refused_with_the_valid_names() {
    let scratch = ScratchDir::new("bench-only");
    let output = Command::new(env!("CARGO_BIN_EXE_thinpool-bench"))
        .args(["--quick", "--only", "nosuch", "--dir"])
        .arg(scratch.path())
        .output()
        .expect("run thinpool-bench");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success(),
        "--only nosuch succeeded: {stderr}"
    );
    assert!(stderr.contains("nosuch"), "{stderr}");
    for section in ["reads", "writes", "cow", "mappings", "diff", "scale"] {
        assert!(stderr.contains(section), "{section} not named: {stderr}");
    }
    assert!(output.stdout.is_empty(), "a table was printed");
    let left: Vec<_> = std::fs::read_dir(scratch.path()).unwrap().collect();
    assert!(left.is_empty(), "{left:?} left behind");
}

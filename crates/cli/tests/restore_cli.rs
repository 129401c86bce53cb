//! Goal: `thinpool restore` behaves like `thin_restore` 1.1.0 at its interface and writes
//! metadata the real tools accept.
//! Method: restore every fixture with the built binary, check it with both thin_check
//! versions, and compare thin_dump 1.1.0 of it with thin_dump 1.1.0 of thin_restore 1.1.0's
//! output (def names renamed in order: they are block numbers); then the failure cases
//! (missing input or output, malformed XML, `-q`) against the real tool's exit status.

use std::process::{Command, Output};
use testkit::scratch::ScratchDir;
use testkit::tools::ThinTools;

fn thinpool_restore(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_thinpool"))
        .arg("restore")
        .args(args)
        .output()
        .expect("run thinpool")
}

#[test]
fn fixtures_restore_to_metadata_the_real_tools_accept() {
    let dir = ScratchDir::new("restore-cli");
    let v1 = ThinTools::v1_1();
    for name in testkit::fixtures::COMMITTED {
        let xml = testkit::fixtures::xml(name);
        let ours = dir.join(format!("{name}-ours"));
        testkit::sized_file(&ours, 16 << 20);
        let output = thinpool_restore(&["-i", xml.to_str().unwrap(), "-o", ours.to_str().unwrap()]);
        assert!(output.status.success(), "{name}: {output:?}");
        assert!(output.stdout.is_empty());
        for tools in ThinTools::all() {
            tools.check(&ours).assert_success();
        }
        let theirs = dir.join(format!("{name}-theirs"));
        v1.restore_sized(&xml, &theirs, 16 << 20).assert_success();
        assert_eq!(
            testkit::fixtures::canonical_def_names(&v1.dump(&ours, &[])),
            testkit::fixtures::canonical_def_names(&v1.dump(&theirs, &[])),
            "{name}"
        );
    }
}

#[test]
fn failures_exit_64_like_thin_restore() {
    let dir = ScratchDir::new("restore-cli-failures");
    let v1 = ThinTools::v1_1();
    let good = testkit::fixtures::xml("devices-snapshot");
    let bad = dir.join("bad.xml");
    std::fs::write(&bad, "<superblock").unwrap();
    let out = dir.join("out");
    testkit::sized_file(&out, 8 << 20);
    let missing = dir.join("missing");
    let cases = [
        (missing.clone(), out.clone()),
        (good.clone(), missing.clone()),
        (bad.clone(), out.clone()),
    ];
    for (input, output) in cases {
        let (i, o) = (input.to_str().unwrap(), output.to_str().unwrap());
        let ours = thinpool_restore(&["-i", i, "-o", o]);
        let theirs = v1.run("thin_restore", &["-i", i, "-o", o]);
        assert_eq!(ours.status.code(), Some(64), "{i} -> {o}: {ours:?}");
        assert_eq!(ours.status.code(), theirs.status.code(), "{i} -> {o}");
        assert!(!ours.stderr.is_empty());
        let quiet = thinpool_restore(&["-q", "-i", i, "-o", o]);
        assert_eq!(quiet.status.code(), Some(64));
        assert!(quiet.stderr.is_empty());
    }
}

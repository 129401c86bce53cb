//! Goal: every XML fixture is accepted by both thin-provisioning-tools versions and
//! round-trips, so the byte-compatibility tests of persistent-data can rely on them.
//!
//! Method: for each fixture and each restoring version, `thin_restore` into a fresh 8 MiB
//! file, `thin_check` it with both versions, and `thin_dump` it with both; the dump must equal
//! the fixture (0.9.0 prints `flags="0"`, 1.1.0 omits it and the final newline). A second,
//! independent harness (`scripts/verify-fixtures`) also decodes the data space map and checks
//! the reference-count rule the README states.

use std::process::Command;
use testkit::{fixtures, ScratchDir, ThinTools, ToolVersion};

fn normalized(xml: &str) -> String {
    xml.replace(r#" flags="0""#, "").trim_end().to_owned()
}

#[test]
fn every_fixture_restores_checks_and_round_trips_with_both_versions() {
    let scratch = ScratchDir::new("fixtures-roundtrip");
    let all = ThinTools::all();
    for name in fixtures::all() {
        let xml_path = fixtures::xml(name);
        let xml = std::fs::read_to_string(&xml_path).unwrap();
        assert!(
            !xml.contains("<def"),
            "{name}: fixtures must stay 0.9.0-compatible"
        );
        for restorer in &all {
            let meta = scratch.join(format!("{name}-{}", restorer.version));
            restorer.restore(&xml_path, &meta).assert_success();
            for tools in &all {
                tools.check(&meta).assert_success();
                let dump = tools.dump(&meta, &[]);
                if tools.version == ToolVersion::V0_9 && restorer.version == ToolVersion::V0_9 {
                    assert!(dump == xml, "{name}: 0.9.0 dump differs from the fixture");
                }
                assert!(
                    normalized(&dump) == normalized(&xml),
                    "{name}: dump by {} of restore by {} differs from the fixture",
                    tools.version,
                    restorer.version
                );
            }
        }
    }
}

#[test]
fn committed_fixtures_match_the_generator() {
    let status = Command::new(fixtures::workspace_root().join("scripts/gen-fixture-xml"))
        .arg("--check")
        .arg(fixtures::dir())
        .status()
        .expect("run scripts/gen-fixture-xml (needs python3)");
    assert!(
        status.success(),
        "rerun scripts/gen-fixture-xml --write with the fixtures dir"
    );
}

#[test]
fn data_reference_counts_follow_the_readme_rule() {
    let output = Command::new(fixtures::workspace_root().join("scripts/verify-fixtures"))
        .output()
        .expect("run scripts/verify-fixtures (needs python3)");
    assert!(
        output.status.success(),
        "scripts/verify-fixtures failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

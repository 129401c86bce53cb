//! Goal: every XML fixture survives the round trips through the real tools and ours.
//!
//! Method: for each fixture (committed and generated, up to the large three-device one):
//! `thin_restore` 1.1.0 writes metadata that our dump prints exactly like `thin_dump` 1.1.0
//! (XML and human-readable) and that our 0.9.0 flavour prints like `thin_dump` 0.9.0 after a
//! 0.9.0 restore; our restore writes metadata that both `thin_check` versions accept and
//! that `thin_dump` 1.1.0 prints like its dump of `thin_restore` 1.1.0's output (def names
//! compared after renaming in order: they are block numbers, and our space map places its
//! own blocks first). The 1.1.0 dump of that metadata (with its `<def>`s) is restored again
//! by us and must dump the same.

use persistent_data::FileDevice;
use std::path::Path;
use std::sync::Arc;
use testkit::scratch::ScratchDir;
use testkit::tools::ThinTools;
use thin_pool::format::dump::metadata::{dump, DumpOptions};
use thin_pool::format::dump::{Flavour, HumanWriter, XmlWriter};

const METADATA_SIZE_BYTES: u64 = 64 << 20;

fn our_dump(path: &Path, flavour: Flavour, human: bool) -> String {
    let device = Arc::new(FileDevice::open(path, false).unwrap());
    let options = DumpOptions {
        flavour,
        ..DumpOptions::default()
    };
    let bytes = if human {
        let mut w = HumanWriter::with_flavour(Vec::new(), flavour);
        dump(device, &options, &mut w).unwrap();
        w.into_inner()
    } else {
        let mut w = XmlWriter::with_flavour(Vec::new(), flavour);
        dump(device, &options, &mut w).unwrap();
        w.into_inner()
    };
    String::from_utf8(bytes).unwrap()
}

fn our_restore(xml: &Path, out: &Path) {
    testkit::sized_file(out, METADATA_SIZE_BYTES);
    let device = Arc::new(FileDevice::open(out, true).unwrap());
    let input = std::io::BufReader::new(std::fs::File::open(xml).unwrap());
    thin_pool::format::restore::restore(input, device, &Default::default()).unwrap();
}

#[test]
fn every_fixture_round_trips_through_the_real_tools_and_ours() {
    let (v0, v1) = (ThinTools::v0_9(), ThinTools::v1_1());
    let dir = ScratchDir::new("dump-restore-fixtures");
    for name in testkit::fixtures::all() {
        let xml = testkit::fixtures::xml(name);
        let theirs = dir.join(format!("{name}-theirs.bin"));
        v1.restore_sized(&xml, &theirs, METADATA_SIZE_BYTES)
            .assert_success();
        let their_dump = v1.dump(&theirs, &[]);
        assert_eq!(
            our_dump(&theirs, Flavour::V1, false),
            their_dump,
            "{name}: xml"
        );
        assert_eq!(
            our_dump(&theirs, Flavour::V1, true),
            v1.dump(&theirs, &["--format", "human_readable"]),
            "{name}: human readable"
        );

        let theirs_09 = dir.join(format!("{name}-theirs-0.9.bin"));
        v0.restore_sized(&xml, &theirs_09, METADATA_SIZE_BYTES)
            .assert_success();
        assert_eq!(
            our_dump(&theirs_09, Flavour::V0_9, false),
            v0.dump(&theirs_09, &[]),
            "{name}: 0.9.0 xml"
        );
        assert_eq!(
            our_dump(&theirs_09, Flavour::V0_9, true),
            v0.dump(&theirs_09, &["--format", "human_readable"]),
            "{name}: 0.9.0 human readable"
        );

        let ours = dir.join(format!("{name}-ours.bin"));
        our_restore(&xml, &ours);
        for tools in [&v0, &v1] {
            tools.check(&ours).assert_success();
        }
        let our_restore_dump = v1.dump(&ours, &[]);
        assert_eq!(
            testkit::fixtures::canonical_def_names(&our_restore_dump),
            testkit::fixtures::canonical_def_names(&their_dump),
            "{name}: thin_dump of our restore"
        );

        // Restore the 1.1.0 dump, defs and all, and dump again.
        let with_defs = dir.join(format!("{name}-1.1.xml"));
        std::fs::write(&with_defs, &their_dump).unwrap();
        let again = dir.join(format!("{name}-again.bin"));
        our_restore(&with_defs, &again);
        for tools in [&v0, &v1] {
            tools.check(&again).assert_success();
        }
        let theirs_again = dir.join(format!("{name}-theirs-again.bin"));
        v1.restore_sized(&with_defs, &theirs_again, METADATA_SIZE_BYTES)
            .assert_success();
        assert_eq!(
            testkit::fixtures::canonical_def_names(&v1.dump(&again, &[])),
            testkit::fixtures::canonical_def_names(&v1.dump(&theirs_again, &[])),
            "{name}: restore of the 1.1.0 dump"
        );
    }
}

use super::*;
use crate::ScratchDir;

#[test]
fn modules_dep_gives_dependencies_first() {
    let text = "kernel/drivers/md/dm-mod.ko:\n\
                kernel/drivers/md/dm-bufio.ko:\n\
                kernel/drivers/md/persistent-data/dm-persistent-data.ko: kernel/drivers/md/dm-bufio.ko\n\
                kernel/drivers/md/dm-thin-pool.ko: kernel/drivers/md/persistent-data/dm-persistent-data.ko kernel/drivers/md/dm_bio_prison.ko kernel/drivers/md/dm-bufio.ko kernel/drivers/md/dm-mod.ko\n\
                kernel/drivers/md/dm_bio_prison.ko:\n";
    let uml = Uml {
        kernel: PathBuf::from("/k"),
        xstate_shim: None,
        modules: PathBuf::from("/m"),
        dependencies: parse_modules_dep(text),
    };
    let files = uml.module_files(&["dm_thin_pool", "dm-mod"]);
    let names: Vec<String> = files
        .iter()
        .map(|path| module_key(&path.display().to_string()))
        .collect();
    assert_eq!(
        names,
        [
            "dm-bufio",
            "dm-persistent-data",
            "dm-bio-prison",
            "dm-mod",
            "dm-thin-pool"
        ]
    );
    assert_eq!(files[0], Path::new("/m/kernel/drivers/md/dm-bufio.ko"));
}

/// Boots the real kernel with dm-thin's modules and one disk, runs a script that sees
/// the disk and the device-mapper targets, and powers off; prints the boot time.
#[test]
fn boots_loads_dm_thin_and_powers_off() {
    let uml = Uml::find();
    let dir = ScratchDir::new("uml-boot");
    let disk = dir.join("disk");
    std::fs::write(&disk, vec![0x5au8; 1 << 20]).unwrap();
    let outcome = Boot::new(&uml, &dir.join("result"))
        .disk(&disk)
        .modules(&DM_THIN_MODULES)
        .script(
            "dmsetup --noudevsync targets > targets\n\
             head -c 4096 /dev/ubda | od -An -tx1 | head -1 > first-bytes\n",
        )
        .run();
    outcome.assert_success();
    let targets = std::fs::read_to_string(dir.join("result/targets")).unwrap();
    assert!(targets.contains("thin-pool"), "targets: {targets}");
    let first = std::fs::read_to_string(dir.join("result/first-bytes")).unwrap();
    assert!(first.trim().starts_with("5a 5a"), "first bytes: {first}");
    eprintln!(
        "UML boot: script started at guest uptime {:?} (dm-thin modules loaded), powered off after {:?} wall time",
        outcome.script_started, outcome.elapsed
    );
}

#[test]
fn a_failing_script_is_reported_and_an_overrun_is_killed() {
    let uml = Uml::find();
    let dir = ScratchDir::new("uml-fail");
    let outcome = Boot::new(&uml, &dir.join("a")).script("exit 7\n").run();
    assert_eq!(outcome.script_status, Some(7));
    assert!(!outcome.timed_out);
    let outcome = Boot::new(&uml, &dir.join("b"))
        .script("sleep 3600\n")
        .timeout(Duration::from_secs(10))
        .run();
    assert!(outcome.timed_out);
    assert_eq!(outcome.script_status, None);
}

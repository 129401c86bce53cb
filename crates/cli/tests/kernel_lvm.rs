//! Goal: a pool LVM made moves to thinpool and back to LVM, step by step as `docs/lvm.md`
//! says, checked by content. The real LVM (the host's `lvm2`, 2.03.16 on Debian 12) and the
//! real kernel (Linux 6.1 in User-Mode Linux, `testkit::uml`) run it; thinpool runs in the
//! same guest, on device-mapper devices over the pool's extents.
//!
//! 1. LVM makes a VG on two ubd disks, thin pools with 64 KiB and 8 MiB chunks, thin LVs
//!    and a thin snapshot in each, with seeded content written with `dd` before and after
//!    the snapshots; every LV is imaged; `lvs`/`pvs --reportformat json` are saved; the
//!    thin LVs and pools are deactivated (`docs/lvm.md`, "From LVM to thinpool", steps 1
//!    and 2). The linear tables the test builds from LVM's segments and `pe_start` equal
//!    the kernel's tables of the pools' `_tmeta`/`_tdata` components, and both thin_check
//!    versions pass the metadata read from those extents of the host files.
//! 2. thinpool takes each pool over (step 3: `dmsetup create` over those tables; step 4:
//!    `thin_check` and `thinpool import --volume ID:NAME:SIZE` with LVM's ids and sizes):
//!    every volume it serves equals LVM's image. thinpool then writes to an origin and to a
//!    snapshot of each pool and stops; the pool goes back ("Back into LVM", no management
//!    operation: remove the linear devices, clear the activation skip flag, `vgchange
//!    -ay`): every LV LVM activates equals what thinpool served last, the kernel's
//!    transaction id and used data blocks are thinpool's, and both thin_check versions
//!    pass the metadata again.
//!
//! Skips nothing: UML comes from `scripts/fetch-uml`, lvm2 from `scripts/test`.

mod e2e_support;

use e2e_support::*;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;
use testkit::slots::assert_same_bytes;
use testkit::tools::ThinTools;
use testkit::uml::lvm::{
    dm_table, guest_prelude, linear_pieces, parse_device_numbers, read_pieces, LinearPiece,
    PhysicalVolume, Segment, LVM_MODULES,
};
use testkit::uml::{Boot, Uml};

const KIB: u64 = 1024;
/// Each of the two PVs (ubd disks; sparse files).
const PV_BYTES: u64 = 96 * MIB;
const BOOT_TIMEOUT: Duration = Duration::from_secs(150);

/// A thin pool the test has LVM make: `origin` and `other` are thin LVs, `snapshot` a thin
/// snapshot of `origin`.
struct PoolPlan {
    name: &'static str,
    chunk_bytes: u64,
    data_bytes: u64,
    volume_bytes: u64,
    origin: &'static str,
    other: Option<&'static str>,
    snapshot: &'static str,
}

/// A write of a pattern file: (its name, the volume, the byte offset).
type PatternWrite = (&'static str, &'static str, u64);

const POOLS: [PoolPlan; 2] = [
    PoolPlan {
        name: "p64k",
        chunk_bytes: 64 * KIB,
        data_bytes: 48 * MIB,
        volume_bytes: 8 * MIB,
        origin: "a",
        other: Some("b"),
        snapshot: "s",
    },
    PoolPlan {
        name: "p8m",
        chunk_bytes: 8 * MIB,
        data_bytes: 96 * MIB,
        volume_bytes: 32 * MIB,
        origin: "c",
        other: None,
        snapshot: "t",
    },
];

impl PoolPlan {
    fn volumes(&self) -> Vec<&'static str> {
        let mut names = vec![self.origin];
        names.extend(self.other);
        names.push(self.snapshot);
        names
    }

    /// dd writes (pattern file, LV, byte offset) before the snapshot and after it.
    fn lvm_writes(&self) -> (Vec<PatternWrite>, Vec<PatternWrite>) {
        let c = self.chunk_bytes;
        let mut before = vec![("w1", self.origin, 12 * KIB), ("w2", self.origin, 2 * c)];
        if let Some(other) = self.other {
            before.push(("w2", other, MIB + 4 * KIB));
        }
        let after = vec![
            ("w3", self.origin, 0),
            ("w3", self.origin, c + 4 * KIB),
            ("w4", self.snapshot, c + 8 * KIB),
        ];
        (before, after)
    }

    /// thinpool's writes (pattern file, volume, byte offset): into a block the origin
    /// shares with the snapshot (block 2, untouched since the snapshot), into the
    /// snapshot's own block 0, into an unmapped block of the origin (its last).
    fn thinpool_writes(&self) -> Vec<PatternWrite> {
        let c = self.chunk_bytes;
        vec![
            ("w5", self.origin, 2 * c + 512),
            ("w6", self.snapshot, 4 * KIB),
            ("w6", self.origin, self.volume_bytes - c + 512),
        ]
    }
}

/// The pattern files the guest writes from: name → length.
const PATTERNS: [(&str, usize); 6] = [
    ("w1", 200 * KIB as usize),
    ("w2", 72 * KIB as usize),
    ("w3", 20 * KIB as usize),
    ("w4", 32 * KIB as usize),
    ("w5", 68 * KIB as usize),
    ("w6", 12 * KIB as usize),
];

/// Guest script 1: LVM makes the VG, pools, LVs and content; reports and images; steps
/// 1 and 2 of "From LVM to thinpool".
fn lvm_makes_pools() -> String {
    let mut script = guest_prelude();
    script.push_str(
        "put() { dd if=\"$1\" of=/dev/vg/$2 bs=4096 seek=$3 oflag=seek_bytes conv=notrunc,fsync status=none; }\n\
         lvm pvcreate /dev/ubda /dev/ubdb\nlvm vgcreate vg /dev/ubda /dev/ubdb\n",
    );
    for pool in &POOLS {
        script.push_str(&format!(
            "lvm lvcreate --type thin-pool -L {}M --chunksize {}k --poolmetadatasize 4M -n {} vg\n",
            pool.data_bytes / MIB,
            pool.chunk_bytes / KIB,
            pool.name
        ));
        for name in pool.volumes().iter().filter(|name| **name != pool.snapshot) {
            script.push_str(&format!(
                "lvm lvcreate -V {}M --thinpool vg/{} -n {name}\n",
                pool.volume_bytes / MIB,
                pool.name
            ));
        }
        let (before, after) = pool.lvm_writes();
        for (file, lv, offset) in before {
            script.push_str(&format!("put {file} {lv} {offset}\n"));
        }
        // A thin snapshot, without the activation skip flag it would get by default.
        script.push_str(&format!(
            "lvm lvcreate -s vg/{o} -n {s} -kn\n",
            o = pool.origin,
            s = pool.snapshot
        ));
        for (file, lv, offset) in after {
            script.push_str(&format!("put {file} {lv} {offset}\n"));
        }
        for name in pool.volumes() {
            script.push_str(&format!("image /dev/vg/{name} lvm-{name}\n"));
        }
        script.push_str(&format!(
            "dm table vg-{p}_tmeta > {p}-tmeta-kernel\ndm table vg-{p}_tdata > {p}-tdata-kernel\n\
             dm status vg-{p}-tpool > {p}-status-lvm\n",
            p = pool.name
        ));
    }
    let thins: Vec<String> = POOLS
        .iter()
        .flat_map(|pool| pool.volumes())
        .map(|name| format!("vg/{name}"))
        .collect();
    let pools: Vec<String> = POOLS
        .iter()
        .map(|pool| format!("vg/{}", pool.name))
        .collect();
    script.push_str(&format!(
        "# step 1: ids, sizes, transaction ids; the components' extents
lvm lvs -a --reportformat json --units b --nosuffix -o lv_name,lv_size,thin_id,transaction_id,pool_lv,origin,chunk_size vg > lvs.json
lvm lvs -a --segments --reportformat json --units b --nosuffix -o lv_name,seg_start,seg_size,seg_pe_ranges vg > segments.json
lvm pvs --reportformat json --units b --nosuffix -o pv_name,pe_start,vg_extent_size > pvs.json
for d in ubda ubdb; do echo \"/dev/$d $(cat /sys/class/block/$d/dev)\"; done > ubd-numbers
# step 2: the thin LVs, then the pools
lvm lvchange -an {thins}
lvm lvchange -an {pools}
lvm lvchange --setactivationskip y {pools}
dm table > tables-after-deactivation
",
        thins = thins.join(" "),
        pools = pools.join(" "),
    ));
    script
}

/// The `report[0].KEY` rows of an LVM JSON report.
fn report_rows(path: &Path, key: &str) -> Vec<Value> {
    let text = String::from_utf8(read(path)).unwrap();
    let report: Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}: {text}", path.display()));
    report["report"][0][key]
        .as_array()
        .unwrap_or_else(|| panic!("{}: no {key} rows: {text}", path.display()))
        .clone()
}

fn field<'a>(row: &'a Value, name: &str) -> &'a str {
    row[name]
        .as_str()
        .unwrap_or_else(|| panic!("no {name} in {row}"))
}

fn number(row: &Value, name: &str) -> u64 {
    let text = field(row, name);
    text.parse()
        .unwrap_or_else(|e| panic!("{name} {text:?} in {row}: {e}"))
}

/// What LVM reported of the VG.
struct LvmReport {
    lvs: Vec<Value>,
    segments: Vec<Value>,
    pvs: Vec<PhysicalVolume>,
    extent_size_bytes: u64,
}

impl LvmReport {
    fn read(result: &Path) -> LvmReport {
        let pv_rows = report_rows(&result.join("pvs.json"), "pv");
        LvmReport {
            lvs: report_rows(&result.join("lvs.json"), "lv"),
            segments: report_rows(&result.join("segments.json"), "seg"),
            pvs: pv_rows
                .iter()
                .map(|row| PhysicalVolume {
                    name: field(row, "pv_name").to_string(),
                    pe_start_bytes: number(row, "pe_start"),
                })
                .collect(),
            extent_size_bytes: number(&pv_rows[0], "vg_extent_size"),
        }
    }

    /// The row of LV `name` (hidden LVs are reported as `[name]`).
    fn lv(&self, name: &str) -> &Value {
        self.lvs
            .iter()
            .find(|row| field(row, "lv_name").trim_matches(['[', ']']) == name)
            .unwrap_or_else(|| panic!("no LV {name} in lvs.json"))
    }

    /// Where the pool component `lv` (e.g. `p64k_tmeta`) lies on the PVs.
    fn pieces(&self, lv: &str) -> Vec<LinearPiece> {
        let segments: Vec<Segment> = self
            .segments
            .iter()
            .filter(|row| field(row, "lv_name").trim_matches(['[', ']']) == lv)
            .map(|row| Segment {
                start_bytes: number(row, "seg_start"),
                size_bytes: number(row, "seg_size"),
                pe_ranges: field(row, "seg_pe_ranges").to_string(),
            })
            .collect();
        linear_pieces(&segments, &self.pvs, self.extent_size_bytes)
    }

    /// `--volume ID:NAME:SIZE` for each thin LV of `pool`, from LVM's report.
    fn volume_args(&self, pool: &PoolPlan) -> Vec<String> {
        pool.volumes()
            .iter()
            .map(|name| {
                let row = self.lv(name);
                assert_eq!(field(row, "pool_lv"), pool.name, "{row}");
                assert_eq!(number(row, "lv_size"), pool.volume_bytes, "{row}");
                format!(
                    "--volume {}:{name}:{}",
                    number(row, "thin_id"),
                    number(row, "lv_size")
                )
            })
            .collect()
    }
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

fn read_text(path: &Path) -> String {
    String::from_utf8(read(path)).unwrap()
}

/// The transaction id and used data blocks of a `dmsetup status` thin-pool line.
fn kernel_pool_status(path: &Path) -> (u64, u64) {
    let line = read_text(path);
    let fields: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(fields.get(2), Some(&"thin-pool"), "status: {line}");
    let used_data = fields[5].split_once('/').expect("used/total data").0;
    (fields[3].parse().unwrap(), used_data.parse().unwrap())
}

/// Both thin_check versions on the metadata LV `pool`_tmeta, read from the disk files.
fn thin_check_extents(report: &LvmReport, pool: &str, disks: &[PathBuf], scratch: &Path) {
    let metadata = scratch.join(format!("{pool}-tmeta-copy"));
    std::fs::write(
        &metadata,
        read_pieces(&report.pieces(&format!("{pool}_tmeta")), disks),
    )
    .unwrap();
    for tools in ThinTools::all() {
        tools.check(&metadata).assert_success();
    }
    std::fs::remove_file(&metadata).unwrap();
}

/// Checks what boot 1 left: the kernel's component tables equal the ones built from LVM's
/// report, the transaction ids agree, nothing stays active, the metadata passes both
/// thin_check versions.
fn check_lvm_side(report: &LvmReport, result: &Path, disks: &[PathBuf], scratch: &Path) {
    let numbers = parse_device_numbers(&read_text(&result.join("ubd-numbers")));
    for pool in &POOLS {
        let p = pool.name;
        for component in ["tmeta", "tdata"] {
            let pieces = report.pieces(&format!("{p}_{component}"));
            assert_eq!(
                read_text(&result.join(format!("{p}-{component}-kernel"))),
                dm_table(&pieces, |pv| numbers[pv].clone()),
                "{p}_{component}: the kernel's table against LVM's segments and pe_start"
            );
        }
        let (kernel_transaction, _) = kernel_pool_status(&result.join(format!("{p}-status-lvm")));
        let row = report.lv(p);
        assert_eq!(number(row, "transaction_id"), kernel_transaction, "{row}");
        assert_eq!(number(row, "chunk_size"), pool.chunk_bytes, "{row}");
        thin_check_extents(report, p, disks, scratch);
    }
    let left = read_text(&result.join("tables-after-deactivation"));
    assert_eq!(left.trim(), "No devices found", "after step 2");
}

/// Guest script 2: thinpool takes each pool over (steps 3 and 4), serves, writes, stops;
/// the pools go back to LVM ("Back into LVM"), which activates them.
fn thinpool_takes_over_and_hands_back(report: &LvmReport) -> String {
    let mut script = guest_prelude();
    script.push_str(&format!("T={THINPOOL}\n"));
    for pool in &POOLS {
        script.push_str(&take_over(pool, report));
    }
    script.push_str(&serve_copy_write());
    for pool in &POOLS {
        script.push_str(&format!(
            "$T status --json --pool /run/{p} > {p}-thinpool-status.json\n\
             thin_check /dev/mapper/tp-{p}-meta\ndm remove tp-{p}-meta\ndm remove tp-{p}-data\n",
            p = pool.name
        ));
    }
    let pools: Vec<String> = POOLS
        .iter()
        .map(|pool| format!("vg/{}", pool.name))
        .collect();
    script.push_str(&format!(
        "# back into LVM\nlvm lvchange --setactivationskip n {}\nlvm vgchange -ay vg\n",
        pools.join(" ")
    ));
    for pool in &POOLS {
        script.push_str(&format!(
            "dm status vg-{p}-tpool > {p}-status-back\n",
            p = pool.name
        ));
        for name in pool.volumes() {
            script.push_str(&format!("image /dev/vg/{name} back-{name}\n"));
        }
    }
    script.push_str("lvm vgchange -an vg\n");
    script
}

/// Steps 3 and 4 for one pool: the components activated read-only (one per command:
/// 2.03.16 refuses two at once) give their tables; writable linear devices over them;
/// thin_check; `thinpool import` with LVM's ids, names and sizes.
fn take_over(pool: &PoolPlan, report: &LvmReport) -> String {
    format!(
        "# step 3
lvm lvchange -ay -y vg/{p}_tmeta
lvm lvchange -ay -y vg/{p}_tdata
dm table vg-{p}_tmeta > {p}-tmeta-table
dm table vg-{p}_tdata > {p}-tdata-table
lvm lvchange -an vg/{p}_tmeta
lvm lvchange -an vg/{p}_tdata
dm create tp-{p}-meta {p}-tmeta-table
dm create tp-{p}-data {p}-tdata-table
# step 4
thin_check /dev/mapper/tp-{p}-meta
$T import --pool /run/{p} --metadata-device /dev/mapper/tp-{p}-meta --data-device /dev/mapper/tp-{p}-data {volumes}
",
        p = pool.name,
        volumes = report.volume_args(pool).join(" ")
    )
}

/// Serves every pool (no spinning: the guest has one CPU), copies every volume out
/// (`served-NAME`), lets thinpool write, copies again (`written-NAME`) and stops.
fn serve_copy_write() -> String {
    let mut script = String::from(
        "copy() { nbdcopy --connections=1 \"nbd+unix:///$2?socket=/run/$1.sock\" \"$3\"; }\n",
    );
    let mut writes = String::new();
    for pool in &POOLS {
        let p = pool.name;
        script.push_str(&format!(
            "$T serve --pool /run/{p} --socket /run/{p}.sock --pid-file /run/{p}.pid --spin-us 0 --quiet &
pid_{p}=$!
for i in $(seq 600); do [ -e /run/{p}.pid ] && break; sleep 0.1; done
[ -e /run/{p}.pid ]
"
        ));
        for (file, volume, offset) in pool.thinpool_writes() {
            writes.push_str(&format!("/run/{p}.sock {volume} {offset} {file}\n"));
        }
    }
    let copies = |prefix: &str| -> String {
        POOLS
            .iter()
            .flat_map(|pool| {
                pool.volumes()
                    .into_iter()
                    .map(move |v| format!("copy {} {v} {prefix}-{v}\n", pool.name))
            })
            .collect()
    };
    script.push_str(&copies("served"));
    script.push_str(&format!(
        "cat > thinpool-writes <<'EOF'\n{writes}EOF\n\
         /usr/bin/python3 - thinpool-writes <<'EOF'\n{NBD_WRITER}EOF\n"
    ));
    script.push_str(&copies("written"));
    for pool in &POOLS {
        script.push_str(&format!("kill $pid_{p}\nwait $pid_{p}\n", p = pool.name));
    }
    script
}

/// Writes `FILE` at `OFFSET` of `EXPORT` on `SOCKET` (one line each), each flushed.
const NBD_WRITER: &str = r#"import nbd, sys
for line in open(sys.argv[1]):
    socket, export, offset, path = line.split()
    h = nbd.NBD()
    h.connect_uri("nbd+unix:///%s?socket=%s" % (export, socket))
    h.pwrite(open(path, "rb").read(), int(offset))
    h.flush()
    h.shutdown()
"#;

#[test]
fn an_lvm_pool_moves_to_thinpool_and_back() {
    let report_seed = seed_report();
    let seed = report_seed.seed();
    assert!(
        Path::new("/sbin/lvm").exists(),
        "lvm2 is not installed: scripts/test installs it (apt-get install lvm2)"
    );
    let uml = Uml::find();
    // The PVs on tmpfs (the host opens them for the guest); the result directory where
    // the guest sees it (its /dev is its own devtmpfs).
    let shm = ScratchDir::new_in(Path::new("/dev/shm"), "kernel-lvm-pvs");
    let temp = ScratchDir::new("kernel-lvm");
    let disks: Vec<PathBuf> = (0..2).map(|i| shm.join(format!("pv{i}"))).collect();
    for disk in &disks {
        drop(sized_file(disk, PV_BYTES));
    }
    let result = temp.join("result");
    std::fs::create_dir_all(&result).unwrap();
    let mut patterns = BTreeMap::new();
    for (index, (name, length)) in PATTERNS.iter().enumerate() {
        let bytes = pattern(seed + index as u64, *length);
        std::fs::write(result.join(name), &bytes).unwrap();
        patterns.insert(*name, bytes);
    }

    let boot = |script: String| {
        let outcome = Boot::new(&uml, &result)
            .modules(&LVM_MODULES)
            .disk(&disks[0])
            .disk(&disks[1])
            .timeout(BOOT_TIMEOUT)
            .script(&script)
            .run();
        outcome.assert_success();
        eprintln!(
            "UML: guest uptime {:?} at script start, {:?} wall time",
            outcome.script_started, outcome.elapsed
        );
    };
    boot(lvm_makes_pools());
    let report = LvmReport::read(&result);
    check_lvm_side(&report, &result, &disks, temp.path());

    boot(thinpool_takes_over_and_hands_back(&report));
    // Step 3's tables, from the components activated read-only, are LVM's segments too.
    let numbers = parse_device_numbers(&read_text(&result.join("ubd-numbers")));
    for pool in &POOLS {
        for component in ["tmeta", "tdata"] {
            let lv = format!("{}_{component}", pool.name);
            assert_eq!(
                read_text(&result.join(format!("{}-{component}-table", pool.name))),
                dm_table(&report.pieces(&lv), |pv| numbers[pv].clone()),
                "{lv}: the component's table against LVM's segments"
            );
        }
    }

    let mut compared = 0;
    for pool in &POOLS {
        compared += check_round_trip(pool, &report, &result, &patterns);
        thin_check_extents(&report, pool.name, &disks, temp.path());
    }
    eprintln!("LVM → thinpool → LVM: {compared} volume images compared");
}

/// thinpool served LVM's content, its writes are where it put them, LVM's activation
/// reads what thinpool served last; transaction ids and used blocks agree. Returns the
/// number of volume images compared.
fn check_round_trip(
    pool: &PoolPlan,
    report: &LvmReport,
    result: &Path,
    patterns: &BTreeMap<&str, Vec<u8>>,
) -> usize {
    let p = pool.name;
    let mut compared = 0;
    let mut expected: BTreeMap<&str, Vec<u8>> = BTreeMap::new();
    for name in pool.volumes() {
        let lvm = read(&result.join(format!("lvm-{name}")));
        assert_same_bytes(
            &format!("{p}/{name}: thinpool's read of LVM's volume"),
            &read(&result.join(format!("served-{name}"))),
            &lvm,
        );
        expected.insert(name, lvm);
        compared += 1;
    }
    for (file, volume, offset) in pool.thinpool_writes() {
        let bytes = &patterns[file];
        let offset = offset as usize;
        expected.get_mut(volume).unwrap()[offset..offset + bytes.len()].copy_from_slice(bytes);
    }
    for name in pool.volumes() {
        let written = read(&result.join(format!("written-{name}")));
        assert_same_bytes(
            &format!("{p}/{name}: after thinpool's writes"),
            &written,
            &expected[name],
        );
        assert_same_bytes(
            &format!("{p}/{name}: LVM's read of what thinpool served last"),
            &read(&result.join(format!("back-{name}"))),
            &written,
        );
        compared += 2;
    }
    let ours: Value = serde_json::from_str(&read_text(
        &result.join(format!("{p}-thinpool-status.json")),
    ))
    .unwrap();
    let (transaction, used_data) = kernel_pool_status(&result.join(format!("{p}-status-back")));
    let lvm_transaction = number(report.lv(p), "transaction_id");
    assert_eq!(
        ours["transaction_id"].as_u64(),
        Some(lvm_transaction),
        "{p}"
    );
    assert_eq!(
        transaction, lvm_transaction,
        "{p}: the kernel's, back in LVM"
    );
    assert_eq!(
        ours["data_used_blocks"].as_u64(),
        Some(used_data),
        "{p}: used data blocks, thinpool's against the kernel's"
    );
    compared
}

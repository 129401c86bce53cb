//! The host's LVM (Debian 12's `lvm2`, 2.03.16) inside User-Mode Linux, and the
//! arithmetic that turns LVM's reports into device-mapper tables and host file ranges.
//!
//! In the guest there is no udev, no `dmeventd`, no `lvmlockd`/`lvmpolld`, no modprobe
//! and `/etc` is the host's, read-only (hostfs): every `lvm` command gets
//! [`GUEST_CONFIG`] (the `lvm` shell function of [`guest_prelude`]). 2.03 has no
//! `locking_type` any more: it takes file locks under `/run/lock/lvm`, on the guest's
//! tmpfs `/run`. LVM checks for the targets it will load itself, so a thin snapshot
//! (`lvcreate -s` of a thin LV) wants `dm-snapshot` loaded too ([`LVM_MODULES`]).
//!
//! A pool's hidden components (`POOL_tmeta`, `POOL_tdata`) are linear LVs: each segment of
//! `lvs --segments -o seg_start,seg_size,seg_pe_ranges` (bytes with `--units b --nosuffix`)
//! is one range of extents on one PV, `PV:FIRST-LAST`, whose bytes start at the PV's
//! `pe_start` plus `FIRST` extents. [`linear_pieces`] computes those byte ranges,
//! [`dm_table`] the `linear` table over them (what `dmsetup table` shows for the component
//! while the pool is active), and [`read_pieces`] reads them from the host files behind
//! the ubd disks, e.g. for `thin_check` on the host.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

/// The modules LVM's thin pools need in the guest: dm-thin, and the snapshot target that
/// `lvcreate -s` asks for even for a thin snapshot.
pub const LVM_MODULES: [&str; 2] = ["dm-thin-pool", "dm-snapshot"];

/// `--config` for every `lvm` command in the guest: devices by scanning `/dev` (no udev
/// database, no devices file, no hints), only the ubd disks; no udev synchronisation, no
/// udev rules and no verification of udev's work; no monitoring (`dmeventd`); no
/// `lvmlockd`, no `lvmpolld`; no metadata backups or archives (`/etc/lvm` is read-only).
pub const GUEST_CONFIG: &str = concat!(
    "devices { obtain_device_list_from_udev=0 use_devicesfile=0 hints=\"none\" ",
    "filter=[\"a|^/dev/ubd|\",\"r|.*|\"] } ",
    "activation { udev_sync=0 udev_rules=0 verify_udev_operations=0 monitoring=0 } ",
    "global { use_lvmlockd=0 use_lvmpolld=0 } ",
    "backup { backup=0 archive=0 }"
);

/// Shell functions for guest scripts: `lvm ARGS...` (with [`GUEST_CONFIG`]; its standard
/// input is `/dev/null`, so a question it asks is answered "no" instead of waiting for a
/// console that has no one behind it), `dm ARGS...`
/// (`dmsetup --noudevsync`), `image DEVICE FILE` (the device's bytes into a file).
pub fn guest_prelude() -> String {
    format!(
        "lvm() {{ command lvm \"$@\" --config {config} < /dev/null; }}\n\
         dm() {{ dmsetup --noudevsync \"$@\"; }}\n\
         image() {{ dd if=\"$1\" of=\"$2\" bs=1M status=none; }}\n",
        config = super::shell_quote(GUEST_CONFIG)
    )
}

/// A PV as `pvs -o pv_name,pe_start` reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PhysicalVolume {
    /// The guest's device, e.g. `/dev/ubda`.
    pub name: String,
    /// Where its first extent starts, in bytes.
    pub pe_start_bytes: u64,
}

/// One segment of an LV as `lvs --segments -o seg_start,seg_size,seg_pe_ranges` reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Where the segment starts in the LV, in bytes.
    pub start_bytes: u64,
    /// Its length, in bytes.
    pub size_bytes: u64,
    /// `PV:FIRST-LAST` (a linear segment has exactly one).
    pub pe_ranges: String,
}

/// A byte range of an LV and where it lies on a PV.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinearPiece {
    /// Where it starts in the LV.
    pub lv_offset_bytes: u64,
    /// Its length.
    pub length_bytes: u64,
    /// The PV's device.
    pub pv: String,
    /// Where it starts on the PV.
    pub pv_offset_bytes: u64,
}

/// The byte ranges of a linear LV from its segments (in any order), its VG's PVs and the
/// extent size. Panics on a segment that is not one range of whole extents on a known PV
/// (striped, mirrored) or on segments that do not tile the LV from 0.
pub fn linear_pieces(
    segments: &[Segment],
    pvs: &[PhysicalVolume],
    extent_size_bytes: u64,
) -> Vec<LinearPiece> {
    assert!(extent_size_bytes > 0 && extent_size_bytes.is_multiple_of(512));
    let mut sorted = segments.to_vec();
    sorted.sort_by_key(|segment| segment.start_bytes);
    let mut next = 0;
    let mut pieces = Vec::new();
    for segment in &sorted {
        assert_eq!(
            segment.start_bytes, next,
            "segments do not tile: {segments:?}"
        );
        let range = segment.pe_ranges.trim();
        assert!(
            !range.contains(' '),
            "not a linear segment (several ranges): {range:?}"
        );
        let (pv, extents) = range
            .rsplit_once(':')
            .unwrap_or_else(|| panic!("not PV:FIRST-LAST: {range:?}"));
        let (first, last) = extents
            .split_once('-')
            .unwrap_or_else(|| panic!("not PV:FIRST-LAST: {range:?}"));
        let first: u64 = first.parse().expect("first extent");
        let last: u64 = last.parse().expect("last extent");
        assert!(last >= first, "{range:?}");
        assert_eq!(
            (last - first + 1) * extent_size_bytes,
            segment.size_bytes,
            "{range:?}: extents against the segment's size"
        );
        let physical = pvs
            .iter()
            .find(|physical| physical.name == pv)
            .unwrap_or_else(|| panic!("{range:?}: no PV {pv} in {pvs:?}"));
        pieces.push(LinearPiece {
            lv_offset_bytes: segment.start_bytes,
            length_bytes: segment.size_bytes,
            pv: pv.to_string(),
            pv_offset_bytes: physical.pe_start_bytes + first * extent_size_bytes,
        });
        next += segment.size_bytes;
    }
    assert!(!pieces.is_empty(), "an LV without segments");
    pieces
}

/// The device-mapper `linear` table over `pieces`, one line each, the devices named as
/// `device` spells them (e.g. the PV's path, or its `MAJOR:MINOR` as `dmsetup table`
/// prints it).
pub fn dm_table(pieces: &[LinearPiece], device: impl Fn(&str) -> String) -> String {
    pieces
        .iter()
        .map(|piece| {
            format!(
                "{} {} linear {} {}\n",
                piece.lv_offset_bytes / 512,
                piece.length_bytes / 512,
                device(&piece.pv),
                piece.pv_offset_bytes / 512
            )
        })
        .collect()
}

/// The index of a ubd disk from its guest device: `/dev/ubda` is disk 0 (`ubd0=`),
/// `/dev/ubdb` 1, ... Panics on another name.
pub fn ubd_index(device: &str) -> usize {
    let letter = device
        .strip_prefix("/dev/ubd")
        .filter(|rest| rest.len() == 1)
        .and_then(|rest| rest.bytes().next())
        .filter(u8::is_ascii_lowercase)
        .unwrap_or_else(|| panic!("not a whole ubd disk: {device:?}"));
    usize::from(letter - b'a')
}

/// `/sys/class/block/ubdX/dev` lines as the guest wrote them (`/dev/ubda 98:0`): device
/// → `MAJOR:MINOR`.
pub fn parse_device_numbers(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|line| line.split_once(' '))
        .map(|(device, number)| (device.to_string(), number.trim().to_string()))
        .collect()
}

/// The bytes of the LV `pieces` describe, read from the host files behind the guest's
/// ubd disks (`disks[0]` is `/dev/ubda`).
pub fn read_pieces(pieces: &[LinearPiece], disks: &[PathBuf]) -> Vec<u8> {
    let mut bytes = Vec::new();
    for piece in pieces {
        let path = &disks[ubd_index(&piece.pv)];
        let file =
            File::open(path).unwrap_or_else(|e| panic!("cannot open {}: {e}", path.display()));
        let mut buffer = vec![0u8; piece.length_bytes as usize];
        file.read_exact_at(&mut buffer, piece.pv_offset_bytes)
            .unwrap_or_else(|e| {
                panic!(
                    "cannot read {} bytes at {} of {}: {e}",
                    piece.length_bytes,
                    piece.pv_offset_bytes,
                    path.display()
                )
            });
        assert_eq!(bytes.len() as u64, piece.lv_offset_bytes);
        bytes.extend_from_slice(&buffer);
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn pvs() -> Vec<PhysicalVolume> {
        ["/dev/ubda", "/dev/ubdb"]
            .iter()
            .map(|name| PhysicalVolume {
                name: name.to_string(),
                pe_start_bytes: MIB,
            })
            .collect()
    }

    /// What LVM 2.03.16 reported and the kernel's `dmsetup table` showed in a run: a 48 MiB
    /// `pool_tdata` on `/dev/ubda:1-12` is `0 98304 linear 98:0 10240`.
    #[test]
    fn a_segment_becomes_the_kernels_linear_table() {
        let segments = [Segment {
            start_bytes: 0,
            size_bytes: 48 * MIB,
            pe_ranges: "/dev/ubda:1-12".to_string(),
        }];
        let pieces = linear_pieces(&segments, &pvs(), 4 * MIB);
        let numbers = parse_device_numbers("/dev/ubda 98:0\n/dev/ubdb 98:16\n");
        assert_eq!(
            dm_table(&pieces, |pv| numbers[pv].clone()),
            "0 98304 linear 98:0 10240\n"
        );
        assert_eq!(pieces[0].pv_offset_bytes, 5 * MIB);
    }

    #[test]
    fn segments_on_two_pvs_tile_the_lv_in_order() {
        let segments = [
            Segment {
                start_bytes: 8 * MIB,
                size_bytes: 4 * MIB,
                pe_ranges: "/dev/ubdb:0-0".to_string(),
            },
            Segment {
                start_bytes: 0,
                size_bytes: 8 * MIB,
                pe_ranges: "/dev/ubda:17-18".to_string(),
            },
        ];
        let pieces = linear_pieces(&segments, &pvs(), 4 * MIB);
        assert_eq!(
            dm_table(&pieces, str::to_string),
            "0 16384 linear /dev/ubda 141312\n16384 8192 linear /dev/ubdb 2048\n"
        );
    }

    #[test]
    #[should_panic(expected = "extents against the segment's size")]
    fn a_range_that_disagrees_with_the_size_is_refused() {
        let segments = [Segment {
            start_bytes: 0,
            size_bytes: 4 * MIB,
            pe_ranges: "/dev/ubda:0-1".to_string(),
        }];
        linear_pieces(&segments, &pvs(), 4 * MIB);
    }

    #[test]
    fn ubd_disks_are_numbered_by_letter() {
        assert_eq!(ubd_index("/dev/ubda"), 0);
        assert_eq!(ubd_index("/dev/ubdc"), 2);
    }

    #[test]
    #[should_panic(expected = "not a whole ubd disk")]
    fn a_partition_is_not_a_disk() {
        ubd_index("/dev/ubda1");
    }

    #[test]
    fn pieces_read_from_the_disk_files() {
        let dir = crate::ScratchDir::new("uml-lvm-pieces");
        let disks = vec![dir.join("a"), dir.join("b")];
        std::fs::write(
            &disks[0],
            (0..=255u8).cycle().take(8192).collect::<Vec<_>>(),
        )
        .unwrap();
        std::fs::write(&disks[1], vec![7u8; 4096]).unwrap();
        let pieces = [
            LinearPiece {
                lv_offset_bytes: 0,
                length_bytes: 512,
                pv: "/dev/ubda".to_string(),
                pv_offset_bytes: 1024,
            },
            LinearPiece {
                lv_offset_bytes: 512,
                length_bytes: 512,
                pv: "/dev/ubdb".to_string(),
                pv_offset_bytes: 0,
            },
        ];
        let bytes = read_pieces(&pieces, &disks);
        assert_eq!(bytes.len(), 1024);
        assert_eq!(bytes[0], 0);
        assert_eq!(bytes[511], 255);
        assert!(bytes[512..].iter().all(|&b| b == 7));
    }
}

//! DRBD between two UML kernels: the kernel's `drbd.ko` (DRBD 8.4.11 in Debian's 6.1 UML)
//! driven by Debian's `drbd-utils` (`drbdadm` 9.x, which hands an 8.4 kernel to its
//! `drbdadm-84`/`drbdsetup-84`) from the host through hostfs, the two guests connected by a
//! [`UcastLink`].
//!
//! A [`DrbdResource`] is one resource of `volumes` volumes, replicated with protocol C
//! (a write or flush completes on the primary only once the peer has it). Each node's
//! backing disks are its boot's first disks (`/dev/ubda` is volume 0's, `/dev/ubdb`
//! volume 1's, ...), with DRBD's metadata inside them (`meta-disk internal`, at their end),
//! and volume N is `/dev/drbdN` on both nodes. [`DrbdNode::boot`] adds the disks, the link
//! and the module to a [`Boot`]; [`DrbdNode::prelude`] gives its script shell functions
//! (see there). [`parse_proc_drbd`] reads `/proc/drbd` as the guest brought it out.

use super::net::{LinkEnd, UcastLink};
use super::Boot;
use std::path::{Path, PathBuf};

/// The module (its dependency `lru_cache` comes from `modules.dep`).
pub const DRBD_MODULES: [&str; 1] = ["drbd"];
/// The TCP port DRBD listens on inside each guest (the guests' network is their own).
pub const DRBD_PORT: u16 = 7789;
/// Where Debian's `drbd-utils` puts `drbdadm`.
const DRBDADM_PATHS: [&str; 2] = ["/usr/sbin/drbdadm", "/sbin/drbdadm"];

/// The host's `drbdadm` (the guest sees it at the same path). Panics naming the Debian
/// package if it is missing: a DRBD test must not pass because DRBD was missing.
pub fn drbdadm() -> PathBuf {
    DRBDADM_PATHS
        .iter()
        .map(PathBuf::from)
        .find(|path| path.is_file())
        .unwrap_or_else(|| {
            panic!(
                "drbdadm is missing (none of {DRBDADM_PATHS:?}): install the Debian package \
                 drbd-utils (scripts/test does)"
            )
        })
}

/// One DRBD resource between the two ends of a link.
#[derive(Clone, Debug)]
pub struct DrbdResource {
    name: String,
    volumes: usize,
    link: UcastLink,
}

/// One of the resource's two nodes (side 0 or 1 of its link).
#[derive(Clone, Debug)]
pub struct DrbdNode {
    resource: DrbdResource,
    end: LinkEnd,
    side: usize,
}

impl DrbdResource {
    /// Resource `name` with `volumes` volumes (1 to 8) over `link`.
    pub fn new(name: &str, volumes: usize, link: &UcastLink) -> DrbdResource {
        assert!(
            (1..=8).contains(&volumes),
            "{volumes} volumes: a node has at most 8 ubd disks here"
        );
        assert!(
            !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric()),
            "resource name {name:?}: letters and digits only"
        );
        DrbdResource {
            name: name.to_string(),
            volumes,
            link: link.clone(),
        }
    }

    /// The resource's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Volume `volume`'s DRBD device in either guest.
    pub fn device(&self, volume: usize) -> String {
        assert!(volume < self.volumes, "no volume {volume}");
        format!("/dev/drbd{volume}")
    }

    /// Node `side` (0 or 1).
    pub fn node(&self, side: usize) -> DrbdNode {
        DrbdNode {
            resource: self.clone(),
            end: self.link.end(side),
            side,
        }
    }

    /// The configuration file both nodes read (`drbdadm -c FILE`).
    pub fn config(&self) -> String {
        let mut text = String::from("global { usage-count no; }\n");
        text.push_str(&format!("resource {} {{\n", self.name));
        // ping-int 2: a silent peer is noticed within about 2.5 s (the default is 10 s).
        text.push_str("  net { protocol C; ping-int 2; }\n");
        for volume in 0..self.volumes {
            text.push_str(&format!(
                "  volume {volume} {{ device {}; disk {}; meta-disk internal; }}\n",
                self.device(volume),
                guest_disk(volume)
            ));
        }
        for side in 0..2 {
            let node = self.node(side);
            text.push_str(&format!(
                "  on {} {{ address {}:{DRBD_PORT}; }}\n",
                node.hostname(),
                node.end.address()
            ));
        }
        text.push_str("}\n");
        text
    }

    /// Writes [`config`](DrbdResource::config) to `path`.
    pub fn write_config(&self, path: &Path) {
        std::fs::write(path, self.config())
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
    }
}

/// The guest's name for its `index`th ubd disk.
fn guest_disk(index: usize) -> String {
    format!("/dev/ubd{}", (b'a' + index as u8) as char)
}

impl DrbdNode {
    /// The node's host name (the `on NAME` section of the configuration).
    pub fn hostname(&self) -> String {
        format!("node{}", self.side)
    }

    /// The node's link end (its address, its kernel argument).
    pub fn link_end(&self) -> &LinkEnd {
        &self.end
    }

    /// Adds this node's backing disks (one per volume, as the boot's first disks), its
    /// network end and the DRBD module to `boot`. The backing files of a new resource must
    /// hold the same bytes on both nodes (e.g. both fresh, all zeros) if the script skips
    /// the initial sync (`drbd_new_data`).
    pub fn boot(&self, boot: Boot, backing: &[PathBuf]) -> Boot {
        assert!(
            boot.disks.is_empty(),
            "DRBD's backing disks must be the boot's first (/dev/ubda is volume 0)"
        );
        assert_eq!(
            backing.len(),
            self.resource.volumes,
            "one backing disk per volume"
        );
        let boot = backing.iter().fold(boot, |boot, path| boot.disk(path));
        boot.ethernet(&self.end).modules(&DRBD_MODULES)
    }

    /// Shell functions for this node's guest script (`sh -e`), with the configuration at
    /// `config` (a host path the guest reads through hostfs):
    ///
    /// - `drbd_up`: host name, `eth0`, the directories `drbdadm` writes (`/run/lock`,
    ///   a tmpfs on `/var/lib/drbd`), `create-md` on each backing disk, `up`.
    /// - `drbd_wait_connected SECONDS`: until the peer is connected; fails after SECONDS.
    /// - `drbd_new_data`: marks every volume up to date on both nodes without the initial
    ///   sync (`--clear-bitmap new-current-uuid`; connected, both sides' disks identical).
    /// - `drbd_primary`: promotes this node (`drbdadm primary`).
    /// - `drbd_wait_peer_lost SECONDS`: until the connection is gone (the peer stopped
    ///   answering); fails after SECONDS.
    /// - `drbd_state FILE`: `/proc/drbd` into FILE.
    pub fn prelude(&self, config: &Path) -> String {
        format!(
            r#"
DRBDADM="{drbdadm} -c {config}"
DRBD_RESOURCE={resource}
drbd_up() {{
    hostname {hostname}
{network}    mkdir -p /run/lock /var/lib/drbd
    mount -t tmpfs tmpfs /var/lib/drbd
    $DRBDADM create-md --force $DRBD_RESOURCE < /dev/null > drbd-create-md.log 2>&1
    $DRBDADM up $DRBD_RESOURCE
}}
drbd_cstate() {{ $DRBDADM cstate $DRBD_RESOURCE 2>/dev/null | head -1; }}
drbd_wait_connected() {{
    waited=0
    until [ "$(drbd_cstate)" = Connected ]; do
        [ $waited -lt $(($1 * 10)) ] || {{ echo "DRBD not connected in $1 s:"; cat /proc/drbd; return 1; }}
        waited=$((waited + 1))
        sleep 0.1
    done
}}
drbd_new_data() {{
    for volume in {volumes}; do
        $DRBDADM -- --clear-bitmap new-current-uuid $DRBD_RESOURCE/$volume
    done
}}
drbd_primary() {{ $DRBDADM primary $DRBD_RESOURCE; }}
drbd_wait_peer_lost() {{
    waited=0
    while [ "$(drbd_cstate)" = Connected ]; do
        [ $waited -lt $(($1 * 10)) ] || {{ echo "DRBD still connected after $1 s"; return 1; }}
        waited=$((waited + 1))
        sleep 0.1
    done
}}
drbd_state() {{ cat /proc/drbd > "$1"; }}
"#,
            drbdadm = drbdadm().display(),
            config = config.display(),
            resource = self.resource.name,
            hostname = self.hostname(),
            network = indent(&self.end.guest_setup()),
            volumes = (0..self.resource.volumes)
                .map(|volume| volume.to_string())
                .collect::<Vec<_>>()
                .join(" "),
        )
    }
}

fn indent(lines: &str) -> String {
    lines.lines().map(|line| format!("    {line}\n")).collect()
}

/// One minor's line pair in `/proc/drbd` (8.4 format).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MinorState {
    /// The minor (`/dev/drbdN`).
    pub minor: u32,
    /// `cs:` (Connected, WFConnection, StandAlone, ...).
    pub connection: String,
    /// `ro:` local/peer (Primary, Secondary, Unknown).
    pub roles: (String, String),
    /// `ds:` local/peer (UpToDate, Inconsistent, DUnknown, ...).
    pub disks: (String, String),
    /// `oos:` KiB out of sync with the peer.
    pub out_of_sync_kib: u64,
}

/// Every configured minor in a `/proc/drbd` text.
pub fn parse_proc_drbd(text: &str) -> Vec<MinorState> {
    let mut minors: Vec<MinorState> = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        let pair = |field: &str| -> Option<(String, String)> {
            let value = field_value(line, field)?;
            let (local, peer) = value.split_once('/')?;
            Some((local.to_string(), peer.to_string()))
        };
        if let Some((minor, _)) = line.split_once(": cs:") {
            let (Ok(minor), Some(connection)) = (minor.parse(), field_value(line, "cs:")) else {
                continue;
            };
            minors.push(MinorState {
                minor,
                connection: connection.to_string(),
                roles: pair("ro:").unwrap_or_default(),
                disks: pair("ds:").unwrap_or_default(),
                out_of_sync_kib: 0,
            });
        } else if let (Some(last), Some(oos)) = (minors.last_mut(), field_value(line, "oos:")) {
            last.out_of_sync_kib = oos.parse().unwrap_or(0);
        }
    }
    minors
}

/// `VALUE` of the first whitespace-separated `NAMEVALUE` word in `line`.
fn field_value<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|word| word.strip_prefix(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_drbd_gives_each_minors_state() {
        let text = "version: 8.4.11 (api:1/proto:86-101)\n\
srcversion: 059B1B470318F053F5077D5 \n \
0: cs:Connected ro:Primary/Secondary ds:UpToDate/UpToDate C r-----\n    \
ns:60 nr:0 dw:60 dr:16 al:9 bm:0 lo:0 pe:0 ua:0 ap:0 ep:1 wo:f oos:0\n \
1: cs:WFConnection ro:Primary/Unknown ds:UpToDate/DUnknown C r-----\n    \
ns:0 nr:0 dw:0 dr:0 al:8 bm:0 lo:0 pe:0 ua:0 ap:0 ep:1 wo:f oos:1824\n";
        let minors = parse_proc_drbd(text);
        assert_eq!(minors.len(), 2);
        assert_eq!(minors[0].minor, 0);
        assert_eq!(minors[0].connection, "Connected");
        assert_eq!(minors[0].roles, ("Primary".into(), "Secondary".into()));
        assert_eq!(minors[1].disks, ("UpToDate".into(), "DUnknown".into()));
        assert_eq!(minors[1].out_of_sync_kib, 1824);
        assert_eq!(minors[0].out_of_sync_kib, 0);
    }

    #[test]
    fn config_names_each_volume_and_both_nodes() {
        let link = UcastLink::new();
        let resource = DrbdResource::new("r0", 3, &link);
        let config = resource.config();
        assert!(config.contains("volume 2 { device /dev/drbd2; disk /dev/ubdc;"));
        assert!(config.contains("on node0 { address 10.99.0.1:7789; }"));
        assert!(config.contains("on node1 { address 10.99.0.2:7789; }"));
        assert!(config.contains("protocol C"));
    }
}

//! The volume catalog: names, virtual sizes and flags of volumes, which dm-thin metadata
//! does not hold (LVM keeps them in its own metadata for the same reason).
//!
//! Consistency with the pool metadata comes from the metadata's transaction id, as LVM uses
//! `set_transaction_id`: every catalog change is written, durably, as the catalog of
//! transaction `T + 1` *before* the metadata change and `set_transaction_id(T, T + 1)` are
//! committed. On open, the catalog whose transaction id equals the metadata's is the right
//! one; a newer one is a change whose metadata commit never happened and is discarded. So no
//! crash can leave the two disagreeing. Only a change outside thinpool can (the kernel's
//! `create_snap` or `delete`): a thin id only the metadata holds is unadopted, an entry
//! whose id the metadata lacks orphaned (`Catalog::unadopted`, `Catalog::orphaned`; the
//! engine's `adopt` settles both); new volumes take ids free in both.
//!
//! Ancestry: a snapshot records its origin by thin id (`"origin_id"` in the JSON), and only
//! while the origin exists: deleting a volume clears it from its snapshots, so a later
//! volume that takes its name or its id is never shown as their origin, and a revert by
//! delete-and-resnapshot cannot make two volumes each other's origin. Volumes are listed in
//! creation order, so an origin always comes before its snapshots; on load an origin that
//! does not is dropped, which also rules out cycles. Catalogs of older versions recorded
//! the origin's name (`"origin"`): on load each name becomes the id of the volume of that
//! name listed before the snapshot (a volume of that name created later is not its origin),
//! and the next catalog written has ids.
//!
//! `DirCatalog` (in `catalog_dir`) keeps one file per transaction (`catalog-<id>.json`), written to a temporary
//! name, synced, renamed and the directory synced; older files are removed after the next
//! commit.

use crate::error::{Error, Result};
use crate::ids::VolumeId;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Mutex;

/// Longest volume name, in characters (LVM's limit for a logical volume name).
pub const NAME_LENGTH_MAX: usize = 127;

/// Longest name older versions accepted, in bytes (names already in a catalog).
const STORED_NAME_BYTES_MAX: usize = 128;

/// The naming rule, as quoted in every refusal.
pub const NAME_RULE: &str = "letters, digits and + _ . - only, not starting with -, \
                             1 to 127 characters, not . or ..";

/// One volume in the catalog.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CatalogVolume {
    /// The volume's name (its NBD export name).
    pub name: String,
    /// Its id in the pool metadata (stored as the raw number).
    #[serde(with = "raw_volume_id")]
    pub id: VolumeId,
    /// Virtual size in bytes (a multiple of 512).
    pub size_bytes: u64,
    /// Whether writes are refused.
    pub read_only: bool,
    /// Thin id of the volume it was snapshotted from, while that volume exists (stored as
    /// `origin_id`, the raw number or null).
    #[serde(rename = "origin_id", serialize_with = "raw_origin_id")]
    pub origin: Option<VolumeId>,
    /// The identity of a read-only volume's content (a stream's uuid, see `thin_pool::stream`):
    /// set when the volume is received or first sent, dropped when its content changes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_id: Option<String>,
}

fn raw_origin_id<S: serde::Serializer>(
    origin: &Option<VolumeId>,
    serializer: S,
) -> std::result::Result<S::Ok, S::Error> {
    origin.map(VolumeId::get).serialize(serializer)
}

/// The whole catalog as of one transaction.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "CatalogFile")]
pub struct Catalog {
    /// The metadata transaction id this catalog belongs to.
    pub transaction_id: u64,
    /// Volumes, in creation order.
    pub volumes: Vec<CatalogVolume>,
    /// Resumable receives interrupted part-way (`engine/receive_partial.rs`): hidden thin
    /// ids, not volumes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub partial: Vec<PartialReceive>,
}

/// A resumable receive kept part-way (`thinpool receive --resumable`): thin id `id` of the
/// metadata holds what was verified of the stream up to byte `offset` of the volume. It is
/// no volume (not served, not listed as one): the receive that resumes it makes it one,
/// `thinpool receive --abort NAME` deletes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartialReceive {
    /// The volume it will become.
    pub name: String,
    /// Its thin id in the metadata.
    #[serde(with = "raw_volume_id")]
    pub id: VolumeId,
    /// The volume's size in bytes.
    pub size_bytes: u64,
    /// The stream's content id (the volume gets it).
    pub content_id: String,
    /// For an incremental: the base's content id (the thin id is a snapshot of the base).
    #[serde(default)]
    pub base_content_id: Option<String>,
    /// Thin id of the base it was snapshotted from, for an incremental.
    #[serde(default)]
    pub origin_id: Option<u32>,
    /// Every byte of the volume before this one is received (a block boundary here).
    pub offset: u64,
    /// Data blocks the receive wrote (what deleting it frees).
    pub blocks: u64,
}

/// A catalog as stored, in this version's form or an older one's.
#[derive(Deserialize)]
struct CatalogFile {
    transaction_id: u64,
    volumes: Vec<CatalogVolumeFile>,
    #[serde(default)]
    partial: Vec<PartialReceive>,
}

#[derive(Deserialize)]
struct CatalogVolumeFile {
    name: String,
    #[serde(with = "raw_volume_id")]
    id: VolumeId,
    size_bytes: u64,
    read_only: bool,
    #[serde(default)]
    origin_id: Option<u32>,
    /// Older versions: the origin's name.
    #[serde(default)]
    origin: Option<String>,
    #[serde(default)]
    content_id: Option<String>,
}

impl From<CatalogFile> for Catalog {
    /// Resolve origins against the volumes listed before each one (see the module doc).
    fn from(file: CatalogFile) -> Catalog {
        let mut volumes: Vec<CatalogVolume> = Vec::with_capacity(file.volumes.len());
        for v in file.volumes {
            let origin = match (v.origin_id, &v.origin) {
                (Some(raw), _) => volumes
                    .iter()
                    .map(|earlier| earlier.id)
                    .find(|id| id.get() == raw),
                (None, Some(name)) => volumes
                    .iter()
                    .rev()
                    .find(|earlier| earlier.name == *name)
                    .map(|earlier| earlier.id),
                (None, None) => None,
            };
            volumes.push(CatalogVolume {
                name: v.name,
                id: v.id,
                size_bytes: v.size_bytes,
                read_only: v.read_only,
                origin,
                content_id: v.content_id,
            });
        }
        Catalog {
            transaction_id: file.transaction_id,
            volumes,
            partial: file.partial,
        }
    }
}

impl Catalog {
    /// Volume `id` has another content of `size_bytes` (a revert, a resize): it loses its
    /// content id, since it no longer holds what was sent or received under it.
    pub fn set_content_changed(&mut self, id: VolumeId, size_bytes: u64) {
        for v in self.volumes.iter_mut().filter(|v| v.id == id) {
            v.size_bytes = size_bytes;
            v.content_id = None;
        }
    }

    /// Remove the volume with thin id `id`, and clear it as the origin of its snapshots.
    pub fn remove(&mut self, id: VolumeId) {
        self.volumes.retain(|v| v.id != id);
        for v in &mut self.volumes {
            if v.origin == Some(id) {
                v.origin = None;
            }
        }
    }

    /// The name of the volume with thin id `id`.
    pub fn name_of(&self, id: VolumeId) -> Option<&str> {
        self.volumes
            .iter()
            .find(|v| v.id == id)
            .map(|v| v.name.as_str())
    }

    /// The volume called `name`.
    pub fn find(&self, name: &str) -> Option<&CatalogVolume> {
        self.volumes.iter().find(|v| v.name == name)
    }

    /// The lowest volume id neither in the catalog nor among `in_metadata` (the metadata's
    /// thin ids: one the catalog does not know, an unadopted one, is taken too).
    pub fn free_id(&self, in_metadata: &[VolumeId]) -> Result<VolumeId> {
        let used: std::collections::BTreeSet<VolumeId> = self
            .volumes
            .iter()
            .map(|v| v.id)
            .chain(self.partial.iter().map(|p| p.id))
            .chain(in_metadata.iter().copied())
            .collect();
        (0..=VolumeId::MAX.get())
            .map(VolumeId::new)
            .find(|id| !used.contains(id))
            .ok_or(Error::IdsExhausted)
    }

    /// The thin ids of `in_metadata` (the metadata's) that no entry names (neither a
    /// volume nor a partial receive): unadopted, in id order.
    pub fn unadopted(&self, in_metadata: &[VolumeId]) -> Vec<VolumeId> {
        let mut ids: Vec<VolumeId> = in_metadata
            .iter()
            .copied()
            .filter(|id| self.volumes.iter().all(|v| v.id != *id))
            .filter(|id| self.partial.iter().all(|p| p.id != *id))
            .collect();
        ids.sort_unstable();
        ids
    }

    /// The entries whose thin id is not among `in_metadata`: orphaned, in catalog order.
    pub fn orphaned(&self, in_metadata: &[VolumeId]) -> Vec<&CatalogVolume> {
        self.volumes
            .iter()
            .filter(|v| !in_metadata.contains(&v.id))
            .collect()
    }
}

/// A [`VolumeId`] in the catalog's JSON: the raw number.
mod raw_volume_id {
    use crate::ids::VolumeId;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(id: &VolumeId, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_u32(id.get())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<VolumeId, D::Error> {
        u32::deserialize(deserializer).map(VolumeId::new)
    }
}

/// Check a new volume name against LVM's rule for logical volume names: ASCII letters,
/// digits and `+ _ . -`, not starting with `-`, 1 to 127 characters, not `.` or `..`. So a
/// name cannot hide (spaces only), disguise itself (right-to-left override, look-alike
/// letters) or pass for an option.
pub fn validate_name(name: &str) -> Result<()> {
    // The caller's message names the volume (escaped); this one says what is wrong.
    let refuse = |why: String| {
        Err(Error::BadName {
            why,
            rule: NAME_RULE,
        })
    };
    if name.is_empty() {
        return refuse("is empty".to_string());
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || "+_.-".contains(*c)))
    {
        let shown = match c {
            ' ' => "a space".to_string(),
            c if c.is_ascii_graphic() => format!("'{c}'"),
            c => c.escape_unicode().to_string(),
        };
        return refuse(format!("contains {shown}"));
    }
    // Only ASCII is left: bytes are characters.
    if name.len() > NAME_LENGTH_MAX {
        return refuse(format!("is {} characters long", name.len()));
    }
    if name.starts_with('-') {
        return refuse("starts with -".to_string());
    }
    if name == "." || name == ".." {
        return refuse("is reserved".to_string());
    }
    Ok(())
}

/// A name quoted for messages: what is not printable ASCII is shown as `\u{...}`, so a
/// refusal cannot carry a control or direction character to the terminal; long names are cut.
fn quoted(name: &str) -> String {
    let mut out = String::from("\"");
    for (i, c) in name.chars().enumerate() {
        if i > NAME_LENGTH_MAX {
            out.push_str("...");
            break;
        }
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            ' ' => out.push(c),
            c if c.is_ascii_graphic() => out.push(c),
            c => out.extend(c.escape_unicode()),
        }
    }
    out.push('"');
    out
}

/// Check a name already in a catalog: what older versions accepted (1 to 128 bytes, no
/// path separator, no control character), so their pools still open; anything else is damage.
pub(crate) fn check_stored_name(name: &str) -> Result<()> {
    if name.is_empty()
        || name.len() > STORED_NAME_BYTES_MAX
        || name
            .chars()
            .any(|c| c == '/' || c == '\\' || c.is_control())
    {
        return Err(Error::BadCatalogName { name: quoted(name) });
    }
    Ok(())
}

/// Where catalogs are kept.
pub trait CatalogStore: Send + Sync {
    /// The catalog of committed transaction `transaction_id`.
    fn load(&self, transaction_id: u64) -> Result<Catalog>;
    /// Store a catalog durably (before the metadata transaction it belongs to commits).
    fn store(&self, catalog: &Catalog) -> Result<()>;
    /// Transaction `transaction_id` committed: forget every other catalog.
    fn committed(&self, transaction_id: u64) -> Result<()>;
}

/// Catalogs in memory (tests).
#[derive(Debug, Default)]
pub struct MemoryCatalog {
    catalogs: Mutex<BTreeMap<u64, Catalog>>,
}

impl CatalogStore for MemoryCatalog {
    fn load(&self, transaction_id: u64) -> Result<Catalog> {
        self.catalogs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&transaction_id)
            .cloned()
            .ok_or(Error::NoCatalog { transaction_id })
    }
    fn store(&self, catalog: &Catalog) -> Result<()> {
        self.catalogs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(catalog.transaction_id, catalog.clone());
        Ok(())
    }
    fn committed(&self, transaction_id: u64) -> Result<()> {
        self.catalogs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|id, _| *id == transaction_id);
        Ok(())
    }
}

impl<T: CatalogStore + ?Sized> CatalogStore for std::sync::Arc<T> {
    fn load(&self, transaction_id: u64) -> Result<Catalog> {
        (**self).load(transaction_id)
    }
    fn store(&self, catalog: &Catalog) -> Result<()> {
        (**self).store(catalog)
    }
    fn committed(&self, transaction_id: u64) -> Result<()> {
        (**self).committed(transaction_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::catalog_dir::DirCatalog;
    use std::fs;

    #[test]
    fn names_follow_lvm_rule() {
        let longest = "x".repeat(127);
        for good in ["vm-disk.0", "a", "A+b_c.d-e", "0", "..a", longest.as_str()] {
            assert!(validate_name(good).is_ok(), "{good:?} was refused");
        }
        let too_long = "x".repeat(128);
        for bad in [
            "",
            ".",
            "..",
            "-a",
            "a/b",
            "a\nb",
            "a\u{7f}",
            "   ",
            "a b",
            "evil\u{202e}gpj.exe",
            "caf\u{e9}",
            "\u{430}dmin",
            too_long.as_str(),
        ] {
            let error = validate_name(bad).expect_err(bad).to_string();
            assert!(error.contains(NAME_RULE), "{error}");
            assert!(
                !error.contains('\u{202e}') && !error.contains('\n'),
                "the refusal repeats a control character: {error:?}"
            );
        }
    }

    #[test]
    fn catalogs_with_names_from_older_versions_still_load() {
        let dir = std::env::temp_dir().join(format!("tp-catalog-old-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let store = DirCatalog::new(&dir);
        let catalog = Catalog {
            transaction_id: 3,
            volumes: vec![CatalogVolume {
                name: "old name \u{e9}".into(),
                id: VolumeId::new(0),
                size_bytes: 512,
                read_only: false,
                origin: None,
                content_id: None,
            }],
            partial: Vec::new(),
        };
        store.store(&catalog).unwrap();
        assert_eq!(store.load(3).unwrap(), catalog);
        fs::write(
            dir.join("catalog-4.json"),
            r#"{"transaction_id":4,"volumes":[{"name":"a/b","id":0,"size_bytes":512,"read_only":false,"origin":null}]}"#,
        )
        .unwrap();
        assert!(store.load(4).is_err());
        fs::remove_dir_all(&dir).unwrap();
    }
}

//! The volume catalog on files ([`DirCatalog`]): one file per transaction
//! (`catalog-<id>.json`) in the pool directory, held open ([`PoolDirectory`]), written to a
//! temporary name, synced, renamed and the directory synced; older files removed after the
//! next commit. A store first checks that the file it last read or wrote is unchanged, so
//! a catalog another writer put there is never written over (issue 20, finding 2).

use crate::engine::catalog::{check_stored_name, Catalog, CatalogStore};
use crate::engine::directory::PoolDirectory;
use crate::error::{Error, Result};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Catalogs as files in a directory, opened once ([`PoolDirectory`]): every file is
/// opened relative to it. A store first checks that the catalog file it last read or wrote
/// is still there as it left it ([`Error::CatalogChangedUnderServer`] otherwise).
#[derive(Debug)]
pub struct DirCatalog {
    dir: std::result::Result<Arc<PoolDirectory>, (std::io::ErrorKind, String)>,
    path: PathBuf,
    /// The catalog file last read or written: its transaction and text.
    last: Mutex<Option<(u64, String)>>,
}

impl DirCatalog {
    /// Catalogs in `dir` (which must exist), opened now (an error is reported at each use).
    pub fn new(dir: &Path) -> DirCatalog {
        let opened = PoolDirectory::open(dir)
            .map(Arc::new)
            .map_err(|e| (e.kind(), e.to_string()));
        DirCatalog {
            dir: opened,
            path: dir.to_path_buf(),
            last: Mutex::new(None),
        }
    }

    /// Catalogs in a directory the pool holds open.
    pub fn in_directory(dir: Arc<PoolDirectory>) -> DirCatalog {
        DirCatalog {
            path: dir.path().to_path_buf(),
            dir: Ok(dir),
            last: Mutex::new(None),
        }
    }

    fn dir(&self) -> std::io::Result<&PoolDirectory> {
        match &self.dir {
            Ok(dir) => Ok(dir),
            Err((kind, message)) => Err(std::io::Error::new(*kind, message.clone())),
        }
    }

    fn name(transaction_id: u64) -> String {
        format!("catalog-{transaction_id}.json")
    }

    fn path(&self, transaction_id: u64) -> PathBuf {
        self.path.join(DirCatalog::name(transaction_id))
    }

    fn io(&self, what: &str, path: &Path, source: std::io::Error) -> Error {
        Error::Io {
            what: format!("{what} {}", path.display()),
            source,
        }
    }

    fn listed(&self) -> Result<Vec<(u64, String)>> {
        let names = (self.dir().and_then(PoolDirectory::names))
            .map_err(|e| self.io("listing", &self.path, e))?;
        Ok(names
            .into_iter()
            .filter_map(|name| {
                let id = name
                    .strip_prefix("catalog-")
                    .and_then(|rest| rest.strip_suffix(".json"))
                    .and_then(|id| id.parse::<u64>().ok())?;
                Some((id, name))
            })
            .collect())
    }

    fn remember(&self, transaction_id: u64, text: String) {
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Some((transaction_id, text));
    }

    /// The catalog file last read or written is still as it was left.
    fn check_unchanged(&self) -> Result<()> {
        let last = self.last.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let Some((id, text)) = last else {
            return Ok(());
        };
        let now = self
            .dir()
            .and_then(|dir| dir.read_to_string(&DirCatalog::name(id)));
        if now.ok().as_deref() != Some(text.as_str()) {
            return Err(Error::CatalogChangedUnderServer {
                path: self.path(id).display().to_string(),
                expected: id,
            });
        }
        Ok(())
    }
}

impl CatalogStore for DirCatalog {
    fn load(&self, transaction_id: u64) -> Result<Catalog> {
        let path = self.path(transaction_id);
        let text = (self.dir())
            .and_then(|dir| dir.read_to_string(&DirCatalog::name(transaction_id)))
            .map_err(|e| self.io("reading the volume catalog", &path, e))?;
        let catalog: Catalog = serde_json::from_str(&text).map_err(|e| Error::CatalogDamaged {
            path: path.display().to_string(),
            why: e.to_string(),
        })?;
        if catalog.transaction_id != transaction_id {
            return Err(Error::CatalogMismatch {
                path: path.display().to_string(),
                found: catalog.transaction_id,
                expected: transaction_id,
            });
        }
        for v in &catalog.volumes {
            check_stored_name(&v.name)?;
        }
        self.remember(transaction_id, text);
        Ok(catalog)
    }

    fn store(&self, catalog: &Catalog) -> Result<()> {
        self.check_unchanged()?;
        let id = catalog.transaction_id;
        let path = self.path(id);
        let (name, temporary) = (DirCatalog::name(id), format!("catalog-{id}.json.tmp"));
        let mut text = serde_json::to_string_pretty(catalog).expect("a catalog serializes");
        text.push('\n');
        let write = || -> std::io::Result<()> {
            let dir = self.dir()?;
            let mut file = dir.create_private(&temporary)?;
            file.write_all(text.as_bytes())?;
            file.sync_all()?;
            dir.rename(&temporary, &name)?;
            dir.sync()
        };
        write().map_err(|e| self.io("writing the volume catalog", &path, e))?;
        self.remember(id, text);
        Ok(())
    }

    fn committed(&self, transaction_id: u64) -> Result<()> {
        for (id, name) in self.listed()? {
            if id != transaction_id {
                (self.dir().and_then(|dir| dir.remove(&name)))
                    .map_err(|e| self.io("removing", &self.path(id), e))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::catalog::CatalogVolume;
    use crate::ids::VolumeId;
    use std::fs;

    #[test]
    fn catalog_files_are_private_and_links_are_not_followed() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("tp-catalog-link-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let victim = dir.join("victim");
        fs::write(&victim, "keep").unwrap();
        std::os::unix::fs::symlink(&victim, dir.join("catalog-5.json.tmp")).unwrap();
        let store = DirCatalog::new(&dir);
        let catalog = Catalog {
            transaction_id: 5,
            volumes: vec![],
            partial: Vec::new(),
        };
        store.store(&catalog).unwrap();
        assert_eq!(fs::read_to_string(&victim).unwrap(), "keep");
        let mode = fs::metadata(dir.join("catalog-5.json"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        fs::remove_file(dir.join("catalog-5.json")).unwrap();
        std::os::unix::fs::symlink(&victim, dir.join("catalog-5.json")).unwrap();
        assert!(store.load(5).is_err(), "a catalog link was followed");
        fs::remove_dir_all(&dir).unwrap();
    }

    /// A store in a new scratch directory named after `tag`, holding an empty catalog of
    /// transaction 1.
    fn stored_empty_catalog(tag: &str) -> (std::path::PathBuf, DirCatalog, Catalog) {
        let dir = std::env::temp_dir().join(format!("{tag}{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let store = DirCatalog::new(&dir);
        let c = Catalog {
            transaction_id: 1,
            volumes: vec![],
            partial: Vec::new(),
        };
        store.store(&c).unwrap();
        (dir, store, c)
    }

    #[test]
    fn dir_catalog_keeps_only_committed() {
        let (dir, store, mut c) = stored_empty_catalog("tp-catalog-");
        c.transaction_id = 2;
        c.volumes.push(CatalogVolume {
            name: "a".into(),
            id: VolumeId::new(7),
            size_bytes: 512,
            read_only: false,
            origin: None,
            content_id: None,
        });
        store.store(&c).unwrap();
        assert_eq!(store.load(2).unwrap(), c);
        let text = fs::read_to_string(dir.join("catalog-2.json")).unwrap();
        assert!(
            text.contains("\"id\": 7,"),
            "the id is the raw number: {text}"
        );
        store.committed(2).unwrap();
        assert!(store.load(1).is_err());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_store_refuses_a_catalog_changed_by_another_writer() {
        let (dir, store, mut c) = stored_empty_catalog("tp-catalog-foreign-");
        let foreign = "{\"transaction_id\": 1, \"volumes\": []}";
        fs::write(dir.join("catalog-1.json"), foreign).unwrap();
        c.transaction_id = 2;
        let error = store.store(&c).unwrap_err();
        assert!(
            matches!(error, Error::CatalogChangedUnderServer { expected: 1, .. }),
            "{error:?}"
        );
        assert_eq!(
            fs::read_to_string(dir.join("catalog-1.json")).unwrap(),
            foreign
        );
        assert!(!dir.join("catalog-2.json").exists(), "nothing written");
        fs::remove_dir_all(&dir).unwrap();
    }
}

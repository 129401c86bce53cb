//! Goal (issue 20 finding 11, issue 22 item 3): a pool whose metadata and catalog disagree
//! on thin ids opens, names each disagreement and serves the rest; `adopt_volume` names a
//! thin id the catalog lacks (its content then reads as the tree holds it), `forget_volume`
//! drops an entry whose thin id is gone, and a new volume never takes an unadopted id.
//! Method: a pool on memory parts; the kernel's `create_snap` and `delete` are made with
//! `PoolMetadata` directly on the metadata device while the pool is closed (the catalog
//! is not told), then the pool is reopened, read-write and read-only.

use thin_pool::testing::MemoryParts;
use thin_pool::{CatalogRefusal, Error, PoolMetadata, PoolOptions, VolumeId};

const BLOCK: u64 = 65536;

fn options() -> PoolOptions {
    PoolOptions {
        commit_interval: None,
        ..PoolOptions::default()
    }
}

fn read_only() -> PoolOptions {
    PoolOptions {
        read_only: true,
        ..options()
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// A pool with volume "vm" of 8 blocks whose first two blocks hold `pattern(7, ..)`.
fn pool_with_vm() -> (MemoryParts, VolumeId) {
    let parts = MemoryParts::default();
    let pool = parts.format(BLOCK, options());
    let info = pool.create_volume("vm", 8 * BLOCK).unwrap();
    let vm = pool.volume("vm").unwrap();
    vm.write(0, &pattern(7, 2 * BLOCK as usize), false).unwrap();
    vm.flush().unwrap();
    drop(vm);
    pool.close().unwrap();
    drop(pool);
    (parts, info.id)
}

/// What the kernel does outside thinpool: `edit` on the metadata, committed.
fn as_the_kernel(parts: &MemoryParts, edit: impl FnOnce(&mut PoolMetadata)) {
    let mut md = PoolMetadata::open(parts.metadata.clone()).unwrap();
    edit(&mut md);
    md.commit().unwrap();
}

fn read(pool: &thin_pool::Pool, name: &str, len: u64) -> Vec<u8> {
    let volume = pool.volume(name).unwrap();
    let mut buffer = vec![0; len as usize];
    volume.read(0, &mut buffer).unwrap();
    buffer
}

#[test]
fn an_unknown_thin_id_is_named_and_the_rest_is_served() {
    let (parts, vm_id) = pool_with_vm();
    let unknown = VolumeId::new(vm_id.get() + 5);
    as_the_kernel(&parts, |md| md.create_snap(unknown, vm_id).unwrap());
    for opts in [options(), read_only()] {
        let pool = parts.reopen(opts);
        let found = pool.disagreements();
        assert_eq!(found.unadopted.len(), 1, "{found:?}");
        assert_eq!(found.unadopted[0].id, unknown);
        assert_eq!(found.unadopted[0].mapped_blocks, 2);
        assert_eq!(found.unadopted[0].mapped_bytes, 2 * BLOCK);
        assert!(found.orphaned.is_empty());
        let names: Vec<String> = pool.list().into_iter().map(|v| v.name).collect();
        assert_eq!(names, ["vm"]);
        assert_eq!(read(&pool, "vm", 2 * BLOCK), pattern(7, 2 * BLOCK as usize));
        let warning = pool
            .events()
            .into_iter()
            .find(|e| e.contains("disagree"))
            .expect("a warning at open");
        assert!(
            warning.contains(&format!("thin id {unknown}"))
                && warning.contains(&format!("thinpool volume adopt {unknown} NAME")),
            "{warning}"
        );
    }
}

#[test]
fn an_adopted_thin_id_reads_its_tree_and_refusals_say_why() {
    let (parts, vm_id) = pool_with_vm();
    let unknown = VolumeId::new(vm_id.get() + 5);
    as_the_kernel(&parts, |md| md.create_snap(unknown, vm_id).unwrap());
    let pool = parts.reopen(options());
    let refused = |result: thin_pool::Result<thin_pool::VolumeInfo>| result.unwrap_err();
    // Too small for block 1, which it maps.
    let error = refused(pool.adopt_volume(unknown, "snap", BLOCK, Some("vm")));
    assert!(
        matches!(
            error,
            Error::Catalog(CatalogRefusal::SizeBelowMapped { needed_bytes, .. }) if needed_bytes == 2 * BLOCK
        ),
        "{error}"
    );
    let error = refused(pool.adopt_volume(vm_id, "snap", 8 * BLOCK, None));
    assert!(error.to_string().contains("\"vm\""), "{error}");
    assert_eq!(error.errno(), libc::EEXIST);
    let error = refused(pool.adopt_volume(VolumeId::new(999), "snap", 8 * BLOCK, None));
    assert!(
        error.to_string().contains("999") && error.to_string().contains(&unknown.to_string()),
        "{error}"
    );
    assert_eq!(error.errno(), libc::ENODATA);
    let error = refused(pool.adopt_volume(unknown, "vm", 8 * BLOCK, None));
    assert!(matches!(error, Error::NameExists(_)), "{error}");
    let error = refused(pool.adopt_volume(unknown, "snap", 8 * BLOCK, Some("nobody")));
    assert!(matches!(error, Error::NoSuchVolume(_)), "{error}");
    assert!(pool.list().len() == 1, "a refusal changes nothing");

    let info = pool
        .adopt_volume(unknown, "snap", 8 * BLOCK, Some("vm"))
        .unwrap();
    assert_eq!((info.id, info.origin.as_deref()), (unknown, Some("vm")));
    assert!(pool.disagreements().is_empty());
    assert_eq!(
        read(&pool, "snap", 2 * BLOCK),
        pattern(7, 2 * BLOCK as usize)
    );
    // The origin's writes break sharing: the adopted snapshot keeps its content.
    let vm = pool.volume("vm").unwrap();
    vm.write(0, &pattern(9, BLOCK as usize), false).unwrap();
    vm.flush().unwrap();
    drop(vm);
    assert_eq!(
        read(&pool, "snap", 2 * BLOCK),
        pattern(7, 2 * BLOCK as usize)
    );
    pool.verify_index().unwrap();
    pool.close().unwrap();
    drop(pool);
    let pool = parts.reopen(options());
    let info = pool.info("snap").unwrap();
    assert_eq!((info.id, info.origin.as_deref()), (unknown, Some("vm")));
    assert_eq!(
        read(&pool, "snap", 2 * BLOCK),
        pattern(7, 2 * BLOCK as usize)
    );
}

#[test]
fn a_new_volume_never_takes_an_unadopted_id() {
    let (parts, vm_id) = pool_with_vm();
    // The id the catalog alone would give next.
    let next = VolumeId::new(vm_id.get() + 1);
    as_the_kernel(&parts, |md| md.create_snap(next, vm_id).unwrap());
    let pool = parts.reopen(options());
    let made = pool.create_volume("new", 4 * BLOCK).unwrap();
    assert_ne!(made.id, next);
    let snap = pool.snapshot("vm", "vm-snap", true).unwrap();
    assert_ne!(snap.id, next);
    pool.delete_volume("vm").unwrap();
    let found = pool.disagreements();
    assert_eq!(found.unadopted.len(), 1);
    assert_eq!(found.unadopted[0].id, next);
    assert_eq!(found.unadopted[0].mapped_blocks, 2, "its blocks are kept");
    pool.adopt_volume(next, "kept", 8 * BLOCK, None).unwrap();
    assert_eq!(
        read(&pool, "kept", 2 * BLOCK),
        pattern(7, 2 * BLOCK as usize)
    );
}

#[test]
fn an_entry_whose_thin_id_is_gone_is_named_refused_and_forgotten() {
    let (parts, vm_id) = pool_with_vm();
    let pool = parts.reopen(options());
    let gone = pool.create_volume("gone", 4 * BLOCK).unwrap().id;
    pool.snapshot("gone", "gone-snap", false).unwrap();
    pool.close().unwrap();
    drop(pool);
    as_the_kernel(&parts, |md| md.delete(gone).unwrap());
    let pool = parts.reopen(options());
    let found = pool.disagreements();
    assert!(found.unadopted.is_empty());
    assert_eq!(found.orphaned.len(), 1);
    assert_eq!(
        (found.orphaned[0].name.as_str(), found.orphaned[0].id),
        ("gone", gone)
    );
    let warning = pool
        .events()
        .into_iter()
        .find(|e| e.contains("disagree"))
        .expect("a warning at open");
    assert!(warning.contains("thinpool volume forget gone"), "{warning}");
    let names: Vec<String> = pool.list().into_iter().map(|v| v.name).collect();
    assert_eq!(names, ["gone-snap", "vm"]);
    for error in [
        pool.volume("gone").map(|_| ()).unwrap_err(),
        pool.delete_volume("gone").unwrap_err(),
    ] {
        assert!(
            matches!(error, Error::Catalog(CatalogRefusal::Orphaned { id, .. }) if id == gone),
            "{error}"
        );
        assert!(error.to_string().contains("volume forget"), "{error}");
    }
    assert!(
        pool.create_volume("gone", BLOCK).is_err(),
        "the name is taken"
    );
    let error = pool.forget_volume("vm").unwrap_err();
    assert!(
        matches!(error, Error::Catalog(CatalogRefusal::StillInMetadata { id, .. }) if id == vm_id),
        "{error}"
    );
    assert!(error.to_string().contains("delete"), "{error}");
    assert!(matches!(
        pool.forget_volume("nobody").unwrap_err(),
        Error::NoSuchVolume(_)
    ));
    pool.forget_volume("gone").unwrap();
    assert!(pool.disagreements().is_empty());
    assert_eq!(pool.info("gone-snap").unwrap().origin, None);
    // Its name and thin id are free again.
    let again = pool.create_volume("gone", BLOCK).unwrap();
    assert_eq!(again.origin, None);
    pool.close().unwrap();
    drop(pool);
    let pool = parts.reopen(options());
    assert!(pool.disagreements().is_empty());
    assert_eq!(pool.info("gone-snap").unwrap().origin, None);
}

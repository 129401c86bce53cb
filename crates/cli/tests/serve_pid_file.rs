//! Goal: `thinpool serve --pid-file FILE` never destroys what FILE names (issue 20, finding
//! 3). The pid file is renamed over FILE and removed at shutdown, so FILE must be a pid file
//! or nothing, and never a pool's file: `--pid-file POOL/data` used to lose every volume,
//! `POOL/catalog-N.json` the names, `POOL/pool.json` the options, and `--pid-file /dev/zero`
//! read until memory ran out.
//!
//! Method: each refused path is given to a real `thinpool serve`; the refusal must come
//! before anything is served (no socket made) and leave the file's bytes as they were. A pid
//! file replaced by another file while the server runs is left in place at shutdown.

mod e2e_support;

use e2e_support::*;
use std::path::{Path, PathBuf};

fn new_pool(temp: &ScratchDir) -> PathBuf {
    let pool = temp.join("pool");
    create_pool(&pool, &["--data-size", "64M"]);
    create_volume(&pool, "vm", "16M");
    pool
}

/// `thinpool serve --pool POOL --pid-file PID_FILE`, which must be refused (within a minute);
/// returns its stderr.
fn serve_refused(pool: &Path, pid_file: &Path) -> String {
    let error = thinpool_err(&[
        "serve",
        "--pool",
        pool.to_str().unwrap(),
        "--pid-file",
        pid_file.to_str().unwrap(),
    ]);
    assert!(
        !pool.join("nbd.sock").exists(),
        "refused before anything is served"
    );
    error
}

#[test]
fn a_pid_file_inside_the_pool_directory_is_refused_and_the_file_kept() {
    let temp = ScratchDir::new("pid-file-in-pool");
    let pool = new_pool(&temp);
    let catalog = std::fs::read_dir(&pool)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .find(|name| name.starts_with("catalog-") && name.ends_with(".json"))
        .expect("a catalog");
    for name in ["data", "metadata", "pool.json", catalog.as_str(), "new.pid"] {
        let path = pool.join(name);
        let before = std::fs::read(&path).ok();
        let error = serve_refused(&pool, &path);
        assert!(
            error.contains("inside the pool directory"),
            "{name}: {error}"
        );
        assert_eq!(std::fs::read(&path).ok(), before, "{name} is unchanged");
    }
    // Another pool's directory too, and a directory below a pool's.
    let other = temp.join("other");
    create_pool(&other, &["--data-size", "64M"]);
    let before = std::fs::read(other.join("data")).unwrap();
    let error = serve_refused(&pool, &other.join("data"));
    assert!(error.contains("inside the pool directory"), "{error}");
    assert_eq!(std::fs::read(other.join("data")).unwrap(), before);
    std::fs::create_dir(pool.join("run")).unwrap();
    let error = serve_refused(&pool, &pool.join("run/serve.pid"));
    assert!(error.contains("inside the pool directory"), "{error}");
    // The pool still opens with its volume.
    let listed = thinpool_ok(&["list", "--pool", pool.to_str().unwrap()]);
    assert!(listed.contains("vm"), "{listed}");
}

#[test]
fn a_pid_file_path_holding_something_else_is_refused_and_kept() {
    let temp = ScratchDir::new("pid-file-other");
    let pool = new_pool(&temp);
    // A file with other content, a pid followed by more, a long run of digits.
    for (name, content) in [
        ("notes.txt", &b"my notes\n"[..]),
        ("pid-and-more", &b"123\nand more\n"[..]),
        ("digits", &[b'7'; 4096][..]),
    ] {
        let path = temp.join(name);
        std::fs::write(&path, content).unwrap();
        let error = serve_refused(&pool, &path);
        assert!(
            error.contains("does not hold a process id"),
            "{name}: {error}"
        );
        assert_eq!(
            std::fs::read(&path).unwrap(),
            content,
            "{name} is unchanged"
        );
    }
    // Not a regular file: a device read until memory runs out, a directory.
    let error = serve_refused(&pool, Path::new("/dev/zero"));
    assert!(error.contains("not a regular file"), "{error}");
    std::fs::create_dir(temp.join("a-directory")).unwrap();
    let error = serve_refused(&pool, &temp.join("a-directory"));
    assert!(error.contains("not a regular file"), "{error}");
    assert!(temp.join("a-directory").is_dir());
    // A symbolic link (to a file of someone's) is not followed, not replaced.
    std::fs::write(temp.join("target"), b"precious\n").unwrap();
    std::os::unix::fs::symlink(temp.join("target"), temp.join("link.pid")).unwrap();
    let error = serve_refused(&pool, &temp.join("link.pid"));
    assert!(error.contains("symbolic link"), "{error}");
    assert_eq!(std::fs::read(temp.join("target")).unwrap(), b"precious\n");
    assert!(std::fs::symlink_metadata(temp.join("link.pid"))
        .unwrap()
        .is_symlink());
}

#[test]
fn an_empty_or_stale_pid_file_is_replaced_and_removed_at_exit() {
    let temp = ScratchDir::new("pid-file-stale");
    let pool = new_pool(&temp);
    for content in [&b""[..], &b"2147483646\n"[..], &b"2147483646"[..]] {
        let pid_file = temp.join("serve.pid");
        std::fs::write(&pid_file, content).unwrap();
        let served = serve(&pool, &["--pid-file", pid_file.to_str().unwrap()]);
        assert_eq!(
            std::fs::read_to_string(&pid_file).unwrap(),
            format!("{}\n", served.pid())
        );
        let (status, log) = served.stop_with_log();
        assert!(status.success(), "{log}");
        assert!(!pid_file.exists(), "removed on a clean shutdown");
    }
}

#[test]
fn a_pid_file_replaced_while_serving_is_left_at_exit() {
    let temp = ScratchDir::new("pid-file-replaced");
    let pool = new_pool(&temp);
    let pid_file = temp.join("serve.pid");
    let served = serve(&pool, &["--pid-file", pid_file.to_str().unwrap()]);
    // Someone puts another file there, even one naming this server: not the file written.
    let text = format!("{}\n", served.pid());
    std::fs::remove_file(&pid_file).unwrap();
    std::fs::write(&pid_file, &text).unwrap();
    let (status, log) = served.stop_with_log();
    assert!(status.success(), "{log}");
    assert_eq!(
        std::fs::read_to_string(&pid_file).unwrap(),
        text,
        "another file at the path is not removed"
    );
}

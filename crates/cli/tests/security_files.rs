//! Goal: another local user can neither redirect thinpool's writes, nor read a pool's data,
//! nor take its sockets; `check` refuses what no open accepts; volume names cannot spoof a
//! listing (issue 10, items 1, 2, 5 and 6).
//!
//! Method: each reproduction of the issue, replayed. The attacker's steps run as `nobody`
//! (`setpriv --reuid --regid --clear-groups`; the tests run as root, here and in CI): planting
//! links to a root-owned 0600 "victim" file, reading pool files, replacing `nbd.sock`. The
//! assertions: thinpool refuses the directory (with the fix in the message), or, where the
//! user insisted with `--allow-shared-dir`, refuses or ignores the planted file and leaves
//! the victim untouched; the attacker's own steps fail with "Permission denied".

use std::io::{BufRead, BufReader, Read};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use persistent_data::checksum::{self, BlockKind};

const THINPOOL: &str = env!("CARGO_BIN_EXE_thinpool");
/// What the victim file holds; it must still hold exactly this after every attack.
const VICTIM_TEXT: &str = "root's secret, not to be overwritten\n";
/// The unprivileged user the attacker's steps run as (Debian's and Fedora's `nobody`).
const NOBODY_UID: u32 = 65534;
const NOBODY_GID: u32 = 65534;
/// Limit for any one command (a hang is a failure, not a measurement).
const COMMAND_DEADLINE: Duration = Duration::from_secs(60);

/// A scratch directory under the system temporary directory (mode 0755, owned by the test),
/// removed on drop.
struct Scratch {
    path: PathBuf,
}

impl Scratch {
    fn new(tag: &str) -> Scratch {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "tp-security-{tag}-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        Scratch { path }
    }

    fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    /// A root-owned 0600 file holding [`VICTIM_TEXT`].
    fn victim(&self, name: &str) -> PathBuf {
        let path = self.join(name);
        std::fs::write(&path, VICTIM_TEXT).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// `command` with captured output, killed by PID after [`COMMAND_DEADLINE`] (testkit's runner).
fn run(command: Command) -> Output {
    let shown = format!("{command:?}");
    testkit::process::run_command(command, &shown, COMMAND_DEADLINE)
}

fn thinpool(args: &[&str]) -> Output {
    let mut command = Command::new(THINPOOL);
    command.args(args).env_remove("THINPOOL_POOL");
    run(command)
}

fn thinpool_ok(args: &[&str]) -> String {
    let out = thinpool(args);
    assert!(
        out.status.success(),
        "thinpool {args:?} failed:\n{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// Runs thinpool, expects a failure, returns its stderr.
fn thinpool_err(args: &[&str]) -> String {
    let out = thinpool(args);
    assert!(
        !out.status.success(),
        "thinpool {args:?} succeeded:\n{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stderr)
}

/// Whether this process is root (so it can run steps as `nobody`).
fn is_root() -> bool {
    let scratch = Scratch::new("whoami");
    let probe = scratch.join("probe");
    std::fs::write(&probe, b"").unwrap();
    std::fs::metadata(&probe).unwrap().uid() == 0
}

/// The tests that act as another user need root; CI and the project's test runs are root.
/// Elsewhere they say so and skip, rather than pass without testing anything silently.
fn require_root(test: &str) -> bool {
    if is_root() {
        true
    } else {
        eprintln!("{test}: skipped: needs root to run the attacker's steps as nobody");
        false
    }
}

/// Runs `program args` as `nobody` (an unprivileged user with no supplementary groups).
fn as_nobody(program: &str, args: &[&str]) -> Output {
    let mut command = Command::new("setpriv");
    command
        .arg(format!("--reuid={NOBODY_UID}"))
        .arg(format!("--regid={NOBODY_GID}"))
        .arg("--clear-groups")
        .arg("--")
        .arg(program)
        .args(args);
    run(command)
}

/// An attacker step that must be refused by the kernel: fails with "Permission denied".
fn nobody_is_denied(program: &str, args: &[&str]) {
    let out = as_nobody(program, args);
    assert!(
        !out.status.success(),
        "as nobody, {program} {args:?} succeeded:\n{}",
        text(&out.stdout)
    );
    assert!(
        text(&out.stderr).contains("Permission denied"),
        "as nobody, {program} {args:?} failed for another reason:\n{}",
        text(&out.stderr)
    );
}

/// An attacker step that works (in a directory left open to others).
fn nobody_does(program: &str, args: &[&str]) {
    let out = as_nobody(program, args);
    assert!(
        out.status.success(),
        "as nobody, {program} {args:?} failed:\n{}",
        text(&out.stderr)
    );
}

fn assert_victim_intact(victim: &Path) {
    assert_eq!(
        std::fs::read_to_string(victim).unwrap(),
        VICTIM_TEXT,
        "{} was written through a planted link",
        victim.display()
    );
    let metadata = std::fs::metadata(victim).unwrap();
    assert_eq!(metadata.len(), VICTIM_TEXT.len() as u64);
    assert_eq!(metadata.mode() & 0o777, 0o600);
}

fn mode(path: &Path) -> u32 {
    std::fs::symlink_metadata(path).unwrap().mode() & 0o7777
}

fn chmod(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

fn create(pool: &Path, extra: &[&str]) {
    let mut args = vec!["create", "--pool", p(pool), "--data-size", "64M"];
    args.extend_from_slice(extra);
    thinpool_ok(&args);
}

fn transaction_id(pool: &Path, extra: &[&str]) -> u64 {
    let mut args = vec!["status", "--json", "--pool", p(pool)];
    args.extend_from_slice(extra);
    let status: serde_json::Value = serde_json::from_str(&thinpool_ok(&args)).unwrap();
    status["transaction_id"].as_u64().unwrap()
}

/// `thinpool serve` in the background, stopped with SIGTERM (or killed) on drop.
struct Server {
    child: Child,
    stderr: PathBuf,
}

impl Server {
    /// Starts `thinpool serve --pool POOL -q EXTRA...` and waits for "thinpool: ready".
    fn start(pool: &Path, extra: &[&str]) -> Server {
        let stderr = pool.with_extension("serve-stderr");
        let mut child = Command::new(THINPOOL)
            .args(["serve", "-q", "--pool", p(pool)])
            .args(extra)
            .env_remove("THINPOOL_POOL")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .expect("start thinpool serve");
        let stdout = child.stdout.take().unwrap();
        let (sender, receiver) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if sender.send(line).is_err() {
                    break;
                }
            }
        });
        let server = Server { child, stderr };
        let deadline = Instant::now() + COMMAND_DEADLINE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match receiver.recv_timeout(left) {
                Ok(line) if line.starts_with("thinpool: ready") => return server,
                Ok(_) => {}
                Err(_) => panic!(
                    "thinpool serve did not become ready:\n{}",
                    std::fs::read_to_string(&server.stderr).unwrap_or_default()
                ),
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let deadline = Instant::now() + COMMAND_DEADLINE;
        while self.child.try_wait().ok().flatten().is_none() {
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = std::fs::remove_file(&self.stderr);
    }
}

/// Reads the NBD greeting from a Unix socket: true if a thinpool server answers there.
fn nbd_greets(socket: &Path) -> bool {
    let Ok(mut stream) = UnixStream::connect(socket) else {
        return false;
    };
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut greeting = [0u8; 8];
    stream.read_exact(&mut greeting).is_ok() && &greeting == b"NBDMAGIC"
}

#[test]
fn pool_directories_other_users_can_change_are_refused_with_the_fix() {
    let scratch = Scratch::new("shared-dirs");

    // World-writable, as /tmp/pool was in the README: refused, `chmod 700` suggested.
    let open = scratch.join("open");
    std::fs::create_dir(&open).unwrap();
    chmod(&open, 0o777);
    let error = thinpool_err(&["create", "--pool", p(&open), "--data-size", "64M"]);
    assert!(
        error.contains("other users can write to it (mode 0777)")
            && error.contains(&format!("chmod 700 {}", open.display()))
            && error.contains("--allow-shared-dir"),
        "{error}"
    );
    assert_eq!(std::fs::read_dir(&open).unwrap().count(), 0, "files made");

    // Group-writable is refused too.
    chmod(&open, 0o770);
    let error = thinpool_err(&["create", "--pool", p(&open), "--data-size", "64M"]);
    assert!(error.contains("mode 0770"), "{error}");

    // A shared sticky directory like /tmp itself: use a directory of its own inside it.
    let sticky = scratch.join("sticky");
    std::fs::create_dir(&sticky).unwrap();
    chmod(&sticky, 0o1777);
    let error = thinpool_err(&["create", "--pool", p(&sticky), "--data-size", "64M"]);
    let inside = sticky.join("thinpool-pool");
    assert!(
        error.contains(&format!("--pool {}", inside.display())),
        "{error}"
    );
    // ... which works: made 0700 inside the sticky directory.
    create(&inside, &[]);
    assert_eq!(mode(&inside), 0o700);

    // A parent others can write to (not sticky) lets them swap the directory: refused.
    let loose = scratch.join("loose");
    std::fs::create_dir(&loose).unwrap();
    chmod(&loose, 0o777);
    let error = thinpool_err(&[
        "create",
        "--pool",
        p(&loose.join("pool")),
        "--data-size",
        "64M",
    ]);
    assert!(
        error.contains(&format!("its parent {}", loose.display())) && error.contains("not sticky"),
        "{error}"
    );

    // Every command that opens a pool refuses a directory opened to others after create;
    // `--allow-shared-dir` is the way to insist.
    let pool = scratch.join("pool");
    create(&pool, &[]);
    thinpool_ok(&["volume", "create", "vm", "--size", "8M", "--pool", p(&pool)]);
    chmod(&pool, 0o777);
    for args in [
        vec!["list"],
        vec!["status"],
        vec!["volume", "create", "other", "--size", "8M"],
        vec!["volume", "delete", "vm"],
        vec!["create", "--grow", "--data-size", "128M"],
        vec!["serve", "-q"],
    ] {
        let mut args = args.clone();
        args.extend(["--pool", p(&pool)]);
        let error = thinpool_err(&args);
        assert!(error.contains("chmod 700"), "{args:?}: {error}");
    }
    let listing = thinpool_ok(&["list", "--pool", p(&pool), "--allow-shared-dir"]);
    assert!(listing.contains("vm"), "{listing}");
    chmod(&pool, 0o700);
    thinpool_ok(&["list", "--pool", p(&pool)]);
}

#[test]
fn pool_directories_of_another_user_are_refused() {
    if !require_root("pool_directories_of_another_user_are_refused") {
        return;
    }
    let scratch = Scratch::new("foreign-dir");
    let pool = scratch.join("pool");
    std::fs::create_dir(&pool).unwrap();
    chmod(&pool, 0o700);
    std::os::unix::fs::chown(&pool, Some(NOBODY_UID), Some(NOBODY_GID)).unwrap();
    let error = thinpool_err(&["create", "--pool", p(&pool), "--data-size", "64M"]);
    assert!(
        error.contains(&format!("belongs to uid {NOBODY_UID}, not to you")),
        "{error}"
    );
    assert_eq!(std::fs::read_dir(&pool).unwrap().count(), 0, "files made");
}

#[test]
fn a_planted_data_link_does_not_make_create_truncate_another_file() {
    if !require_root("a_planted_data_link_does_not_make_create_truncate_another_file") {
        return;
    }
    let scratch = Scratch::new("data-link");
    let victim = scratch.victim("victim");
    let pool = scratch.join("pool");
    std::fs::create_dir(&pool).unwrap();
    chmod(&pool, 0o777);
    // The reproduction: nobody plants `data` -> root's 0600 file in the open directory.
    nobody_does("ln", &["-s", p(&victim), p(&pool.join("data"))]);

    let error = thinpool_err(&["create", "--pool", p(&pool), "--data-size", "64M"]);
    assert!(error.contains("other users can write to it"), "{error}");
    assert_victim_intact(&victim);

    // Insisting does not make it follow the link: the data file is created afresh or not at
    // all.
    let error = thinpool_err(&[
        "create",
        "--pool",
        p(&pool),
        "--data-size",
        "64M",
        "--allow-shared-dir",
    ]);
    assert!(error.contains("data"), "{error}");
    assert_victim_intact(&victim);

    // Same with `metadata` planted.
    let pool = scratch.join("pool2");
    std::fs::create_dir(&pool).unwrap();
    chmod(&pool, 0o777);
    nobody_does("ln", &["-s", p(&victim), p(&pool.join("metadata"))]);
    thinpool_err(&[
        "create",
        "--pool",
        p(&pool),
        "--data-size",
        "64M",
        "--allow-shared-dir",
    ]);
    assert_victim_intact(&victim);
}

#[test]
fn a_planted_catalog_link_does_not_redirect_the_servers_writes() {
    if !require_root("a_planted_catalog_link_does_not_redirect_the_servers_writes") {
        return;
    }
    let scratch = Scratch::new("catalog-link");
    let victim = scratch.victim("victim");

    // In a pool directory thinpool made, nobody cannot plant anything.
    let pool = scratch.join("pool");
    create(&pool, &[]);
    assert_eq!(mode(&pool), 0o700);
    let next = transaction_id(&pool, &[]) + 1;
    let planted = pool.join(format!("catalog-{next}.json.tmp"));
    nobody_is_denied("ln", &["-s", p(&victim), p(&planted)]);

    // The reproduction, in a directory the user opened to others and insisted on: the
    // server's next catalog write does not go through the planted link.
    let shared = scratch.join("shared");
    create(&shared, &[]);
    chmod(&shared, 0o777);
    let insist = ["--allow-shared-dir"];
    let server = Server::start(&shared, &insist);
    let next = transaction_id(&shared, &insist) + 1;
    let planted = shared.join(format!("catalog-{next}.json.tmp"));
    nobody_does("ln", &["-s", p(&victim), p(&planted)]);
    thinpool_ok(&[
        "volume",
        "create",
        "vm",
        "--size",
        "8M",
        "--pool",
        p(&shared),
        "--allow-shared-dir",
    ]);
    assert_victim_intact(&victim);
    assert!(!planted.exists(), "the planted link is still there");
    let catalog = shared.join(format!("catalog-{next}.json"));
    let metadata = std::fs::symlink_metadata(&catalog).unwrap();
    assert!(
        metadata.is_file(),
        "{} is not a plain file",
        catalog.display()
    );
    assert_eq!(metadata.mode() & 0o777, 0o600);
    let listing = thinpool_ok(&["list", "--pool", p(&shared), "--allow-shared-dir"]);
    assert!(listing.contains("vm"), "{listing}");
    drop(server);

    // A catalog replaced by a link is refused at open, not read through.
    let current = transaction_id(&shared, &insist);
    let catalog = shared.join(format!("catalog-{current}.json"));
    std::fs::remove_file(&catalog).unwrap();
    nobody_does("ln", &["-s", p(&victim), p(&catalog)]);
    let error = thinpool_err(&["list", "--pool", p(&shared), "--allow-shared-dir"]);
    assert!(error.contains("symbolic link"), "{error}");
    assert_victim_intact(&victim);
}

#[test]
fn another_user_can_neither_read_the_pool_nor_replace_its_socket() {
    if !require_root("another_user_can_neither_read_the_pool_nor_replace_its_socket") {
        return;
    }
    let scratch = Scratch::new("private");
    let pool = scratch.join("pool");
    create(&pool, &[]);
    thinpool_ok(&["volume", "create", "vm", "--size", "8M", "--pool", p(&pool)]);
    assert_eq!(mode(&pool), 0o700);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&pool)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .collect();
    files.sort();
    assert!(files.len() >= 4, "{files:?}");
    for file in &files {
        assert_eq!(mode(file), 0o600, "{}", file.display());
    }

    let server = Server::start(&pool, &[]);
    let socket = pool.join("nbd.sock");
    let control = pool.join("control.sock");
    assert!(nbd_greets(&socket));
    // The reproduction: read `data`, replace `nbd.sock`. Both fail now.
    nobody_is_denied("cat", &[p(&pool.join("data"))]);
    nobody_is_denied("cat", &[p(&pool.join("metadata"))]);
    nobody_is_denied("rm", &["-f", p(&socket)]);
    nobody_is_denied("ln", &["-sf", p(&scratch.join("elsewhere")), p(&socket)]);
    let out = as_nobody(THINPOOL, &["list", "--pool", p(&pool)]);
    assert!(!out.status.success(), "nobody listed the pool");
    assert!(nbd_greets(&socket), "the server's socket was replaced");
    assert!(std::fs::symlink_metadata(&control).is_ok());

    // Even with the directory opened up to traversal, the files stay closed.
    chmod(&pool, 0o755);
    nobody_is_denied("cat", &[p(&pool.join("data"))]);
    nobody_is_denied("cat", &[p(&files[0])]);
    chmod(&pool, 0o700);
    drop(server);
}

#[test]
fn files_of_older_pools_are_made_private() {
    let scratch = Scratch::new("old-modes");
    let pool = scratch.join("pool");
    create(&pool, &[]);
    // As an older version left them.
    for name in ["data", "metadata", "pool.json"] {
        chmod(&pool.join(name), 0o644);
    }
    let out = thinpool(&["list", "--pool", p(&pool)]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let notes = text(&out.stderr);
    for name in ["data", "metadata", "pool.json"] {
        assert_eq!(mode(&pool.join(name)), 0o600, "{name}");
        assert!(
            notes.contains(&format!(
                "{} was open to other users (mode 0644)",
                p(&pool.join(name))
            )),
            "{notes}"
        );
    }
}

#[test]
fn a_stale_socket_of_another_user_is_not_removed() {
    if !require_root("a_stale_socket_of_another_user_is_not_removed") {
        return;
    }
    let scratch = Scratch::new("foreign-socket");
    let pool = scratch.join("pool");
    create(&pool, &[]);
    // A socket nobody listens on, left by another user (only possible in a shared directory).
    chmod(&pool, 0o777);
    let socket = pool.join("nbd.sock");
    drop(UnixListener::bind(&socket).unwrap());
    std::os::unix::fs::chown(&socket, Some(NOBODY_UID), Some(NOBODY_GID)).unwrap();
    let error = thinpool_err(&["serve", "-q", "--pool", p(&pool), "--allow-shared-dir"]);
    assert!(error.contains("socket of another user"), "{error}");
    assert_eq!(
        std::fs::symlink_metadata(&socket).unwrap().uid(),
        NOBODY_UID
    );
}

#[test]
fn check_refuses_a_wrong_superblock_magic() {
    let scratch = Scratch::new("magic");
    let pool = scratch.join("pool");
    create(&pool, &[]);
    let metadata = pool.join("metadata");
    thinpool_ok(&["check", p(&metadata)]);

    // Wrong magic with a valid checksum: only the magic is wrong.
    let mut image = std::fs::read(&metadata).unwrap();
    let block: &mut [u8; 4096] = (&mut image[..4096]).try_into().unwrap();
    block[32..40].copy_from_slice(&27_022_011u64.to_le_bytes());
    checksum::stamp(block, BlockKind::Superblock);
    std::fs::write(&metadata, &image).unwrap();

    let out = thinpool(&["check", p(&metadata)]);
    assert!(!out.status.success(), "check passed a wrong magic");
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("magic is 27022011, expected 27022010"),
        "{stderr}"
    );
    // As every command that opens the pool.
    let error = thinpool_err(&["list", "--pool", p(&pool)]);
    assert!(error.contains("magic"), "{error}");
    // Quiet, as thin_check -q: only the exit code.
    let out = thinpool(&["check", "-q", p(&metadata)]);
    assert!(!out.status.success());
}

#[test]
fn volume_names_follow_lvm_rule() {
    let scratch = Scratch::new("names");
    let pool = scratch.join("pool");
    create(&pool, &[]);
    let rule = "letters, digits and + _ . - only, not starting with -, 1 to 127 characters";
    let too_long = "x".repeat(128);
    for bad in [
        "evil\u{202e}gpj.exe",
        "   ",
        "a b",
        "caf\u{e9}",
        "-rf",
        "..",
        "a/b",
        too_long.as_str(),
    ] {
        let error = thinpool_err(&[
            "volume",
            "create",
            "--pool",
            p(&pool),
            "--size",
            "8M",
            "--",
            bad,
        ]);
        assert!(error.contains(rule), "{bad:?}: {error}");
        assert!(
            !error.contains('\u{202e}'),
            "the refusal carries the override character to the terminal: {error:?}"
        );
        // Snapshots are named by the same rule.
        thinpool_ok(&[
            "volume",
            "create",
            "origin",
            "--size",
            "8M",
            "--pool",
            p(&pool),
        ]);
        let error = thinpool_err(&[
            "volume",
            "snapshot",
            "--pool",
            p(&pool),
            "--",
            "origin",
            bad,
        ]);
        assert!(error.contains(rule), "{bad:?}: {error}");
        thinpool_ok(&["volume", "delete", "origin", "--pool", p(&pool)]);
    }
    let longest = "y".repeat(127);
    for good in ["vm0", "A+b_c.d-e", "0", longest.as_str()] {
        thinpool_ok(&["volume", "create", good, "--size", "8M", "--pool", p(&pool)]);
    }
    let listing = thinpool_ok(&["list", "--pool", p(&pool)]);
    assert!(
        listing.contains("A+b_c.d-e") && listing.contains(&longest),
        "{listing}"
    );
    assert_eq!(listing.lines().count(), 5, "{listing}");
}

/// Issue 20, finding 6: `--pool` through another user's symbolic link. The directory check
/// resolved the path once and later opens went through it again, so a link in a
/// world-writable directory that its owner flipped in between sent root's catalog into that
/// user's directory. Now a path through an entry another user can change is refused before
/// anything is opened: a link owned by nobody in a sticky, world-writable directory (as in
/// `/tmp`), a link in a directory nobody owns; a link of root's own in the sticky directory
/// is followed as before.
#[test]
fn a_pool_path_through_another_users_link_is_refused() {
    if !require_root("a_pool_path_through_another_users_link_is_refused") {
        return;
    }
    let scratch = Scratch::new("pool-link");
    let pool = scratch.join("pool");
    thinpool_ok(&["create", "--pool", p(&pool), "--data-size", "16M"]);
    // A shared directory like /tmp: world-writable and sticky, root's.
    let shared = scratch.join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let theirs = shared.join("theirs");
    nobody_does("ln", &["-s", p(&pool), p(&theirs)]);
    assert_eq!(
        std::fs::symlink_metadata(&theirs).unwrap().uid(),
        NOBODY_UID
    );
    let catalogs_before = catalogs(&pool);
    for command in [
        &["list"][..],
        &["status"],
        &["volume", "create", "v", "--size", "1M"],
    ] {
        let mut args = command.to_vec();
        args.extend(["--pool", p(&theirs)]);
        let error = thinpool_err(&args);
        assert!(
            error.contains("refusing pool directory") && error.contains("belongs to uid 65534"),
            "{args:?}: {error}"
        );
    }
    assert_eq!(catalogs(&pool), catalogs_before, "nothing was written");
    // A directory of nobody's holding a link of root's: nobody can replace the link.
    let nobody_dir = scratch.join("nobody-dir");
    std::fs::create_dir(&nobody_dir).unwrap();
    std::os::unix::fs::chown(&nobody_dir, Some(NOBODY_UID), Some(NOBODY_GID)).unwrap();
    let link = nobody_dir.join("pool");
    std::os::unix::fs::symlink(&pool, &link).unwrap();
    let error = thinpool_err(&["list", "--pool", p(&link)]);
    assert!(
        error.contains("refusing pool directory") && error.contains("writable by other users"),
        "{error}"
    );
    // Root's own link in the sticky directory: only root can change it; followed.
    let mine = shared.join("mine");
    std::os::unix::fs::symlink(&pool, &mine).unwrap();
    thinpool_ok(&["list", "--pool", p(&mine)]);
    thinpool_ok(&["list", "--pool", p(&pool)]);
}

/// The names of the `catalog-N.json` files in `pool`, with their contents.
fn catalogs(pool: &Path) -> Vec<(String, Vec<u8>)> {
    let mut found: Vec<(String, Vec<u8>)> = std::fs::read_dir(pool)
        .unwrap()
        .map(|entry| entry.unwrap())
        .filter(|entry| entry.file_name().to_string_lossy().starts_with("catalog-"))
        .map(|entry| {
            (
                entry.file_name().to_string_lossy().into_owned(),
                std::fs::read(entry.path()).unwrap(),
            )
        })
        .collect();
    found.sort();
    found
}

//! Goal: every command with a result prints, under `--json`, one object that docs/json.md's
//! schema (docs/json-schema.json) accepts: on success the object `x-commands` names for it,
//! on failure the error object (kind, errno, code, message), on stdout, with a non-zero
//! exit; the same on a pool no server holds and on a served one (through the control
//! socket), whose own answer lines validate against `socket_answer`.
//!
//! Method: one scratch pool per round, every command run with `--json` (successes and
//! refusals), each stdout parsed and validated with the `jsonschema` crate against the
//! schema of the object it must be; the commands that validated are collected and must be
//! every key of `x-commands` (and the unit test in `commands/json.rs` holds `x-commands` to
//! the command line's definition, so a new command without a schema fails one of the two).
//! Values are checked against the model of what was asked where the schema cannot (a
//! volume's name and size, the version field, the error's kind and errno).
//! `import` needs block devices: its success is checked on loop devices where they attach
//! (skipped, saying so, elsewhere, unless `THINPOOL_REQUIRE_LOOP_DEVICES=1`).

mod e2e_support;

use e2e_support::*;
use serde_json::Value;
use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use testkit::loop_device::LoopDevice;
use thin_pool::{Pool, PoolOptions};

const SCHEMA: &str = include_str!("../../../docs/json-schema.json");

/// The schema, and the commands whose outputs validated.
struct Contract {
    schema: Value,
    covered: BTreeSet<String>,
}

impl Contract {
    fn new() -> Contract {
        let schema: Value = serde_json::from_str(SCHEMA).expect("the schema is JSON");
        jsonschema::meta::validate(&schema).expect("the schema is a valid JSON Schema");
        Contract {
            schema,
            covered: BTreeSet::new(),
        }
    }

    /// What `$defs/def` finds wrong with `value`.
    fn violations(&self, def: &str, value: &Value) -> Vec<String> {
        let mut schema = self.schema.clone();
        schema["$ref"] = Value::String(format!("#/$defs/{def}"));
        let validator = jsonschema::draft202012::new(&schema)
            .unwrap_or_else(|error| panic!("schema for {def}: {error}"));
        validator
            .iter_errors(value)
            .map(|error| format!("{} at {}", error, error.instance_path()))
            .collect()
    }

    /// Validates `value` against `$defs/def`; panics with every violation.
    fn validate(&self, def: &str, value: &Value, what: &str) {
        let errors = self.violations(def, value);
        assert!(
            errors.is_empty(),
            "{what}: not a {def}:\n{}\n{value:#}",
            errors.join("\n")
        );
    }

    /// The object `x-commands` names for a command path.
    fn def_of(&self, path: &str) -> String {
        self.schema["x-commands"][path]
            .as_str()
            .unwrap_or_else(|| panic!("no x-commands entry for {path:?}"))
            .to_string()
    }

    /// `thinpool ARGS --json` (the command path is the leading words of `args` that name
    /// it): must succeed with the object of its path; returns it.
    #[track_caller]
    fn ok(&mut self, path: &str, args: &[&str]) -> Value {
        let output = thinpool(&with_json(args));
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success(),
            "thinpool {args:?} failed: {}\n{stdout}",
            String::from_utf8_lossy(&output.stderr)
        );
        let value = one_object(&stdout, args);
        self.validate(&self.def_of(path), &value, &format!("thinpool {args:?}"));
        assert_eq!(value["thinpool_json"], 1);
        self.covered.insert(path.to_string());
        value
    }

    /// `thinpool ARGS --json`, which must fail with the error object of `kind` (and `errno`
    /// when given) on stdout; returns the error.
    #[track_caller]
    fn refused(&mut self, args: &[&str], kind: &str, errno: Option<i32>) -> Value {
        let output = thinpool(&with_json(args));
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            !output.status.success(),
            "thinpool {args:?} succeeded: {stdout}"
        );
        let value = one_object(&stdout, args);
        self.validate("error_answer", &value, &format!("thinpool {args:?}"));
        let error = &value["error"];
        assert_eq!(error["kind"], kind, "thinpool {args:?}: {value:#}");
        if let Some(errno) = errno {
            assert_eq!(error["errno"], errno, "thinpool {args:?}: {value:#}");
        }
        let stderr = String::from_utf8_lossy(&output.stderr);
        let message = error["message"].as_str().unwrap();
        assert!(
            stderr.contains(message.lines().next().unwrap()),
            "the error object and stderr disagree:\n{message}\n{stderr}"
        );
        error.clone()
    }
}

fn with_json<'a>(args: &[&'a str]) -> Vec<&'a str> {
    let mut args = args.to_vec();
    args.push("--json");
    args
}

/// Stdout must be exactly one JSON object.
fn one_object(stdout: &str, args: &[&str]) -> Value {
    let mut stream = serde_json::Deserializer::from_str(stdout).into_iter::<Value>();
    let value = match stream.next() {
        Some(Ok(value)) => value,
        other => panic!("thinpool {args:?}: stdout is not JSON ({other:?}):\n{stdout}"),
    };
    assert!(
        stream.next().is_none(),
        "thinpool {args:?}: more than one object:\n{stdout}"
    );
    assert!(value.is_object(), "{value}");
    value
}

/// Drops `drop` from the catalog (its thin id becomes unadopted) and adds an entry whose
/// thin id the metadata lacks (orphaned), as the kernel's create_snap and delete would.
fn make_disagreements(pool: &Path, drop: &str, orphan: &str) {
    let catalog = std::fs::read_dir(pool)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .find(|path| {
            let name = path.file_name().unwrap().to_string_lossy();
            name.starts_with("catalog-") && name.ends_with(".json")
        })
        .expect("a catalog file");
    let mut value: Value = serde_json::from_str(&std::fs::read_to_string(&catalog).unwrap())
        .expect("the catalog is JSON");
    let volumes = value["volumes"].as_array_mut().unwrap();
    volumes.retain(|volume| volume["name"] != drop);
    volumes.push(serde_json::json!({
        "name": orphan, "id": 900, "size_bytes": 1 << 20, "read_only": false, "origin_id": null
    }));
    std::fs::write(&catalog, serde_json::to_vec_pretty(&value).unwrap()).unwrap();
}

/// The pool commands on `pool` (made, given disagreements, served when `served`), each
/// success and refusal validated.
fn pool_round(contract: &mut Contract, scratch: &ScratchDir, round: &str, served: bool) {
    let pool = scratch.join(format!("pool-{round}"));
    let p = pool.to_str().unwrap();
    let created = contract.ok("create", &["create", "--pool", p, "--data-size", "64M"]);
    assert_eq!(created["volume_count"], 0);
    assert_eq!(created["autoextend"], Value::Null);
    contract.ok(
        "volume create",
        &["volume", "create", "kept", "--size", "1M", "--pool", p],
    );
    contract.ok(
        "volume snapshot",
        &["volume", "snapshot", "kept", "kept-s", "--pool", p],
    );
    make_disagreements(&pool, "kept-s", "gone");
    let server = served.then(|| serve(&pool, &["--quiet"]));
    volume_commands(contract, p);
    let unadopted = lists(contract, p);
    reports(contract, p, served);
    pool_changes(contract, p);
    catalog_and_streams(contract, scratch, round, p, &unadopted);

    if let Some(server) = server {
        socket_answers(contract, &pool.join("control.sock"));
        assert!(server.stop().success());
    } else {
        check_commands(contract, &pool, scratch);
    }
}

/// The volume commands, and their refusals.
fn volume_commands(contract: &mut Contract, p: &str) {
    let volume = contract.ok(
        "volume create",
        &["volume", "create", "a", "--size", "4M", "--pool", p],
    );
    assert_eq!(
        (volume["name"].as_str(), volume["size_bytes"].as_u64()),
        (Some("a"), Some(4 << 20))
    );
    assert_eq!(volume["unmapped_bytes"], Value::Null, "{volume:#}");
    contract.refused(
        &["volume", "create", "a", "--size", "4M", "--pool", p],
        "refused",
        Some(ERRNO_EEXIST),
    );
    contract.ok(
        "volume snapshot",
        &[
            "volume",
            "snapshot",
            "a",
            "a-ro",
            "--read-only",
            "--pool",
            p,
        ],
    );
    contract.ok(
        "volume snapshot",
        &["volume", "snapshot", "a", "a-rw", "--pool", p],
    );
    let resized = contract.ok(
        "volume resize",
        &["volume", "resize", "a", "--size", "8M", "--pool", p],
    );
    assert_eq!(resized["unmapped_bytes"], 0, "{resized:#}");
    contract.ok(
        "volume revert",
        &["volume", "revert", "a", "a-rw", "--pool", p],
    );
    contract.ok(
        "volume rename",
        &["volume", "rename", "a-rw", "b", "--pool", p],
    );
    contract.refused(
        &["volume", "rename", "nosuch", "c", "--pool", p],
        "refused",
        Some(ERRNO_ENOENT),
    );
}

/// `list` in its forms; returns the unadopted thin id.
fn lists(contract: &mut Contract, p: &str) -> String {
    let listed = contract.ok("list", &["list", "--pool", p]);
    let names: Vec<&str> = listed["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["a", "a-ro", "b", "kept"], "{listed:#}");
    assert_eq!(listed["orphaned"][0]["name"], "gone", "{listed:#}");
    assert_eq!(
        listed["unadopted"].as_array().unwrap().len(),
        1,
        "{listed:#}"
    );
    let unadopted = listed["unadopted"][0]["id"].to_string();
    let by_id = contract.ok("list", &["list", "--ids", "--pool", p]);
    let ids: Vec<u64> = by_id["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["id"].as_u64().unwrap())
        .collect();
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "{ids:?}");
    contract.ok("volume list", &["volume", "list", "--pool", p]);
    unadopted
}

/// `status` and `diff`.
fn reports(contract: &mut Contract, p: &str, served: bool) {
    let status = contract.ok("status", &["status", "--pool", p]);
    assert_eq!(status["served"].is_null(), !served, "{status:#}");
    assert_eq!(status["volume_count"], 4, "{status:#}");

    let diff = contract.ok("diff", &["diff", "a-ro", "a", "--pool", p]);
    assert_eq!(
        (
            diff["base"]["name"].as_str(),
            diff["target"]["name"].as_str()
        ),
        (Some("a-ro"), Some("a"))
    );
    contract.refused(
        &["diff", "nosuch", "a", "--pool", p],
        "refused",
        Some(ERRNO_ENOENT),
    );
    let output = thinpool(&["diff", "a-ro", "a", "--format", "json", "--pool", p]);
    assert!(output.status.success());
    assert_eq!(
        one_object(&String::from_utf8_lossy(&output.stdout), &["diff"]),
        diff
    );
}

/// `trim`, `metadata-snap` and the grows.
fn pool_changes(contract: &mut Contract, p: &str) {
    contract.ok("trim", &["trim", "--pool", p]);
    let held = contract.ok(
        "metadata-snap reserve",
        &["metadata-snap", "reserve", "--pool", p],
    );
    assert!(held["metadata_snap_block"].is_u64(), "{held:#}");
    let released = contract.ok(
        "metadata-snap release",
        &["metadata-snap", "release", "--pool", p],
    );
    assert_eq!(released["metadata_snap_block"], Value::Null, "{released:#}");
    contract.refused(&["metadata-snap", "release", "--pool", p], "refused", None);

    let grown = contract.ok("grow", &["grow", "--data-size", "96M", "--pool", p]);
    assert_eq!(grown["data_total_blocks"], 96 * 16, "{grown:#}");
    contract.ok(
        "create",
        &["create", "--grow", "--data-size", "128M", "--pool", p],
    );
    contract.refused(
        &["grow", "--data-size", "16M", "--pool", p],
        "refused",
        Some(ERRNO_EINVAL),
    );
}

/// `volume adopt` and `forget`, `receive` of a sent snapshot, `volume delete`.
fn catalog_and_streams(
    contract: &mut Contract,
    scratch: &ScratchDir,
    round: &str,
    p: &str,
    unadopted: &str,
) {
    let adopted = contract.ok(
        "volume adopt",
        &[
            "volume", "adopt", unadopted, "kept-s2", "--size", "1M", "--pool", p,
        ],
    );
    assert_eq!(adopted["name"], "kept-s2");
    let forgotten = contract.ok("volume forget", &["volume", "forget", "gone", "--pool", p]);
    assert_eq!(forgotten["forgotten"]["id"], 900, "{forgotten:#}");
    contract.refused(&["volume", "forget", "kept", "--pool", p], "refused", None);

    let stream = scratch.join(format!("a-ro-{round}.stream"));
    thinpool_ok(&["send", "a-ro", "-o", stream.to_str().unwrap(), "--pool", p]);
    let copy = scratch.join(format!("copy-{round}"));
    let c = copy.to_str().unwrap();
    contract.ok("create", &["create", "--pool", c, "--data-size", "64M"]);
    let received = contract.ok(
        "receive",
        &[
            "receive",
            "a-ro",
            "-i",
            stream.to_str().unwrap(),
            "--pool",
            c,
        ],
    );
    assert_eq!(
        (received["name"].as_str(), received["read_only"].as_bool()),
        (Some("a-ro"), Some(true))
    );
    partial_receives(contract, scratch, round, c, p);

    let deleted = contract.ok("volume delete", &["volume", "delete", "b", "--pool", p]);
    assert_eq!(deleted["name"], "b");
    contract.refused(
        &["volume", "delete", "b", "--pool", p],
        "refused",
        Some(ERRNO_ENOENT),
    );
}

/// `receive --list-partial` and `receive --abort` on `p`, after a resumable receive of a
/// stream cut in half (of a volume with data, made in the pool `c` no server holds).
fn partial_receives(contract: &mut Contract, scratch: &ScratchDir, round: &str, c: &str, p: &str) {
    let pool = Pool::open(Path::new(c), PoolOptions::default()).unwrap();
    // 4 MiB mapped: 4 records of 1 MiB, so half the stream holds whole verified records.
    pool.create_volume("full", 4 << 20).unwrap();
    let volume = pool.volume("full").unwrap();
    volume.write(0, &vec![0x5a; 4 << 20], false).unwrap();
    drop(volume);
    pool.snapshot("full", "full-ro", true).unwrap();
    pool.close().unwrap();
    drop(pool);
    let stream = scratch.join(format!("full-{round}.stream"));
    let s = stream.to_str().unwrap();
    thinpool_ok(&["send", "full-ro", "-o", s, "--pool", c]);
    let bytes = std::fs::read(&stream).unwrap();
    std::fs::write(&stream, &bytes[..bytes.len() / 2]).unwrap();
    let args = [
        "receive",
        "cut",
        "--resumable",
        "--checkpoint",
        "64K",
        "-i",
        s,
        "--pool",
        p,
    ];
    let output = thinpool(&with_json(&args));
    assert!(!output.status.success(), "a cut stream was received");
    let refusal = one_object(&String::from_utf8_lossy(&output.stdout), &args);
    contract.validate("error_answer", &refusal, "receive of a cut stream");

    let listed = contract.ok(
        "receive --list-partial",
        &["receive", "--list-partial", "--pool", p],
    );
    let kept = listed["partial_receives"].clone();
    assert_eq!(kept.as_array().map(Vec::len), Some(1), "{listed:#}");
    assert_eq!(kept[0]["name"], "cut", "{listed:#}");
    assert!(kept[0]["held_blocks"].as_u64() > Some(0), "{listed:#}");
    let dropped = contract.ok(
        "receive --abort",
        &["receive", "--abort", "cut", "--pool", p],
    );
    assert_eq!(dropped["partial_receives"], kept, "not the one listed");
    contract.refused(&["receive", "--abort", "cut", "--pool", p], "refused", None);
    let listed = contract.ok(
        "receive --list-partial",
        &["receive", "--list-partial", "--pool", p],
    );
    assert_eq!(listed["partial_receives"], serde_json::json!([]));
}

/// Linux errnos the refusals carry.
const ERRNO_ENOENT: i32 = 2;
const ERRNO_EEXIST: i32 = 17;
const ERRNO_EINVAL: i32 = 22;

/// Answer lines of the control socket itself.
fn socket_answers(contract: &Contract, socket: &Path) {
    let stream = UnixStream::connect(socket).unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut writer = stream;
    for request in [
        r#"{"op":"status"}"#,
        r#"{"op":"list"}"#,
        r#"{"op":"diff","base":"a-ro","target":"a"}"#,
        r#"{"op":"partial_receives"}"#,
        r#"{"op":"delete_volume","name":"nosuch"}"#,
        r#"{"op":"no_such_op"}"#,
    ] {
        writer.write_all(format!("{request}\n").as_bytes()).unwrap();
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        let value: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
        contract.validate("socket_answer", &value, request);
    }
    // A trim and a diff asked with progress: progress lines, the last with all blocks done,
    // then the answer.
    let answer = with_progress(
        contract,
        (&mut writer, &mut reader),
        r#"{"op":"trim","progress":true}"#,
    );
    assert!(answer["trimmed_bytes"].is_u64(), "{answer}");
    let answer = with_progress(
        contract,
        (&mut writer, &mut reader),
        r#"{"op":"diff","base":"a-ro","target":"a","progress":true}"#,
    );
    assert!(answer["diff"]["ranges"].is_array(), "{answer}");
}

/// Sends `request` (one that asks for progress lines) and reads its progress lines and its
/// answer, each checked against the schema; the answer.
fn with_progress(
    contract: &Contract,
    (writer, reader): (&mut UnixStream, &mut BufReader<UnixStream>),
    request: &str,
) -> Value {
    writer.write_all(format!("{request}\n").as_bytes()).unwrap();
    let mut frames = Vec::new();
    let answer = loop {
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        let value: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
        if value.get("ok").is_some() {
            break value;
        }
        contract.validate("socket_progress", &value, request);
        frames.push(value["progress"].clone());
    };
    contract.validate("socket_answer", &answer, request);
    assert_eq!(answer["ok"], true, "{request}: {answer}");
    let last = frames.last().expect("no progress line before the answer");
    assert_eq!(last["done_blocks"], last["total_blocks"], "{frames:?}");
    assert!(
        frames.windows(2).all(|w| w[0] != w[1]),
        "a frame repeated: {frames:?}"
    );
    answer
}

/// `check` (clean, and on damaged metadata), `metadata-size` and `import`, on the offline
/// round's pool.
fn check_commands(contract: &mut Contract, pool: &Path, scratch: &ScratchDir) {
    let metadata = pool.join("metadata");
    let clean = contract.ok("check", &["check", metadata.to_str().unwrap()]);
    assert_eq!(
        (clean["passed"].as_bool(), clean["fatal_count"].as_u64()),
        (Some(true), Some(0))
    );
    let zeros = scratch.join("zeros.img");
    sized_file(&zeros, 4 << 20);
    let output = thinpool(&["check", zeros.to_str().unwrap(), "--json"]);
    assert!(!output.status.success());
    let damaged = one_object(&String::from_utf8_lossy(&output.stdout), &["check"]);
    contract.validate("check_answer", &damaged, "check of zeros");
    assert_eq!(
        (damaged["passed"].as_bool(), &damaged["transaction_id"]),
        (Some(false), &Value::Null)
    );
    contract.refused(
        &["check", "/nonexistent/metadata"],
        "io",
        Some(ERRNO_ENOENT),
    );

    let size = contract.ok(
        "metadata-size",
        &["metadata-size", "-b", "64k", "-s", "1t", "-m", "1000"],
    );
    assert_eq!(size["metadata_size_bytes"], 549_494_784);
    let output = thinpool(&[
        "metadata-size",
        "-b",
        "3k",
        "-s",
        "1t",
        "-m",
        "10",
        "--json",
    ]);
    assert!(!output.status.success());
    contract.validate(
        "error_answer",
        &one_object(&String::from_utf8_lossy(&output.stdout), &["metadata-size"]),
        "metadata-size -b 3k",
    );

    // Usage errors, the missing pool, a pool directory of files to import.
    contract.refused(
        &["volume", "create", "--size", "1M"],
        "usage",
        Some(ERRNO_EINVAL),
    );
    contract.refused(
        &["status", "--pool", scratch.join("none").to_str().unwrap()],
        "refused",
        None,
    );
    let files = scratch.join("files");
    contract.refused(
        &[
            "import",
            "--pool",
            files.to_str().unwrap(),
            "--metadata-device",
            metadata.to_str().unwrap(),
            "--data-device",
            pool.join("data").to_str().unwrap(),
        ],
        "refused",
        Some(ERRNO_EINVAL),
    );
    import_on_loop_devices(contract, pool, scratch);
}

/// `import --json` of a copy of the pool on loop devices.
fn import_on_loop_devices(contract: &mut Contract, pool: &Path, scratch: &ScratchDir) {
    let (metadata_file, data_file) = (
        scratch.join("import-meta.img"),
        scratch.join("import-data.img"),
    );
    std::fs::copy(pool.join("metadata"), &metadata_file).unwrap();
    std::fs::copy(pool.join("data"), &data_file).unwrap();
    let Some(metadata) = LoopDevice::attach(&metadata_file, "json_contract") else {
        contract.covered.insert("import".to_string());
        eprintln!("json_contract: import's success not checked (no loop devices)");
        return;
    };
    let Some(data) = LoopDevice::attach(&data_file, "json_contract") else {
        metadata.detach();
        contract.covered.insert("import".to_string());
        eprintln!("json_contract: import's success not checked (no loop devices)");
        return;
    };
    let volumes = contract.ok("status", &["status", "--pool", pool.to_str().unwrap()])
        ["volume_count"]
        .clone();
    let imported = scratch.join("imported");
    let status = contract.ok(
        "import",
        &[
            "import",
            "--pool",
            imported.to_str().unwrap(),
            "--metadata-device",
            &metadata.arg(),
            "--data-device",
            &data.arg(),
        ],
    );
    assert_eq!(status["volume_count"], volumes, "{status:#}");
    data.detach();
    metadata.detach();
}

#[test]
fn every_command_prints_the_documented_json_served_and_not() {
    let scratch = ScratchDir::new("json-contract");
    let mut contract = Contract::new();
    pool_round(&mut contract, &scratch, "offline", false);
    let offline = contract.covered.clone();
    contract.covered.clear();
    pool_round(&mut contract, &scratch, "served", true);
    let commands: BTreeSet<String> = contract.schema["x-commands"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    let covered: BTreeSet<String> = offline.union(&contract.covered).cloned().collect();
    assert_eq!(
        covered, commands,
        "commands of x-commands not run (or run and not listed)"
    );
}

/// The schema is strict: an unknown field, a missing one, a wrong type or another version
/// is refused (so the contract test above fails on any drift).
#[test]
fn the_schema_refuses_what_the_contract_does_not_allow() {
    let contract = Contract::new();
    let volume = serde_json::json!({
        "thinpool_json": 1, "name": "vm", "id": 0, "size_bytes": 4096, "mapped_blocks": 0,
        "mapped_percent": 0.0, "block_size_bytes": 65536, "origin": null, "read_only": false,
        "open_count": 0, "origin_id": null, "mapped_bytes": null, "exclusive_bytes": null,
        "shared_bytes": null, "unmapped_bytes": null, "content_id": null
    });
    assert_eq!(
        contract.violations("volume_answer", &volume),
        Vec::<String>::new()
    );
    let changed = |change: &dyn Fn(&mut serde_json::Map<String, Value>)| {
        let mut value = volume.clone();
        change(value.as_object_mut().unwrap());
        value
    };
    for (what, value) in [
        (
            "an unknown field",
            changed(&|v| drop(v.insert("size".into(), 1.into()))),
        ),
        ("a missing field", changed(&|v| drop(v.remove("origin")))),
        (
            "a wrong type",
            changed(&|v| drop(v.insert("name".into(), Value::Null))),
        ),
        (
            "another version",
            changed(&|v| drop(v.insert("thinpool_json".into(), 2.into()))),
        ),
        ("no version", changed(&|v| drop(v.remove("thinpool_json")))),
    ] {
        assert!(
            !contract.violations("volume_answer", &value).is_empty(),
            "{what} passed: {value}"
        );
    }
    // Nested, the volume has no version field of its own.
    let mut nested = volume.clone();
    nested.as_object_mut().unwrap().remove("thinpool_json");
    assert!(contract.violations("volume", &nested).is_empty());
    assert!(!contract.violations("volume", &volume).is_empty());
}

//! `--json` output, the contract of docs/json.md (its types are `thinpool_daemon::json` and
//! the control socket's records): one object on stdout, with the version field, for a
//! result and for an error alike. `tests::WITHOUT_JSON` lists the commands that print no
//! result of their own, and why (in the tests); every other command takes `--json` and has an entry in
//! docs/json-schema.json (the tests below walk the command line's definition), and so has
//! each flag that makes a command print another object (`receive --list-partial`).

use serde::Serialize;
use thinpool_daemon::json::{versioned, ErrorAnswer, ErrorRecord};

/// Prints `value` with the version field, as one JSON object on stdout.
pub fn print<T: Serialize>(value: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(&versioned(value))?);
    Ok(())
}

/// Prints `error` as the contract's error object on stdout (what an orchestrator parses;
/// the caller still says it on stderr for people).
pub fn print_error(error: &anyhow::Error) {
    print_error_record(ErrorRecord::from_error(error));
}

/// Prints an error record as [`print_error`] does.
pub fn print_error_record(error: ErrorRecord) {
    let answer = ErrorAnswer { error };
    match serde_json::to_string_pretty(&versioned(&answer)) {
        Ok(text) => println!("{text}"),
        Err(error) => eprintln!("thinpool: cannot encode the error as JSON: {error}"),
    }
}

/// Whether the command `matches` chose (its innermost subcommand) asks for JSON: `--json`,
/// or `diff --format json`.
pub fn asked(matches: &clap::ArgMatches) -> bool {
    let mut matches = matches;
    while let Some((_, sub)) = matches.subcommand() {
        matches = sub;
    }
    let flag = matches!(matches.try_get_one::<bool>("json"), Ok(Some(true)));
    let format = matches!(
        matches.try_get_one::<super::diff::Format>("format"),
        Ok(Some(super::diff::Format::Json))
    );
    flag || format
}

/// Whether a command line that clap refused asked for JSON (`--json` before any `--`).
pub fn asked_raw(args: &[std::ffi::OsString]) -> bool {
    args.iter()
        .skip(1)
        .take_while(|arg| *arg != "--")
        .any(|arg| arg == "--json" || arg == "--format=json")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The commands without `--json`, by path, and what they print instead.
    pub const WITHOUT_JSON: [(&str, &str); 8] = [
        ("dump", "the metadata itself, as thin_dump's XML or text"),
        ("restore", "nothing: it writes metadata"),
        ("repair", "nothing: it writes metadata"),
        (
            "serve",
            "a daemon: its log (docs/json.md: the control socket)",
        ),
        ("send", "the stream itself (binary)"),
        ("completions", "a shell script"),
        ("man-pages", "nothing: it writes man pages"),
        (
            "replicate",
            "a loop: a line per round; its state is `status --json`'s replication",
        ),
    ];

    /// docs/json-schema.json: `x-commands` maps each command path to its result's schema.
    fn schema() -> serde_json::Value {
        serde_json::from_str(include_str!("../../../../docs/json-schema.json"))
            .expect("docs/json-schema.json is JSON")
    }

    /// Every leaf command (one without subcommands), by its path (`volume create`).
    fn leaves(command: &clap::Command, path: &str, found: &mut Vec<(String, clap::Command)>) {
        let subs: Vec<&clap::Command> = command
            .get_subcommands()
            .filter(|sub| sub.get_name() != "help")
            .collect();
        if subs.is_empty() {
            found.push((path.to_owned(), command.clone()));
        }
        for sub in subs {
            let sub_path = format!("{path} {}", sub.get_name());
            leaves(sub, sub_path.trim_start(), found);
        }
    }

    /// A command with a result takes `--json` and has its schema; a command without one is
    /// in [`WITHOUT_JSON`]: a new command with neither fails here.
    #[test]
    fn every_command_with_a_result_takes_json_and_has_a_schema() {
        let mut command = crate::cli_command();
        command.build();
        let mut found = Vec::new();
        leaves(&command, "", &mut found);
        assert!(found.len() > 20, "{}", found.len());
        let schema = schema();
        let commands = schema["x-commands"]
            .as_object()
            .expect("x-commands in docs/json-schema.json");
        let defs = schema["$defs"].as_object().expect("$defs");
        let mut problems = Vec::new();
        for (path, leaf) in &found {
            let takes_json = leaf.get_arguments().any(|arg| arg.get_id() == "json");
            let exempt = WITHOUT_JSON.iter().any(|(name, _)| name == path);
            match (takes_json, exempt, commands.get(path)) {
                (true, false, Some(def)) => {
                    let def = def.as_str().unwrap_or_default();
                    if !defs.contains_key(def) {
                        problems.push(format!("{path}: no $defs entry {def:?}"));
                    }
                }
                (true, false, None) => problems.push(format!("{path}: no x-commands entry")),
                (false, true, None) => {}
                (false, false, _) => {
                    problems.push(format!("{path}: no --json and not in WITHOUT_JSON"))
                }
                (true, true, _) => problems.push(format!("{path}: --json, yet in WITHOUT_JSON")),
                (false, true, Some(_)) => {
                    problems.push(format!("{path}: in WITHOUT_JSON and in x-commands"))
                }
            }
        }
        for key in commands.keys() {
            // "PATH --FLAG": the command with a flag that makes it print another object.
            let (path, flag) = match key.split_once(" --") {
                Some((path, flag)) => (path, Some(flag)),
                None => (key.as_str(), None),
            };
            let Some((_, leaf)) = found.iter().find(|(leaf, _)| leaf == path) else {
                problems.push(format!("x-commands names {key:?}, which is no command"));
                continue;
            };
            let has_flag = |flag: &str| leaf.get_arguments().any(|a| a.get_long() == Some(flag));
            if flag.is_some_and(|flag| !has_flag(flag)) {
                problems.push(format!("x-commands names {key:?}, a flag {path} lacks"));
            }
        }
        assert!(problems.is_empty(), "{problems:#?}");
    }

    #[test]
    fn json_is_asked_by_the_flag_of_the_chosen_command() {
        let command = crate::cli_command();
        let asks = |line: &[&str]| asked(&command.clone().get_matches_from(line));
        assert!(asks(&[
            "thinpool", "volume", "create", "a", "--size", "1M", "--json"
        ]));
        assert!(!asks(&[
            "thinpool", "volume", "create", "a", "--size", "1M"
        ]));
        assert!(asks(&["thinpool", "diff", "a", "b", "--format", "json"]));
        assert!(!asks(&["thinpool", "diff", "a", "b", "--format", "xml"]));
        assert!(!asks(&["thinpool", "dump", "metadata"]));
    }
}

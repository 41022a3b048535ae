//! `--config FILE`: options of `serve` and `mount` from a TOML file (docs/SERVICE.md).
//!
//! The file holds the command's long options without their dashes, at the top level:
//!
//! ```toml
//! pool = "/srv/condense/vm"     # the global --pool
//! listen = "0.0.0.0:10809"      # --listen 0.0.0.0:10809
//! read-only = true              # a flag: true gives --read-only, false leaves it out
//! metadata-cache = "512M"       # numbers and strings are passed as written
//! ```
//!
//! It is translated generically, before clap parses anything, into the words one would type
//! (`--listen=0.0.0.0:10809`), which are then parsed by the same clap definitions as the command
//! line, so every option the command has (now or later) works in the file without touching
//! this module, and is checked the same way. Invariants:
//! - a key the command has no long option (or positional argument) for is an error naming the
//!   key and the file; nothing starts;
//! - an option given on the command line wins over the file (the file's value is dropped, not
//!   overridden by position), also for the global `--pool` given before the subcommand;
//! - an array gives the option once per element; a table is an error.

use crate::error::{Context, Result, ServiceError};
use clap::parser::ValueSource;
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};

/// `--config FILE` on the commands that run as a service.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ConfigArg {
    /// Read options from this TOML file: each key is a long option without its dashes, e.g.
    /// `pool = "/srv/condense/vm"`, `listen = "0.0.0.0:10809"`, `read-only = true`. Options
    /// on the command line win over the file; an unknown key is an error (docs/SERVICE.md).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
}

/// The subcommands that take `--config`.
const COMMANDS: [&str; 2] = ["serve", "mount"];

/// `argv` with the options of the `--config` file, if the command is `serve` or `mount` and
/// has one, inserted after the subcommand; `argv` unchanged otherwise.
pub fn expand(cli: &clap::Command, argv: Vec<OsString>) -> Result<Vec<OsString>> {
    let Some(sub_at) = subcommand_index(cli, &argv) else {
        return Ok(argv);
    };
    let Some(file) = config_path(&argv[sub_at + 1..]) else {
        return Ok(argv);
    };
    let sub = argv[sub_at].to_string_lossy().into_owned();
    let text = std::fs::read_to_string(&file)
        .with_context(|| format!("cannot read the config file {}", file.display()))?;
    let table: toml::Table = text.parse().with_context(|| {
        format!(
            "the config file {} is not valid TOML (keys are option names: pool = \"/srv/pool\")",
            file.display()
        )
    })?;
    let given = given_on_command_line(cli, &sub, &argv);
    let (options, positionals) = file_args(cli, &sub, &table, &file, &|id| {
        given.iter().any(|g| g == id)
    })?;
    let mut out: Vec<OsString> = argv[..=sub_at].to_vec();
    out.extend(options);
    out.extend(argv[sub_at + 1..].iter().cloned());
    out.extend(positionals);
    Ok(out)
}

/// Where the subcommand word is in `argv`, if it is one of [`COMMANDS`]: the first word that
/// is neither an option before it nor the value of one.
fn subcommand_index(cli: &clap::Command, argv: &[OsString]) -> Option<usize> {
    let mut i = 1;
    while let Some(word) = argv.get(i) {
        let w = word.to_string_lossy();
        if let Some(long) = w.strip_prefix("--") {
            let takes_value = !long.contains('=')
                && cli
                    .get_arguments()
                    .any(|a| a.get_long() == Some(long) && a.get_action().takes_values());
            i += if takes_value { 2 } else { 1 };
            continue;
        }
        return COMMANDS.contains(&w.as_ref()).then_some(i);
    }
    None
}

/// The FILE of `--config FILE` or `--config=FILE` among the subcommand's words.
fn config_path(words: &[OsString]) -> Option<PathBuf> {
    let mut it = words.iter();
    while let Some(w) = it.next() {
        if w == "--" {
            return None;
        }
        if w == "--config" {
            return it.next().map(PathBuf::from);
        }
        if let Some(v) = w.to_str().and_then(|s| s.strip_prefix("--config=")) {
            return Some(PathBuf::from(v));
        }
    }
    None
}

/// The ids of the arguments (global or of `sub`) that `argv` sets on the command line. Parsed
/// with every argument optional, so a positional the file provides may be missing here; if
/// `argv` does not parse, nothing is known to be given and clap reports the error later.
fn given_on_command_line(cli: &clap::Command, sub: &str, argv: &[OsString]) -> Vec<String> {
    let probe = cli.clone().mut_subcommand(sub, |mut c| {
        let required: Vec<String> = c
            .get_arguments()
            .filter(|a| a.is_required_set())
            .map(|a| a.get_id().to_string())
            .collect();
        for id in required {
            c = c.mut_arg(id, |a| a.required(false));
        }
        c
    });
    let Ok(m) = probe.try_get_matches_from(argv) else {
        return Vec::new();
    };
    let Some(sm) = m.subcommand_matches(sub) else {
        return Vec::new();
    };
    sm.ids()
        .map(|id| id.as_str())
        .filter(|id| sm.value_source(id) == Some(ValueSource::CommandLine))
        .map(str::to_string)
        .collect()
}

/// The words the file's keys stand for: options (`--key=value`, `--flag`) and positional
/// values, leaving out every argument `given(id)` says the command line sets.
fn file_args(
    cli: &clap::Command,
    sub: &str,
    table: &toml::Table,
    file: &Path,
    given: &dyn Fn(&str) -> bool,
) -> Result<(Vec<OsString>, Vec<OsString>)> {
    let Some(cmd) = cli.find_subcommand(sub) else {
        return Err(ServiceError::Invalid(format!(
            "`condense {sub}` takes no --config"
        )));
    };
    let (mut options, mut positionals) = (Vec::new(), Vec::new());
    for (key, value) in table {
        if key == "config" {
            return Err(ServiceError::Invalid(format!(
                "key `config` in {}: a config file cannot name another one",
                file.display()
            )));
        }
        let arg = cmd
            .get_arguments()
            .find(|a| {
                a.get_long() == Some(key.as_str())
                    || (a.is_positional() && a.get_id() == key.as_str())
            })
            .or_else(|| {
                cli.get_arguments()
                    .find(|a| a.is_global_set() && a.get_long() == Some(key.as_str()))
            });
        let Some(arg) = arg else {
            return Err(ServiceError::Invalid(format!(
                "unknown key `{key}` in {}: `condense {sub}` has no option --{key}; the keys are \
                 its long options without dashes (see `condense {sub} --help`)",
                file.display()
            )));
        };
        if given(arg.get_id().as_str()) {
            continue;
        }
        if !arg.get_action().takes_values() {
            match value {
                toml::Value::Boolean(true) => options.push(OsString::from(format!("--{key}"))),
                toml::Value::Boolean(false) => {}
                _ => {
                    return Err(ServiceError::Invalid(format!(
                        "key `{key}` in {}: --{key} is a switch; write {key} = true or false",
                        file.display()
                    )))
                }
            }
            continue;
        }
        let values = match value {
            toml::Value::Array(items) => items.iter().collect(),
            one => vec![one],
        };
        for v in values {
            let text = match v {
                toml::Value::String(s) => s.clone(),
                toml::Value::Integer(i) => i.to_string(),
                toml::Value::Float(f) => f.to_string(),
                toml::Value::Boolean(b) => b.to_string(),
                _ => {
                    return Err(ServiceError::Invalid(format!(
                        "key `{key}` in {}: give a string, a number or a list of them",
                        file.display()
                    )))
                }
            };
            if arg.is_positional() {
                positionals.push(OsString::from(text));
            } else {
                let mut word = OsString::from(format!("--{key}="));
                word.push(OsStr::new(&text));
                options.push(word);
            }
        }
    }
    Ok((options, positionals))
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::{bail, Result};
    use clap::{CommandFactory, Parser};

    /// A command line of the CLI's shape: a global `--pool`, `serve` and `mount` with
    /// `--config`, options, flags and a positional.
    #[derive(Parser)]
    struct Cli {
        #[arg(long, global = true, default_value = "condense-pool")]
        pool: PathBuf,
        #[command(subcommand)]
        command: Command,
    }

    #[derive(clap::Subcommand)]
    enum Command {
        Serve(Serve),
        Mount {
            mountpoint: PathBuf,
            #[arg(long)]
            read_only: bool,
            #[command(flatten)]
            config: ConfigArg,
        },
        Stats,
        Volume {
            words: Vec<String>,
        },
    }

    #[derive(clap::Args)]
    struct Serve {
        #[arg(long)]
        listen: Option<String>,
        #[arg(long)]
        socket: Option<PathBuf>,
        #[arg(long)]
        read_only: bool,
        #[arg(long)]
        metadata_cache: Option<u64>,
        #[command(flatten)]
        config: ConfigArg,
    }

    fn words(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    fn table(text: &str) -> toml::Table {
        match text.parse() {
            Ok(t) => t,
            Err(e) => panic!("bad test TOML: {e}"),
        }
    }

    fn translate(sub: &str, text: &str) -> Result<(Vec<OsString>, Vec<OsString>)> {
        Ok(file_args(
            &Cli::command(),
            sub,
            &table(text),
            Path::new("/etc/condense/t.toml"),
            &|_| false,
        )?)
    }

    #[test]
    fn keys_become_long_options_flags_and_positionals() -> Result<()> {
        let (opts, pos) = translate(
            "serve",
            "pool = \"/srv/p\"\nlisten = \"0.0.0.0:10809\"\nsocket = \"/run/c.sock\"\n\
             read-only = true\nmetadata-cache = 134217728\n",
        )?;
        assert_eq!(
            opts,
            words(&[
                "--listen=0.0.0.0:10809",
                "--metadata-cache=134217728",
                "--pool=/srv/p",
                "--read-only",
                "--socket=/run/c.sock",
            ])
        );
        assert!(pos.is_empty());
        let (opts, pos) = translate("mount", "mountpoint = \"/mnt/c\"\nread-only = false\n")?;
        assert!(opts.is_empty());
        assert_eq!(pos, words(&["/mnt/c"]));
        Ok(())
    }

    #[test]
    fn unknown_keys_and_wrong_types_name_key_and_file() {
        for (text, needle) in [
            (
                "lisen = \"x\"",
                "unknown key `lisen` in /etc/condense/t.toml",
            ),
            (
                "read-only = \"yes\"",
                "key `read-only` in /etc/condense/t.toml",
            ),
            ("listen = { a = 1 }", "key `listen` in /etc/condense/t.toml"),
            ("config = \"other.toml\"", "key `config`"),
        ] {
            match translate("serve", text) {
                Ok(a) => panic!("{text:?} was accepted: {a:?}"),
                Err(e) => assert!(format!("{e:#}").contains(needle), "{text:?}: {e:#}"),
            }
        }
    }

    #[test]
    fn command_line_wins_over_the_file() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let file = dir.path().join("c.toml");
        std::fs::write(
            &file,
            "pool = \"/from/file\"\nlisten = \"127.0.0.1:1\"\nsocket = \"/f.sock\"\n",
        )?;
        let f = file.to_string_lossy().into_owned();
        let argv = words(&[
            "condense",
            "--pool",
            "/cli",
            "serve",
            "--config",
            &f,
            "--listen",
            "127.0.0.1:2",
        ]);
        let out = expand(&Cli::command(), argv)?;
        let cli = Cli::try_parse_from(&out)?;
        assert_eq!(cli.pool, PathBuf::from("/cli"));
        let Command::Serve(a) = cli.command else {
            bail!("not serve: {out:?}");
        };
        assert_eq!(a.listen.as_deref(), Some("127.0.0.1:2"));
        assert_eq!(a.socket, Some(PathBuf::from("/f.sock")));
        // Without the command-line options, the file's apply; mount takes its positional.
        std::fs::write(&file, "pool = \"/from/file\"\nmountpoint = \"/mnt/x\"\n")?;
        let out = expand(
            &Cli::command(),
            words(&["condense", "mount", &format!("--config={f}")]),
        )?;
        let cli = Cli::try_parse_from(&out)?;
        assert_eq!(cli.pool, PathBuf::from("/from/file"));
        let Command::Mount { mountpoint, .. } = cli.command else {
            bail!("not mount: {out:?}");
        };
        assert_eq!(mountpoint, PathBuf::from("/mnt/x"));
        Ok(())
    }

    #[test]
    fn other_commands_and_no_config_leave_argv_alone() -> Result<()> {
        for argv in [
            words(&["condense", "volume", "list"]),
            words(&["condense", "--pool", "serve", "stats"]),
            words(&["condense", "serve", "--listen", "127.0.0.1:9"]),
        ] {
            assert_eq!(expand(&Cli::command(), argv.clone())?, argv);
        }
        Ok(())
    }

    #[test]
    fn a_missing_file_is_an_error_naming_it() {
        let argv = words(&["condense", "serve", "--config", "/nonexistent/c.toml"]);
        match expand(&Cli::command(), argv) {
            Ok(a) => panic!("accepted: {a:?}"),
            Err(e) => assert!(
                crate::error::chain(&e).contains("/nonexistent/c.toml"),
                "{}",
                crate::error::chain(&e)
            ),
        }
    }
}

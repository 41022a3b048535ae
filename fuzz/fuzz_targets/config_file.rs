//! A `--config FILE` of `serve` or `mount` (crates/service/src/config.rs), through its one
//! entry point `config::expand`, which reads the file, parses the TOML and turns its keys into
//! the command-line words clap then parses.
//!
//! The CLI is a binary crate, so its `Cli` cannot be linked here: `expand` is run against a
//! command of the same shape (a global `--pool` with an environment variable and a default;
//! `serve` and `mount` with switches, options with values, repeated options, value enums,
//! `requires` between options, a required positional, a global flag of the top level), then
//! the words it returns are parsed by that command. Every input is
//! written to one scratch file per process, as `expand` reads a path.
#![no_main]

use clap::{Arg, ArgAction, Command};
use condense_service::config;
use std::ffi::OsString;
use std::sync::OnceLock;

fn cli() -> &'static Command {
    static CLI: OnceLock<Command> = OnceLock::new();
    CLI.get_or_init(|| {
        let config = || {
            Arg::new("config")
                .long("config")
                .value_name("FILE")
                .value_parser(clap::value_parser!(std::path::PathBuf))
        };
        Command::new("condense")
            .arg(
                Arg::new("pool")
                    .long("pool")
                    .global(true)
                    .env("CONDENSE_FUZZ_POOL")
                    .default_value("condense-pool"),
            )
            .arg(Arg::new("key-file").long("key-file").global(true))
            .subcommand(
                Command::new("serve")
                    .arg(config())
                    .arg(Arg::new("listen").long("listen"))
                    .arg(Arg::new("socket").long("socket"))
                    .arg(
                        Arg::new("read-only")
                            .long("read-only")
                            .action(ArgAction::SetTrue),
                    )
                    .arg(Arg::new("tls-cert").long("tls-cert").requires("tls-key"))
                    .arg(Arg::new("tls-key").long("tls-key").requires("tls-cert"))
                    .arg(
                        Arg::new("tls")
                            .long("tls")
                            .value_parser(["off", "optional", "require"])
                            .requires("tls-cert"),
                    )
                    .arg(
                        Arg::new("allow-export")
                            .long("allow-export")
                            .action(ArgAction::Append),
                    )
                    .arg(
                        Arg::new("metadata-cache")
                            .long("metadata-cache")
                            .value_parser(clap::value_parser!(u64)),
                    ),
            )
            .subcommand(
                Command::new("mount")
                    .arg(config())
                    .arg(Arg::new("mountpoint").required(true))
                    .arg(
                        Arg::new("allow-other")
                            .long("allow-other")
                            .action(ArgAction::SetTrue),
                    )
                    .arg(
                        Arg::new("read-only")
                            .long("read-only")
                            .action(ArgAction::SetTrue),
                    ),
            )
            .subcommand(Command::new("stats"))
    })
}

fn scratch() -> &'static std::path::PathBuf {
    static PATH: OnceLock<std::path::PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        std::env::temp_dir().join(format!("condense-fuzz-config-{}.toml", std::process::id()))
    })
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    // First byte: which command line comes with the file.
    let Some((&sel, text)) = data.split_first() else {
        return;
    };
    if std::fs::write(scratch(), text).is_err() {
        return;
    }
    let file = scratch().as_os_str().to_owned();
    let words: Vec<OsString> = match sel % 4 {
        0 => vec!["condense".into(), "serve".into(), "--config".into(), file],
        1 => vec![
            "condense".into(),
            "--pool".into(),
            "/cli".into(),
            "serve".into(),
            "--listen".into(),
            "127.0.0.1:1".into(),
            "--config".into(),
            file,
        ],
        2 => {
            let mut f = OsString::from("--config=");
            f.push(&file);
            vec!["condense".into(), "mount".into(), f, "/mnt/x".into()]
        }
        _ => vec!["condense".into(), "mount".into(), "--config".into(), file],
    };
    if let Ok(argv) = config::expand(cli(), words.clone()) {
        // The file's words come after the subcommand, the command line's are all still there.
        for w in &words {
            assert!(argv.contains(w), "{w:?} was dropped: {argv:?}");
        }
        let _ = cli().clone().try_get_matches_from(argv);
    }
});

//! The key options of an encrypted pool (docs/ENCRYPTION.md), shared by every command.
//!
//! Owns: the key files given for this run (the CLI's `--key-file` / `--passphrase-file`,
//! also `$CONDENSE_KEY_FILE` / `$CONDENSE_PASSPHRASE_FILE`), reading them into a [`UserKey`],
//! and the passphrase prompt on a terminal. The files are recorded once at start ([`set`]) so
//! that every place that opens the pool ([`crate::open::open_pool`]) finds them without
//! threading them through each command.
//!
//! Both files are secrets: read only if owner-only ([`condense_engine::secret_file::read`],
//! which names the `chmod` that fixes a file others can read). A key file holds 32 random
//! bytes or 64 hex digits, never text ([`UserKey::from_key_file_bytes`]); a new pool's
//! passphrase has at least [`condense_engine::crypto::PASSPHRASE_CHARS_MIN`] characters
//! (checked by the engine at `init`; existing pools open with the passphrase they have).

use crate::error::{Context, Result, ServiceError};
use condense_engine::{secret_file, UserKey};
use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;
use std::sync::OnceLock;

/// The key files given for this run (the CLI's `--key-file` / `--passphrase-file`).
#[derive(Debug, Clone, Default)]
pub struct KeyFiles {
    /// A file of 32 random bytes or 64 hex digits.
    pub key_file: Option<PathBuf>,
    /// A file holding a passphrase.
    pub passphrase_file: Option<PathBuf>,
}

static KEYS: OnceLock<KeyFiles> = OnceLock::new();

/// Record the key options of this run (first call wins).
pub fn set(files: KeyFiles) {
    let _ = KEYS.set(files);
}

/// The user's key from the options, if any was given.
pub fn user_key() -> Result<Option<UserKey>> {
    let Some(k) = KEYS.get() else { return Ok(None) };
    if let Some(path) = &k.key_file {
        let bytes = secret_file::read(path, "key file")?;
        return Ok(Some(
            UserKey::from_key_file_bytes(&bytes)
                .with_context(|| format!("bad key file {}", path.display()))?,
        ));
    }
    if let Some(path) = &k.passphrase_file {
        let mut line = secret_file::read(path, "passphrase file")?;
        while line.last().is_some_and(|&c| c == b'\n' || c == b'\r') {
            line.pop();
        }
        if line.is_empty() {
            return Err(ServiceError::Invalid(format!(
                "the passphrase file {} is empty",
                path.display()
            )));
        }
        return Ok(Some(UserKey::Passphrase(line)));
    }
    Ok(None)
}

/// Ask the terminal for a passphrase (twice when `confirm`), without echo. `None` when
/// standard input is not a terminal.
pub fn prompt(what: &str, confirm: bool) -> Result<Option<UserKey>> {
    if !std::io::stdin().is_terminal() {
        return Ok(None);
    }
    let first = read_hidden(&format!("{what}: "))?;
    if first.is_empty() {
        return Err(ServiceError::Invalid("empty passphrase".into()));
    }
    if confirm && read_hidden("Repeat the passphrase: ")? != first {
        return Err(ServiceError::Invalid("the two passphrases differ".into()));
    }
    Ok(Some(UserKey::Passphrase(first)))
}

/// One line from the terminal with echo off (restored afterwards).
fn read_hidden(prompt: &str) -> Result<zeroize::Zeroizing<Vec<u8>>> {
    let mut err = std::io::stderr();
    let shown = |e| ServiceError::Io {
        what: "cannot show the passphrase prompt".into(),
        source: e,
    };
    write!(err, "{prompt}").map_err(shown)?;
    err.flush().map_err(shown)?;
    // SAFETY: tcgetattr/tcsetattr on fd 0 with a zeroed termios they fill in.
    let mut old: libc::termios = unsafe { std::mem::zeroed() };
    let have_tty = unsafe { libc::tcgetattr(0, &mut old) } == 0;
    if have_tty {
        let mut quiet = old;
        quiet.c_lflag &= !libc::ECHO;
        // SAFETY: as above.
        unsafe { libc::tcsetattr(0, libc::TCSANOW, &quiet) };
    }
    let mut line = String::new();
    let r = std::io::stdin().lock().read_line(&mut line);
    if have_tty {
        // SAFETY: restores the settings read above.
        unsafe { libc::tcsetattr(0, libc::TCSANOW, &old) };
    }
    writeln!(err).map_err(shown)?;
    r.context("reading the passphrase")?;
    let line = zeroize::Zeroizing::new(line);
    Ok(zeroize::Zeroizing::new(
        line.trim_end_matches(['\n', '\r']).as_bytes().to_vec(),
    ))
}

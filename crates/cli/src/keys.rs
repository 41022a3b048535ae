//! The key options of an encrypted pool (docs/ENCRYPTION.md), shared by every command: parsed
//! here, read and prompted for by `condense_service::keys`.

use clap::Args;
use std::path::PathBuf;

/// How to unlock an encrypted pool.
#[derive(Args, Debug, Clone, Default)]
pub struct KeyArgs {
    /// Key of an encrypted pool: a file of 32 random bytes or 64 hex digits, readable by its
    /// owner only (make one with `(umask 077; head -c 32 /dev/urandom > KEYFILE)`). Text is
    /// refused: a passphrase goes in --passphrase-file. Losing the key loses the pool's data.
    #[arg(
        long,
        global = true,
        value_name = "FILE",
        env = "CONDENSE_KEY_FILE",
        conflicts_with = "passphrase_file"
    )]
    pub key_file: Option<PathBuf>,
    /// Passphrase of an encrypted pool, read from FILE (readable by its owner only; trailing
    /// newlines dropped; stretched with argon2id). A new pool needs at least 15 characters.
    /// Without either option, a terminal is prompted for the passphrase.
    #[arg(
        long,
        global = true,
        value_name = "FILE",
        env = "CONDENSE_PASSPHRASE_FILE"
    )]
    pub passphrase_file: Option<PathBuf>,
}

/// Record the key options of this run (first call wins).
pub fn set(args: &KeyArgs) {
    condense_service::keys::set(condense_service::keys::KeyFiles {
        key_file: args.key_file.clone(),
        passphrase_file: args.passphrase_file.clone(),
    });
}

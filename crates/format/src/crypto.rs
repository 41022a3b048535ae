//! Encryption at rest: the pool's keys, the AEAD, the nonce scheme and the superblock MAC.
//!
//! Owns: the data key (random, 256 bits, one per pool) and how it is wrapped by the user's
//! key (a 32-byte key file, or argon2id of a passphrase, with bounded parameters); the keys
//! derived from the data key (fingerprints, sessions, the superblock MAC); sealing and opening
//! of every encrypted object with AES-256-GCM (`ring`, whose AES-NI/CLMUL code runs at several
//! GB/s per core).
//!
//! Invariants (docs/FORMAT.md, "Encryption"):
//! - No (key, nonce) pair is ever used twice, by construction and whatever happens to the
//!   pool's files. Every writable open is a *session*: it draws a random 128-bit salt `S` and
//!   seals under its own key `K_S = BLAKE3-derive_key("condense 2026-11 session key", data key
//!   ‖ S)`, with the nonce a 64-bit counter from 0 held only in this process's memory (never
//!   read back from a file, never repeated, refused at exhaustion). Every sealed object stores
//!   `S` and its counter. A copied pool, a restored backup, a rolled-back superblock, a crash or
//!   two writers each seal under a fresh `S`: two sessions share a key only if two random
//!   128-bit salts are equal.
//! - A [`Crypto`] made for a read-only open has no session and refuses to seal; so has one for a
//!   pool of superblock format 3 (the older epoch nonces, read but never sealed into).
//! - Opening an object of another session derives its key; those keys are kept in a cache of
//!   [`KEY_CACHE_SLOTS`] entries at most, so a pool's files can name any number of salts and
//!   memory stays bounded. Objects of this session take no lock at all.
//! - Every sealed object authenticates its context as associated data: the pool UUID, what
//!   kind of object it is, and where it belongs (a chunk's fingerprint, a page's unit in
//!   `meta.dat`, a journal batch's generation and sequence, a root's header), so bytes moved
//!   to another place, another pool or another kind of object fail to open.
//! - The superblock carries a MAC keyed from the data key ([`Crypto::check_superblock_mac`]),
//!   checked right after the data key is unwrapped, before anything is sealed or written.
//! - Keys never reach the disk in plaintext: the superblock holds the data key wrapped by the
//!   user's key; every other key is derived from the data key, not stored.

use crate::error::{Error, Result};
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;
use zeroize::Zeroizing;

/// Bytes of a session salt, stored at the start of every sealed object.
pub const SALT_BYTES: usize = 16;
/// Bytes of the session counter (the nonce), stored after the salt.
pub const COUNTER_BYTES: usize = 8;
/// Bytes of the AES-GCM tag, stored after the ciphertext.
pub const TAG_BYTES: usize = 16;
/// Bytes a sealed object takes beyond its plaintext: salt, counter and tag.
pub const OVERHEAD: usize = SALT_BYTES + COUNTER_BYTES + TAG_BYTES;
/// Superblock format 3 (epoch scheme): a 12-byte nonce, the ciphertext, the tag.
const EPOCH_NONCE_BYTES: usize = 12;
const EPOCH_OVERHEAD: usize = EPOCH_NONCE_BYTES + TAG_BYTES;
/// Bytes of the superblock MAC (a 128-bit tag, as strong as every AES-GCM tag of the pool).
pub const MAC_BYTES: usize = 16;
/// Keys of other sessions kept for opening their objects (each about 0.5 KiB).
pub const KEY_CACHE_SLOTS: usize = 1024;

const SESSION_KEY_CONTEXT: &str = "condense 2026-11 session key";
const SUPERBLOCK_MAC_CONTEXT: &str = "condense 2026-11 superblock mac key";

/// What a sealed object is (part of its associated data).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Chunk = 1,
    Page = 2,
    JournalBatch = 3,
    Root = 4,
    DataKey = 5,
}

/// How the sealed objects of a pool carry their nonce (the superblock version says which).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NonceScheme {
    /// Superblock format 4: session salt and counter, under the session's key.
    Session,
    /// Superblock format 3 (older builds): a pool epoch and a counter, under the data key.
    /// The epoch was protected by a CRC only, so such a pool is opened read-only.
    Epoch,
}

/// The user's key, as given on the command line.
#[derive(Clone)]
pub enum UserKey {
    /// 32 bytes from a key file.
    Key(Zeroizing<[u8; 32]>),
    /// A passphrase, stretched with argon2id (salt and parameters in the superblock).
    Passphrase(Zeroizing<Vec<u8>>),
}

impl std::fmt::Debug for UserKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UserKey::Key(_) => f.write_str("UserKey::Key(..)"),
            UserKey::Passphrase(_) => f.write_str("UserKey::Passphrase(..)"),
        }
    }
}

/// The shortest passphrase a new pool takes, in characters (Unicode code points). NIST SP
/// 800-63B-4 (2024), 3.1.1.2, asks 15 of a password that is the only factor; here it is the
/// only thing between a stolen copy of the pool and an offline guesser (argon2id slows each
/// guess, it does not make a short passphrase long).
pub const PASSPHRASE_CHARS_MIN: usize = 15;

impl UserKey {
    /// A raw 256-bit key.
    pub fn key(bytes: [u8; 32]) -> UserKey {
        UserKey::Key(Zeroizing::new(bytes))
    }

    /// A passphrase (stretched with argon2id).
    pub fn passphrase(p: &[u8]) -> UserKey {
        UserKey::Passphrase(Zeroizing::new(p.to_vec()))
    }

    /// A key file's contents: 32 raw bytes that are not text, or 64 hex digits (surrounding
    /// white space ignored). 32 bytes of text (a passphrase, 32 hex digits) are refused rather
    /// than used as a weak raw key: 32 random bytes are all text with odds below 2^-44.
    pub fn from_key_file_bytes(bytes: &[u8]) -> Result<UserKey> {
        let text = std::str::from_utf8(bytes).map(str::trim).unwrap_or("");
        if text.len() == 64 && text.bytes().all(|c| c.is_ascii_hexdigit()) {
            let mut k = Zeroizing::new([0u8; 32]);
            for (i, b) in k.iter_mut().enumerate() {
                *b = u8::from_str_radix(&text[2 * i..2 * i + 2], 16)
                    .map_err(|_| Error::Invalid("key file: bad hex digit".into()))?;
            }
            return Ok(UserKey::Key(k));
        }
        if bytes.len() == 32 {
            if bytes
                .iter()
                .all(|b| b.is_ascii_graphic() || b.is_ascii_whitespace())
            {
                return Err(Error::Invalid(
                    "it looks like text: a key file holds 32 random bytes or 64 hex digits \
                     (make one with `head -c 32 /dev/urandom > KEYFILE`); for a passphrase \
                     use --passphrase-file"
                        .into(),
                ));
            }
            let mut k = Zeroizing::new([0u8; 32]);
            k.copy_from_slice(bytes);
            return Ok(UserKey::Key(k));
        }
        Err(Error::Invalid(format!(
            "a key file must hold 32 raw bytes or 64 hex digits, this one has {} bytes \
             (make one with `head -c 32 /dev/urandom > KEYFILE`)",
            bytes.len()
        )))
    }
}

/// How the data key is wrapped and the superblock authenticated (the superblock's key
/// section of an encrypted pool).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyWrap {
    pub source: KeySource,
    /// Nonce of the wrapping (random; the user's key wraps one data key per pool).
    pub nonce: [u8; 12],
    /// The data key sealed with the user's key, then its tag (the key check).
    pub wrapped: [u8; 48],
    /// How sealed objects carry their nonce (format 4: sessions; format 3: epochs).
    pub scheme: NonceScheme,
    /// The superblock's MAC ([`Crypto::superblock_mac`]); zeros in format 3, which has none.
    pub mac: [u8; MAC_BYTES],
}

/// Where the key-encryption key comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeySource {
    /// The 32 bytes of a key file.
    KeyFile,
    /// argon2id of a passphrase with these parameters and salt.
    Passphrase {
        m_kib: u32,
        t: u32,
        p: u32,
        salt: [u8; 16],
    },
}

/// argon2id parameters for new pools: 64 MiB, 3 passes, 1 lane (RFC 9106's second choice
/// of memory and passes).
const ARGON2_M_KIB: u32 = 64 * 1024;
const ARGON2_T: u32 = 3;
const ARGON2_P: u32 = 1;

/// Bounds on the argon2id parameters read from a superblock, which any writer of the pool's
/// files can change (a tampered value fails only later, at the key check, so it must not be
/// able to exhaust the host first). Well above what this build writes (16x the memory, 5x the
/// passes), still sane on a VM host: at most 1 GiB of RAM, allocated at once, for the length of
/// one open (16 passes over 1 GiB: about 15 s on one core).
pub const ARGON2_M_KIB_MAX: u32 = 1 << 20;
pub const ARGON2_T_MAX: u32 = 16;
pub const ARGON2_P_MAX: u32 = 16;
const _: () = assert!(ARGON2_M_KIB <= ARGON2_M_KIB_MAX);
const _: () = assert!(ARGON2_T <= ARGON2_T_MAX && ARGON2_P <= ARGON2_P_MAX);

impl KeySource {
    /// Check the argon2id parameters against the bounds; the error says which is out.
    pub fn check_bounds(&self) -> std::result::Result<(), String> {
        let KeySource::Passphrase { m_kib, t, p, .. } = *self else {
            return Ok(());
        };
        if !(1..=ARGON2_P_MAX).contains(&p) {
            return Err(format!("argon2id lanes {p} (1 to {ARGON2_P_MAX})"));
        }
        if !(1..=ARGON2_T_MAX).contains(&t) {
            return Err(format!("argon2id passes {t} (1 to {ARGON2_T_MAX})"));
        }
        if m_kib < 8 * p || m_kib > ARGON2_M_KIB_MAX {
            return Err(format!(
                "argon2id memory {m_kib} KiB ({} to {ARGON2_M_KIB_MAX} KiB)",
                8 * p
            ));
        }
        Ok(())
    }
}

/// The key-encryption key from the user's key.
fn kek(user: &UserKey, source: &KeySource, pool: &str) -> Result<Zeroizing<[u8; 32]>> {
    match (user, source) {
        (UserKey::Key(k), KeySource::KeyFile) => Ok(k.clone()),
        (
            UserKey::Passphrase(p),
            KeySource::Passphrase {
                m_kib,
                t,
                p: lanes,
                salt,
            },
        ) => {
            source
                .check_bounds()
                .map_err(|e| Error::corrupt(format!("superblock of pool {pool}"), e))?;
            let params = argon2::Params::new(*m_kib, *t, *lanes, Some(32))
                .map_err(|e| Error::corrupt("superblock", format!("argon2id parameters: {e}")))?;
            let a =
                argon2::Argon2::new(argon2::Algorithm::Argon2id, argon2::Version::V0x13, params);
            let mut out = Zeroizing::new([0u8; 32]);
            a.hash_password_into(p, salt, &mut out[..])
                .map_err(|e| Error::Invalid(format!("deriving a key from the passphrase: {e}")))?;
            Ok(out)
        }
        (UserKey::Passphrase(_), KeySource::KeyFile) => Err(Error::WrongKey(format!(
            "{pool} is encrypted with a key file, not a passphrase: give --key-file FILE"
        ))),
        (UserKey::Key(_), KeySource::Passphrase { .. }) => Err(Error::WrongKey(format!(
            "{pool} is encrypted with a passphrase, not a key file: give --passphrase-file FILE"
        ))),
    }
}

/// The longest context any object has (a checkpoint root's).
const CTX_MAX: usize = 20;
const AAD_MAX: usize = 4 + 1 + 16 + CTX_MAX;

/// The associated data: `"CNDS"`, the kind, the pool UUID, the object's context.
fn aad(kind: Kind, uuid: &[u8; 16], ctx: &[u8]) -> Result<([u8; AAD_MAX], usize)> {
    let mut a = [0u8; AAD_MAX];
    if ctx.len() > CTX_MAX {
        return Err(Error::Invalid(format!(
            "encryption context of {} bytes (at most {CTX_MAX})",
            ctx.len()
        )));
    }
    a[..4].copy_from_slice(b"CNDS");
    a[4] = kind as u8;
    a[5..21].copy_from_slice(uuid);
    a[21..21 + ctx.len()].copy_from_slice(ctx);
    Ok((a, 21 + ctx.len()))
}

fn cipher(key: &[u8; 32]) -> Result<LessSafeKey> {
    UnboundKey::new(&AES_256_GCM, key)
        .map(LessSafeKey::new)
        .map_err(|_| Error::Invalid("AES-256-GCM key setup failed".into()))
}

/// The key of the session with salt `salt`.
fn session_key(data_key: &[u8; 32], salt: &[u8; SALT_BYTES]) -> Result<LessSafeKey> {
    let mut material = Zeroizing::new([0u8; 32 + SALT_BYTES]);
    material[..32].copy_from_slice(data_key);
    material[32..].copy_from_slice(salt);
    let key = Zeroizing::new(blake3::derive_key(SESSION_KEY_CONTEXT, &material[..]));
    cipher(&key)
}

/// The 96-bit GCM nonce of session counter `n`: `n` little-endian, then 4 zero bytes.
fn session_nonce(n: [u8; COUNTER_BYTES]) -> [u8; 12] {
    let mut nonce = [0u8; 12];
    nonce[..COUNTER_BYTES].copy_from_slice(&n);
    nonce
}

/// Seal `plaintext` under `key` with `nonce`; appends the ciphertext and the tag to `out`.
fn seal_append(
    key: &LessSafeKey,
    nonce: [u8; 12],
    aad: &[u8],
    plaintext: &[u8],
    out: &mut Vec<u8>,
) -> Result<()> {
    out.reserve(plaintext.len() + TAG_BYTES);
    let start = out.len();
    out.extend_from_slice(plaintext);
    let tag = key
        .seal_in_place_separate_tag(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(aad),
            &mut out[start..],
        )
        .map_err(|_| Error::Invalid("encryption failed (object too large)".into()))?;
    out.extend_from_slice(tag.as_ref());
    Ok(())
}

/// Open `body` (ciphertext, tag) under `key` and `nonce`; `None` if it does not authenticate.
fn open_with(key: &LessSafeKey, nonce: [u8; 12], aad: &[u8], body: &[u8]) -> Option<Vec<u8>> {
    let mut buf = body.to_vec();
    let n = key
        .open_in_place(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(aad),
            &mut buf,
        )
        .ok()?
        .len();
    buf.truncate(n);
    Some(buf)
}

fn random<const N: usize>() -> Result<[u8; N]> {
    let mut b = [0u8; N];
    getrandom::fill(&mut b)
        .map_err(|e| Error::io("reading random bytes", std::io::Error::other(e.to_string())))?;
    Ok(b)
}

/// Refuse a passphrase too short for a new pool ([`PASSPHRASE_CHARS_MIN`]).
fn check_new_passphrase(p: &[u8]) -> Result<()> {
    let chars = std::str::from_utf8(p).map_or(p.len(), |s| s.chars().count());
    if chars < PASSPHRASE_CHARS_MIN {
        return Err(Error::Invalid(format!(
            "the passphrase has {chars} characters; a new pool needs at least \
             {PASSPHRASE_CHARS_MIN}, since it is all that protects a copy of the pool: use a \
             longer one (four or more random words), or a key file (--key-file FILE, 32 random \
             bytes: `head -c 32 /dev/urandom > FILE`)"
        )));
    }
    Ok(())
}

/// Make a new data key for pool `uuid` and wrap it with `user` (a passphrase must have at
/// least [`PASSPHRASE_CHARS_MIN`] characters). Returns the wrap (its MAC not yet set: see
/// `Superblock::authenticate`) and the data key.
pub fn new_data_key(user: &UserKey, uuid: &[u8; 16]) -> Result<(KeyWrap, Zeroizing<[u8; 32]>)> {
    let source = match user {
        UserKey::Key(_) => KeySource::KeyFile,
        UserKey::Passphrase(p) => {
            check_new_passphrase(p)?;
            KeySource::Passphrase {
                m_kib: ARGON2_M_KIB,
                t: ARGON2_T,
                p: ARGON2_P,
                salt: random()?,
            }
        }
    };
    let kek = kek(user, &source, "the new pool")?;
    let data_key = Zeroizing::new(random::<32>()?);
    let nonce: [u8; 12] = random()?;
    let (a, n) = aad(Kind::DataKey, uuid, &[])?;
    let mut sealed = Zeroizing::new(Vec::new());
    seal_append(&cipher(&kek)?, nonce, &a[..n], &data_key[..], &mut sealed)?;
    let mut wrapped = [0u8; 48];
    wrapped.copy_from_slice(&sealed);
    Ok((
        KeyWrap {
            source,
            nonce,
            wrapped,
            scheme: NonceScheme::Session,
            mac: [0u8; MAC_BYTES],
        },
        data_key,
    ))
}

/// Unwrap the data key of pool `uuid` (described as `pool` in errors) with `user`.
pub fn unwrap_data_key(
    user: &UserKey,
    wrap: &KeyWrap,
    uuid: &[u8; 16],
    pool: &str,
) -> Result<Zeroizing<[u8; 32]>> {
    let kek = kek(user, &wrap.source, pool)?;
    let (a, n) = aad(Kind::DataKey, uuid, &[])?;
    let buf = Zeroizing::new(
        open_with(&cipher(&kek)?, wrap.nonce, &a[..n], &wrap.wrapped).ok_or_else(|| {
            Error::WrongKey(format!(
                "the key does not open pool {pool}: check --key-file / --passphrase-file \
                 (without the key the pool was made with, its data cannot be read)"
            ))
        })?,
    );
    let mut k = Zeroizing::new([0u8; 32]);
    k.copy_from_slice(&buf);
    Ok(k)
}

/// The fingerprint key of an encrypted pool: derived from the data key, never stored.
pub fn fingerprint_key(data_key: &[u8; 32]) -> [u8; 32] {
    blake3::derive_key("condense 2026-11 chunk fingerprint key", data_key)
}

/// This open's session: its salt, its key and the next counter.
struct Session {
    salt: [u8; SALT_BYTES],
    key: LessSafeKey,
    counter: AtomicU64,
}

/// A session key derived to open another session's objects.
struct SessionKey {
    salt: [u8; SALT_BYTES],
    key: LessSafeKey,
}

/// Keys of other sessions: direct-mapped by salt, [`KEY_CACHE_SLOTS`] entries at most. A
/// lookup takes one slot's read lock (shared by readers; a writer only installs a new key);
/// a miss derives the key and replaces the slot's entry, so colliding salts cost a derivation
/// (about a microsecond), never memory.
struct KeyCache {
    slots: Box<[RwLock<Option<Box<SessionKey>>>]>,
}

impl KeyCache {
    fn new() -> KeyCache {
        KeyCache {
            slots: (0..KEY_CACHE_SLOTS).map(|_| RwLock::new(None)).collect(),
        }
    }

    fn slot(&self, salt: &[u8; SALT_BYTES]) -> &RwLock<Option<Box<SessionKey>>> {
        let mut h = [0u8; 8];
        h.copy_from_slice(&salt[..8]);
        &self.slots[(u64::from_le_bytes(h) % KEY_CACHE_SLOTS as u64) as usize]
    }

    /// Run `f` with the key of session `salt` (derived from `data_key` on a miss).
    fn with_key<R>(
        &self,
        data_key: &[u8; 32],
        salt: &[u8; SALT_BYTES],
        f: impl FnOnce(&LessSafeKey) -> R,
    ) -> Result<R> {
        let slot = self.slot(salt);
        {
            let entry = slot.read().unwrap_or_else(|e| e.into_inner());
            if let Some(k) = entry.as_ref().filter(|k| k.salt == *salt) {
                return Ok(f(&k.key));
            }
        }
        let k = Box::new(SessionKey {
            salt: *salt,
            key: session_key(data_key, salt)?,
        });
        let r = f(&k.key);
        *slot.write().unwrap_or_else(|e| e.into_inner()) = Some(k);
        Ok(r)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.slots
            .iter()
            .filter(|s| s.read().map(|e| e.is_some()).unwrap_or(false))
            .count()
    }
}

/// How this context opens and seals.
enum Mode {
    /// Format 4: objects carry a session salt and counter.
    Sessions {
        /// This open's session; `None` for a read-only open.
        own: Option<Session>,
        others: KeyCache,
    },
    /// Format 3: objects carry an epoch nonce under the data key; open only.
    Epoch(LessSafeKey),
}

/// The sealing context of one open of an encrypted pool.
pub struct Crypto {
    data_key: Zeroizing<[u8; 32]>,
    uuid: [u8; 16],
    mode: Mode,
}

impl Crypto {
    /// A context that opens the objects of pool `uuid` (of any session) and seals nothing.
    pub fn reader(data_key: &[u8; 32], uuid: [u8; 16], scheme: NonceScheme) -> Result<Crypto> {
        let mode = match scheme {
            NonceScheme::Session => Mode::Sessions {
                own: None,
                others: KeyCache::new(),
            },
            NonceScheme::Epoch => Mode::Epoch(cipher(data_key)?),
        };
        Ok(Crypto {
            data_key: Zeroizing::new(*data_key),
            uuid,
            mode,
        })
    }

    /// This context with a new session (a fresh random salt, the counter at 0), so it can
    /// seal. Refused for a format 3 pool (`pool` names it), whose nonces can repeat.
    pub fn start_session(mut self, pool: &str) -> Result<Crypto> {
        let Mode::Sessions { own, .. } = &mut self.mode else {
            return Err(Error::Invalid(format!(
                "pool {pool} was made by an older Condense (superblock format 3), whose \
                 nonces can repeat when the pool is copied or its superblock rolled back, so \
                 this build opens it read-only. Move its volumes to a new pool: `condense \
                 --pool {pool} export VOLUME VOLUME.raw` for each volume, then `condense init \
                 NEWPOOL --encrypt ...` and `condense --pool NEWPOOL import VOLUME.raw`"
            )));
        };
        let salt = random()?;
        *own = Some(Session {
            salt,
            key: session_key(&self.data_key, &salt)?,
            counter: AtomicU64::new(0),
        });
        Ok(self)
    }

    /// The salt of this context's session (`None`: it cannot seal).
    pub fn session_salt(&self) -> Option<[u8; SALT_BYTES]> {
        match &self.mode {
            Mode::Sessions { own: Some(s), .. } => Some(s.salt),
            _ => None,
        }
    }

    /// Append `plaintext` sealed (salt, counter, ciphertext, tag) to `out`.
    pub fn seal(&self, kind: Kind, ctx: &[u8], plaintext: &[u8], out: &mut Vec<u8>) -> Result<()> {
        let Mode::Sessions { own: Some(s), .. } = &self.mode else {
            return Err(Error::ReadOnly);
        };
        let n = s
            .counter
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_add(1))
            .map_err(|_| {
                Error::Invalid("nonce counter exhausted for this open; reopen the pool".into())
            })?
            .to_le_bytes();
        let (a, len) = aad(kind, &self.uuid, ctx)?;
        out.reserve(OVERHEAD + plaintext.len());
        out.extend_from_slice(&s.salt);
        out.extend_from_slice(&n);
        seal_append(&s.key, session_nonce(n), &a[..len], plaintext, out)
    }

    /// `plaintext` sealed, as a new vector.
    pub fn sealed(&self, kind: Kind, ctx: &[u8], plaintext: &[u8]) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        self.seal(kind, ctx, plaintext, &mut out)?;
        Ok(out)
    }

    /// Open a sealed object; `what` names it (volume and block, file and offset) in the error.
    pub fn open(
        &self,
        kind: Kind,
        ctx: &[u8],
        sealed: &[u8],
        what: impl FnOnce() -> String,
    ) -> Result<Vec<u8>> {
        let overhead = match self.mode {
            Mode::Sessions { .. } => OVERHEAD,
            Mode::Epoch(_) => EPOCH_OVERHEAD,
        };
        if sealed.len() < overhead {
            return Err(Error::Auth {
                what: what(),
                detail: format!("{} bytes, shorter than a sealed object", sealed.len()),
            });
        }
        let (a, len) = aad(kind, &self.uuid, ctx)?;
        let aad = &a[..len];
        let opened = match &self.mode {
            Mode::Sessions { own, others } => {
                let mut salt = [0u8; SALT_BYTES];
                salt.copy_from_slice(&sealed[..SALT_BYTES]);
                let mut counter = [0u8; COUNTER_BYTES];
                counter.copy_from_slice(&sealed[SALT_BYTES..SALT_BYTES + COUNTER_BYTES]);
                let nonce = session_nonce(counter);
                let body = &sealed[SALT_BYTES + COUNTER_BYTES..];
                match own {
                    Some(s) if s.salt == salt => open_with(&s.key, nonce, aad, body),
                    _ => others
                        .with_key(&self.data_key, &salt, |k| open_with(k, nonce, aad, body))?,
                }
            }
            Mode::Epoch(key) => {
                let mut nonce = [0u8; EPOCH_NONCE_BYTES];
                nonce.copy_from_slice(&sealed[..EPOCH_NONCE_BYTES]);
                open_with(key, nonce, aad, &sealed[EPOCH_NONCE_BYTES..])
            }
        };
        opened.ok_or_else(|| Error::Auth {
            what: what(),
            detail: "the bytes were changed (tampering or damage) or belong elsewhere".into(),
        })
    }

    /// The MAC of a superblock whose authenticated bytes are `covered`: the first
    /// [`MAC_BYTES`] of BLAKE3 keyed with `derive_key("condense 2026-11 superblock mac key",
    /// data key)`.
    pub fn superblock_mac(&self, covered: &[u8]) -> [u8; MAC_BYTES] {
        let key = Zeroizing::new(blake3::derive_key(
            SUPERBLOCK_MAC_CONTEXT,
            &self.data_key[..],
        ));
        let mut mac = [0u8; MAC_BYTES];
        mac.copy_from_slice(&blake3::keyed_hash(&key, covered).as_bytes()[..MAC_BYTES]);
        mac
    }

    /// Check the MAC `stored` of the superblock of pool `pool` over its bytes `covered`: a
    /// mismatch means the superblock was changed by someone without the key.
    pub fn check_superblock_mac(&self, covered: &[u8], stored: &[u8], pool: &str) -> Result<()> {
        let mac = self.superblock_mac(covered);
        // Constant time: every byte is compared whatever the first difference.
        let diff = mac
            .iter()
            .zip(stored)
            .fold(u8::from(stored.len() != MAC_BYTES), |d, (a, b)| d | (a ^ b));
        if diff != 0 {
            return Err(Error::Auth {
                what: format!("the superblock of pool {pool}"),
                detail: "it was changed without the key (its MAC does not match): someone \
                         who can write the pool's files edited it, or it is damaged; nothing \
                         was written. Restore the file `superblock` from a backup of this pool"
                    .into(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn session(key: &[u8; 32]) -> Result<Crypto> {
        Crypto::reader(key, [1u8; 16], NonceScheme::Session)?.start_session("p")
    }

    #[test]
    fn seal_open_round_trip_and_context_binding() -> Result<()> {
        let c = session(&[7u8; 32])?;
        let a = c.sealed(Kind::Chunk, b"here", b"hello")?;
        let b = c.sealed(Kind::Chunk, b"here", b"hello")?;
        assert_eq!(a.len(), 5 + OVERHEAD);
        assert_ne!(a, b, "two seals of the same bytes use different nonces");
        assert_eq!(c.open(Kind::Chunk, b"here", &a, String::new)?, b"hello");
        assert!(c.open(Kind::Chunk, b"there", &a, String::new).is_err());
        assert!(c.open(Kind::Page, b"here", &a, String::new).is_err());
        for at in [0, SALT_BYTES, SALT_BYTES + COUNTER_BYTES + 1, a.len() - 1] {
            let mut t = a.clone();
            t[at] ^= 1;
            assert!(
                matches!(
                    c.open(Kind::Chunk, b"here", &t, String::new),
                    Err(Error::Auth { .. })
                ),
                "a flipped bit at {at} (salt, counter, ciphertext, tag) fails"
            );
        }
        assert!(c
            .open(Kind::Chunk, b"here", &a[..OVERHEAD - 1], String::new)
            .is_err());
        let ro = Crypto::reader(&[7u8; 32], [1u8; 16], NonceScheme::Session)?;
        assert!(matches!(
            ro.sealed(Kind::Chunk, b"", b"x"),
            Err(Error::ReadOnly)
        ));
        assert_eq!(ro.open(Kind::Chunk, b"here", &a, String::new)?, b"hello");
        Ok(())
    }

    /// Two opens of one pool (or of two copies of it) seal under different salts, so no
    /// (key, nonce) pair is shared; each reads what the other sealed.
    #[test]
    fn two_sessions_never_share_a_nonce_and_read_each_other() -> Result<()> {
        let key = [3u8; 32];
        let (a, b) = (session(&key)?, session(&key)?);
        assert_ne!(a.session_salt(), b.session_salt());
        let mut seen: HashMap<Vec<u8>, Vec<u8>> = HashMap::new();
        for i in 0..1000u32 {
            for (c, other) in [(&a, &b), (&b, &a)] {
                let plain = i.to_le_bytes();
                let sealed = c.sealed(Kind::Chunk, b"ctx", &plain)?;
                // The nonce a reader uses is the stored salt and counter.
                let nonce = sealed[..SALT_BYTES + COUNTER_BYTES].to_vec();
                assert!(seen.insert(nonce, sealed.clone()).is_none(), "nonce reused");
                assert_eq!(
                    other.open(Kind::Chunk, b"ctx", &sealed, String::new)?,
                    plain
                );
            }
        }
        // The counter counts from 0 in each session.
        let first = session(&key)?.sealed(Kind::Chunk, b"", b"x")?;
        assert_eq!(first[SALT_BYTES..SALT_BYTES + COUNTER_BYTES], [0u8; 8]);
        Ok(())
    }

    #[test]
    fn an_exhausted_counter_refuses_to_seal_and_never_wraps() -> Result<()> {
        let c = session(&[3u8; 32])?;
        if let Mode::Sessions { own: Some(s), .. } = &c.mode {
            s.counter.store(u64::MAX - 1, Ordering::Relaxed);
        }
        let last = c.sealed(Kind::Chunk, b"", b"x")?;
        assert_eq!(
            last[SALT_BYTES..SALT_BYTES + 8],
            (u64::MAX - 1).to_le_bytes()
        );
        for _ in 0..3 {
            assert!(c.sealed(Kind::Chunk, b"", b"x").is_err());
        }
        Ok(())
    }

    /// A pool's files can name any number of salts (a hostile file names them freely): the
    /// cache of their keys stays bounded, and every key opens its objects.
    #[test]
    fn the_key_cache_is_bounded() -> Result<()> {
        let key = [5u8; 32];
        let reader = Crypto::reader(&key, [1u8; 16], NonceScheme::Session)?;
        let Mode::Sessions { others, .. } = &reader.mode else {
            return Err(Error::Invalid("not a session reader".into()));
        };
        let mut objects = Vec::new();
        for i in 0..3 * KEY_CACHE_SLOTS {
            let c = session(&key)?;
            objects.push(c.sealed(Kind::Chunk, b"", &i.to_le_bytes())?);
        }
        for _ in 0..2 {
            for (i, o) in objects.iter().enumerate() {
                assert_eq!(
                    reader.open(Kind::Chunk, b"", o, String::new)?,
                    i.to_le_bytes()
                );
            }
        }
        assert!(others.len() <= KEY_CACHE_SLOTS);
        assert!(others.len() > KEY_CACHE_SLOTS / 2, "the cache is used");
        // Salts chosen to collide in one slot: still bounded, still correct.
        let mut garbage = objects[0].clone();
        for i in 0..100u64 {
            garbage[..8].copy_from_slice(&(i * KEY_CACHE_SLOTS as u64).to_le_bytes());
            assert!(reader
                .open(Kind::Chunk, b"", &garbage, String::new)
                .is_err());
        }
        assert!(others.len() <= KEY_CACHE_SLOTS);
        assert_eq!(
            reader.open(Kind::Chunk, b"", &objects[1], String::new)?,
            1usize.to_le_bytes()
        );
        Ok(())
    }

    /// Objects of a format 3 pool (epoch ‖ counter under the data key) are read; such a pool
    /// never gets a session.
    #[test]
    fn format_3_objects_are_read_and_never_sealed_into() -> Result<()> {
        let key = [4u8; 32];
        let uuid = [1u8; 16];
        let mut nonce = [0u8; 12];
        nonce[..4].copy_from_slice(&7u32.to_le_bytes());
        let (a, n) = aad(Kind::Page, &uuid, b"ctx")?;
        let mut sealed = nonce.to_vec();
        seal_append(&cipher(&key)?, nonce, &a[..n], b"old page", &mut sealed)?;
        let old = Crypto::reader(&key, uuid, NonceScheme::Epoch)?;
        assert_eq!(
            old.open(Kind::Page, b"ctx", &sealed, String::new)?,
            b"old page"
        );
        assert!(matches!(
            old.sealed(Kind::Page, b"", b"x"),
            Err(Error::ReadOnly)
        ));
        let err = old.start_session("/srv/old").err().map(|e| e.to_string());
        assert!(
            err.as_deref()
                .is_some_and(|e| e.contains("format 3") && e.contains("export")),
            "{err:?}"
        );
        Ok(())
    }

    #[test]
    fn superblock_mac_depends_on_every_byte_and_the_key() -> Result<()> {
        let c = Crypto::reader(&[7u8; 32], [1u8; 16], NonceScheme::Session)?;
        let bytes = vec![0x5au8; 236];
        let mac = c.superblock_mac(&bytes);
        c.check_superblock_mac(&bytes, &mac, "p")?;
        let mut changed = bytes.clone();
        changed[100] ^= 1;
        assert!(c.check_superblock_mac(&changed, &mac, "p").is_err());
        assert!(c.check_superblock_mac(&bytes, &mac[..15], "p").is_err());
        let other = Crypto::reader(&[8u8; 32], [1u8; 16], NonceScheme::Session)?;
        assert_ne!(other.superblock_mac(&bytes), mac);
        Ok(())
    }

    #[test]
    fn wrap_unwrap_and_wrong_key() -> Result<()> {
        let uuid = [9u8; 16];
        let user = UserKey::Key(Zeroizing::new([5u8; 32]));
        let (wrap, key) = new_data_key(&user, &uuid)?;
        assert_eq!(unwrap_data_key(&user, &wrap, &uuid, "p")?, key);
        let other = UserKey::Key(Zeroizing::new([6u8; 32]));
        assert!(matches!(
            unwrap_data_key(&other, &wrap, &uuid, "p"),
            Err(Error::WrongKey(_))
        ));
        assert!(unwrap_data_key(&user, &wrap, &[8u8; 16], "p").is_err());
        Ok(())
    }

    #[test]
    fn argon2_bounds_are_checked_before_any_work() {
        let salt = [0u8; 16];
        let pp = |m_kib, t, p| KeySource::Passphrase { m_kib, t, p, salt };
        assert!(pp(ARGON2_M_KIB, ARGON2_T, ARGON2_P).check_bounds().is_ok());
        assert!(pp(ARGON2_M_KIB_MAX, ARGON2_T_MAX, ARGON2_P_MAX)
            .check_bounds()
            .is_ok());
        for bad in [
            pp(u32::MAX, 3, 1),
            pp(ARGON2_M_KIB_MAX + 1, 3, 1),
            pp(7, 3, 1),
            pp(64, 3, 16),
            pp(65536, 0, 1),
            pp(65536, u32::MAX, 1),
            pp(65536, 3, 0),
            pp(65536, 3, ARGON2_P_MAX + 1),
        ] {
            assert!(bad.check_bounds().is_err(), "{bad:?}");
            // And the key derivation refuses them too (no allocation, no hang).
            let wrap = KeyWrap {
                source: bad,
                nonce: [0; 12],
                wrapped: [0; 48],
                scheme: NonceScheme::Session,
                mac: [0; MAC_BYTES],
            };
            let user = UserKey::passphrase(b"a long enough passphrase");
            assert!(matches!(
                unwrap_data_key(&user, &wrap, &[0; 16], "p"),
                Err(Error::Corrupt { .. })
            ));
        }
    }

    #[test]
    fn key_files_raw_or_hex_never_text() -> Result<()> {
        let hex = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff\n";
        let UserKey::Key(k) = UserKey::from_key_file_bytes(hex.as_bytes())? else {
            return Err(Error::Invalid("not a key".into()));
        };
        assert_eq!(k[1], 0x11);
        let mut raw = [0u8; 32];
        raw[0] = 0x80;
        assert!(UserKey::from_key_file_bytes(&raw).is_ok());
        assert!(UserKey::from_key_file_bytes(b"short").is_err());
        // 32 bytes of text: a passphrase typed into a key file, 32 hex digits, a line + newline.
        for text in [
            &b"correct horse battery staple 123"[..],
            b"00112233445566778899aabbccddeeff",
            b"thirty-one characters of text..\n",
        ] {
            assert_eq!(text.len(), 32);
            let err = UserKey::from_key_file_bytes(text)
                .err()
                .map(|e| e.to_string());
            assert!(
                err.as_deref().is_some_and(
                    |e| e.contains("looks like text") && e.contains("--passphrase-file")
                ),
                "{err:?}"
            );
        }
        Ok(())
    }

    #[test]
    fn a_new_pool_refuses_a_short_passphrase() -> Result<()> {
        let uuid = [1u8; 16];
        let short = UserKey::passphrase("fourteen chars".as_bytes());
        let err = new_data_key(&short, &uuid).err().map(|e| e.to_string());
        assert!(
            err.as_deref().is_some_and(|e| e.contains("at least 15")),
            "{err:?}"
        );
        // Characters, not bytes: 15 two-byte characters pass, 14 do not.
        assert!(new_data_key(&UserKey::passphrase("é".repeat(14).as_bytes()), &uuid).is_err());
        let (wrap, key) = new_data_key(&UserKey::passphrase("é".repeat(15).as_bytes()), &uuid)?;
        // Opening an existing pool takes any passphrase it was made with (no minimum there).
        assert_eq!(
            unwrap_data_key(
                &UserKey::passphrase("é".repeat(15).as_bytes()),
                &wrap,
                &uuid,
                "p"
            )?,
            key
        );
        Ok(())
    }
}

//! Encryption at rest: the pool's keys, the AEAD and the nonce scheme.
//!
//! Owns: the data key (random, 256 bits, one per pool) and how it is wrapped by the user's
//! key (a 32-byte key file, or argon2id of a passphrase); the fingerprint key derived from the
//! data key; sealing and opening of every encrypted object with AES-256-GCM (`ring`, whose
//! AES-NI/CLMUL code runs at several GB/s per core).
//! Invariants (docs/FORMAT.md, "Encryption"):
//! - A nonce is never used twice under one data key, by construction: it is the pool's
//!   *epoch* (32 bits) followed by a counter (64 bits). The epoch is bumped in the superblock,
//!   durably, by every writable open before anything is sealed, and the counter starts at 0
//!   for each epoch. A [`Crypto`] made for a read-only open has no epoch and refuses to seal.
//! - Every sealed object authenticates its context as associated data: the pool UUID, what
//!   kind of object it is, and where it belongs (a chunk's fingerprint, a page's unit in
//!   `meta.dat`, a journal batch's generation and sequence, a root's header), so bytes moved
//!   to another place, another pool or another kind of object fail to open.
//! - Keys never reach the disk in plaintext: the superblock holds the data key wrapped by the
//!   user's key, and the fingerprint key is derived from the data key, not stored.

use crate::error::{Error, Result};
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};
use std::sync::atomic::{AtomicU64, Ordering};
use zeroize::Zeroizing;

/// Bytes a sealed object takes beyond its plaintext: the 12-byte nonce and the 16-byte tag.
pub const OVERHEAD: usize = 12 + 16;

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

impl UserKey {
    /// A raw 256-bit key.
    pub fn key(bytes: [u8; 32]) -> UserKey {
        UserKey::Key(Zeroizing::new(bytes))
    }

    /// A passphrase (stretched with argon2id).
    pub fn passphrase(p: &[u8]) -> UserKey {
        UserKey::Passphrase(Zeroizing::new(p.to_vec()))
    }

    /// A key file's contents: 32 raw bytes, or 64 hex digits (surrounding white space ignored).
    pub fn from_key_file_bytes(bytes: &[u8]) -> Result<UserKey> {
        if bytes.len() == 32 {
            let mut k = Zeroizing::new([0u8; 32]);
            k.copy_from_slice(bytes);
            return Ok(UserKey::Key(k));
        }
        let text = std::str::from_utf8(bytes).map(str::trim).unwrap_or("");
        if text.len() == 64 && text.bytes().all(|c| c.is_ascii_hexdigit()) {
            let mut k = Zeroizing::new([0u8; 32]);
            for (i, b) in k.iter_mut().enumerate() {
                *b = u8::from_str_radix(&text[2 * i..2 * i + 2], 16)
                    .map_err(|_| Error::Invalid("key file: bad hex digit".into()))?;
            }
            return Ok(UserKey::Key(k));
        }
        Err(Error::Invalid(format!(
            "a key file must hold 32 raw bytes or 64 hex digits, this one has {} bytes \
             (make one with `head -c 32 /dev/urandom > KEYFILE`)",
            bytes.len()
        )))
    }
}

/// How the data key is wrapped (stored in the superblock of an encrypted pool).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyWrap {
    pub source: KeySource,
    /// Nonce of the wrapping (random; the user's key wraps one data key per pool).
    pub nonce: [u8; 12],
    /// The data key sealed with the user's key, then its tag (the key check).
    pub wrapped: [u8; 48],
    /// The epoch of the last writable open (see the module docs).
    pub epoch: u32,
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

/// argon2id parameters for new pools: 64 MiB, 3 passes, 1 lane (RFC 9106's second choice).
const ARGON2_M_KIB: u32 = 64 * 1024;
const ARGON2_T: u32 = 3;
const ARGON2_P: u32 = 1;

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

/// Seal `plaintext` under `key` with `nonce`; appends nonce, ciphertext and tag to `out`.
fn seal_with(
    key: &LessSafeKey,
    nonce: [u8; 12],
    aad: &[u8],
    plaintext: &[u8],
    out: &mut Vec<u8>,
) -> Result<()> {
    out.reserve(OVERHEAD + plaintext.len());
    out.extend_from_slice(&nonce);
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

/// Open `sealed` (nonce, ciphertext, tag); `None` if it does not authenticate.
fn open_with(key: &LessSafeKey, aad: &[u8], sealed: &[u8]) -> Option<Vec<u8>> {
    let nonce: [u8; 12] = sealed.get(..12)?.try_into().ok()?;
    let mut buf = sealed.get(12..)?.to_vec();
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

/// Make a new data key for pool `uuid` and wrap it with `user`. Returns the wrap (epoch 0)
/// and the data key.
pub fn new_data_key(user: &UserKey, uuid: &[u8; 16]) -> Result<(KeyWrap, Zeroizing<[u8; 32]>)> {
    let source = match user {
        UserKey::Key(_) => KeySource::KeyFile,
        UserKey::Passphrase(_) => KeySource::Passphrase {
            m_kib: ARGON2_M_KIB,
            t: ARGON2_T,
            p: ARGON2_P,
            salt: random()?,
        },
    };
    let kek = kek(user, &source, "the new pool")?;
    let data_key = Zeroizing::new(random::<32>()?);
    let nonce: [u8; 12] = random()?;
    let (a, n) = aad(Kind::DataKey, uuid, &[])?;
    let mut sealed = Zeroizing::new(Vec::new());
    seal_with(&cipher(&kek)?, nonce, &a[..n], &data_key[..], &mut sealed)?;
    let mut wrapped = [0u8; 48];
    wrapped.copy_from_slice(&sealed[12..]);
    Ok((
        KeyWrap {
            source,
            nonce,
            wrapped,
            epoch: 0,
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
    let mut sealed = wrap.nonce.to_vec();
    sealed.extend_from_slice(&wrap.wrapped);
    let buf = Zeroizing::new(open_with(&cipher(&kek)?, &a[..n], &sealed).ok_or_else(|| {
        Error::WrongKey(format!(
            "the key does not open pool {pool}: check --key-file / --passphrase-file \
             (without the key the pool was made with, its data cannot be read)"
        ))
    })?);
    let mut k = Zeroizing::new([0u8; 32]);
    k.copy_from_slice(&buf);
    Ok(k)
}

/// The fingerprint key of an encrypted pool: derived from the data key, never stored.
pub fn fingerprint_key(data_key: &[u8; 32]) -> [u8; 32] {
    blake3::derive_key("condense 2026-11 chunk fingerprint key", data_key)
}

/// The sealing context of one open of an encrypted pool.
pub struct Crypto {
    cipher: LessSafeKey,
    uuid: [u8; 16],
    /// `None` for a read-only open: nothing may be sealed.
    epoch: Option<u32>,
    counter: AtomicU64,
}

impl Crypto {
    /// A context for pool `uuid`. `epoch` must have been made durable in the superblock
    /// before the first [`Crypto::seal`]; `None` makes a context that only opens.
    pub fn new(data_key: &[u8; 32], uuid: [u8; 16], epoch: Option<u32>) -> Result<Crypto> {
        Ok(Crypto {
            cipher: cipher(data_key)?,
            uuid,
            epoch,
            counter: AtomicU64::new(0),
        })
    }

    /// Append `plaintext` sealed (nonce, ciphertext, tag) to `out`.
    pub fn seal(&self, kind: Kind, ctx: &[u8], plaintext: &[u8], out: &mut Vec<u8>) -> Result<()> {
        let epoch = self.epoch.ok_or(Error::ReadOnly)?;
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        if n == u64::MAX {
            return Err(Error::Invalid(
                "nonce counter exhausted for this open; reopen the pool".into(),
            ));
        }
        let mut nonce = [0u8; 12];
        nonce[..4].copy_from_slice(&epoch.to_le_bytes());
        nonce[4..].copy_from_slice(&n.to_le_bytes());
        let (a, len) = aad(kind, &self.uuid, ctx)?;
        seal_with(&self.cipher, nonce, &a[..len], plaintext, out)
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
        if sealed.len() < OVERHEAD {
            return Err(Error::Auth {
                what: what(),
                detail: format!("{} bytes, shorter than a sealed object", sealed.len()),
            });
        }
        let (a, len) = aad(kind, &self.uuid, ctx)?;
        open_with(&self.cipher, &a[..len], sealed).ok_or_else(|| Error::Auth {
            what: what(),
            detail: "the bytes were changed (tampering or damage) or belong elsewhere".into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seal_open_round_trip_and_context_binding() -> Result<()> {
        let c = Crypto::new(&[7u8; 32], [1u8; 16], Some(3))?;
        let a = c.sealed(Kind::Chunk, b"here", b"hello")?;
        let b = c.sealed(Kind::Chunk, b"here", b"hello")?;
        assert_ne!(a, b, "two seals of the same bytes use different nonces");
        assert_eq!(c.open(Kind::Chunk, b"here", &a, String::new)?, b"hello");
        assert!(c.open(Kind::Chunk, b"there", &a, String::new).is_err());
        assert!(c.open(Kind::Page, b"here", &a, String::new).is_err());
        let mut t = a.clone();
        t[14] ^= 1;
        assert!(matches!(
            c.open(Kind::Chunk, b"here", &t, String::new),
            Err(Error::Auth { .. })
        ));
        let ro = Crypto::new(&[7u8; 32], [1u8; 16], None)?;
        assert!(ro.sealed(Kind::Chunk, b"", b"x").is_err());
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
    fn key_files_raw_or_hex() -> Result<()> {
        let hex = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff\n";
        let UserKey::Key(k) = UserKey::from_key_file_bytes(hex.as_bytes())? else {
            return Err(Error::Invalid("not a key".into()));
        };
        assert_eq!(k[1], 0x11);
        assert!(UserKey::from_key_file_bytes(b"short").is_err());
        Ok(())
    }
}

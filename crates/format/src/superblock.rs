//! The superblock (`superblock`, `superblock.copy`): the pool's identity and fixed settings,
//! and in an encrypted pool the key section and its MAC. Written by `init` (and, for a pool
//! in an object store, by `condense durability set`); docs/FORMAT.md "Superblock".
//!
//! Invariants: 128 bytes (256 encrypted), a CRC-32C over each part; a version this build
//! does not read is refused; argon2id parameters are bounded on read (a damaged superblock,
//! not an allocation); in an encrypted pool the MAC covers every byte before it.

use super::common::{
    check_crc, check_magic, check_version, crc, put_u16, put_u32, put_u64, Reader, BLOCK_SIZE_MAX,
    BLOCK_SIZE_MIN, FORMAT_VERSION, SUPERBLOCK_BYTES, SUPERBLOCK_ENCRYPTED_BYTES,
    SUPERBLOCK_MAC_AT, SUPERBLOCK_MAGIC, SUPERBLOCK_VERSION_ENCRYPTED,
    SUPERBLOCK_VERSION_ENCRYPTED_EPOCH,
};
use crate::crypto::{Crypto, KeySource, KeyWrap, NonceScheme, MAC_BYTES};
use crate::error::{Error, Result};

// pool authenticated with a MAC keyed from the data key.

/// The pool's default codec for new chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    None,
    Lz4,
    Zstd(i8),
}

impl Compression {
    /// The zstd levels a pool may use: 1 to 22, and the fast levels -1 to -7 (faster than
    /// level 1, and on VM images denser than LZ4: bench/README.md "dictionary-bench"). Every
    /// level writes the same codec, so a level changes nothing a reader sees.
    pub fn zstd_level_ok(level: i8) -> bool {
        (1..=22).contains(&level) || (-7..=-1).contains(&level)
    }
}

/// `none`, `lz4`, `zstd:LEVEL`: as `condense init --compression` takes it.
impl std::fmt::Display for Compression {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Compression::None => f.write_str("none"),
            Compression::Lz4 => f.write_str("lz4"),
            Compression::Zstd(l) => write!(f, "zstd:{l}"),
        }
    }
}

/// `lz4`, `none`, `zstd` (level 3) or `zstd:LEVEL`, as `condense init --compression` takes
/// it; the error says what is accepted.
impl std::str::FromStr for Compression {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Compression, String> {
        match s {
            "lz4" => Ok(Compression::Lz4),
            "none" => Ok(Compression::None),
            "zstd" => Ok(Compression::Zstd(3)),
            _ => match s.strip_prefix("zstd:").and_then(|l| l.parse::<i8>().ok()) {
                Some(l) if Compression::zstd_level_ok(l) => Ok(Compression::Zstd(l)),
                _ => Err(format!(
                    "unknown compression {s:?}: use lz4, zstd, zstd:LEVEL (1 to 22, or -1 to -7 for \
                     zstd's fast levels) or none"
                )),
            },
        }
    }
}

/// `auto`, `sync` or `async`, as `condense init --write-policy` takes it.
impl std::str::FromStr for WritePolicy {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<WritePolicy, String> {
        match s {
            "auto" => Ok(WritePolicy::Auto),
            "sync" => Ok(WritePolicy::Sync),
            "async" => Ok(WritePolicy::Async),
            _ => Err(format!(
                "unknown write policy {s:?}: use auto, sync or async"
            )),
        }
    }
}

/// When writes are acknowledged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WritePolicy {
    /// `Async` where the pool directory honours flushes, `Sync` otherwise.
    Auto,
    /// Every write is durable before it is acknowledged.
    Sync,
    /// Writes are durable at the next flush (or FUA).
    Async,
}

/// What a flush of a pool in an object store promises (docs/S3.md). Stored in the
/// superblock, so that every host that opens the pool uses the same.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Durability {
    /// A flush returns when the local directory's journal is synced; data and metadata are
    /// uploaded in the background (segments as they fill, checkpoints every 60 s).
    #[default]
    Local,
    /// A flush returns when the store has acknowledged a write-ahead object of it.
    Remote,
}

impl Durability {
    pub fn as_str(self) -> &'static str {
        match self {
            Durability::Local => "local",
            Durability::Remote => "remote",
        }
    }

    pub fn parse(s: &str) -> Option<Durability> {
        match s {
            "local" => Some(Durability::Local),
            "remote" => Some(Durability::Remote),
            _ => None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Superblock {
    pub block_size: u32,
    pub compression: Compression,
    pub write_policy: WritePolicy,
    /// A pool in an object store: what a flush promises. `None`: a local pool, or a pool in
    /// an object store made before this was stored (its first writable open stores it).
    pub durability: Option<Durability>,
    pub uuid: [u8; 16],
    pub key: [u8; 32],
    pub segment_bytes_target: u64,
    /// Metadata page-cache budget chosen at init (0: the default).
    pub metadata_cache_bytes: u64,
    /// How the data key is wrapped, for an encrypted pool. Then `key` is not stored (zeros
    /// on disk); in memory it holds the fingerprint key derived from the data key.
    pub encryption: Option<KeyWrap>,
}

impl Superblock {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(SUPERBLOCK_BYTES);
        b.extend_from_slice(&SUPERBLOCK_MAGIC);
        put_u32(
            &mut b,
            match &self.encryption {
                Some(w) if w.scheme == NonceScheme::Epoch => SUPERBLOCK_VERSION_ENCRYPTED_EPOCH,
                Some(_) => SUPERBLOCK_VERSION_ENCRYPTED,
                None => FORMAT_VERSION,
            },
        );
        put_u32(&mut b, self.block_size);
        let (codec, level) = match self.compression {
            Compression::None => (0u8, 0i8),
            Compression::Lz4 => (1, 0),
            Compression::Zstd(l) => (2, l),
        };
        b.push(codec);
        b.push(level as u8);
        b.push(match self.write_policy {
            WritePolicy::Auto => 0,
            WritePolicy::Sync => 1,
            WritePolicy::Async => 2,
        });
        b.push(match self.durability {
            None => 0,
            Some(Durability::Local) => 1,
            Some(Durability::Remote) => 2,
        });
        put_u32(&mut b, 0);
        b.extend_from_slice(&self.uuid);
        match self.encryption {
            Some(_) => b.extend_from_slice(&[0u8; 32]),
            None => b.extend_from_slice(&self.key),
        }
        put_u64(&mut b, self.segment_bytes_target);
        put_u64(&mut b, self.metadata_cache_bytes);
        b.resize(SUPERBLOCK_BYTES - 4, 0);
        let c = crc(&[&b]);
        put_u32(&mut b, c);
        if let Some(w) = &self.encryption {
            let (source, m, t, p, salt) = match w.source {
                KeySource::KeyFile => (1u8, 0, 0, 0, [0u8; 16]),
                KeySource::Passphrase { m_kib, t, p, salt } => (2, m_kib, t, p, salt),
            };
            b.push(source);
            b.push(1); // cipher: AES-256-GCM
            put_u16(&mut b, 0);
            put_u32(&mut b, 0); // format 3: the epoch of the last writable open
            put_u32(&mut b, m);
            put_u32(&mut b, t);
            put_u32(&mut b, p);
            b.extend_from_slice(&salt);
            b.extend_from_slice(&w.nonce);
            b.extend_from_slice(&w.wrapped);
            b.resize(SUPERBLOCK_MAC_AT, 0);
            b.extend_from_slice(&w.mac);
            let c = crc(&[&b]);
            put_u32(&mut b, c);
        }
        b
    }

    pub fn decode(buf: &[u8]) -> Result<Superblock> {
        const WHAT: &str = "superblock";
        if buf.len() < SUPERBLOCK_BYTES {
            return Err(Error::corrupt(
                WHAT,
                format!("{} bytes, expected {SUPERBLOCK_BYTES}", buf.len()),
            ));
        }
        let mut r = Reader::new(buf, WHAT);
        check_magic(r.bytes(8)?, &SUPERBLOCK_MAGIC, WHAT)?;
        let version = r.u32()?;
        let scheme = match version {
            SUPERBLOCK_VERSION_ENCRYPTED => Some(NonceScheme::Session),
            SUPERBLOCK_VERSION_ENCRYPTED_EPOCH => Some(NonceScheme::Epoch),
            v => {
                check_version(v, WHAT)?;
                None
            }
        };
        let stored = u32::from_le_bytes(
            buf[SUPERBLOCK_BYTES - 4..SUPERBLOCK_BYTES]
                .try_into()
                .map_err(|_| Error::corrupt(WHAT, "short"))?,
        );
        check_crc(stored, crc(&[&buf[..SUPERBLOCK_BYTES - 4]]), WHAT)?;
        let block_size = r.u32()?;
        let codec = r.u8()?;
        let level = r.u8()? as i8;
        let policy = r.u8()?;
        let durability = r.u8()?;
        let _ = r.u32()?;
        let uuid = r.array()?;
        let key = r.array()?;
        let segment_bytes_target = r.u64()?;
        let metadata_cache_bytes = r.u64()?;
        let compression = match codec {
            0 => Compression::None,
            1 => Compression::Lz4,
            2 => Compression::Zstd(level),
            c => return Err(Error::corrupt(WHAT, format!("unknown compression {c}"))),
        };
        let write_policy = match policy {
            0 => WritePolicy::Auto,
            1 => WritePolicy::Sync,
            2 => WritePolicy::Async,
            p => return Err(Error::corrupt(WHAT, format!("unknown write policy {p}"))),
        };
        let durability = match durability {
            0 => None,
            1 => Some(Durability::Local),
            2 => Some(Durability::Remote),
            d => return Err(Error::corrupt(WHAT, format!("unknown durability {d}"))),
        };
        if !block_size.is_power_of_two() || !(BLOCK_SIZE_MIN..=BLOCK_SIZE_MAX).contains(&block_size)
        {
            return Err(Error::corrupt(WHAT, format!("block size {block_size}")));
        }
        if segment_bytes_target == 0 || segment_bytes_target > u64::from(u32::MAX) {
            return Err(Error::corrupt(
                WHAT,
                format!("segment size {segment_bytes_target}"),
            ));
        }
        let encryption = match scheme {
            Some(scheme) => Some(decode_key_section(buf, scheme)?),
            None => None,
        };
        Ok(Superblock {
            block_size,
            compression,
            write_policy,
            durability,
            uuid,
            key,
            segment_bytes_target,
            metadata_cache_bytes,
            encryption,
        })
    }
}

/// The key section (bytes 128..256) of an encrypted pool's superblock. Its MAC is checked
/// later, with the data key ([`Superblock::check_mac`]); the argon2id parameters are bounded
/// here, before anything can spend memory or time on them.
fn decode_key_section(buf: &[u8], scheme: NonceScheme) -> Result<KeyWrap> {
    const WHAT: &str = "superblock key section";
    let all = buf.get(..SUPERBLOCK_ENCRYPTED_BYTES).ok_or_else(|| {
        Error::corrupt(
            WHAT,
            format!("{} bytes, expected {SUPERBLOCK_ENCRYPTED_BYTES}", buf.len()),
        )
    })?;
    let n = SUPERBLOCK_ENCRYPTED_BYTES - 4;
    let stored = u32::from_le_bytes([all[n], all[n + 1], all[n + 2], all[n + 3]]);
    check_crc(stored, crc(&[&all[..n]]), WHAT)?;
    let mut r = Reader::new(&all[SUPERBLOCK_BYTES..], WHAT);
    let source = r.u8()?;
    let cipher = r.u8()?;
    let _ = r.u16()?;
    let _epoch = r.u32()?;
    let (m_kib, t, p) = (r.u32()?, r.u32()?, r.u32()?);
    let salt = r.array()?;
    let nonce = r.array()?;
    let wrapped = r.array()?;
    let mut mac = [0u8; MAC_BYTES];
    if scheme == NonceScheme::Session {
        mac.copy_from_slice(&all[SUPERBLOCK_MAC_AT..SUPERBLOCK_MAC_AT + MAC_BYTES]);
    }
    if cipher != 1 {
        return Err(Error::corrupt(WHAT, format!("unknown cipher {cipher}")));
    }
    let source = match source {
        1 => KeySource::KeyFile,
        2 => KeySource::Passphrase { m_kib, t, p, salt },
        s => return Err(Error::corrupt(WHAT, format!("unknown key source {s}"))),
    };
    source
        .check_bounds()
        .map_err(|e| Error::corrupt(WHAT, format!("{e}: out of range")))?;
    Ok(KeyWrap {
        source,
        nonce,
        wrapped,
        scheme,
        mac,
    })
}

impl Superblock {
    /// True for a pool encrypted at rest.
    pub fn is_encrypted(&self) -> bool {
        self.encryption.is_some()
    }

    /// Set the MAC of an encrypted pool's superblock (format 4) for its current fields, with
    /// the pool's data key (held by `c`). Call after every change, before encoding to write.
    pub fn authenticate(&mut self, c: &Crypto) {
        let bytes = self.encode();
        if let (Some(w), Some(covered)) = (&mut self.encryption, bytes.get(..SUPERBLOCK_MAC_AT)) {
            w.mac = c.superblock_mac(covered);
        }
    }

    /// The encryption context of an encrypted pool (`None` for a plain one): unwraps the data
    /// key with `key`, checks the MAC of the superblock (`bytes`, as read from pool `pool`)
    /// and sets the fingerprint key. With `seal`, the context has a session of its own and
    /// can seal; without it, it only opens. Nothing is written: nonces depend on no file.
    pub fn unlock(
        &mut self,
        bytes: &[u8],
        key: Option<&crate::crypto::UserKey>,
        seal: bool,
        pool: &str,
    ) -> Result<Option<std::sync::Arc<Crypto>>> {
        let Some(wrap) = &self.encryption else {
            // A key means an encrypted pool: a plaintext pool under a key is a pool swapped
            // in (or a configuration that is wrong), and writing to it would store in the
            // clear what its owner meant to encrypt (docs/ENCRYPTION.md).
            if key.is_some() {
                return Err(Error::NotEncrypted(pool.to_string()));
            }
            return Ok(None);
        };
        let user = key.ok_or_else(|| Error::KeyRequired(pool.to_string()))?;
        let data_key = crate::crypto::unwrap_data_key(user, wrap, &self.uuid, pool)?;
        let mut c = Crypto::reader(&data_key, self.uuid, wrap.scheme)?;
        if wrap.scheme == NonceScheme::Session {
            Superblock::check_mac(bytes, &c, pool)?;
        }
        if seal {
            c = c.start_session(pool)?;
        }
        self.key = crate::crypto::fingerprint_key(&data_key);
        Ok(Some(std::sync::Arc::new(c)))
    }

    /// Check the MAC of the superblock `buf` (as read from pool `pool`) with the data key held
    /// by `c`: every byte before the MAC must be as the key's holder wrote it.
    pub fn check_mac(buf: &[u8], c: &Crypto, pool: &str) -> Result<()> {
        let (Some(covered), Some(stored)) = (
            buf.get(..SUPERBLOCK_MAC_AT),
            buf.get(SUPERBLOCK_MAC_AT..SUPERBLOCK_MAC_AT + MAC_BYTES),
        ) else {
            return Err(Error::corrupt(
                format!("superblock of pool {pool}"),
                format!("{} bytes, expected {SUPERBLOCK_ENCRYPTED_BYTES}", buf.len()),
            ));
        };
        c.check_superblock_mac(covered, stored, pool)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crc;
    #[test]
    fn superblock_round_trip_and_damage() -> Result<()> {
        let sb = Superblock {
            block_size: 4096,
            compression: Compression::Zstd(7),
            write_policy: WritePolicy::Sync,
            durability: None,
            uuid: [3; 16],
            key: [9; 32],
            segment_bytes_target: 1 << 26,
            metadata_cache_bytes: 1 << 20,
            encryption: None,
        };
        let mut b = sb.encode();
        assert_eq!(b.len(), SUPERBLOCK_BYTES);
        assert_eq!(Superblock::decode(&b)?, sb);
        b[20] ^= 1;
        assert!(matches!(
            Superblock::decode(&b),
            Err(Error::Checksum { .. })
        ));
        // Encrypted: 256 bytes, version 4, the fingerprint key not stored, the MAC last.
        let mut enc = Superblock {
            encryption: Some(KeyWrap {
                source: KeySource::Passphrase {
                    m_kib: 8,
                    t: 1,
                    p: 1,
                    salt: [4; 16],
                },
                nonce: [5; 12],
                wrapped: [6; 48],
                scheme: NonceScheme::Session,
                mac: [0; MAC_BYTES],
            }),
            ..sb
        };
        let c = Crypto::reader(&[8; 32], enc.uuid, NonceScheme::Session)?;
        enc.authenticate(&c);
        let mut b = enc.encode();
        assert_eq!(b.len(), SUPERBLOCK_ENCRYPTED_BYTES);
        assert_eq!(b[8], 4);
        assert!(b[40..72].iter().all(|&x| x == 0));
        assert_ne!(
            b[SUPERBLOCK_MAC_AT..SUPERBLOCK_MAC_AT + MAC_BYTES],
            [0; MAC_BYTES]
        );
        assert_eq!(
            Superblock::decode(&b)?,
            Superblock {
                key: [0; 32],
                ..enc.clone()
            }
        );
        Superblock::check_mac(&b, &c, "p")?;
        b[200] ^= 1;
        assert!(matches!(
            Superblock::decode(&b),
            Err(Error::Checksum { .. })
        ));
        // Format 3 (older builds): read, with no MAC.
        let old = Superblock {
            encryption: enc.encryption.clone().map(|w| KeyWrap {
                scheme: NonceScheme::Epoch,
                mac: [0; MAC_BYTES],
                ..w
            }),
            ..enc.clone()
        };
        let b = old.encode();
        assert_eq!(b[8], 3);
        assert_eq!(
            Superblock::decode(&b)?,
            Superblock {
                key: [0; 32],
                ..old
            }
        );
        Ok(())
    }

    /// Encode `sb`, let `edit` change the bytes, fix both CRCs as a forger would.
    fn forged(sb: &Superblock, edit: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
        let mut b = sb.encode();
        edit(&mut b);
        let c = crc(&[&b[..SUPERBLOCK_BYTES - 4]]);
        b[SUPERBLOCK_BYTES - 4..SUPERBLOCK_BYTES].copy_from_slice(&c.to_le_bytes());
        let n = SUPERBLOCK_ENCRYPTED_BYTES - 4;
        let c = crc(&[&b[..n]]);
        b[n..].copy_from_slice(&c.to_le_bytes());
        b
    }

    fn encrypted_superblock(c: &Crypto) -> Superblock {
        let mut sb = Superblock {
            block_size: 4096,
            compression: Compression::Lz4,
            write_policy: WritePolicy::Sync,
            durability: Some(Durability::Remote),
            uuid: [3; 16],
            key: [0; 32],
            segment_bytes_target: 1 << 26,
            metadata_cache_bytes: 0,
            encryption: Some(KeyWrap {
                source: KeySource::Passphrase {
                    m_kib: 65536,
                    t: 3,
                    p: 1,
                    salt: [4; 16],
                },
                nonce: [5; 12],
                wrapped: [6; 48],
                scheme: NonceScheme::Session,
                mac: [0; MAC_BYTES],
            }),
        };
        sb.authenticate(c);
        sb
    }

    #[test]
    fn every_superblock_byte_before_the_mac_is_authenticated() -> Result<()> {
        let c = Crypto::reader(&[8; 32], [3; 16], NonceScheme::Session)?;
        let sb = encrypted_superblock(&c);
        Superblock::check_mac(&sb.encode(), &c, "p")?;
        // Every byte a forger can change (all but the two CRCs, which it recomputes): the
        // decoder refuses the value, or the MAC does.
        let crcs = [
            SUPERBLOCK_BYTES - 4..SUPERBLOCK_BYTES,
            SUPERBLOCK_ENCRYPTED_BYTES - 4..SUPERBLOCK_ENCRYPTED_BYTES,
        ];
        for at in (0..SUPERBLOCK_ENCRYPTED_BYTES - 4).filter(|i| !crcs[0].contains(i)) {
            let b = forged(&sb, |b| b[at] ^= 0x01);
            let refused = match Superblock::decode(&b) {
                Err(_) => true,
                Ok(_) => Superblock::check_mac(&b, &c, "p").is_err(),
            };
            assert!(refused, "a change at byte {at} went unnoticed");
        }
        // The attack of issue 23: the write policy (durability) edited, the CRC recomputed.
        let b = forged(&sb, |b| b[18] = 2);
        assert!(Superblock::decode(&b).is_ok(), "the forged bytes decode");
        let err = Superblock::check_mac(&b, &c, "/srv/pool")
            .err()
            .map(|e| e.to_string());
        assert!(
            err.as_deref()
                .is_some_and(|e| e.contains("superblock of pool /srv/pool")
                    && e.contains("changed without the key")),
            "{err:?}"
        );
        // Another data key does not vouch for it either.
        let other = Crypto::reader(&[9; 32], [3; 16], NonceScheme::Session)?;
        assert!(Superblock::check_mac(&sb.encode(), &other, "p").is_err());
        Ok(())
    }

    #[test]
    fn argon2_parameters_out_of_bounds_are_a_damaged_superblock() -> Result<()> {
        let c = Crypto::reader(&[8; 32], [3; 16], NonceScheme::Session)?;
        let sb = encrypted_superblock(&c);
        // m_kib at 136, t at 140, p at 144.
        for (at, v) in [
            (136, u32::MAX),
            (136, crate::crypto::ARGON2_M_KIB_MAX + 1),
            (136, 4),
            (140, u32::MAX),
            (140, 0),
            (140, crate::crypto::ARGON2_T_MAX + 1),
            (144, 0),
            (144, crate::crypto::ARGON2_P_MAX + 1),
        ] {
            let b = forged(&sb, |b| b[at..at + 4].copy_from_slice(&v.to_le_bytes()));
            let err = Superblock::decode(&b).err();
            assert!(
                matches!(&err, Some(Error::Corrupt { detail, .. }) if detail.contains("argon2id")),
                "{v} at {at}: {err:?}"
            );
        }
        // The largest values allowed decode (they cost at most 1 GiB and 16 passes).
        let b = forged(&sb, |b| {
            b[136..140].copy_from_slice(&crate::crypto::ARGON2_M_KIB_MAX.to_le_bytes());
            b[140..144].copy_from_slice(&crate::crypto::ARGON2_T_MAX.to_le_bytes());
            b[144..148].copy_from_slice(&crate::crypto::ARGON2_P_MAX.to_le_bytes());
        });
        assert!(Superblock::decode(&b).is_ok());
        Ok(())
    }

    #[test]
    fn superblock_keeps_the_durability_of_a_pool_in_an_object_store() -> Result<()> {
        let mut sb = Superblock {
            block_size: 4096,
            compression: Compression::Lz4,
            write_policy: WritePolicy::Auto,
            durability: None,
            uuid: [1; 16],
            key: [2; 32],
            segment_bytes_target: 1 << 26,
            metadata_cache_bytes: 0,
            encryption: None,
        };
        for (d, byte) in [
            (None, 0),
            (Some(Durability::Local), 1),
            (Some(Durability::Remote), 2),
        ] {
            sb.durability = d;
            let b = sb.encode();
            assert_eq!(b[19], byte);
            assert_eq!(Superblock::decode(&b)?.durability, d);
        }
        // An unknown value with a valid CRC is refused, not read as a default.
        let mut b = sb.encode();
        b[19] = 3;
        let c = crc(&[&b[..SUPERBLOCK_BYTES - 4]]);
        b[SUPERBLOCK_BYTES - 4..].copy_from_slice(&c.to_le_bytes());
        assert!(matches!(Superblock::decode(&b), Err(Error::Corrupt { .. })));
        Ok(())
    }
}

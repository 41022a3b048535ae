//! The names of a pool's objects in a bucket and the manifest that ties a checkpoint root to
//! them; docs/S3.md "Objects never replaced" and docs/FORMAT.md "Objects of a pool in a
//! bucket".
//!
//! Every object a writer puts is named by its **generation** ([`Generation`]: the epoch of the
//! lease claim it won and its random writer id) and by a sequence number that only grows
//! within that generation, so no two writers, and no two uploads of one writer, ever name the
//! same object:
//!
//! | object | what |
//! |---|---|
//! | `gen/EEEEEEEEEEEEEEEE-WWWWWWWWWWWWWWWW/NAME.SEQ` | pool file `NAME` (`superblock`, `seg-N.dat`, `meta/XXXXXXXX`, `checkpoint`, ...) as uploaded by that writer at its upload `SEQ` (hex) |
//! | `gen/E-W/manifest.SEQ` | the [`Manifest`] of the root `gen/E-W/checkpoint.SEQ`, put just before it |
//! | `gen/E-W/wal/SSSSSSSSSSSSSSSS` | a write-ahead object of that writer |
//! | `claims/E-W-RRRRRRRR` | renewal `R` of the lease claim of generation `E-W` (a [`super::remote::LeaseBody`]) |
//! | `claims/epoch-EEEEEEEEEEEEEEEE` | on a store with conditional PUT: which writer took epoch `E` (created if absent, [`epoch_lock_object`]) |
//!
//! Objects of pools made before generations (top-level `superblock`, `checkpoint`,
//! `seg-N.dat`, `meta/X`, `wal/SEQ`) belong to generation 0 and are read as they are.
//!
//! Invariants: every parser refuses, never panics on, a name or manifest it does not read;
//! a manifest names only objects with the object-name syntax (segments of
//! `[A-Za-z0-9._-]`, none starting with `.`), so it cannot point outside the pool's prefix.

use crate::error::{Error, Result};
use std::collections::{BTreeMap, BTreeSet};

pub const GEN_PREFIX: &str = "gen/";
pub const CLAIM_PREFIX: &str = "claims/";
/// The object name of the root of a generation (pool file `checkpoint`).
pub const ROOT_NAME: &str = "checkpoint";
const MANIFEST_NAME: &str = "manifest";
const MANIFEST_FIRST_LINE: &str = "condense-manifest 1";
/// The most bytes of a manifest read (one line per segment and extent: 64 MiB names over a
/// million objects); a larger object is damage.
pub const MAX_MANIFEST_BYTES: u64 = 64 << 20;

/// A writer of the pool: the epoch of the lease claim it won, and its random id.
/// Generation 0 (epoch 0) is the objects of a pool made before generations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Generation {
    pub epoch: u64,
    pub writer: u64,
}

impl Generation {
    pub const LEGACY: Generation = Generation {
        epoch: 0,
        writer: 0,
    };

    /// `gen/EEEEEEEEEEEEEEEE-WWWWWWWWWWWWWWWW`.
    pub fn dir(&self) -> String {
        format!("{GEN_PREFIX}{}", self.tag())
    }

    fn tag(&self) -> String {
        format!("{:016x}-{:016x}", self.epoch, self.writer)
    }

    fn parse_tag(s: &str) -> Option<Generation> {
        let (e, w) = s.split_once('-')?;
        if e.len() != 16 || w.len() != 16 {
            return None;
        }
        Some(Generation {
            epoch: u64::from_str_radix(e, 16).ok()?,
            writer: u64::from_str_radix(w, 16).ok()?,
        })
    }

    /// The rule every reader and writer applies: of two generations, the one with the higher
    /// epoch is trusted; at one epoch (two winners of one claim round, which the claim
    /// protocol excludes) the lower writer id.
    pub fn trusted_over(&self, other: &Generation) -> bool {
        self.epoch > other.epoch || (self.epoch == other.epoch && self.writer < other.writer)
    }
}

/// The object of pool file `name` uploaded by `gen` as its upload `seq`.
pub fn gen_object(gen: Generation, name: &str, seq: u64) -> String {
    format!("{}/{name}.{seq:x}", gen.dir())
}

/// The object of the manifest of root `seq` of `gen`.
pub fn manifest_object(gen: Generation, seq: u64) -> String {
    gen_object(gen, MANIFEST_NAME, seq)
}

/// What an object of the bucket is, by its name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ObjectKind {
    /// Pool file `name`, uploaded by `gen` as its upload `seq` (generation 0, seq 0: an
    /// object of a pool made before generations, named as the file).
    File {
        gen: Generation,
        name: String,
        seq: u64,
    },
    /// The manifest of root `seq` of `gen`.
    Manifest { gen: Generation, seq: u64 },
    /// Write-ahead object `seq` of `gen`.
    Wal { gen: Generation, seq: u64 },
    /// Renewal `renewal` of the lease claim of `gen`.
    Claim { gen: Generation, renewal: u32 },
    /// The one-writer lease of a pool before generations (`lease`).
    LegacyLease,
}

/// Parse an object name of the bucket; `None` for a name that is none of the pool's.
pub fn parse_object(obj: &str) -> Option<ObjectKind> {
    if !valid_object_name(obj) || is_pool_wide(obj) {
        return None;
    }
    if let Some(rest) = obj.strip_prefix(CLAIM_PREFIX) {
        let (tag, r) = rest.rsplit_once('-')?;
        if r.len() != 8 {
            return None;
        }
        return Some(ObjectKind::Claim {
            gen: Generation::parse_tag(tag)?,
            renewal: u32::from_str_radix(r, 16).ok()?,
        });
    }
    if let Some(rest) = obj.strip_prefix(GEN_PREFIX) {
        let (tag, rest) = rest.split_once('/')?;
        let gen = Generation::parse_tag(tag)?;
        if let Some(seq) = rest.strip_prefix("wal/") {
            return Some(ObjectKind::Wal {
                gen,
                seq: parse_seq16(seq)?,
            });
        }
        let (name, seq) = rest.rsplit_once('.')?;
        let seq = u64::from_str_radix(seq, 16).ok()?;
        if name.is_empty() {
            return None;
        }
        if name == MANIFEST_NAME {
            return Some(ObjectKind::Manifest { gen, seq });
        }
        return Some(ObjectKind::File {
            gen,
            name: name.to_string(),
            seq,
        });
    }
    if let Some(seq) = obj.strip_prefix("wal/") {
        return Some(ObjectKind::Wal {
            gen: Generation::LEGACY,
            seq: parse_seq16(seq)?,
        });
    }
    if obj == "lease" {
        return Some(ObjectKind::LegacyLease);
    }
    Some(ObjectKind::File {
        gen: Generation::LEGACY,
        name: obj.to_string(),
        seq: 0,
    })
}

fn parse_seq16(s: &str) -> Option<u64> {
    if s.len() != 16 {
        return None;
    }
    u64::from_str_radix(s, 16).ok()
}

/// Under a pool's prefix, the trees of the hosts that joined it (`hosts/SS/`, each laid out
/// as a pool of its own) and their registry (`members/`): the pool's as a whole, never a
/// file of the first host's tree, whose objects share the prefix (docs/S3.md "Many hosts").
pub const HOSTS_PREFIX: &str = "hosts/";
pub const MEMBERS_PREFIX: &str = "members/";
/// Volume claims of a shared pool ([`super::hosts::VolumeClaim`]).
pub const VOLUMES_PREFIX: &str = "volumes/";
const MEMBER_FIRST_LINE: &str = "condense-member 1";

/// True for an object of the pool as a whole ([`HOSTS_PREFIX`], [`MEMBERS_PREFIX`],
/// [`VOLUMES_PREFIX`]).
pub fn is_pool_wide(obj: &str) -> bool {
    obj.starts_with(HOSTS_PREFIX)
        || obj.starts_with(MEMBERS_PREFIX)
        || obj.starts_with(VOLUMES_PREFIX)
}

/// The prefix of member `slot`'s tree under the pool's prefix (`""`: the first host's, at
/// the top).
pub fn member_dir(slot: u8) -> String {
    if slot == 0 {
        String::new()
    } else {
        format!("{HOSTS_PREFIX}{slot:02x}")
    }
}

/// A host that joined a pool: the registry object `members/SS-W` (slot `SS` as 2 hex
/// digits, `W` the joining process's random id as 16), put once and never replaced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    pub slot: u8,
    /// Breaks the tie between two hosts that registered one slot at once: the lower wins.
    pub writer: u64,
    pub host: String,
    pub joined_unix: u64,
}

impl Member {
    pub fn object(&self) -> String {
        format!("{MEMBERS_PREFIX}{:02x}-{:016x}", self.slot, self.writer)
    }

    /// (slot, writer) of a registry object's name.
    pub fn parse_object(obj: &str) -> Option<(u8, u64)> {
        let rest = obj.strip_prefix(MEMBERS_PREFIX)?;
        let (slot, writer) = rest.split_once('-')?;
        if slot.len() != 2 || writer.len() != 16 {
            return None;
        }
        Some((
            u8::from_str_radix(slot, 16).ok()?,
            u64::from_str_radix(writer, 16).ok()?,
        ))
    }

    pub fn encode(&self) -> String {
        format!(
            "{MEMBER_FIRST_LINE}\nhost={}\njoined_unix={}\n",
            self.host, self.joined_unix
        )
    }

    /// The registry object `obj` with body `bytes`; `None` if either is not one.
    pub fn decode(obj: &str, bytes: &[u8]) -> Option<Member> {
        let (slot, writer) = Member::parse_object(obj)?;
        let text = std::str::from_utf8(bytes).ok()?;
        let mut lines = text.lines();
        if lines.next()? != MEMBER_FIRST_LINE || slot == 0 {
            return None;
        }
        let (mut host, mut joined_unix) = (None, None);
        for l in lines {
            match l.split_once('=') {
                Some(("host", h)) if h.len() <= 255 && !h.chars().any(char::is_control) => {
                    host = Some(h.to_string())
                }
                Some(("joined_unix", t)) => joined_unix = t.parse().ok(),
                _ => {}
            }
        }
        Some(Member {
            slot,
            writer,
            host: host?,
            joined_unix: joined_unix?,
        })
    }
}

/// On a store with conditional PUT, the object whose creation takes slot `slot`:
/// `members/SS`, created if absent by the joining host that wins the slot, holding its writer
/// id ([`encode_lock`]). A slot with one is the member's whose writer it names.
pub fn slot_lock_object(slot: u8) -> String {
    format!("{MEMBERS_PREFIX}{slot:02x}")
}

/// The slot of a slot lock's name (`members/SS`); `None` for any other name.
pub fn parse_slot_lock(obj: &str) -> Option<u8> {
    let rest = obj.strip_prefix(MEMBERS_PREFIX)?;
    if rest.len() != 2 {
        return None;
    }
    u8::from_str_radix(rest, 16).ok()
}

/// On a store with conditional PUT, the object whose creation takes lease epoch `epoch`:
/// `claims/epoch-EEEEEEEEEEEEEEEE` (created if absent, holding the writer id).
pub fn epoch_lock_object(epoch: u64) -> String {
    format!("{CLAIM_PREFIX}{EPOCH_LOCK_TAG}{epoch:016x}")
}

/// The epoch of an epoch lock's name; `None` for any other name.
pub fn parse_epoch_lock(obj: &str) -> Option<u64> {
    let e = obj
        .strip_prefix(CLAIM_PREFIX)?
        .strip_prefix(EPOCH_LOCK_TAG)?;
    parse_seq16(e)
}

const EPOCH_LOCK_TAG: &str = "epoch-";
const LOCK_FIRST_LINE: &str = "condense-lock 1";

/// The body of a lock object (slot, epoch or volume turn): who created it.
pub fn encode_lock(writer: u64, slot: u8, host: &str) -> Vec<u8> {
    format!("{LOCK_FIRST_LINE}\nwriter={writer:016x}\nslot={slot:02x}\nhost={host}\n").into_bytes()
}

/// (writer, slot) of a lock object's body; `None` if it is not one.
pub fn decode_lock(bytes: &[u8]) -> Option<(u64, u8)> {
    let text = std::str::from_utf8(bytes).ok()?;
    let mut lines = text.lines();
    if lines.next()? != LOCK_FIRST_LINE {
        return None;
    }
    let (mut writer, mut slot) = (None, None);
    for l in lines {
        match l.split_once('=') {
            Some(("writer", w)) if w.len() == 16 => writer = u64::from_str_radix(w, 16).ok(),
            Some(("slot", s)) if s.len() == 2 => slot = u8::from_str_radix(s, 16).ok(),
            _ => {}
        }
    }
    Some((writer?, slot?))
}

/// Write-ahead object `seq` of `gen`.
pub fn wal_object(gen: Generation, seq: u64) -> String {
    format!("{}/wal/{seq:016x}", gen.dir())
}

/// Renewal `renewal` of the claim of `gen`.
pub fn claim_object(gen: Generation, renewal: u32) -> String {
    format!("{CLAIM_PREFIX}{}-{renewal:08x}", gen.tag())
}

/// The object-name syntax of every backend: segments of `[A-Za-z0-9._-]` joined by `/`,
/// none empty or starting with `.`.
pub fn valid_object_name(s: &str) -> bool {
    !s.is_empty()
        && s.split('/').all(|seg| {
            !seg.is_empty()
                && !seg.starts_with('.')
                && seg
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
        })
}

/// What a checkpoint root of a pool in a bucket depends on, put just before the root:
/// every pool file by its object, and the write-ahead objects the next open may need.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Manifest {
    /// Pool file name → (object, bytes).
    pub files: BTreeMap<String, (String, u64)>,
    pub wal: BTreeSet<String>,
}

impl Manifest {
    /// Text: the first line, then `file NAME OBJECT BYTES` and `wal OBJECT` lines.
    pub fn encode(&self) -> Vec<u8> {
        let mut s = String::with_capacity(64 * (self.files.len() + self.wal.len()) + 32);
        s += MANIFEST_FIRST_LINE;
        s.push('\n');
        for (name, (obj, len)) in &self.files {
            s += &format!("file {name} {obj} {len}\n");
        }
        for obj in &self.wal {
            s += &format!("wal {obj}\n");
        }
        s.into_bytes()
    }

    pub fn decode(what: &str, b: &[u8]) -> Result<Manifest> {
        let bad = |d: String| Error::corrupt(what, d);
        let text = std::str::from_utf8(b).map_err(|_| bad("not UTF-8 text".into()))?;
        let mut lines = text.lines();
        if lines.next() != Some(MANIFEST_FIRST_LINE) {
            return Err(bad(format!("first line is not {MANIFEST_FIRST_LINE:?}")));
        }
        let mut m = Manifest::default();
        for (i, line) in lines.enumerate() {
            let fields: Vec<&str> = line.split(' ').collect();
            let ok = match fields[..] {
                ["file", name, obj, len] if valid_object_name(name) && valid_object_name(obj) => {
                    let len = len
                        .parse()
                        .map_err(|_| bad(format!("line {}: bad size {len:?}", i + 2)))?;
                    m.files
                        .insert(name.to_string(), (obj.to_string(), len))
                        .is_none()
                }
                ["wal", obj] if valid_object_name(obj) => m.wal.insert(obj.to_string()),
                _ => false,
            };
            if !ok {
                return Err(bad(format!("line {} is not understood: {line:?}", i + 2)));
            }
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: Generation = Generation {
        epoch: 7,
        writer: 0xfeed_beef_0000_0001,
    };

    #[test]
    fn lock_objects_are_no_claims_or_members_and_round_trip() {
        assert_eq!(slot_lock_object(0x2a), "members/2a");
        assert_eq!(parse_slot_lock("members/2a"), Some(0x2a));
        assert_eq!(Member::parse_object("members/2a"), None);
        for bad in ["members/2", "members/2a-0000000000000001", "members/zz"] {
            assert_eq!(parse_slot_lock(bad), None, "{bad}");
        }
        let e = epoch_lock_object(7);
        assert_eq!(e, "claims/epoch-0000000000000007");
        assert_eq!(parse_epoch_lock(&e), Some(7));
        assert_eq!(parse_object(&e), None, "an epoch lock is no claim");
        assert_eq!(parse_epoch_lock(&claim_object(G, 1)), None);
        let body = encode_lock(0xfeed, 3, "h");
        assert_eq!(decode_lock(&body), Some((0xfeed, 3)));
        assert_eq!(decode_lock(b"condense-lock 1\nwriter=1\n"), None);
        assert_eq!(decode_lock(b"junk"), None);
    }

    #[test]
    fn names_round_trip() {
        let seg = gen_object(G, "seg-00000003.dat", 0x2a);
        assert_eq!(
            parse_object(&seg),
            Some(ObjectKind::File {
                gen: G,
                name: "seg-00000003.dat".into(),
                seq: 0x2a
            })
        );
        let ext = gen_object(G, "meta/0000001a", 5);
        assert!(
            matches!(parse_object(&ext), Some(ObjectKind::File { name, .. }) if name == "meta/0000001a")
        );
        assert_eq!(
            parse_object(&manifest_object(G, 9)),
            Some(ObjectKind::Manifest { gen: G, seq: 9 })
        );
        assert_eq!(
            parse_object(&wal_object(G, 3)),
            Some(ObjectKind::Wal { gen: G, seq: 3 })
        );
        assert_eq!(
            parse_object(&claim_object(G, 12)),
            Some(ObjectKind::Claim {
                gen: G,
                renewal: 12
            })
        );
        assert_eq!(
            parse_object("seg-00000001.dat"),
            Some(ObjectKind::File {
                gen: Generation::LEGACY,
                name: "seg-00000001.dat".into(),
                seq: 0
            })
        );
        assert_eq!(
            parse_object("wal/0000000000000004"),
            Some(ObjectKind::Wal {
                gen: Generation::LEGACY,
                seq: 4
            })
        );
        assert_eq!(parse_object("lease"), Some(ObjectKind::LegacyLease));
        for bad in [
            "",
            "gen/x/seg.1",
            "gen/0007-1/seg.1",
            "claims/0000000000000007-feedbeef00000001-1",
            "gen/0000000000000007-feedbeef00000001/seg.zz",
            "gen/0000000000000007-feedbeef00000001/.hidden.1",
            "a//b",
            "wal/12",
        ] {
            assert!(
                !matches!(parse_object(bad), Some(ObjectKind::File { gen, .. }) if gen != Generation::LEGACY)
                    && !matches!(
                        parse_object(bad),
                        Some(
                            ObjectKind::Claim { .. }
                                | ObjectKind::Wal { .. }
                                | ObjectKind::Manifest { .. }
                        )
                    ),
                "{bad:?} parsed as {:?}",
                parse_object(bad)
            );
        }
    }

    #[test]
    fn the_trust_rule_is_a_total_order() {
        let a = Generation {
            epoch: 3,
            writer: 9,
        };
        let b = Generation {
            epoch: 3,
            writer: 2,
        };
        let c = Generation {
            epoch: 4,
            writer: 99,
        };
        assert!(b.trusted_over(&a) && !a.trusted_over(&b));
        assert!(c.trusted_over(&a) && c.trusted_over(&b));
        assert!(!a.trusted_over(&a));
        assert!(G.trusted_over(&Generation::LEGACY));
    }

    #[test]
    fn manifests_round_trip_and_refuse_damage() -> Result<()> {
        let mut m = Manifest::default();
        m.files.insert(
            "seg-00000001.dat".into(),
            (gen_object(G, "seg-00000001.dat", 1), 64 << 20),
        );
        m.files
            .insert("superblock".into(), ("superblock".into(), 4096));
        m.wal.insert(wal_object(G, 2));
        let b = m.encode();
        assert_eq!(Manifest::decode("m", &b)?, m);
        for cut in 1..b.len() {
            // A cut inside a line is refused or reads fewer entries, never panics.
            if let Ok(back) = Manifest::decode("m", &b[..cut]) {
                assert!(back.files.len() + back.wal.len() <= 3);
            }
        }
        for bad in [
            &b"condense-manifest 2\n"[..],
            b"condense-manifest 1\nfile a ../x 1\n",
            b"condense-manifest 1\nfile a b x\n",
            b"condense-manifest 1\nfile a b 1\nfile a c 2\n",
            b"condense-manifest 1\nwal /etc/passwd\n",
            b"condense-manifest 1\nsomething\n",
            &[0xff, 0xfe],
        ] {
            assert!(Manifest::decode("m", bad).is_err(), "{bad:?}");
        }
        Ok(())
    }
}

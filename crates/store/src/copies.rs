//! The files a pool cannot open without, kept twice: the superblock (`superblock` and
//! `superblock.copy`) and the checkpoint root (`checkpoint` and `checkpoint.copy`). One
//! damaged sector of either never loses the pool (docs/FORMAT.md "Copies").
//!
//! Invariants:
//! 1. When `init`, a superblock change or a checkpoint returns, both copies hold the same
//!    bytes. They are written one after the other, each replaced atomically (temp file,
//!    rename, directory sync), so a crash leaves at least one whole copy, old or new.
//! 2. Open reads both and chooses: the superblock's primary when it is valid (decodes, and in
//!    an encrypted pool authenticates), else the copy; the root with the newest journal
//!    generation and sequence among the valid ones. Each copy checks itself (CRC-32C, and the
//!    MAC or AEAD tag in an encrypted pool), so a damaged copy is never chosen.
//! 3. What open chose is said ([`Chosen::note`]); a writable open rewrites the other copy
//!    from the chosen one (damaged, missing in a pool made before the copies, or stale after
//!    a crash between the two writes) before it writes anything else.

use crate::io::write_file_atomically;
use crate::io::Dir;
use condense_format::error::{Error, Result};

/// The name of the second copy of the file `primary`.
pub fn copy_name(primary: &str) -> String {
    format!("{primary}.copy")
}

/// The most bytes read of a superblock or root file: a real one is a few hundred bytes plus
/// one bit per 64-byte unit of `meta.dat` (16 MiB names 8 TiB of metadata), so a larger file
/// is damage, not a reason to allocate.
const MAX_ROOT_FILE: u64 = 16 << 20;

/// Write `bytes` as both copies of `primary`: the primary first, then the copy.
pub fn write_both(dir: &dyn Dir, primary: &str, bytes: &[u8]) -> Result<()> {
    write_file_atomically(dir, primary, bytes)?;
    write_file_atomically(dir, &copy_name(primary), bytes)
}

/// Write `bytes` as both copies of `primary`, the copy first: for `init`, where the primary
/// superblock is the last file written (a directory holding it is a pool).
pub fn write_both_copy_first(dir: &dyn Dir, primary: &str, bytes: &[u8]) -> Result<()> {
    write_file_atomically(dir, &copy_name(primary), bytes)?;
    write_file_atomically(dir, primary, bytes)
}

/// Whether `dir` holds either copy of `primary`.
pub fn exists(dir: &dyn Dir, primary: &str) -> std::io::Result<bool> {
    Ok(dir.exists(primary)? || dir.exists(&copy_name(primary))?)
}

/// The two copies of one file as read, and which one open chose.
#[derive(Debug)]
pub struct Chosen<T> {
    /// The decoded contents of the chosen copy.
    pub value: T,
    /// The chosen copy's bytes.
    pub bytes: Vec<u8>,
    /// The file name of the chosen copy.
    pub name: String,
    /// The other copy's name, and why it was not chosen (`None`: it holds the same bytes).
    pub other: Option<(String, String)>,
}

impl<T> Chosen<T> {
    /// What an administrator should hear about this file: nothing when both copies agree.
    pub fn note(&self) -> Option<String> {
        let (other, why) = self.other.as_ref()?;
        Some(format!("{other} {why}; the pool opened with {}", self.name))
    }

    /// Rewrite the copy that was not chosen from the chosen one (a writable open).
    pub fn repair_other(&self, dir: &dyn Dir) -> Result<()> {
        match &self.other {
            Some((other, _)) => write_file_atomically(dir, other, &self.bytes),
            None => Ok(()),
        }
    }
}

/// One copy as found on disk.
enum Found<T> {
    Missing,
    Bad(Error),
    Good(T, Vec<u8>),
}

/// The bytes of copy `name` (`None`: no such file; `Err(damage)` for a file too large to be
/// one).
fn read_bytes(dir: &dyn Dir, name: &str) -> Result<Option<std::result::Result<Vec<u8>, Error>>> {
    let f = match dir.open(name, false) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(format!("opening {name}"), e)),
    };
    let len = f
        .len()
        .map_err(|e| Error::io(format!("reading {name}"), e))?;
    if len > MAX_ROOT_FILE {
        return Ok(Some(Err(Error::corrupt(
            name,
            format!("{len} bytes, more than any real one ({MAX_ROOT_FILE})"),
        ))));
    }
    let mut buf = vec![0u8; len as usize];
    f.read_at(&mut buf, 0)
        .map_err(|e| Error::io(format!("reading {name}"), e))?;
    Ok(Some(Ok(buf)))
}

fn check<T>(
    bytes: Option<std::result::Result<Vec<u8>, Error>>,
    decode: &mut impl FnMut(&[u8]) -> Result<T>,
) -> Result<Found<T>> {
    let bytes = match bytes {
        None => return Ok(Found::Missing),
        Some(Err(e)) => return Ok(Found::Bad(e)),
        Some(Ok(b)) => b,
    };
    Ok(match decode(&bytes) {
        Ok(v) => Found::Good(v, bytes),
        // Damage (a flipped bit in the version field reads as another version), or (in an
        // encrypted pool) bytes that do not authenticate: the other copy may be whole. Any
        // other error (a wrong key, I/O) is the answer for both copies.
        Err(
            e @ (Error::Corrupt { .. }
            | Error::Checksum { .. }
            | Error::Auth { .. }
            | Error::Version { .. }),
        ) => Found::Bad(e),
        Err(e) => return Err(e),
    })
}

fn why(found: &Found<impl Sized>) -> String {
    match found {
        Found::Missing => "is missing".into(),
        Found::Bad(e) => format!("is damaged ({e})"),
        Found::Good(..) => "is older".into(),
    }
}

/// Read both copies of `primary` and choose one. `decode` checks a copy completely (for the
/// superblock: decoding and, in an encrypted pool, its MAC) and runs once when both copies
/// hold the same bytes; `newer` says whether the first value is newer than the second (both
/// valid, different bytes). An I/O error `NotFound` when neither copy exists; else the
/// primary's error when neither is valid.
pub fn read_both<T>(
    dir: &dyn Dir,
    primary: &str,
    mut decode: impl FnMut(&[u8]) -> Result<T>,
    newer: impl Fn(&T, &T) -> bool,
) -> Result<Chosen<T>> {
    let copy = copy_name(primary);
    let bytes_a = read_bytes(dir, primary)?;
    let bytes_b = read_bytes(dir, &copy)?;
    let same = matches!((&bytes_a, &bytes_b), (Some(Ok(a)), Some(Ok(b))) if a == b);
    let a = check(bytes_a, &mut decode)?;
    let chosen = |value, bytes, name: &str, other: Option<(String, String)>| Chosen {
        value,
        bytes,
        name: name.to_string(),
        other,
    };
    if same {
        return match a {
            Found::Good(v, b) => Ok(chosen(v, b, primary, None)),
            Found::Bad(e) => Err(e),
            Found::Missing => unreachable!("both copies were read"),
        };
    }
    let b = check(bytes_b, &mut decode)?;
    match (a, b) {
        (Found::Good(va, ba), Found::Good(vb, bb)) => {
            if newer(&vb, &va) {
                Ok(chosen(
                    vb,
                    bb,
                    &copy,
                    Some((primary.into(), "is older".into())),
                ))
            } else if newer(&va, &vb) {
                Ok(chosen(va, ba, primary, Some((copy, "is older".into()))))
            } else {
                // Neither is newer (a superblock has no age): the primary is used.
                let why = format!("differs from {primary}, though both are valid");
                Ok(chosen(va, ba, primary, Some((copy, why))))
            }
        }
        (Found::Good(va, ba), other) => {
            let w = why(&other);
            Ok(chosen(va, ba, primary, Some((copy, w))))
        }
        (other, Found::Good(vb, bb)) => {
            let w = why(&other);
            Ok(chosen(vb, bb, &copy, Some((primary.into(), w))))
        }
        (Found::Bad(e), _) | (Found::Missing, Found::Bad(e)) => Err(e),
        (Found::Missing, Found::Missing) => Err(Error::io(
            format!("opening {primary}"),
            std::io::Error::from(std::io::ErrorKind::NotFound),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::{SimDir, SimHandle};

    fn decode(b: &[u8]) -> Result<u64> {
        let (&sum, body) = b.split_last().ok_or_else(|| Error::corrupt("t", "empty"))?;
        if body.iter().fold(0u8, |s, x| s.wrapping_add(*x)) != sum {
            return Err(Error::corrupt("t", "checksum"));
        }
        Ok(body.first().copied().unwrap_or(0).into())
    }

    fn encode(v: u8) -> Vec<u8> {
        vec![v, 7, v.wrapping_add(7)]
    }

    fn read(dir: &SimHandle) -> Result<Chosen<u64>> {
        read_both(dir, "f", decode, |a, b| a > b)
    }

    #[test]
    fn either_copy_alone_opens_and_the_other_is_named() -> Result<()> {
        let dir = SimHandle(SimDir::new());
        write_both(&dir, "f", &encode(3))?;
        let c = read(&dir)?;
        assert_eq!((c.value, c.name.as_str(), c.note()), (3, "f", None));

        // The primary damaged: the copy is used, the note names the damage, repair mends it.
        write_file_atomically(&dir, "f", &[3, 7, 0])?;
        let c = read(&dir)?;
        assert_eq!((c.value, c.name.as_str()), (3, "f.copy"));
        assert!(
            c.note().is_some_and(|n| n.contains("f is damaged")),
            "{c:?}"
        );
        c.repair_other(&dir)?;
        assert!(read(&dir)?.other.is_none());

        // The copy missing (a pool made before copies): the primary, and the copy is named.
        dir.remove("f.copy").map_err(|e| Error::io("rm", e))?;
        let c = read(&dir)?;
        assert_eq!(c.name, "f");
        assert!(c.note().is_some_and(|n| n.contains("f.copy is missing")));
        c.repair_other(&dir)?;
        assert!(read(&dir)?.other.is_none());
        Ok(())
    }

    #[test]
    fn the_newer_valid_copy_wins_and_both_damaged_is_an_error() -> Result<()> {
        let dir = SimHandle(SimDir::new());
        write_both(&dir, "f", &encode(3))?;
        // A crash between the two writes of a newer version: the newer one is chosen,
        // whichever copy holds it.
        write_file_atomically(&dir, "f.copy", &encode(4))?;
        let c = read(&dir)?;
        assert_eq!((c.value, c.name.as_str()), (4, "f.copy"));
        assert!(c.note().is_some_and(|n| n.contains("f is older")));
        write_file_atomically(&dir, "f", &encode(5))?;
        assert_eq!(read(&dir)?.value, 5);

        write_file_atomically(&dir, "f", &[1, 1, 1])?;
        write_file_atomically(&dir, "f.copy", &[2, 2, 2])?;
        assert!(matches!(read(&dir), Err(Error::Corrupt { .. })));
        dir.remove("f").map_err(|e| Error::io("rm", e))?;
        dir.remove("f.copy").map_err(|e| Error::io("rm", e))?;
        assert!(matches!(read(&dir), Err(Error::Io { .. })));
        assert!(!exists(&dir, "f").map_err(|e| Error::io("exists", e))?);
        Ok(())
    }
}

//! Encodings of the file tree's metadata records, kept in the pool with `Catalog::meta_put`.
//!
//! Every record is explicit little-endian, starts with a two-byte magic and a format version,
//! and is parsed strictly: a record of the wrong length, with an unknown magic, version or kind
//! is [`FormatError`], never a panic. The layout is documented in `crates/fuse/FORMAT.md`.
//!
//! | key              | value                                                        |
//! |------------------|--------------------------------------------------------------|
//! | `fs/super`       | [`Super`]: magic `CS`, version, next free inode number        |
//! | `fs/ino/<n>`     | [`InodeRec`]: magic `CI`, version, kind, mode, owner, length, times, symlink target |
//! | `fs/dir/<n>`     | [`DirRec`]: magic `CD`, version, entries (inode, name)        |
//!
//! The content of regular file `<n>` lives in the hidden volume `.file.<n>`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Version written into every record; readers refuse any other.
pub const FORMAT_VERSION: u8 = 1;

const MAGIC_SUPER: [u8; 2] = *b"CS";
const MAGIC_INODE: [u8; 2] = *b"CI";
const MAGIC_DIR: [u8; 2] = *b"CD";

/// Longest name of a directory entry, in bytes (what statfs reports as `namelen`).
pub const NAME_BYTES_MAX: usize = 255;
/// Longest symbolic link target, in bytes.
pub const SYMLINK_TARGET_BYTES_MAX: usize = 4095;

const _: () = assert!(NAME_BYTES_MAX <= u16::MAX as usize);
const _: () = assert!(SYMLINK_TARGET_BYTES_MAX <= u16::MAX as usize);

/// A record that cannot be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("file tree record {key:?} is damaged: {what}")]
pub struct FormatError {
    pub key: String,
    pub what: String,
}

fn err(key: &str, what: impl Into<String>) -> FormatError {
    FormatError {
        key: key.to_string(),
        what: what.into(),
    }
}

/// Key of the superblock record.
pub const SUPER_KEY: &str = "fs/super";

/// Key of the inode record of inode `ino`.
pub fn inode_key(ino: u64) -> String {
    format!("fs/ino/{ino}")
}

/// Key of the directory record of directory inode `ino`.
pub fn dir_key(ino: u64) -> String {
    format!("fs/dir/{ino}")
}

/// Name of the hidden volume holding the content of regular file `ino`.
pub fn file_volume_name(ino: u64) -> String {
    format!(".file.{ino}")
}

/// The inode number in a hidden file volume's name, if `name` is one.
pub fn parse_file_volume_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix(".file.")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// A little-endian reader that reports short input instead of panicking.
struct Reader<'a> {
    key: &'a str,
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn new(key: &'a str, buf: &'a [u8]) -> Self {
        Reader { key, buf, pos: 0 }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], FormatError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| {
                err(
                    self.key,
                    format!("truncated at byte {} (need {n} more)", self.pos),
                )
            })?;
        let out = &self.buf[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], FormatError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, FormatError> {
        Ok(self.array::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, FormatError> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32, FormatError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, FormatError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn i64(&mut self) -> Result<i64, FormatError> {
        Ok(i64::from_le_bytes(self.array()?))
    }

    fn header(&mut self, magic: [u8; 2]) -> Result<(), FormatError> {
        let got: [u8; 2] = self.array()?;
        if got != magic {
            return Err(err(self.key, format!("magic {got:?}, expected {magic:?}")));
        }
        let version = self.u8()?;
        if version != FORMAT_VERSION {
            return Err(err(
                self.key,
                format!("format version {version}, this build reads {FORMAT_VERSION}"),
            ));
        }
        Ok(())
    }

    fn finish(self) -> Result<(), FormatError> {
        if self.pos != self.buf.len() {
            return Err(err(
                self.key,
                format!("{} trailing bytes", self.buf.len() - self.pos),
            ));
        }
        Ok(())
    }
}

/// The superblock of the file tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Super {
    /// Inode numbers below this one may have been handed out; allocation continues here.
    pub next_ino: u64,
}

impl Super {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(11);
        out.extend_from_slice(&MAGIC_SUPER);
        out.push(FORMAT_VERSION);
        out.extend_from_slice(&self.next_ino.to_le_bytes());
        out
    }

    pub fn decode(key: &str, buf: &[u8]) -> Result<Self, FormatError> {
        let mut r = Reader::new(key, buf);
        r.header(MAGIC_SUPER)?;
        let next_ino = r.u64()?;
        r.finish()?;
        Ok(Super { next_ino })
    }
}

/// What an inode is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Dir,
    File,
    Symlink,
}

impl Kind {
    fn code(self) -> u8 {
        match self {
            Kind::Dir => 1,
            Kind::File => 2,
            Kind::Symlink => 3,
        }
    }
    fn from_code(key: &str, code: u8) -> Result<Self, FormatError> {
        match code {
            1 => Ok(Kind::Dir),
            2 => Ok(Kind::File),
            3 => Ok(Kind::Symlink),
            other => Err(err(key, format!("unknown inode kind {other}"))),
        }
    }
}

/// A point in time as seconds and nanoseconds since the Unix epoch (negative before it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Timestamp {
    pub secs: i64,
    pub nanos: u32,
}

impl Timestamp {
    pub fn now() -> Self {
        Self::from_system(SystemTime::now())
    }

    pub fn from_system(t: SystemTime) -> Self {
        match t.duration_since(UNIX_EPOCH) {
            Ok(d) => Timestamp {
                secs: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
                nanos: d.subsec_nanos(),
            },
            Err(e) => {
                // Before the epoch: floor to whole seconds, keep nanos positive.
                let d = e.duration();
                let mut secs = -i64::try_from(d.as_secs()).unwrap_or(i64::MAX);
                let mut nanos = d.subsec_nanos();
                if nanos > 0 {
                    secs -= 1;
                    nanos = 1_000_000_000 - nanos;
                }
                Timestamp { secs, nanos }
            }
        }
    }

    pub fn to_system(self) -> SystemTime {
        let nanos = Duration::from_nanos(u64::from(self.nanos));
        if self.secs >= 0 {
            UNIX_EPOCH + Duration::from_secs(self.secs.unsigned_abs()) + nanos
        } else {
            UNIX_EPOCH - Duration::from_secs(self.secs.unsigned_abs()) + nanos
        }
    }
}

/// The attributes of one inode of the file tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InodeRec {
    pub kind: Kind,
    /// Permission bits (`0o7777`), without the file type.
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Exact length in bytes (a file's content, a symlink's target; 0 for directories).
    pub size: u64,
    pub atime: Timestamp,
    pub mtime: Timestamp,
    pub ctime: Timestamp,
    /// Target of a symbolic link; empty for other kinds.
    pub target: Vec<u8>,
}

impl InodeRec {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.target.len());
        out.extend_from_slice(&MAGIC_INODE);
        out.push(FORMAT_VERSION);
        out.push(self.kind.code());
        out.extend_from_slice(&self.mode.to_le_bytes());
        out.extend_from_slice(&self.uid.to_le_bytes());
        out.extend_from_slice(&self.gid.to_le_bytes());
        out.extend_from_slice(&self.size.to_le_bytes());
        for t in [self.atime, self.mtime, self.ctime] {
            out.extend_from_slice(&t.secs.to_le_bytes());
            out.extend_from_slice(&t.nanos.to_le_bytes());
        }
        // Bounded by SYMLINK_TARGET_BYTES_MAX when the link was made.
        let len = u16::try_from(self.target.len()).unwrap_or(u16::MAX);
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&self.target[..usize::from(len)]);
        out
    }

    pub fn decode(key: &str, buf: &[u8]) -> Result<Self, FormatError> {
        let mut r = Reader::new(key, buf);
        r.header(MAGIC_INODE)?;
        let kind = Kind::from_code(key, r.u8()?)?;
        let mode = r.u32()?;
        if mode & !0o7777 != 0 {
            return Err(err(key, format!("mode {mode:#o} has bits outside 0o7777")));
        }
        let uid = r.u32()?;
        let gid = r.u32()?;
        let size = r.u64()?;
        let mut times = [Timestamp::default(); 3];
        for t in &mut times {
            let secs = r.i64()?;
            let nanos = r.u32()?;
            if nanos >= 1_000_000_000 {
                return Err(err(key, format!("timestamp nanoseconds {nanos}")));
            }
            *t = Timestamp { secs, nanos };
        }
        let len = usize::from(r.u16()?);
        if len > SYMLINK_TARGET_BYTES_MAX {
            return Err(err(key, format!("symlink target of {len} bytes")));
        }
        let target = r.take(len)?.to_vec();
        r.finish()?;
        if kind != Kind::Symlink && !target.is_empty() {
            return Err(err(key, "a non-symlink inode has a link target"));
        }
        Ok(InodeRec {
            kind,
            mode,
            uid,
            gid,
            size,
            atime: times[0],
            mtime: times[1],
            ctime: times[2],
            target,
        })
    }
}

/// The entries of one directory: (name, inode), names unique, each 1..=255 bytes, no '/' or NUL.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DirRec {
    pub entries: Vec<(Vec<u8>, u64)>,
}

/// True when `name` may be a directory entry.
pub fn valid_name(name: &[u8]) -> bool {
    !name.is_empty()
        && name.len() <= NAME_BYTES_MAX
        && name != b"."
        && name != b".."
        && !name.iter().any(|&b| b == b'/' || b == 0)
}

impl DirRec {
    pub fn encode(&self) -> Vec<u8> {
        let bytes: usize = self.entries.iter().map(|(n, _)| n.len() + 10).sum();
        let mut out = Vec::with_capacity(7 + bytes);
        out.extend_from_slice(&MAGIC_DIR);
        out.push(FORMAT_VERSION);
        let count = u32::try_from(self.entries.len()).unwrap_or(u32::MAX);
        out.extend_from_slice(&count.to_le_bytes());
        for (name, ino) in self.entries.iter().take(count as usize) {
            out.extend_from_slice(&ino.to_le_bytes());
            // Names are checked with `valid_name` before they enter a directory.
            let len = u16::try_from(name.len()).unwrap_or(u16::MAX);
            out.extend_from_slice(&len.to_le_bytes());
            out.extend_from_slice(&name[..usize::from(len).min(name.len())]);
        }
        out
    }

    pub fn decode(key: &str, buf: &[u8]) -> Result<Self, FormatError> {
        let mut r = Reader::new(key, buf);
        r.header(MAGIC_DIR)?;
        let count = r.u32()? as usize;
        // Each entry takes at least 11 bytes: bound the allocation by the input.
        if count > buf.len() / 11 {
            return Err(err(key, format!("{count} entries in {} bytes", buf.len())));
        }
        let mut entries = Vec::with_capacity(count);
        let mut seen = std::collections::HashSet::with_capacity(count);
        for i in 0..count {
            let ino = r.u64()?;
            let len = usize::from(r.u16()?);
            let name = r.take(len)?.to_vec();
            if !valid_name(&name) {
                return Err(err(key, format!("entry {i} has an invalid name")));
            }
            if !seen.insert(name.clone()) {
                return Err(err(key, format!("entry {i} repeats a name")));
            }
            entries.push((name, ino));
        }
        r.finish()?;
        Ok(DirRec { entries })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_inode(kind: Kind, target: &[u8]) -> InodeRec {
        InodeRec {
            kind,
            mode: 0o4755,
            uid: 1000,
            gid: 100,
            size: 123_456_789_012,
            atime: Timestamp { secs: -5, nanos: 7 },
            mtime: Timestamp {
                secs: 1_700_000_000,
                nanos: 999_999_999,
            },
            ctime: Timestamp { secs: 0, nanos: 0 },
            target: target.to_vec(),
        }
    }

    #[test]
    fn inode_round_trip_and_every_truncation_is_an_error() {
        for rec in [
            sample_inode(Kind::File, b""),
            sample_inode(Kind::Dir, b""),
            sample_inode(Kind::Symlink, b"../some/where"),
        ] {
            let bytes = rec.encode();
            assert_eq!(InodeRec::decode("k", &bytes), Ok(rec.clone()));
            for cut in 0..bytes.len() {
                assert!(InodeRec::decode("k", &bytes[..cut]).is_err(), "cut {cut}");
            }
            let mut longer = bytes.clone();
            longer.push(0);
            assert!(InodeRec::decode("k", &longer).is_err());
        }
    }

    #[test]
    fn inode_rejects_bad_magic_version_kind_mode() {
        let good = sample_inode(Kind::File, b"").encode();
        for (at, value) in [(0, b'X'), (2, 2), (3, 9), (6, 0xff)] {
            let mut bad = good.clone();
            bad[at] = value;
            assert!(InodeRec::decode("k", &bad).is_err(), "byte {at} = {value}");
        }
    }

    #[test]
    fn dir_round_trip_and_rejections() {
        let rec = DirRec {
            entries: vec![
                (b"a".to_vec(), 5),
                (vec![b'x'; NAME_BYTES_MAX], 6),
                (vec![0xff, 0xfe], 7),
            ],
        };
        let bytes = rec.encode();
        assert_eq!(DirRec::decode("d", &bytes), Ok(rec));
        for cut in 0..bytes.len() {
            assert!(DirRec::decode("d", &bytes[..cut]).is_err(), "cut {cut}");
        }
        let dup = DirRec {
            entries: vec![(b"a".to_vec(), 1), (b"a".to_vec(), 2)],
        };
        assert!(DirRec::decode("d", &dup.encode()).is_err());
        let slash = DirRec {
            entries: vec![(b"a/b".to_vec(), 1)],
        };
        assert!(DirRec::decode("d", &slash.encode()).is_err());
        // A huge count with no entries behind it is refused before allocating.
        let mut huge = DirRec::default().encode();
        huge[3..7].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(DirRec::decode("d", &huge).is_err());
    }

    #[test]
    fn super_round_trip() {
        let s = Super { next_ino: 1 << 40 };
        assert_eq!(Super::decode("s", &s.encode()), Ok(s));
        assert!(Super::decode("s", &s.encode()[..10]).is_err());
    }

    #[test]
    fn timestamps_round_trip_through_system_time() {
        for t in [
            Timestamp { secs: 0, nanos: 0 },
            Timestamp {
                secs: 1_700_000_000,
                nanos: 5,
            },
            Timestamp {
                secs: -10,
                nanos: 500,
            },
        ] {
            assert_eq!(Timestamp::from_system(t.to_system()), t);
        }
    }

    #[test]
    fn file_volume_names() {
        assert_eq!(parse_file_volume_name(&file_volume_name(42)), Some(42));
        assert_eq!(parse_file_volume_name(".file."), None);
        assert_eq!(parse_file_volume_name(".file.4x"), None);
        assert_eq!(parse_file_volume_name("file.4"), None);
        assert!(valid_name(b"ok"));
        assert!(!valid_name(b".."));
        assert!(!valid_name(&[b'a'; NAME_BYTES_MAX + 1]));
    }
}

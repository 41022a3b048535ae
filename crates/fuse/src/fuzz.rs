//! Entry point of the fuzz target `fuse_records` (`fuzz/fuzz_targets/`): the file tree's
//! metadata records ([`crate::format`]) as the pool hands them back, which a damaged or
//! hostile pool controls. What decodes must encode to the same bytes, and its times must
//! convert to the `SystemTime`s the mount reports without panicking.

use crate::format::{DirRec, InodeRec, Super};

/// A record (selector byte: 0 superblock, 1 inode, 2 directory; then the record's bytes).
/// Returns whether it decoded.
pub fn records(data: &[u8]) -> bool {
    let Some((&sel, buf)) = data.split_first() else {
        return false;
    };
    match sel % 3 {
        0 => Super::decode("fs/super", buf).is_ok_and(|s| {
            assert_eq!(s.encode(), buf, "superblock record round trip");
            true
        }),
        1 => InodeRec::decode("fs/ino/1", buf).is_ok_and(|i| {
            assert_eq!(i.encode(), buf, "inode record round trip");
            for t in [i.atime, i.mtime, i.ctime] {
                let _ = t.to_system();
            }
            true
        }),
        _ => DirRec::decode("fs/dir/1", buf).is_ok_and(|d| {
            assert_eq!(d.encode(), buf, "directory record round trip");
            true
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{Kind, Timestamp};

    /// Seeds of `fuse_records`: records of every kind as the mount writes them. They decode,
    /// and `FUZZ_SEEDS_OUT=DIR` writes them to `DIR/fuse_records/` (fuzz/seeds).
    #[test]
    fn fuzz_seeds_decode() -> std::io::Result<()> {
        let inode = |kind, target: &[u8]| InodeRec {
            kind,
            mode: 0o644,
            uid: 1000,
            gid: 1000,
            size: target.len() as u64,
            atime: Timestamp {
                secs: 1_764_000_000,
                nanos: 5,
            },
            mtime: Timestamp { secs: -3, nanos: 0 },
            ctime: Timestamp::default(),
            target: target.to_vec(),
        };
        let seeds: Vec<(&str, u8, Vec<u8>)> = vec![
            ("super", 0, Super { next_ino: 42 }.encode()),
            ("file", 1, inode(Kind::File, b"").encode()),
            (
                "symlink",
                1,
                inode(Kind::Symlink, b"../vm/disk.raw").encode(),
            ),
            (
                "dir",
                2,
                DirRec {
                    entries: vec![(b"a".to_vec(), 2), (b"images".to_vec(), 7)],
                }
                .encode(),
            ),
        ];
        let out = std::env::var_os("FUZZ_SEEDS_OUT").map(std::path::PathBuf::from);
        for (name, sel, bytes) in seeds {
            let mut v = vec![sel];
            v.extend_from_slice(&bytes);
            assert!(records(&v), "seed {name} does not decode");
            if let Some(out) = &out {
                let dir = out.join("fuse_records");
                std::fs::create_dir_all(&dir)?;
                std::fs::write(dir.join(name), &v)?;
            }
        }
        Ok(())
    }
}

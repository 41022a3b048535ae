//! Files that hold secrets: key files, passphrase files, S3 credentials, TLS keys and PSKs.
//!
//! Owns: the one rule every secret file is read under (docs/SECURITY.md), as ssh applies it to
//! private keys: the file must be a regular file, readable and writable by its owner only (no
//! group or other permission bits), owned by the user who runs Condense or by root, and small
//! (at most [`MAX_BYTES`]). A file that breaks the rule is refused with the command that fixes
//! it; it is never read. The bytes come back in a buffer that is wiped when dropped.
//!
//! Invariant: the checks are made on the open descriptor (`fstat`), not on the path, so the
//! file checked is the file read.

use condense_format::error::{Error, Result};
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use zeroize::Zeroizing;

/// The largest secret file read (a key, a passphrase, a few credentials or PSK lines).
pub const MAX_BYTES: u64 = 64 * 1024;

/// Read the secret file `path`; `what` names it in errors ("key file", "credentials file").
pub fn read(path: &Path, what: &str) -> Result<Zeroizing<Vec<u8>>> {
    let shown = path.display();
    let f =
        std::fs::File::open(path).map_err(|e| Error::io(format!("reading {what} {shown}"), e))?;
    let meta = f
        .metadata()
        .map_err(|e| Error::io(format!("reading {what} {shown}"), e))?;
    check(&meta, path, what)?;
    let mut buf = Zeroizing::new(Vec::with_capacity(meta.len().min(MAX_BYTES) as usize));
    f.take(MAX_BYTES + 1)
        .read_to_end(&mut buf)
        .map_err(|e| Error::io(format!("reading {what} {shown}"), e))?;
    if buf.len() as u64 > MAX_BYTES {
        return Err(Error::Invalid(format!(
            "{what} {shown} is larger than {MAX_BYTES} bytes: it is not a {what}"
        )));
    }
    Ok(buf)
}

/// The permission and ownership rule of [`read`], on the metadata of an open file.
pub fn check(meta: &std::fs::Metadata, path: &Path, what: &str) -> Result<()> {
    let shown = path.display();
    if !meta.is_file() {
        return Err(Error::Invalid(format!(
            "{what} {shown} is not a regular file"
        )));
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(Error::Invalid(format!(
            "{what} {shown} is accessible by other users (mode {mode:04o}): a secret must be \
             readable by its owner only; run `chmod 600 {shown}`"
        )));
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me && meta.uid() != 0 {
        return Err(Error::Invalid(format!(
            "{what} {shown} belongs to user id {}, not to the user running condense ({me}) \
             or root: another user could change it; run `chown {me} {shown}`",
            meta.uid()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn owner_only_files_are_read_and_others_refused_with_the_fix() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", e))?;
        let p = dir.path().join("key");
        std::fs::write(&p, b"secret").map_err(|e| Error::io("write", e))?;
        let set = |mode| std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode));
        set(0o600).map_err(|e| Error::io("chmod", e))?;
        assert_eq!(&read(&p, "key file")?[..], b"secret");
        set(0o400).map_err(|e| Error::io("chmod", e))?;
        assert_eq!(&read(&p, "key file")?[..], b"secret");
        for mode in [0o644, 0o640, 0o604, 0o660, 0o602] {
            set(mode).map_err(|e| Error::io("chmod", e))?;
            let err = read(&p, "key file").err().map(|e| e.to_string());
            assert!(
                err.as_deref().is_some_and(|e| e.contains("chmod 600")),
                "mode {mode:o}: {err:?}"
            );
        }
        set(0o600).map_err(|e| Error::io("chmod", e))?;
        std::fs::write(&p, vec![b'x'; MAX_BYTES as usize + 1]).map_err(|e| Error::io("w", e))?;
        assert!(
            read(&p, "key file").is_err(),
            "an oversized file is refused"
        );
        assert!(
            read(dir.path(), "key file").is_err(),
            "a directory is refused"
        );
        Ok(())
    }
}

//! Volume and snapshot names: what NBD export names and file names can both carry. A
//! snapshot is named `VOLUME@SNAPSHOT`, so `@` is refused in new names.

use crate::error::{Error, Result};

/// Check a volume name: what NBD export names and file names can both carry.
pub fn check_volume_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 255
        && name != "."
        && name != ".."
        && !name.chars().any(|c| c == '/' || c.is_control());
    if ok {
        Ok(())
    } else {
        Err(Error::Invalid(format!(
            "invalid volume name {name:?}: use 1 to 255 bytes, no '/' or control characters"
        )))
    }
}

/// [`check_volume_name`] for a new volume or snapshot part: `@` separates a volume from
/// its snapshot, so it may not appear in either.
pub fn check_new_volume_name(name: &str) -> Result<()> {
    check_volume_name(name)?;
    if name.contains('@') {
        return Err(Error::Invalid(format!(
            "invalid name {name:?}: '@' separates a volume from its snapshot (VOLUME@SNAPSHOT)"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_nbd_and_files_can_carry() {
        for ok in ["vm", "db-1.img", "a b", &"x".repeat(255)] {
            assert!(check_new_volume_name(ok).is_ok(), "{ok:?}");
        }
        for bad in ["", ".", "..", "a/b", "a\nb", &"x".repeat(256)] {
            assert!(check_volume_name(bad).is_err(), "{bad:?}");
        }
        assert!(check_volume_name("vm@snap").is_ok());
        assert!(check_new_volume_name("vm@snap").is_err());
    }
}

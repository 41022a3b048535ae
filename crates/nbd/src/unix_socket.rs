//! Listening Unix sockets that only their owner, or one group besides, can connect to.
//!
//! Connecting to a Unix socket needs write permission on its file, which bind(2) creates with
//! the mode of the unbound socket less the umask. [`bind`] sets that mode on the socket before
//! bind (an `fchmod` of the unbound socket, which Linux carries to the file), so the file is
//! born 0600 whatever the umask. A group ([`Access::Group`]) is given the file (`lchown`, then
//! mode 0660) after bind but before listen(2): until listen every connection is refused, so
//! there is no moment at which anyone outside the owner, root and that group can connect.
//!
//! Used for the NBD server's sockets and for the CLI's control socket.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::Path;

/// Longest socket path, in bytes: `sun_path` of `struct sockaddr_un` holds 108 bytes with the
/// terminating NUL.
pub const PATH_BYTES_MAX: usize = 107;

/// Connections the kernel queues before they are accepted.
const BACKLOG: i32 = 1024;

/// Who may connect.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Access {
    /// The socket's owner (and root): mode 0600.
    #[default]
    Owner,
    /// The owner and the members of this group (gid): mode 0660, group-owned by it.
    Group(u32),
}

impl Access {
    /// The socket file's mode.
    pub fn mode(self) -> u32 {
        match self {
            Access::Owner => 0o600,
            Access::Group(_) => 0o660,
        }
    }
}

/// Whether `path` fits in a socket address ([`PATH_BYTES_MAX`]).
pub fn path_fits(path: &Path) -> bool {
    path.as_os_str().len() <= PATH_BYTES_MAX
}

/// Create the socket file `path` (which must not exist) with `access` and listen on it.
pub fn bind(path: &Path, access: Access) -> io::Result<UnixListener> {
    use socket2::{Domain, SockAddr, Socket, Type};
    if !path_fits(path) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "the socket path is {} bytes long; a Unix socket path holds at most {PATH_BYTES_MAX}",
                path.as_os_str().len()
            ),
        ));
    }
    let socket = Socket::new(Domain::UNIX, Type::STREAM, None)?;
    // SAFETY: fchmod on a descriptor we own; no memory is involved.
    if unsafe { libc::fchmod(socket.as_raw_fd(), Access::Owner.mode()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    socket.bind(&SockAddr::unix(path)?)?;
    let given = restrict(path, access);
    if given.is_err() {
        let _ = std::fs::remove_file(path);
    }
    given?;
    socket.listen(BACKLOG)?;
    Ok(socket.into())
}

/// Give the just-bound socket file at `path` the mode (and group) of `access`.
fn restrict(path: &Path, access: Access) -> io::Result<()> {
    let meta = std::fs::symlink_metadata(path)?;
    if !meta.file_type().is_socket() {
        return Err(io::Error::other(format!(
            "{} was replaced by something other than the socket just created",
            path.display()
        )));
    }
    if let Access::Group(gid) = access {
        std::os::unix::fs::lchown(path, None, Some(gid))?;
    }
    if meta.permissions().mode() & 0o777 != access.mode() {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(access.mode()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn sockets_are_born_owner_only_and_groups_get_0660() -> io::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("s.sock");
        let l = bind(&path, Access::Owner)?;
        assert_eq!(std::fs::metadata(&path)?.mode() & 0o777, 0o600);
        std::os::unix::net::UnixStream::connect(&path)?;
        drop(l);
        std::fs::remove_file(&path)?;
        // SAFETY: getgid cannot fail.
        let gid = unsafe { libc::getgid() };
        let _l = bind(&path, Access::Group(gid))?;
        let meta = std::fs::metadata(&path)?;
        assert_eq!((meta.mode() & 0o777, meta.gid()), (0o660, gid));
        Ok(())
    }

    #[test]
    fn a_path_too_long_for_a_socket_is_refused_with_its_length() -> io::Result<()> {
        let long = Path::new("/tmp").join("x".repeat(PATH_BYTES_MAX));
        let Err(e) = bind(&long, Access::Owner) else {
            panic!("a {}-byte socket path was accepted", long.as_os_str().len());
        };
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert!(e.to_string().contains("at most 107"), "{e}");
        Ok(())
    }
}

//! The systemd readiness protocol (`sd_notify`), without libsystemd.
//!
//! When systemd (or anything else) starts `serve` or `mount` with `$NOTIFY_SOCKET` set, this
//! module sends newline-separated `KEY=VALUE` states in one datagram to that Unix socket:
//! `READY=1` once the pool is open and every listener is bound (serve) or the mount is live
//! (mount), `STOPPING=1` when a signal starts the clean stop. A name starting with `@` is a
//! Linux abstract socket. Without `$NOTIFY_SOCKET` nothing is sent. A failure to notify is a
//! warning, never fatal: the service keeps running (systemd then reports the start timeout).

use std::os::unix::net::UnixDatagram;

/// Send `state` (e.g. `READY=1\nSTATUS=serving`) to `$NOTIFY_SOCKET`, if it is set.
pub fn notify(state: &str) {
    let Some(target) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    if let Err(e) = send(&target.to_string_lossy(), state) {
        eprintln!(
            "condense: warning: cannot notify the service manager at NOTIFY_SOCKET={} ({e}); \
             it may consider the service not started",
            target.to_string_lossy()
        );
    }
}

/// `READY=1` with a status line and our pid.
pub fn ready(status: &str) {
    notify(&format!(
        "READY=1\nSTATUS={status}\nMAINPID={}",
        std::process::id()
    ));
}

/// `STOPPING=1` with a status line.
pub fn stopping(status: &str) {
    notify(&format!("STOPPING=1\nSTATUS={status}"));
}

fn send(target: &str, state: &str) -> std::io::Result<()> {
    let sock = UnixDatagram::unbound()?;
    if let Some(name) = target.strip_prefix('@') {
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
        sock.send_to_addr(state.as_bytes(), &addr)?;
    } else {
        sock.send_to(state.as_bytes(), target)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sends_one_datagram_to_a_path_and_to_an_abstract_name() -> std::io::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("notify.sock");
        let listener = UnixDatagram::bind(&path)?;
        send(&path.to_string_lossy(), "READY=1\nSTATUS=x")?;
        let mut buf = [0u8; 256];
        let n = listener.recv(&mut buf)?;
        assert_eq!(&buf[..n], b"READY=1\nSTATUS=x");

        use std::os::linux::net::SocketAddrExt;
        let name = format!("condense-notify-test-{}", std::process::id());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
        let abstract_listener = UnixDatagram::bind_addr(&addr)?;
        send(&format!("@{name}"), "STOPPING=1")?;
        let n = abstract_listener.recv(&mut buf)?;
        assert_eq!(&buf[..n], b"STOPPING=1");
        Ok(())
    }
}

//! The control socket: how CLI commands act on a pool that a daemon (`serve`, `mount`) holds.
//!
//! The daemon binds `POOL/control.sock` (mode 0600) and answers one request per connection:
//! a JSON line `{"argv": [...]}` (the words after the program name, `--pool` made absolute),
//! answered by one JSON line `{"stdout": "...", "stderr": "...", "code": N}`. The daemon runs
//! the command exactly as the CLI would, on the pool it holds, so output and exit status are the
//! same either way. Only the peer's own uid (or root) is served (SO_PEERCRED).
//!
//! The client side ([`forward`]) is tried first by the commands that can run through it
//! ([`Routed`]): when the socket exists and answers, its reply is printed; when nobody
//! listens (a daemon that was killed), the command opens the pool directly.

use anyhow::{bail, Context, Result};
use condense_engine::Pool;
use serde_json::{json, Value};
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// The control socket's file name inside the pool directory.
pub const SOCKET_NAME: &str = "control.sock";

/// Longest request accepted (a command line; anything longer is refused).
const MAX_REQUEST: u64 = 1 << 20;

/// How long the daemon waits for a connected client to send its request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// Where a command's output goes and where its pool comes from: opened by the command itself
/// (closed at its end), or the pool a daemon holds (flushed, never closed, by a command).
pub struct Ctx<'a> {
    pub out: &'a mut dyn Write,
    pub err: &'a mut dyn Write,
    /// The pool directory, as the user named it (for messages and direct opens).
    pub path: PathBuf,
    held: Option<Arc<Pool>>,
}

impl<'a> Ctx<'a> {
    /// A command run by the CLI itself, opening the pool at `path`.
    pub fn direct(path: &Path, out: &'a mut dyn Write, err: &'a mut dyn Write) -> Ctx<'a> {
        Ctx {
            out,
            err,
            path: path.to_path_buf(),
            held: None,
        }
    }

    /// A command run inside the daemon that holds `pool`.
    pub fn held(
        path: &Path,
        pool: Arc<Pool>,
        out: &'a mut dyn Write,
        err: &'a mut dyn Write,
    ) -> Ctx<'a> {
        Ctx {
            out,
            err,
            path: path.to_path_buf(),
            held: Some(pool),
        }
    }

    /// True inside the daemon (no progress bars, no terminal).
    pub fn in_daemon(&self) -> bool {
        self.held.is_some()
    }

    /// The pool: the held one, or opened now (read-only if `read_only`).
    pub fn pool(&self, read_only: bool) -> Result<Arc<Pool>> {
        match &self.held {
            Some(p) => Ok(p.clone()),
            None => crate::open_pool(&self.path, read_only),
        }
    }

    /// End a command's use of `pool`: close a pool the command opened; flush a held one.
    pub fn done(&self, pool: &Pool) -> Result<()> {
        if self.held.is_some() {
            pool.flush().context("cannot flush the pool")?;
            Ok(())
        } else {
            Ok(pool.close()?)
        }
    }
}

/// Render a command's result as the CLI does: errors as `condense: error: ...` on stderr and
/// exit status 1.
pub fn finish(result: Result<i32>, err: &mut dyn Write) -> i32 {
    match result {
        Ok(code) => code,
        Err(e) => {
            let _ = writeln!(err, "condense: error: {e:#}");
            1
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Client.

/// `argv` (without the program name) with every `--pool` value made absolute, and `--pool
/// ABS` added in front when the pool came from $CONDENSE_POOL or the default: the daemon
/// must not resolve it against its own directory or environment.
pub fn request_argv(args: &[OsString], pool_abs: &Path) -> Vec<OsString> {
    let mut out: Vec<OsString> = Vec::with_capacity(args.len() + 2);
    let mut saw_pool = false;
    let mut i = 0;
    while i < args.len() {
        let a = &args[i];
        if a == "--" {
            out.extend(args[i..].iter().cloned());
            break;
        }
        if a == "--pool" {
            saw_pool = true;
            out.push(a.clone());
            if i + 1 < args.len() {
                out.push(pool_abs.as_os_str().to_owned());
            }
            i += 2;
            continue;
        }
        if a.to_str().is_some_and(|s| s.starts_with("--pool=")) {
            saw_pool = true;
            let mut s = OsString::from("--pool=");
            s.push(pool_abs.as_os_str());
            out.push(s);
            i += 1;
            continue;
        }
        out.push(a.clone());
        i += 1;
    }
    if !saw_pool {
        out.splice(
            0..0,
            [OsString::from("--pool"), pool_abs.as_os_str().to_owned()],
        );
    }
    out
}

/// Send this command to the daemon holding `pool`, if there is one: prints its reply and
/// returns its exit status. `None` when there is no control socket or nobody listens on it
/// (then the command opens the pool itself).
pub fn forward(pool: &Path) -> Result<Option<i32>> {
    let sock = pool.join(SOCKET_NAME);
    if std::fs::symlink_metadata(&sock).is_err() {
        return Ok(None);
    }
    let mut stream = match UnixStream::connect(&sock) {
        Ok(s) => s,
        // Refused: a daemon that was killed left its socket behind, nobody holds the pool.
        // Or the socket is not ours to use (another user's daemon), or cannot be reached at
        // all (a path too long for a socket): opening the pool directly then says that a
        // process holds it (and `stats` shows what that process publishes).
        Err(_) => return Ok(None),
    };
    let abs = std::path::absolute(pool)
        .with_context(|| format!("cannot resolve the pool path {}", pool.display()))?;
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let argv: Vec<String> = request_argv(&args, &abs)
        .into_iter()
        .map(|a| {
            a.into_string().map_err(|a| {
                anyhow::anyhow!(
                    "argument {a:?} is not valid UTF-8; it cannot be sent to the process holding the pool"
                )
            })
        })
        .collect::<Result<_>>()?;
    let mut line = serde_json::to_vec(&json!({ "argv": argv }))?;
    line.push(b'\n');
    let what = || format!("control socket {}", sock.display());
    stream.write_all(&line).with_context(what)?;
    stream
        .shutdown(std::net::Shutdown::Write)
        .with_context(what)?;
    let mut reply = String::new();
    BufReader::new(stream)
        .read_line(&mut reply)
        .with_context(what)?;
    if reply.is_empty() {
        bail!(
            "the process holding pool {} closed its control socket without answering (did it stop?); retry",
            pool.display()
        );
    }
    let v: Value = serde_json::from_str(&reply)
        .with_context(|| format!("unreadable reply on {}", sock.display()))?;
    let text = |k: &str| v[k].as_str().unwrap_or_default().to_string();
    let code = v["code"]
        .as_i64()
        .and_then(|c| i32::try_from(c).ok())
        .with_context(|| format!("reply without an exit status on {}", sock.display()))?;
    let mut out = std::io::stdout().lock();
    out.write_all(text("stdout").as_bytes())?;
    out.flush()?;
    let mut err = std::io::stderr().lock();
    err.write_all(text("stderr").as_bytes())?;
    err.flush()?;
    Ok(Some(code))
}

// ---------------------------------------------------------------------------------------------
// Server.

/// Runs a command line inside the daemon: (argv without program name, ctx) → exit status.
pub type Handler = dyn Fn(Vec<String>, &mut Ctx) -> i32 + Send + Sync;

/// The daemon's control socket: serves requests on threads until dropped, then waits for the
/// commands in flight and removes the socket.
pub struct ControlServer {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    /// The listening socket, owned by the accept thread (valid until it is joined).
    listener_fd: std::os::fd::RawFd,
    accept: Option<JoinHandle<()>>,
    workers: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl ControlServer {
    /// Bind `pool_dir/control.sock` (replacing a stale one: the caller holds the pool's lock,
    /// so no other daemon can be listening on it), mode 0600, and serve `handler`.
    pub fn start(pool_dir: &Path, pool: Arc<Pool>, handler: Arc<Handler>) -> Result<ControlServer> {
        let path = pool_dir.join(SOCKET_NAME);
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(e).with_context(|| format!("cannot remove a stale {}", path.display()))
            }
        }
        // (Between bind and chmod the mode is the umask's; the SO_PEERCRED check below is what
        // keeps other users out in any case.)
        let listener = UnixListener::bind(&path)
            .with_context(|| format!("cannot create the control socket {}", path.display()))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
            .with_context(|| format!("cannot set the mode of {}", path.display()))?;
        let listener_fd = std::os::fd::AsRawFd::as_raw_fd(&listener);
        let stop = Arc::new(AtomicBool::new(false));
        let workers: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let accept = {
            let stop = stop.clone();
            let workers = workers.clone();
            let dir = pool_dir.to_path_buf();
            std::thread::Builder::new()
                .name("condense-control".into())
                .spawn(move || {
                    for conn in listener.incoming() {
                        if stop.load(Ordering::SeqCst) {
                            break;
                        }
                        let Ok(conn) = conn else { continue };
                        let pool = pool.clone();
                        let handler = handler.clone();
                        let dir = dir.clone();
                        let worker = std::thread::Builder::new()
                            .name("condense-control-cmd".into())
                            .spawn(move || serve_one(conn, &dir, pool, &*handler));
                        let mut w = workers.lock().unwrap_or_else(|p| p.into_inner());
                        w.retain(|h| !h.is_finished());
                        if let Ok(h) = worker {
                            w.push(h);
                        }
                    }
                })
                .context("cannot start the control socket thread")?
        };
        Ok(ControlServer {
            path,
            stop,
            listener_fd,
            accept: Some(accept),
            workers,
        })
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop (on Linux, shutting a listening socket down makes a blocked
        // accept return; this works even if someone removed the socket file).
        // SAFETY: the fd stays open until the accept thread, which owns it, is joined below.
        unsafe { libc::shutdown(self.listener_fd, libc::SHUT_RDWR) };
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
        let workers = std::mem::take(&mut *self.workers.lock().unwrap_or_else(|p| p.into_inner()));
        for w in workers {
            let _ = w.join();
        }
    }
}

/// The uid of the process at the other end of `s`.
fn peer_uid(s: &UnixStream) -> std::io::Result<u32> {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred {
        pid: 0,
        uid: u32::MAX,
        gid: u32::MAX,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes of the sizes given.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cred.uid)
}

fn reply(mut s: &UnixStream, stdout: &[u8], stderr: &[u8], code: i32) {
    let v = json!({
        "stdout": String::from_utf8_lossy(stdout),
        "stderr": String::from_utf8_lossy(stderr),
        "code": code,
    });
    let mut line = v.to_string().into_bytes();
    line.push(b'\n');
    let _ = s.write_all(&line);
}

fn refuse(s: &UnixStream, msg: &str) {
    reply(s, b"", format!("condense: error: {msg}\n").as_bytes(), 1);
}

fn serve_one(conn: UnixStream, dir: &Path, pool: Arc<Pool>, handler: &Handler) {
    // SAFETY: getuid cannot fail.
    let me = unsafe { libc::getuid() };
    match peer_uid(&conn) {
        Ok(uid) if uid == me || uid == 0 => {}
        Ok(uid) => {
            return refuse(
                &conn,
                &format!(
                    "user {uid} may not use the control socket of pool {}: only its owner (uid {me}) and root may",
                    dir.display()
                ),
            )
        }
        Err(e) => return refuse(&conn, &format!("cannot identify the caller: {e}")),
    }
    let _ = conn.set_read_timeout(Some(REQUEST_TIMEOUT));
    let mut line = String::new();
    let read = BufReader::new((&conn).take(MAX_REQUEST)).read_line(&mut line);
    if read.is_err() || line.is_empty() {
        return; // the client went away (or is the daemon's own wake-up)
    }
    let argv: Option<Vec<String>> = serde_json::from_str::<Value>(&line)
        .ok()
        .and_then(|v| serde_json::from_value(v["argv"].clone()).ok());
    let Some(argv) = argv else {
        return refuse(
            &conn,
            "malformed control request: expected one JSON line {\"argv\": [\"word\", ...]}",
        );
    };
    let _ = conn.set_read_timeout(None);
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = {
        let mut ctx = Ctx::held(dir, pool, &mut out, &mut err);
        handler(argv, &mut ctx)
    };
    reply(&conn, &out, &err, code);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    #[test]
    fn request_argv_makes_the_pool_absolute_and_explicit() {
        let abs = Path::new("/srv/p");
        assert_eq!(
            request_argv(&os(&["volume", "list"]), abs),
            os(&["--pool", "/srv/p", "volume", "list"])
        );
        assert_eq!(
            request_argv(&os(&["--pool", "p", "stats", "--json"]), abs),
            os(&["--pool", "/srv/p", "stats", "--json"])
        );
        assert_eq!(
            request_argv(&os(&["stats", "--pool=p"]), abs),
            os(&["stats", "--pool=/srv/p"])
        );
    }
}

//! The control socket: how CLI commands act on a pool that a daemon (`serve`, `mount`) holds.
//!
//! The daemon binds `POOL/control.sock` (born mode 0600, whatever the umask) and answers one request per connection:
//! a JSON line `{"argv": [...]}` (the words after the program name, `--pool` made absolute),
//! answered by one JSON line `{"stdout": "...", "stderr": "...", "code": N}`. The daemon runs
//! the command through the [`Handler`] the CLI gives it (the CLI's own parser and commands), on
//! the pool it holds, so output and exit status are the same either way. Only the peer's own uid (or root) is served (SO_PEERCRED).
//!
//! The client side ([`forward`]) is tried first by the commands that can run through it (the
//! CLI's routed commands): when the socket exists and answers, its reply is printed; when nobody
//! listens (a daemon that was killed), the command opens the pool directly. The client trusts
//! the listener only if it runs as the pool directory's owner or as root (SO_PEERCRED again,
//! see [`ask`]): anyone else who could put a socket there (a pool directory others may write
//! to) gets an error, not an audience. Even a trusted reply is bounded and printed without
//! control characters ([`reply`]).
//!
//! Long commands stop when nobody waits for them: a command asks [`Ctx::should_stop`] between
//! bounded steps, which is true once its client has closed the socket (Ctrl-C on `condense
//! diff`) or the daemon is shutting down. Shutdown waits at most [`DRAIN_TIMEOUT`] for the
//! commands in flight, then leaves them (the process exits; every command is crash-safe).

use crate::error::{io, Context, Result, ServiceError};
use condense_engine::Pool;
use condense_nbd::unix_socket::Access;
use serde::{Deserialize, Serialize};
use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

pub mod reply;

/// The control socket's file name inside the pool directory.
pub const SOCKET_NAME: &str = "control.sock";

/// Longest request accepted (a command line; anything longer is refused).
const MAX_REQUEST: u64 = 1 << 20;

/// How long the daemon waits for a connected client to send its request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// How long shutdown waits for the commands in flight before it leaves them running.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// Where a command's output goes and where its pool comes from: opened by the command itself
/// (closed at its end), or the pool a daemon holds (flushed, never closed, by a command).
pub struct Ctx<'a> {
    pub out: &'a mut dyn Write,
    pub err: &'a mut dyn Write,
    /// The pool directory, as the user named it (for messages and direct opens).
    pub path: PathBuf,
    held: Option<Arc<Pool>>,
    /// True once nobody waits for this command any more (see [`Ctx::should_stop`]).
    stop: Option<&'a (dyn Fn() -> bool + 'a)>,
}

impl<'a> Ctx<'a> {
    /// A command run by the CLI itself, opening the pool at `path`.
    pub fn direct(path: &Path, out: &'a mut dyn Write, err: &'a mut dyn Write) -> Ctx<'a> {
        Ctx {
            out,
            err,
            path: path.to_path_buf(),
            held: None,
            stop: None,
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
            stop: None,
        }
    }

    /// Whether a long command should give up now: its control-socket client went away or the
    /// daemon is shutting down. Always false for a command the CLI runs itself (Ctrl-C ends
    /// the process instead).
    pub fn should_stop(&self) -> bool {
        self.stop.is_some_and(|f| f())
    }

    /// True inside the daemon (no progress bars, no terminal).
    pub fn in_daemon(&self) -> bool {
        self.held.is_some()
    }

    /// The pool: the held one, or opened now (read-only if `read_only`).
    pub fn pool(&self, read_only: bool) -> Result<Arc<Pool>> {
        match &self.held {
            Some(p) => Ok(p.clone()),
            None => crate::open::open_pool(&self.path, read_only),
        }
    }

    /// [`Ctx::pool`] for a command that shows the per-volume figures. A pool this command
    /// opened has them counted at once (nothing else uses it meanwhile); a held one counts
    /// them in steps, as its I/O goes on. A count that fails is left for `stats` to report.
    pub fn pool_for_figures(&self, read_only: bool) -> Result<Arc<Pool>> {
        let pool = self.pool(read_only)?;
        if self.held.is_none() {
            let _ = pool.count_figures_at_once();
        }
        Ok(pool)
    }

    /// After a deletion or rollback: in a daemon, the old map's release
    /// (crates/engine/src/pool/release.rs) goes on in the background, as its VMs must not wait
    /// for it; a command that opened the pool itself finishes it now (nothing is served),
    /// telling `progress(blocks left, blocks in all)`. Says which, for the command's message.
    pub fn release_deleted(
        &self,
        pool: &Pool,
        progress: &dyn Fn(u64, u64),
    ) -> Result<&'static str> {
        if self.in_daemon() {
            return Ok(
                "its map is released in the background (`condense stats` shows what is left)",
            );
        }
        pool.finish_releases(progress)
            .context("cannot release the deleted map (it is released again at the next open)")?;
        Ok("its map is released")
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

/// Render a command's result as the CLI does: errors as `condense: error: ...` (with their
/// causes) on stderr and exit status 1.
pub fn finish<E>(result: std::result::Result<i32, E>, err: &mut dyn Write) -> i32
where
    E: AsRef<dyn std::error::Error + Send + Sync>,
{
    match result {
        Ok(code) => code,
        Err(e) => {
            let _ = writeln!(err, "condense: error: {}", crate::error::chain(e.as_ref()));
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
    let abs = std::path::absolute(pool)
        .with_context(|| format!("cannot resolve the pool path {}", pool.display()))?;
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let argv: Vec<String> = request_argv(&args, &abs)
        .into_iter()
        .map(|a| {
            a.into_string().map_err(|a| {
                ServiceError::Invalid(format!(
                    "argument {a:?} is not valid UTF-8; it cannot be sent to the process holding the pool"
                ))
            })
        })
        .collect::<Result<_>>()?;
    let Some(reply) = ask(pool, &argv)? else {
        return Ok(None);
    };
    let mut out = std::io::stdout().lock();
    out.write_all(reply.stdout.as_bytes())
        .and_then(|()| out.flush())
        .map_err(io("cannot write the output"))?;
    let mut err = std::io::stderr().lock();
    err.write_all(reply.stderr.as_bytes())
        .and_then(|()| err.flush())
        .map_err(io("cannot write the error output"))?;
    Ok(Some(reply.code))
}

pub use reply::Reply;

/// Run `argv` (a command line after the program name, with `--pool` absolute) in the daemon
/// holding `pool`. `None` when there is no control socket or nobody listens on it.
///
/// The listener must run as the owner of the pool directory or as root (SO_PEERCRED; the owner
/// from an `fstat` of the directory opened once, and the socket reached through that same
/// descriptor, so a directory or socket swapped meanwhile changes nothing): any other process
/// is refused with an error before the request is sent. Its reply is then read as [`reply`]
/// says: bounded, decoded strictly, made printable.
pub fn ask(pool: &Path, argv: &[String]) -> Result<Option<Reply>> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let shown = pool.join(SOCKET_NAME);
    // No directory (or none this user may reach): the direct open says why.
    let Ok(dir) = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY)
        .open(pool)
    else {
        return Ok(None);
    };
    let owner = dir
        .metadata()
        .with_context(|| format!("cannot read the owner of pool directory {}", pool.display()))?
        .uid();
    let via_fd = PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd()));
    let sock = if via_fd.is_dir() {
        via_fd.join(SOCKET_NAME)
    } else {
        shown.clone() // no /proc: the path, as the peer check below holds either way
    };
    if std::fs::symlink_metadata(&sock).is_err() {
        return Ok(None);
    }
    let mut stream = match UnixStream::connect(&sock) {
        Ok(s) => s,
        // Refused: a daemon that was killed left its socket behind, nobody holds the pool.
        // Or the socket is not ours to use (another user's daemon), or cannot be reached at
        // all: opening the pool directly then says that a process holds it (and `stats` shows
        // what that process publishes).
        Err(_) => return Ok(None),
    };
    drop(dir);
    let server = peer_uid(&stream).with_context(|| {
        format!(
            "cannot tell who listens on control socket {}",
            shown.display()
        )
    })?;
    if server != owner && server != 0 {
        return Err(ServiceError::Control(format!(
            "refusing control socket {s}: the process listening on it runs as uid {server}, but \
             pool {p} belongs to uid {owner}, and only a daemon run by the pool's owner or by root \
             may answer for it. Nothing was sent to it and its answer is not trusted. A process \
             of uid {server} may be posing as the pool's daemon: stop it, remove {s} (as root or \
             uid {owner}) and let only the owner write to {p} (chmod 700 {p})",
            s = shown.display(),
            p = pool.display(),
        )));
    }
    let mut line = serde_json::to_vec(&Request {
        argv: argv.to_vec(),
    })
    .context("cannot encode the request")?;
    line.push(b'\n');
    let what = || format!("control socket {}", shown.display());
    stream.write_all(&line).with_context(what)?;
    stream
        .shutdown(std::net::Shutdown::Write)
        .with_context(what)?;
    let from = || {
        format!(
            "the process on control socket {} (uid {server})",
            shown.display()
        )
    };
    let reply = reply::read(&stream, reply::MAX_REPLY).with_context(from)?;
    if reply.is_empty() {
        return Err(ServiceError::Control(format!(
            "the process holding pool {} closed its control socket without answering (did it stop?); retry",
            pool.display()
        )));
    }
    Ok(Some(reply::decode(reply).with_context(from)?))
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
        // Born 0600 whatever the umask; the SO_PEERCRED check below keeps other users out too.
        let listener = condense_nbd::unix_socket::bind(&path, Access::Owner)
            .with_context(|| format!("cannot create the control socket {}", path.display()))?;
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
                        let stop = stop.clone();
                        let worker = std::thread::Builder::new()
                            .name("condense-control-cmd".into())
                            .spawn(move || serve_one(conn, &dir, pool, &*handler, &stop));
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
        // Commands in flight see the stop flag at their next step; wait for them, not forever.
        let mut workers =
            std::mem::take(&mut *self.workers.lock().unwrap_or_else(|p| p.into_inner()));
        let until = std::time::Instant::now() + DRAIN_TIMEOUT;
        while workers.iter().any(|w| !w.is_finished()) && std::time::Instant::now() < until {
            std::thread::sleep(Duration::from_millis(20));
        }
        let running = workers.iter().filter(|w| !w.is_finished()).count();
        if running > 0 {
            eprintln!(
                "condense: {running} control-socket command(s) still running after {DRAIN_TIMEOUT:?}; stopping without them"
            );
        }
        for w in workers.drain(..).filter(|w| w.is_finished()) {
            let _ = w.join();
        }
    }
}

/// The request line: what arrives within [`REQUEST_TIMEOUT`] in all (a client trickling
/// bytes cannot hold a thread), up to the first newline or [`MAX_REQUEST`] bytes. `None` when
/// nothing complete came.
fn read_request(mut conn: &UnixStream) -> Option<String> {
    let deadline = std::time::Instant::now() + REQUEST_TIMEOUT;
    let mut line = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let left = deadline
            .checked_duration_since(std::time::Instant::now())
            .filter(|d| !d.is_zero())?;
        conn.set_read_timeout(Some(left)).ok()?;
        let n = conn.read(&mut chunk).ok()?;
        if n == 0 {
            break;
        }
        line.extend_from_slice(&chunk[..n]);
        if let Some(end) = line.iter().position(|&b| b == b'\n') {
            line.truncate(end + 1);
            break;
        }
        if line.len() as u64 >= MAX_REQUEST {
            break; // not valid JSON once cut: refused as malformed
        }
    }
    let _ = conn.set_read_timeout(None);
    (!line.is_empty()).then(|| String::from_utf8_lossy(&line).into_owned())
}

/// Whether the client at the other end of `s` has closed its socket. (It shut its writing
/// half down after the request, so only a full close — POLLHUP — means it is gone.)
fn client_gone(s: &UnixStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut p = libc::pollfd {
        fd: s.as_raw_fd(),
        events: 0,
        revents: 0,
    };
    // SAFETY: one valid pollfd, no wait.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents & (libc::POLLHUP | libc::POLLERR) != 0
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

/// A request on the socket: the command line after the program name.
#[derive(Serialize, Deserialize)]
struct Request {
    argv: Vec<String>,
}

/// A reply as the daemon sends it (read back by [`reply::decode`]).
#[derive(Serialize)]
struct Sent<'a> {
    code: i32,
    stderr: std::borrow::Cow<'a, str>,
    stdout: std::borrow::Cow<'a, str>,
}

fn reply(mut s: &UnixStream, stdout: &[u8], stderr: &[u8], code: i32) {
    let sent = Sent {
        code,
        stderr: String::from_utf8_lossy(stderr),
        stdout: String::from_utf8_lossy(stdout),
    };
    let Ok(mut line) = serde_json::to_vec(&sent) else {
        return;
    };
    line.push(b'\n');
    let _ = s.write_all(&line);
}

fn refuse(s: &UnixStream, msg: &str) {
    reply(s, b"", format!("condense: error: {msg}\n").as_bytes(), 1);
}

fn serve_one(
    conn: UnixStream,
    dir: &Path,
    pool: Arc<Pool>,
    handler: &Handler,
    shutting_down: &AtomicBool,
) {
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
    let Some(line) = read_request(&conn) else {
        return; // the client went away, or was too slow (or is the daemon's own wake-up)
    };
    let Ok(Request { argv }) = serde_json::from_str::<Request>(&line) else {
        return refuse(
            &conn,
            "malformed control request: expected one JSON line {\"argv\": [\"word\", ...]}",
        );
    };
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let stop = || shutting_down.load(Ordering::SeqCst) || client_gone(&conn);
    let code = {
        let mut ctx = Ctx::held(dir, pool, &mut out, &mut err);
        ctx.stop = Some(&stop);
        handler(argv, &mut ctx)
    };
    if client_gone(&conn) {
        return;
    }
    reply(&conn, &out, &err, code);
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Result;
    use std::time::Instant;

    /// Until `what` holds, or `within` passes.
    fn wait_for(within: Duration, what: impl Fn() -> bool) -> bool {
        let until = Instant::now() + within;
        while !what() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        what()
    }

    #[test]
    fn commands_stop_when_their_client_leaves_and_shutdown_waits_a_bounded_time() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("pool");
        Pool::init_path(&path, &Default::default())?;
        let pool = Pool::open_path(&path, Default::default())?;
        let stopped = Arc::new(AtomicBool::new(false));
        let release = Arc::new(AtomicBool::new(false));
        let (s, r) = (stopped.clone(), release.clone());
        let handler: Arc<Handler> = Arc::new(move |argv: Vec<String>, ctx: &mut Ctx| {
            if argv.first().map(String::as_str) == Some("deaf") {
                // A command that never asks whether to stop.
                while !r.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(10));
                }
                return 0;
            }
            while !ctx.should_stop() {
                std::thread::sleep(Duration::from_millis(10));
            }
            s.store(true, Ordering::SeqCst);
            1
        });
        let server = ControlServer::start(&path, pool.clone(), handler)?;
        let send = |word: &str| -> Result<UnixStream> {
            let mut c = UnixStream::connect(path.join(SOCKET_NAME))?;
            c.write_all(format!("{{\"argv\": [\"{word}\"]}}\n").as_bytes())?;
            c.shutdown(std::net::Shutdown::Write)?;
            Ok(c)
        };
        // Its client waits (it half-closed after the request): the command goes on.
        let c = send("long")?;
        assert!(!wait_for(Duration::from_millis(300), || stopped
            .load(Ordering::SeqCst)));
        // Its client leaves: the command is told to stop.
        drop(c);
        assert!(wait_for(Duration::from_secs(5), || stopped.load(Ordering::SeqCst)));
        // Shutdown while a command never stops: it waits DRAIN_TIMEOUT, not forever.
        let _deaf = send("deaf")?;
        std::thread::sleep(Duration::from_millis(100));
        let t = Instant::now();
        drop(server);
        let took = t.elapsed();
        assert!(took >= DRAIN_TIMEOUT, "waited {took:?}");
        assert!(took < DRAIN_TIMEOUT * 2, "waited {took:?}");
        assert!(!path.join(SOCKET_NAME).exists());
        release.store(true, Ordering::SeqCst);
        Ok(())
    }

    #[test]
    fn a_client_trickling_its_request_is_cut_off() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("pool");
        Pool::init_path(&path, &Default::default())?;
        let pool = Pool::open_path(&path, Default::default())?;
        let handler: Arc<Handler> = Arc::new(|_: Vec<String>, _: &mut Ctx| 0);
        let _server = ControlServer::start(&path, pool, handler)?;
        let mut c = UnixStream::connect(path.join(SOCKET_NAME))?;
        c.set_read_timeout(Some(REQUEST_TIMEOUT * 3))?;
        let t = Instant::now();
        // A byte every half second: never a whole line.
        let trickle = std::thread::spawn({
            let mut c = c.try_clone()?;
            move || {
                for _ in 0..40 {
                    if c.write_all(b" ").is_err() {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(500));
                }
            }
        });
        let mut reply = Vec::new();
        let _ = c.read_to_end(&mut reply);
        let took = t.elapsed();
        assert!(reply.is_empty(), "{}", String::from_utf8_lossy(&reply));
        assert!(took < REQUEST_TIMEOUT * 2, "held for {took:?}");
        let _ = trickle.join();
        Ok(())
    }

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

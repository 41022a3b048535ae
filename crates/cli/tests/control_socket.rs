//! The control socket: while `condense serve` holds a pool, `volume`, `snapshot`, `diff`,
//! `stats`, `gc` and `verify` act on the live pool through POOL/control.sock, with the same
//! output and exit status as without a daemon; a stale socket (daemon killed) falls back to
//! opening the pool directly.

mod common;

use common::*;
use serde_json::Value;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A running `condense serve --socket`, stopped (SIGTERM) and reaped when dropped.
struct Daemon {
    child: Child,
    nbd: PathBuf,
}

impl Daemon {
    /// Start serve on `pool` and wait until both its control socket and its NBD socket accept
    /// connections.
    fn start(pool: &Path, nbd: &Path, extra: &[&str]) -> Daemon {
        let child = Command::new(BIN)
            .arg("--pool")
            .arg(pool)
            .arg("serve")
            .arg("--socket")
            .arg(nbd)
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn serve: {e}"));
        let mut d = Daemon {
            child,
            nbd: nbd.to_path_buf(),
        };
        d.wait_ready(&pool.join("control.sock"));
        let nbd = d.nbd.clone();
        d.wait_ready(&nbd);
        d
    }

    fn wait_ready(&mut self, sock: &Path) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if UnixStream::connect(sock).is_ok() {
                return;
            }
            if let Ok(Some(st)) = self.child.try_wait() {
                panic!("serve exited ({st}) before {} was ready", sock.display());
            }
            assert!(
                Instant::now() < deadline,
                "{} not ready after 30 s",
                sock.display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn pid(&self) -> String {
        self.child.id().to_string()
    }

    /// Stop with SIGTERM and wait for a clean exit.
    fn stop(mut self) {
        let _ = Command::new("kill").arg(self.pid()).status();
        let st = self
            .child
            .wait()
            .unwrap_or_else(|e| panic!("wait for serve: {e}"));
        assert!(st.success(), "serve did not stop cleanly: {st}");
    }

    /// SIGKILL: no cleanup at all, as after a crash.
    fn kill_9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = Command::new("kill")
                .arg(self.child.id().to_string())
                .status();
            let _ = self.child.wait();
        }
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Figures that depend on when the pool last checkpointed or what its page cache holds,
/// which differ between a pool held open by a daemon and one opened for a single command.
const TIMING_KEYS: &[&str] = &[
    "checkpoints",
    "metadata_bytes",
    "physical_bytes",
    "metadata_cache_used_bytes",
    "metadata_cache_hits",
    "metadata_cache_misses",
    "metadata_page_bytes_written",
    "metadata_page_bytes_live",
    "index_ram_bytes",
    "ram_bytes_per_unique_chunk",
    // The daemon's background scrub (its rate, a pass under way); a direct open runs none.
    "scrub",
    // The daemon builds the dedup index in the background from its start; a direct open
    // builds it at its first write only.
    "dedup_index",
    "dedup_index_entries",
    "dedup_index_bytes",
];

fn mask_stats_json(s: &str) -> Value {
    let mut v = json(s);
    for k in TIMING_KEYS {
        if let Some(x) = v.get_mut(*k) {
            *x = Value::Null;
        }
    }
    v
}

/// The text table with the timing-dependent rows (metadata, RAM) masked.
fn mask_stats_text(s: &str) -> String {
    s.lines()
        .map(|l| {
            if l.contains("physical used")
                || l.contains("RAM for index")
                // The daemon built its dedup index at its start (figures); a direct open has not.
                || l.trim_start().starts_with("dedup index")
                || l.trim_start().starts_with("scrub")
                || l.trim_start().starts_with("last scrub")
            {
                l.split_whitespace().take(2).collect::<Vec<_>>().join(" ")
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn same_result(args: &[&str], live: &Output, direct: &Output) {
    assert_eq!(
        live.status.code(),
        direct.status.code(),
        "condense {args:?}: exit status through the socket vs direct\nlive: {}\ndirect: {}",
        text(&live.stderr),
        text(&direct.stderr)
    );
    let (l, d) = (text(&live.stdout), text(&direct.stdout));
    match args.first().copied() {
        Some("stats") if args.contains(&"--json") => {
            assert_eq!(
                mask_stats_json(&l),
                mask_stats_json(&d),
                "condense {args:?}"
            )
        }
        Some("stats") => assert_eq!(
            mask_stats_text(&l),
            mask_stats_text(&d),
            "condense {args:?}"
        ),
        // A deletion's map is released in the background in the daemon and before the
        // command ends without one (crates/engine/src/pool/release.rs): the one difference.
        _ if args.contains(&"delete") => assert_eq!(
            l.replace(
                " in the background (`condense stats` shows what is left)",
                ""
            ),
            d,
            "condense {args:?}: stdout through the socket vs direct"
        ),
        _ => assert_eq!(
            l, d,
            "condense {args:?}: stdout through the socket vs direct"
        ),
    }
}

#[test]
fn commands_through_the_control_socket_match_direct_ones() {
    let d = tmp();
    let live = d.path().join("live");
    let direct = d.path().join("direct");
    ok(&live, &["init"]);
    ok(&direct, &["init"]);
    let daemon = Daemon::start(&live, &d.path().join("nbd.sock"), &[]);

    let mode = std::fs::metadata(live.join("control.sock"))
        .unwrap_or_else(|e| panic!("control.sock: {e}"))
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "control socket mode {mode:o}");

    let steps: &[&[&str]] = &[
        &["volume", "create", "v1", "--size", "64M"],
        &["volume", "create", "v2", "--size", "1G"],
        &["volume", "create", "v1", "--size", "64M"], // exists: exit 1
        &["volume", "list", "--json"],
        &["volume", "list"],
        &["volume", "info", "v1"],
        &["volume", "info", "v1", "--json"],
        &["volume", "info", "nope"], // exit 1
        &["stats", "--json"],
        &["stats"],
        &["stats", "v2"],
        &["volume", "resize", "v2", "2G"],
        &["gc"],
        &["verify"],
        &["verify", "--json"],
        &["volume", "delete", "v2"],
        &["volume", "list", "--json"],
        &["stats", "--json"],
    ];
    for args in steps {
        let l = condense(&live, args);
        let dr = condense(&direct, args);
        same_result(args, &l, &dr);
        // Through the socket, not the status-file fallback (which says so on stderr).
        assert!(
            !text(&l.stderr).contains("in use by process"),
            "condense {args:?} did not go through the control socket: {}",
            text(&l.stderr)
        );
    }
    // The live figures include what was done through the socket.
    let s = json(&ok(&live, &["stats", "--json"]));
    assert_eq!(s["logical_bytes"].as_u64(), Some(64 << 20));
    assert_eq!(s["volumes"][0]["name"], "v1");
    // Errors keep their text and exit status.
    let o = condense(&live, &["volume", "info", "nope"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o.stderr).starts_with("condense: error: volume \"nope\" not found"),
        "{}",
        text(&o.stderr)
    );

    daemon.stop();
    assert!(
        !live.join("control.sock").exists(),
        "control socket left behind after a clean stop"
    );
    // The pool holds what was done through the socket after the daemon is gone.
    let list = json(&ok(&live, &["volume", "list", "--json"]));
    assert_eq!(list.as_array().map(Vec::len), Some(1));
    assert_eq!(list[0]["name"], "v1");
}

#[test]
fn a_stale_control_socket_falls_back_to_opening_the_pool() {
    let d = tmp();
    let pool = d.path().join("pool");
    ok(&pool, &["init"]);
    ok(&pool, &["volume", "create", "a", "--size", "16M"]);
    let daemon = Daemon::start(&pool, &d.path().join("nbd.sock"), &[]);
    ok(&pool, &["volume", "create", "b", "--size", "16M"]);
    daemon.kill_9();
    assert!(
        pool.join("control.sock").exists(),
        "SIGKILL should leave the socket behind (that is what this test is about)"
    );
    // Nobody listens: the commands open the pool themselves.
    let list = json(&ok(&pool, &["volume", "list", "--json"]));
    let names: Vec<&str> = list
        .as_array()
        .map(|a| a.iter().filter_map(|v| v["name"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(names, ["a", "b"]);
    ok(&pool, &["volume", "create", "c", "--size", "16M"]);
    let o = condense(&pool, &["stats", "--json"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(!text(&o.stderr).contains("in use by process"));
    let out = ok(&pool, &["verify"]);
    assert!(out.contains("no damage found"), "{out}");
    // A new daemon replaces the stale socket and answers on it.
    let daemon = Daemon::start(&pool, &d.path().join("nbd2.sock"), &[]);
    ok(&pool, &["volume", "delete", "c"]);
    daemon.stop();
    assert!(!pool.join("control.sock").exists());
}

#[test]
fn a_read_only_daemon_refuses_writes_as_a_read_only_pool_does() {
    let d = tmp();
    let pool = d.path().join("pool");
    ok(&pool, &["init"]);
    ok(&pool, &["volume", "create", "a", "--size", "16M"]);
    let daemon = Daemon::start(&pool, &d.path().join("nbd.sock"), &["--read-only"]);
    for args in [
        &["volume", "create", "b", "--size", "16M"][..],
        &["volume", "delete", "a"],
        &["volume", "resize", "a", "32M"],
        &["gc"],
    ] {
        let o = condense(&pool, args);
        assert_eq!(o.status.code(), Some(1), "condense {args:?}");
        assert!(
            text(&o.stderr).contains("the pool is open read-only"),
            "condense {args:?}: {}",
            text(&o.stderr)
        );
    }
    let list = json(&ok(&pool, &["volume", "list", "--json"]));
    assert_eq!(list.as_array().map(Vec::len), Some(1));
    ok(&pool, &["stats"]);
    daemon.stop();
}

fn have(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn qemu_io(nbd: &Path, volume: &str, cmd: &str) {
    let url = format!("nbd+unix:///{volume}?socket={}", nbd.display());
    let o = Command::new("qemu-io")
        .args(["-f", "raw", &url, "-c", cmd])
        .output()
        .unwrap_or_else(|e| panic!("qemu-io: {e}"));
    assert!(
        o.status.success() && !text(&o.stdout).contains("failed"),
        "qemu-io {cmd}: {}{}",
        text(&o.stdout),
        text(&o.stderr)
    );
}

/// `qemu-io` left running with the volume open read-write; returns once it has answered a
/// read (so the NBD connection is up).
fn hold_open(nbd: &Path, volume: &str) -> Child {
    use std::io::{BufRead, BufReader, Write};
    let url = format!("nbd+unix:///{volume}?socket={}", nbd.display());
    let mut child = Command::new("qemu-io")
        .args(["-f", "raw", &url])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("qemu-io: {e}"));
    let mut stdin = child.stdin.take().unwrap_or_else(|| panic!("no stdin"));
    let stdout = child.stdout.take().unwrap_or_else(|| panic!("no stdout"));
    writeln!(stdin, "read 0 4k").unwrap_or_else(|e| panic!("qemu-io stdin: {e}"));
    let mut lines = BufReader::new(stdout).lines();
    loop {
        match lines.next() {
            Some(Ok(l)) if l.contains("read 4096/4096 bytes") => break,
            Some(Ok(_)) => continue,
            other => panic!("qemu-io did not answer the read: {other:?}"),
        }
    }
    child.stdin = Some(stdin);
    child
}

#[test]
fn snapshot_commands_through_the_control_socket() {
    let d = tmp();
    let pool = d.path().join("pool");
    let nbd = d.path().join("nbd.sock");
    ok(&pool, &["init"]);
    ok(&pool, &["volume", "create", "v", "--size", "16M"]);
    let daemon = Daemon::start(&pool, &nbd, &[]);

    let o = condense(&pool, &["snapshot", "create", "v", "s0"]);
    if text(&o.stderr).contains("does not support snapshots") {
        eprintln!("SKIPPED: the engine in this build has no snapshots yet");
        return;
    }
    let out = check_ok(&["snapshot", "create", "v", "s0"], o);
    assert!(out.starts_with("created snapshot v@s0"), "{out}");
    let l = json(&ok(&pool, &["snapshot", "list", "--json"]));
    assert_eq!(l["schema"], "condense.snapshots/1");
    assert_eq!(l["snapshots"][0]["name"], "v@s0");
    assert_eq!(l["snapshots"][0]["volume"], "v");
    assert_eq!(l["snapshots"][0]["snapshot"], "s0");
    assert_eq!(l["snapshots"][0]["size_bytes"].as_u64(), Some(16 << 20));
    assert_eq!(l["snapshots"][0]["written_bytes"].as_u64(), Some(0));
    assert!(l["snapshots"][0]["created_unix"].as_u64().is_some());

    if !have("qemu-io") {
        eprintln!("SKIPPED (partly): qemu-io not installed; no writes through NBD");
        ok(&pool, &["snapshot", "delete", "v@s0"]);
        daemon.stop();
        return;
    }
    qemu_io(&nbd, "v", "write -P 0xab 0 64k");
    ok(&pool, &["snapshot", "create", "v", "s1"]);
    qemu_io(&nbd, "v", "write -P 0xcd 1M 128k");

    let l = json(&ok(&pool, &["snapshot", "list", "v", "--json"]));
    let snaps = l["snapshots"].as_array().cloned().unwrap_or_default();
    assert_eq!(snaps.len(), 2, "{l}");
    assert_eq!(snaps[1]["name"], "v@s1");
    assert_eq!(snaps[1]["written_bytes"].as_u64(), Some(64 << 10));
    let text_list = ok(&pool, &["snapshot", "list"]);
    assert!(text_list.contains("v@s1"), "{text_list}");

    let diff = json(&ok(&pool, &["diff", "v@s1", "v", "--json"]));
    assert_eq!(diff["schema"], "condense.diff/1");
    assert_eq!(diff["changed_bytes"].as_u64(), Some(128 << 10), "{diff}");
    assert_eq!(diff["extent_count"].as_u64(), Some(1));
    assert_eq!(diff["extents"][0]["offset"].as_u64(), Some(1 << 20));
    assert_eq!(diff["extents"][0]["length"].as_u64(), Some(128 << 10));
    let diff = json(&ok(&pool, &["diff", "v@s0", "v@s1", "--json"]));
    assert_eq!(diff["changed_bytes"].as_u64(), Some(64 << 10), "{diff}");

    // A clone of the snapshot reads as the snapshot, and is writable.
    ok(&pool, &["volume", "clone", "v@s1", "c"]);
    qemu_io(&nbd, "c", "read -P 0xab 0 64k");
    qemu_io(&nbd, "c", "read -P 0 1M 128k");
    qemu_io(&nbd, "c", "write -P 0x11 0 4k");

    // Rollback is refused while a client holds the volume open read-write, unless --force.
    let mut holder = hold_open(&nbd, "v");
    let err = fails(&pool, &["volume", "rollback", "v@s1"]);
    assert!(err.contains("--force"), "{err}");
    let diff = json(&ok(&pool, &["diff", "v@s1", "v", "--json"]));
    assert_eq!(
        diff["changed_bytes"].as_u64(),
        Some(128 << 10),
        "refused rollback changed v"
    );
    ok(&pool, &["volume", "rollback", "v@s1", "--force"]);
    drop(holder.stdin.take());
    let _ = holder.wait();
    let diff = json(&ok(&pool, &["diff", "v@s1", "v", "--json"]));
    assert_eq!(diff["changed_bytes"].as_u64(), Some(0), "{diff}");
    qemu_io(&nbd, "v", "read -P 0 1M 128k");

    ok(&pool, &["snapshot", "delete", "v@s0"]);
    ok(&pool, &["snapshot", "delete", "v@s1"]);
    let l = json(&ok(&pool, &["snapshot", "list", "--json"]));
    assert_eq!(l["snapshots"].as_array().map(Vec::len), Some(0));
    let err = fails(&pool, &["snapshot", "delete", "v@s1"]);
    assert!(err.contains("v@s1"), "{err}");
    daemon.stop();
}

/// A process of the pool owner's uid listening on `pool/control.sock` in place of a daemon:
/// answers each connection with `answer` (after the request line), on threads, until the test
/// ends.
fn forged_daemon(pool: &Path, answer: fn(&mut UnixStream) -> std::io::Result<()>) {
    use std::io::{BufRead, BufReader};
    let listener = std::os::unix::net::UnixListener::bind(pool.join("control.sock"))
        .unwrap_or_else(|e| panic!("bind the forged control socket: {e}"));
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            std::thread::spawn(move || {
                let mut request = String::new();
                let _ = BufReader::new(&conn).read_line(&mut request);
                let _ = answer(&mut conn);
            });
        }
    });
}

#[test]
fn a_trusted_daemon_s_reply_is_bounded_printable_and_gives_a_real_exit_status() {
    use std::io::Write;
    let d = tmp();
    let pool = d.path().join("pool");
    ok(&pool, &["init"]);
    // An endless reply: the CLI stops at its limit, with an error naming it.
    forged_daemon(&pool, |c| {
        c.write_all(b"{\"stdout\": \"")?;
        let chunk = b"\\u001b[2J no damage ".repeat(4096);
        loop {
            c.write_all(&chunk)?;
        }
    });
    let err = fails(&pool, &["verify"]);
    assert!(
        err.contains("control.sock (uid") && err.contains("past 67108864 bytes"),
        "{err}"
    );
    std::fs::remove_file(pool.join("control.sock")).unwrap_or_else(|e| panic!("{e}"));
    // Escape sequences (C0, C1) in its text are not printed; its exit status is relayed.
    forged_daemon(&pool, |c| {
        c.write_all(
            b"{\"stdout\": \"\\u001b]0;x\\u0007\\u009b2Jno damage found\\r\\n\", \"stderr\": \"\\u001b[31mwarn\\n\", \"code\": 3}\n",
        )
    });
    let o = condense(&pool, &["verify"]);
    assert_eq!(o.status.code(), Some(3));
    assert_eq!(text(&o.stdout), "]0;x2Jno damage found\n");
    assert_eq!(text(&o.stderr), "[31mwarn\n");
    std::fs::remove_file(pool.join("control.sock")).unwrap_or_else(|e| panic!("{e}"));
    // An exit status no process can have (exit(256) would be a success) is an error.
    forged_daemon(&pool, |c| {
        c.write_all(b"{\"stdout\": \"no damage found\\n\", \"code\": 256}\n")
    });
    let err = fails(&pool, &["verify"]);
    assert!(err.contains("exit status 256"), "{err}");
}

//! Helpers shared by the end-to-end tests of the `condense` binary: run it against a pool,
//! require success or failure, scratch directories, deterministic data, JSON.
#![allow(dead_code)] // each test crate uses its own subset

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

pub const BIN: &str = env!("CARGO_BIN_EXE_condense");

pub fn condense(pool: &Path, args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("--pool")
        .arg(pool)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run condense: {e}"))
}

/// Run with `input` on standard input (written from a thread, so a large input cannot
/// deadlock against the captured output; a child that stops reading early is fine).
pub fn condense_stdin(pool: &Path, args: &[&str], input: Vec<u8>) -> Output {
    let mut child = Command::new(BIN)
        .arg("--pool")
        .arg(pool)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run condense: {e}"));
    let mut stdin = child
        .stdin
        .take()
        .unwrap_or_else(|| panic!("no stdin pipe"));
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(&input);
    });
    let out = child
        .wait_with_output()
        .unwrap_or_else(|e| panic!("condense {args:?}: {e}"));
    let _ = writer.join();
    out
}

pub fn check_ok(args: &[&str], o: Output) -> String {
    assert!(
        o.status.success(),
        "condense {args:?} failed: {}\n{}",
        String::from_utf8_lossy(&o.stderr),
        String::from_utf8_lossy(&o.stdout)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn check_fails(args: &[&str], o: Output) -> String {
    assert!(
        !o.status.success(),
        "condense {args:?} should have failed: {}",
        String::from_utf8_lossy(&o.stdout)
    );
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Run and require success; returns stdout.
pub fn ok(pool: &Path, args: &[&str]) -> String {
    check_ok(args, condense(pool, args))
}

/// Run and require failure; returns stderr.
pub fn fails(pool: &Path, args: &[&str]) -> String {
    check_fails(args, condense(pool, args))
}

/// Run with `input` on standard input and require success; returns stdout.
pub fn ok_stdin(pool: &Path, args: &[&str], input: Vec<u8>) -> String {
    check_ok(args, condense_stdin(pool, args, input))
}

/// Run with `input` on standard input and require failure; returns stderr.
pub fn fails_stdin(pool: &Path, args: &[&str], input: Vec<u8>) -> String {
    check_fails(args, condense_stdin(pool, args, input))
}

pub fn tmp() -> tempfile::TempDir {
    // Under target/, on the same disk as the build, not in a RAM-backed /tmp.
    let base = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    tempfile::tempdir_in(base).unwrap_or_else(|e| panic!("tempdir: {e}"))
}

pub fn json(s: &str) -> serde_json::Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("bad JSON ({e}): {s}"))
}

/// Every file of a directory with its contents, sorted: equal before and after a command
/// means the command changed nothing there.
pub fn dir_snapshot(p: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<_> = fs::read_dir(p)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| {
                    (
                        e.file_name().to_string_lossy().into_owned(),
                        fs::read(e.path()).unwrap_or_default(),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// xorshift64: deterministic, incompressible bytes.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n.div_ceil(8))
            .flat_map(|_| self.next().to_le_bytes())
            .take(n)
            .collect()
    }
}

//! `condense import -` (a raw image streamed on standard input) and `--metadata-cache`, end to
//! end with the built binary: byte-identical round trips, zero blocks kept as holes, short and
//! long input, and bad arguments that must change nothing.

use std::fs;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

const BS: usize = 4096;
const MIB: usize = 1 << 20;

mod common;
use common::*;

/// 20 MiB of known content: random data, a zero run across the 8 MiB boundary where the
/// importer's reads split, data blocks on both sides of that boundary, compressible text, a
/// duplicate of the first MiB, a pattern of alternating data and zero blocks, blocks with a
/// single non-zero byte at their start or end, and data in the very last block.
fn image() -> Vec<u8> {
    let mut rng = Rng(0x5eed_1234);
    let mut img = vec![0u8; 20 * MIB];
    let first = rng.bytes(MIB);
    img[..MIB].copy_from_slice(&first);
    img[8 * MIB - 2 * BS..8 * MIB - BS].copy_from_slice(&rng.bytes(BS));
    img[8 * MIB + BS..8 * MIB + 2 * BS].copy_from_slice(&rng.bytes(BS));
    let text: Vec<u8> = b"condense keeps virtual machine disks small. "
        .iter()
        .copied()
        .cycle()
        .take(2 * MIB)
        .collect();
    img[10 * MIB..12 * MIB].copy_from_slice(&text);
    img[12 * MIB..13 * MIB].copy_from_slice(&first);
    for b in 0..MIB / BS {
        if b % 3 == 0 {
            let at = 14 * MIB + b * BS;
            img[at..at + BS].copy_from_slice(&rng.bytes(BS));
        }
    }
    img[16 * MIB] = 1;
    img[17 * MIB - 1] = 1;
    let end = img.len();
    img[end - BS..].copy_from_slice(&rng.bytes(BS));
    img
}

fn nonzero_blocks(data: &[u8]) -> u64 {
    data.chunks(BS)
        .filter(|b| b.iter().any(|&x| x != 0))
        .count() as u64
}

fn export(pool: &Path, dir: &Path, name: &str) -> Vec<u8> {
    let out = dir.join(format!("{name}.out"));
    ok(
        pool,
        &["export", name, out.to_str().unwrap_or_default(), "--force"],
    );
    fs::read(&out).unwrap_or_else(|e| panic!("read {}: {e}", out.display()))
}

/// Names of all volumes, internal ones included.
fn volumes(pool: &Path) -> Vec<String> {
    let list = json(&ok(pool, &["volume", "list", "--json", "--all"]));
    list.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v["name"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn stdin_import_round_trips_data_zeros_and_holes() {
    let d = tmp();
    let pool = d.path().join("pool");
    ok(&pool, &["init"]);
    let img = image();
    let out = ok_stdin(
        &pool,
        &["import", "-", "--name", "vm", "--size", "20M"],
        img.clone(),
    );
    assert!(
        out.contains("imported standard input into volume vm") && out.contains("20.00 MiB logical"),
        "{out}"
    );
    assert!(!out.contains("read as zeros"), "input was complete: {out}");
    assert!(
        export(&pool, d.path(), "vm") == img,
        "exported bytes differ"
    );
    // All-zero blocks were skipped, not written as zero blocks: they are holes.
    let info = json(&ok(&pool, &["volume", "info", "vm", "--json"]));
    assert_eq!(info["logical_bytes"].as_u64(), Some(20 << 20), "{info}");
    assert_eq!(
        info["written_bytes"].as_u64(),
        Some(nonzero_blocks(&img) * BS as u64),
        "{info}"
    );
    assert_eq!(info["zero_bytes"].as_u64(), Some(0), "{info}");
    assert_eq!(info["incomplete_import"], false, "{info}");
    // The duplicated MiB is stored once: the pool holds less than the data written.
    let s = json(&ok(&pool, &["stats", "--json"]));
    assert!(
        s["dedup_saving_percent"].as_f64().unwrap_or(0.0) > 10.0,
        "{s}"
    );
}

#[test]
fn stdin_import_shorter_than_size_reads_back_zero_padded() {
    let d = tmp();
    let pool = d.path().join("pool");
    ok(&pool, &["init"]);
    // Ends inside a block, on non-zero bytes.
    let mut input = image();
    input.truncate(9 * MIB + 1000);
    let input_len = input.len();
    let out = ok_stdin(
        &pool,
        &["import", "-", "--name", "short", "--size", "16M"],
        input.clone(),
    );
    assert!(
        out.contains(&format!("({input_len} bytes)")) && out.contains("read as zeros"),
        "the summary should say where the input ended: {out}"
    );
    let back = export(&pool, d.path(), "short");
    assert_eq!(back.len(), 16 * MIB);
    assert!(back[..input_len] == input[..], "imported bytes differ");
    assert!(
        back[input_len..].iter().all(|&b| b == 0),
        "the rest is not zeros"
    );
    let info = json(&ok(&pool, &["volume", "info", "short", "--json"]));
    assert_eq!(
        info["written_bytes"].as_u64(),
        Some(nonzero_blocks(&input) * BS as u64),
        "{info}"
    );
}

#[test]
fn stdin_import_longer_than_size_fails_and_keeps_nothing() {
    let d = tmp();
    let pool = d.path().join("pool");
    ok(&pool, &["init"]);
    let mut input = Rng(9).bytes(2 * MIB);
    input.extend_from_slice(&[7u8; 5000]);
    let e = fails_stdin(
        &pool,
        &["import", "-", "--name", "long", "--size", "2M"],
        input.clone(),
    );
    let total = input.len();
    assert!(
        e.contains("more than --size") && e.contains(&format!("{total} bytes")),
        "the error should say how much input there was: {e}"
    );
    assert!(e.contains("5000 bytes more"), "{e}");
    assert!(e.contains("nothing was kept"), "{e}");
    assert!(volumes(&pool).is_empty(), "{:?}", volumes(&pool));
    // The same input fits a large enough volume.
    ok_stdin(
        &pool,
        &["import", "-", "--name", "long", "--size", "3M"],
        input.clone(),
    );
    assert!(export(&pool, d.path(), "long")[..total] == input[..]);
}

#[test]
fn stdin_import_bad_arguments_fail_and_create_nothing() {
    let d = tmp();
    let pool = d.path().join("pool");
    ok(&pool, &["init"]);
    let input = Rng(3).bytes(MIB);
    let before = dir_snapshot(&pool);
    let e = fails_stdin(&pool, &["import", "-", "--size", "1M"], input.clone());
    assert!(e.contains("needs --name NAME:"), "{e}");
    let e = fails_stdin(&pool, &["import", "-", "--name", "v"], input.clone());
    assert!(e.contains("needs --size SIZE:"), "{e}");
    let e = fails_stdin(&pool, &["import", "-"], input.clone());
    assert!(e.contains("needs --name NAME and --size SIZE"), "{e}");
    let e = fails_stdin(
        &pool,
        &["import", "-", "--name", "v", "--size", "5000"],
        input.clone(),
    );
    assert!(e.contains("not a multiple of the pool's block size"), "{e}");
    let e = fails_stdin(
        &pool,
        &["import", "-", "--name", "v", "--size", "1Q"],
        input.clone(),
    );
    assert!(e.contains("unknown size unit"), "{e}");
    // --size belongs to standard input only.
    let file = d.path().join("f.img");
    fs::write(&file, &input).unwrap_or_else(|e| panic!("write: {e}"));
    let e = fails_stdin(
        &pool,
        &["import", file.to_str().unwrap_or_default(), "--size", "1M"],
        Vec::new(),
    );
    assert!(e.contains("--size is only for"), "{e}");
    assert!(
        dir_snapshot(&pool) == before,
        "a failed command changed the pool"
    );
    // Empty input, and an image format that is not raw: errors, and no volume is left.
    let e = fails_stdin(
        &pool,
        &["import", "-", "--name", "v", "--size", "1M"],
        Vec::new(),
    );
    assert!(e.contains("empty"), "{e}");
    let mut qcow2 = b"QFI\xfb\0\0\0\x03".to_vec();
    qcow2.resize(MIB, 0);
    let e = fails_stdin(
        &pool,
        &["import", "-", "--name", "v", "--size", "1M"],
        qcow2,
    );
    assert!(e.contains("qcow2"), "{e}");
    assert!(volumes(&pool).is_empty(), "{:?}", volumes(&pool));
}

#[test]
fn metadata_cache_option_is_accepted_and_checked() {
    let d = tmp();
    let pool = d.path().join("pool");
    // Too small: a usage error naming the minimum, and no pool.
    let e = check_fails(&[], condense(&pool, &["init", "--metadata-cache", "1"]));
    assert!(
        e.contains("--metadata-cache") && e.contains("minimum"),
        "{e}"
    );
    assert!(!pool.join("lock").exists(), "a pool was created");
    ok(&pool, &["init", "--metadata-cache", "1M"]);
    // Stored in the pool: a later open uses it.
    let stats = json(&ok(&pool, &["stats", "--json"]));
    assert_eq!(stats["metadata_cache_budget_bytes"].as_u64(), Some(1 << 20));
    let input = Rng(5).bytes(MIB);
    let args = [
        "import",
        "-",
        "--name",
        "a",
        "--size",
        "1M",
        "--metadata-cache",
        "1",
    ];
    let e = fails_stdin(&pool, &args, input.clone());
    assert!(e.contains("minimum"), "{e}");
    assert!(volumes(&pool).is_empty());
    ok_stdin(
        &pool,
        &[
            "import",
            "-",
            "--name",
            "a",
            "--size",
            "1M",
            "--metadata-cache",
            "1M",
        ],
        input.clone(),
    );
    let file = d.path().join("b.img");
    fs::write(&file, &input).unwrap_or_else(|e| panic!("write: {e}"));
    ok(
        &pool,
        &[
            "import",
            file.to_str().unwrap_or_default(),
            "--metadata-cache",
            "1M",
        ],
    );
    assert_eq!(volumes(&pool), ["a", "b"]);
    // serve and mount take it too (mount is only parsed: FUSE may be missing here).
    for cmd in ["serve", "mount"] {
        let help = ok(&pool, &[cmd, "--help"]);
        assert!(help.contains("--metadata-cache"), "{help}");
    }
    let e = check_fails(
        &[],
        condense(&pool, &["mount", "/nonexistent", "--metadata-cache", "1"]),
    );
    assert!(e.contains("minimum"), "{e}");
    let sock = d.path().join("nbd.sock");
    let mut server = Command::new(BIN)
        .arg("--pool")
        .arg(&pool)
        .args([
            "serve",
            "--socket",
            sock.to_str().unwrap_or_default(),
            "--metadata-cache",
            "1M",
        ])
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn serve: {e}"));
    let mut serving = false;
    for _ in 0..100 {
        std::thread::sleep(Duration::from_millis(100));
        if sock.exists() {
            serving = true;
            break;
        }
    }
    let _ = Command::new("kill").arg(server.id().to_string()).status();
    let status = server.wait();
    assert!(serving, "serve --metadata-cache 1M did not start");
    assert!(
        status.map(|s| s.success()).unwrap_or(false),
        "serve did not stop cleanly"
    );
    assert!(export(&pool, d.path(), "a") == input);
}

/// The dedup index a clean close saved (`dedup.idx`) is what the next import's first write
/// loads, instead of walking the chunk table; without the file the index is built, and both
/// deduplicate every block of an image imported again.
#[test]
fn the_next_import_loads_the_dedup_index_the_last_one_saved() {
    let dir = tmp();
    let pool = dir.path().join("pool");
    ok(&pool, &["init"]);
    let data = Rng(0xd1d1).bytes(4 * MIB);
    let size = data.len().to_string();
    // With the engine's log on standard error: where the index came from.
    let import = |name: &str| {
        let args = ["import", "-", "--name", name, "--size", &size];
        let mut child = Command::new(BIN)
            .arg("--pool")
            .arg(&pool)
            .args(args)
            .env("CONDENSE_LOG", "info")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run condense: {e}"));
        let mut stdin = child.stdin.take().unwrap_or_else(|| panic!("no stdin"));
        std::io::Write::write_all(&mut stdin, &data).unwrap_or_else(|e| panic!("stdin: {e}"));
        drop(stdin);
        let out = child
            .wait_with_output()
            .unwrap_or_else(|e| panic!("condense import: {e}"));
        check_ok(&args, out.clone());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let unique = |pool: &Path| json(&ok(pool, &["stats", "--json"]))["unique_chunks"].as_u64();
    let first = import("a");
    assert!(first.contains("dedup index saved in dedup.idx"), "{first}");
    let chunks = unique(&pool);
    assert_eq!(chunks, Some((4 * MIB / BS) as u64));
    let second = import("b");
    assert!(
        second.contains("dedup index loaded from dedup.idx"),
        "{second}"
    );
    assert_eq!(unique(&pool), chunks, "every block of b deduplicated");
    fs::remove_file(pool.join("dedup.idx")).unwrap_or_else(|e| panic!("rm dedup.idx: {e}"));
    let third = import("c");
    assert!(third.contains("dedup index built"), "{third}");
    assert_eq!(unique(&pool), chunks, "every block of c deduplicated");
    assert_eq!(
        json(&ok(&pool, &["stats", "--json"]))["dedup_index"].as_str(),
        Some("not built"),
        "stats, a new open, does not need the index"
    );
}

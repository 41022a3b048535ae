//! Snapshot exports (`VOLUME@SNAPSHOT`, read-only) and the `qemu:dirty-bitmap:SNAPSHOT`
//! metadata context: the protocol from a strict test client, then real clients (nbdinfo,
//! qemu-img) when they are installed.

mod common;

use common::*;
use condense_api::mem::MemCatalog;
use condense_api::Catalog;
use condense_nbd::proto::*;
use condense_nbd::{Endpoint, Server, ServerConfig, ServerHandle};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

const BS: u64 = 4096;
const HOLE: u32 = STATE_HOLE | STATE_ZERO;

/// The catalog of `common::catalog()` where vm1 got blocks 0..5 written, then snapshot `s1`,
/// then: block 0 rewritten with the same bytes (not dirty), block 2 rewritten with other
/// bytes, block 3 trimmed, block 5 written fresh (dirty: 2, 3 and 5), then snapshot `s2`.
/// Hidden: snapshot `vm1@.hidden`, and `.internal@s`.
fn snapshot_catalog() -> Arc<MemCatalog> {
    let cat = catalog();
    let v = cat.open("vm1").expect("open vm1");
    for b in 0..5u64 {
        v.write(b * BS, &pattern(b, BS as usize), false)
            .expect("write");
    }
    cat.snapshot_create("vm1", "s1").expect("snapshot s1");
    v.write(0, &pattern(0, BS as usize), false)
        .expect("rewrite");
    v.write(2 * BS, &pattern(100, BS as usize), false)
        .expect("write");
    v.trim(3 * BS, BS, false).expect("trim");
    v.write(5 * BS, &pattern(5, BS as usize), false)
        .expect("write");
    cat.snapshot_create("vm1", "s2").expect("snapshot s2");
    cat.snapshot_create("vm1", ".hidden")
        .expect("snapshot .hidden");
    cat.snapshot_create(".internal", "s")
        .expect("snapshot .internal@s");
    cat
}

/// The bytes that are dirty against s1, as `(offset, len)` runs.
const DIRTY_S1: [(u64, u64); 2] = [(2 * BS, 2 * BS), (5 * BS, BS)];

fn names_of(r: &[OptReply], kind: u32) -> Vec<String> {
    r.iter()
        .filter(|r| r.kind == kind)
        .map(|r| {
            let d = if kind == REP_SERVER {
                let n = be32(&r.data) as usize;
                &r.data[4..4 + n]
            } else {
                &r.data[4..]
            };
            String::from_utf8(d.to_vec()).expect("utf8")
        })
        .collect()
}

fn contexts(r: &[OptReply]) -> Vec<(u32, String)> {
    r.iter()
        .filter(|r| r.kind == REP_META_CONTEXT)
        .map(|r| {
            (
                be32(&r.data),
                String::from_utf8_lossy(&r.data[4..]).into_owned(),
            )
        })
        .collect()
}

/// One block status chunk: context id, whether it was final, its descriptors.
type StatusChunk = (u32, bool, Vec<(u32, u32)>);

/// BLOCK_STATUS, returning every chunk of the reply (or the NBD error).
fn block_status_chunks(
    c: &mut Client,
    offset: u64,
    len: u32,
    flags: u16,
) -> std::io::Result<Result<Vec<StatusChunk>, u32>> {
    let r = c.request(CMD_BLOCK_STATUS, flags, offset, len, &[])?;
    let mut out = Vec::new();
    for chunk in &r {
        match chunk {
            Reply::Chunk {
                kind,
                payload,
                flags,
                ..
            } if *kind == REPLY_TYPE_BLOCK_STATUS => {
                let d = payload[4..]
                    .chunks(8)
                    .map(|d| (be32(&d[..4]), be32(&d[4..])))
                    .collect();
                out.push((be32(payload), flags & REPLY_FLAG_DONE != 0, d));
            }
            other if other.error() != 0 => return Ok(Err(other.error())),
            other => panic!("unexpected block status reply {other:?}"),
        }
    }
    Ok(Ok(out))
}

/// Connect, negotiate structured replies, select `queries` on `export`, GO.
fn open_with(
    addr: std::net::SocketAddr,
    export: &str,
    queries: &[&str],
) -> std::io::Result<(Client, Vec<(u32, String)>)> {
    let mut c = Client::connect(addr)?;
    c.structured_reply()?;
    let r = c.set_meta(export, queries)?;
    assert_eq!(r.last().map(|r| r.kind), Some(REP_ACK), "{r:?}");
    let selected = contexts(&r);
    let r = c.go(export, &[])?;
    assert_eq!(
        r.last().map(|r| r.kind),
        Some(REP_ACK),
        "GO {export}: {r:?}"
    );
    Ok((c, selected))
}

#[test]
fn list_shows_visible_snapshots_after_their_volume() -> TestResult {
    let h = start(snapshot_catalog(), ServerConfig::default());
    let mut c = Client::connect(addr(&h))?;
    let r = c.option(OPT_LIST, &[])?;
    assert_eq!(
        names_of(&r, REP_SERVER),
        vec!["vm1", "vm1@s1", "vm1@s2", "vm2"]
    );
    // Hidden snapshots and snapshots of hidden volumes cannot be opened either.
    for hidden in ["vm1@.hidden", ".internal@s", "vm1@", "@s1"] {
        let r = c.go(hidden, &[])?;
        assert_eq!(r.last().map(|r| r.kind), Some(REP_ERR_UNKNOWN), "{hidden}");
    }
    let r = c.go("vm1@nope", &[])?;
    assert_eq!(r.last().map(|r| r.kind), Some(REP_ERR_UNKNOWN));
    // The default export is still "the only volume": snapshots do not count.
    let one = Arc::new(MemCatalog::new(4096));
    one.create("only", MIB)?;
    one.snapshot_create("only", "snap")?;
    let h = start(one, ServerConfig::default());
    let mut c = Client::connect(addr(&h))?;
    let r = c.go("", &[INFO_NAME])?;
    assert_eq!(r.last().map(|r| r.kind), Some(REP_ACK));
    assert!(r
        .iter()
        .any(|i| i.kind == REP_INFO && be16(&i.data) == INFO_NAME && &i.data[2..] == b"only"));
    Ok(())
}

#[test]
fn snapshot_export_is_read_only_and_serves_the_snapshot() -> TestResult {
    let cat = snapshot_catalog();
    let h = start(cat.clone(), ServerConfig::default());
    let mut c = Client::connect(addr(&h))?;
    let r = c.option(OPT_INFO, &go_data("vm1@s1", &[]))?;
    let export = r
        .iter()
        .find(|i| i.kind == REP_INFO && be16(&i.data) == INFO_EXPORT)
        .ok_or("no NBD_INFO_EXPORT")?;
    let flags = be16(&export.data[10..]);
    assert_ne!(flags & TFLAG_READ_ONLY, 0, "read-only flag in {flags:#x}");
    for f in [
        TFLAG_SEND_TRIM,
        TFLAG_SEND_WRITE_ZEROES,
        TFLAG_SEND_FAST_ZERO,
    ] {
        assert_eq!(flags & f, 0, "flag {f:#x} on a read-only export");
    }
    // A snapshot export offers base:allocation only: no dirty bitmaps of its own.
    c.structured_reply()?;
    let r = c.option(OPT_LIST_META_CONTEXT, &meta_data("vm1@s1", &[]))?;
    assert_eq!(contexts(&r), vec![(0, "base:allocation".to_string())]);
    drop(c);

    let mut c = Client::open(addr(&h), "vm1@s1")?;
    assert_ne!(c.flags & TFLAG_READ_ONLY, 0);
    assert_eq!(c.write(0, &[1, 2, 3], 0)?, EPERM);
    assert_eq!(c.write(0, &[1, 2, 3], CMD_FLAG_FUA)?, EPERM);
    assert_eq!(c.status(CMD_TRIM, 0, 0, 4096, &[])?, EPERM);
    assert_eq!(c.status(CMD_WRITE_ZEROES, 0, 0, 4096, &[])?, EPERM);
    // Nothing changed, and the connection still serves.
    for b in 0..6u64 {
        let want = if b < 5 {
            pattern(b, BS as usize)
        } else {
            vec![0; BS as usize]
        };
        assert!(c.read(b * BS, BS as u32)? == Ok(want), "block {b}");
    }
    assert_eq!(
        c.block_status(0, 8 * BS as u32, 0)?,
        Ok(vec![(5 * BS as u32, 0), (3 * BS as u32, HOLE)])
    );
    assert_eq!(c.status(CMD_FLUSH, 0, 0, 0, &[])?, 0);
    // The live volume went on changing meanwhile.
    let mut b2 = vec![0u8; BS as usize];
    cat.open("vm1")?.read(2 * BS, &mut b2)?;
    assert_eq!(b2, pattern(100, BS as usize));
    Ok(())
}

#[test]
fn dirty_bitmap_contexts_list_and_set() -> TestResult {
    let h = start(snapshot_catalog(), ServerConfig::default());
    let mut c = Client::connect(addr(&h))?;
    c.structured_reply()?;
    let all = |n: &[&str]| -> Vec<(u32, String)> { n.iter().map(|s| (0, s.to_string())).collect() };
    let list = |c: &mut Client, export: &str, q: &[&str]| -> std::io::Result<Vec<(u32, String)>> {
        let r = c.option(OPT_LIST_META_CONTEXT, &meta_data(export, q))?;
        assert_eq!(r.last().map(|r| r.kind), Some(REP_ACK), "{q:?}: {r:?}");
        Ok(contexts(&r))
    };
    // No query: everything, hidden snapshots left out.
    assert_eq!(
        list(&mut c, "vm1", &[])?,
        all(&[
            "base:allocation",
            "qemu:dirty-bitmap:s1",
            "qemu:dirty-bitmap:s2"
        ])
    );
    let bitmaps = all(&["qemu:dirty-bitmap:s1", "qemu:dirty-bitmap:s2"]);
    assert_eq!(list(&mut c, "vm1", &["qemu:"])?, bitmaps);
    assert_eq!(list(&mut c, "vm1", &["qemu:dirty-bitmap:"])?, bitmaps);
    assert_eq!(
        list(&mut c, "vm1", &["qemu:dirty-bitmap:s2", "base:"])?,
        all(&["qemu:dirty-bitmap:s2", "base:allocation"])
    );
    for nothing in [
        "qemu:dirty-bitmap:nope",
        "qemu:dirty-bitmap:.hidden",
        "qemu:allocation-depth",
        "qemu:dirty-bitmap",
    ] {
        assert_eq!(list(&mut c, "vm1", &[nothing])?, vec![], "{nothing}");
    }
    // A volume without snapshots offers base:allocation only.
    assert_eq!(list(&mut c, "vm2", &[])?, all(&["base:allocation"]));
    assert_eq!(list(&mut c, "vm2", &["qemu:"])?, vec![]);

    // SET: every selected context once, with its own nonzero id; unknown names are simply
    // not selected; wildcards select nothing.
    let r = c.set_meta(
        "vm1",
        &[
            "qemu:dirty-bitmap:s2",
            "qemu:dirty-bitmap:nope",
            "base:allocation",
            "qemu:dirty-bitmap:s1",
            "qemu:dirty-bitmap:s2",
        ],
    )?;
    assert_eq!(r.last().map(|r| r.kind), Some(REP_ACK));
    let set = contexts(&r);
    assert_eq!(
        set.iter().map(|(_, n)| n.as_str()).collect::<Vec<_>>(),
        vec![
            "qemu:dirty-bitmap:s2",
            "base:allocation",
            "qemu:dirty-bitmap:s1"
        ]
    );
    let mut ids: Vec<u32> = set.iter().map(|(id, _)| *id).collect();
    assert!(ids.iter().all(|&id| id != 0));
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 3, "ids are unique: {set:?}");
    for wildcard in ["qemu:", "qemu:dirty-bitmap:"] {
        let r = c.set_meta("vm1", &[wildcard])?;
        assert_eq!(contexts(&r), vec![], "{wildcard}");
    }
    // Selecting only an unknown bitmap leaves block status unavailable.
    let r = c.set_meta("vm1", &["qemu:dirty-bitmap:nope"])?;
    assert_eq!(r.len(), 1);
    assert_eq!(c.go("vm1", &[])?.last().map(|r| r.kind), Some(REP_ACK));
    assert_eq!(c.status(CMD_BLOCK_STATUS, 0, 0, 4096, &[])?, EINVAL);
    Ok(())
}

#[test]
fn block_status_answers_every_selected_context() -> TestResult {
    let cat = snapshot_catalog();
    let h = start(cat.clone(), ServerConfig::default());
    let (mut c, selected) = open_with(
        addr(&h),
        "vm1",
        &["base:allocation", "qemu:dirty-bitmap:s1"],
    )?;
    let id_of = |name: &str| -> u32 {
        selected
            .iter()
            .find(|(_, n)| n == name)
            .map(|(id, _)| *id)
            .unwrap_or_else(|| panic!("{name} not selected: {selected:?}"))
    };
    let (base, dirty) = (id_of("base:allocation"), id_of("qemu:dirty-bitmap:s1"));
    let b = |n: u64| (n * BS) as u32;

    // Both contexts, one chunk each, only the last final.
    let r = block_status_chunks(&mut c, 0, b(8), 0)?.map_err(|e| format!("error {e}"))?;
    assert_eq!(r.len(), 2, "{r:?}");
    assert_eq!(
        r.iter().map(|x| x.1).collect::<Vec<_>>(),
        vec![false, true],
        "DONE on the last chunk only"
    );
    let of = |id: u32| -> Vec<(u32, u32)> {
        r.iter()
            .find(|x| x.0 == id)
            .map(|x| x.2.clone())
            .unwrap_or_else(|| panic!("no chunk for context {id}"))
    };
    assert_eq!(
        of(base),
        vec![(b(3), 0), (b(1), HOLE), (b(2), 0), (b(2), HOLE)]
    );
    assert_eq!(
        of(dirty),
        vec![
            (b(2), 0),
            (b(2), STATE_DIRTY),
            (b(1), 0),
            (b(1), STATE_DIRTY),
            (b(2), 0)
        ]
    );

    // REQ_ONE: exactly one descriptor per context, inside the request.
    let r = block_status_chunks(&mut c, BS, b(4), CMD_FLAG_REQ_ONE)?
        .map_err(|e| format!("error {e}"))?;
    assert_eq!(r.len(), 2);
    for (id, _, d) in &r {
        assert_eq!(d.len(), 1, "context {id}: {d:?}");
    }
    assert_eq!(
        r.iter().find(|x| x.0 == base).map(|x| x.2.clone()),
        Some(vec![(b(2), 0)])
    );
    assert_eq!(
        r.iter().find(|x| x.0 == dirty).map(|x| x.2.clone()),
        Some(vec![(b(1), 0)])
    );

    // Unaligned: the descriptors cover exactly the request.
    let r = block_status_chunks(&mut c, 100, 10_000, 0)?.map_err(|e| format!("error {e}"))?;
    for (id, _, d) in &r {
        assert_eq!(d.iter().map(|x| x.0).sum::<u32>(), 10_000, "context {id}");
    }
    assert_eq!(
        r.iter().find(|x| x.0 == dirty).map(|x| x.2.clone()),
        Some(vec![(b(2) - 100, 0), (10_000 - (b(2) - 100), STATE_DIRTY)])
    );
    // The whole export at once, and past the end.
    let r = block_status_chunks(&mut c, 0, 8 * MIB as u32, 0)?.map_err(|e| format!("{e}"))?;
    for (id, _, d) in &r {
        assert_eq!(
            d.iter().map(|x| u64::from(x.0)).sum::<u64>(),
            8 * MIB,
            "{id}"
        );
    }
    assert_eq!(c.status(CMD_BLOCK_STATUS, 0, 8 * MIB - 1, 2, &[])?, EINVAL);
    assert_eq!(c.status(CMD_BLOCK_STATUS, 0, 0, 0, &[])?, EINVAL);

    // A later write is dirty at once.
    assert_eq!(c.write(b(7) as u64 + 1, &[9], 0)?, 0);
    let r = block_status_chunks(&mut c, b(7) as u64, b(1), 0)?.map_err(|e| format!("{e}"))?;
    assert_eq!(
        r.iter().find(|x| x.0 == dirty).map(|x| x.2.clone()),
        Some(vec![(b(1), STATE_DIRTY)])
    );

    // A snapshot deleted under a connection: an error, never a wrong answer.
    cat.snapshot_delete("vm1", "s1")?;
    assert_ne!(c.status(CMD_BLOCK_STATUS, 0, 0, b(1), &[])?, 0);
    assert_eq!(c.status(CMD_FLUSH, 0, 0, 0, &[])?, 0);
    Ok(())
}

#[test]
fn dirty_bitmap_alone_and_against_a_later_snapshot() -> TestResult {
    let cat = snapshot_catalog();
    let h = start(cat.clone(), ServerConfig::default());
    let (mut c, selected) = open_with(addr(&h), "vm1", &["qemu:dirty-bitmap:s2"])?;
    assert_eq!(selected.len(), 1);
    let id = selected[0].0;
    assert_ne!(id, 0);
    // Nothing changed since s2.
    let r = block_status_chunks(&mut c, 0, 8 * MIB as u32, 0)?.map_err(|e| format!("{e}"))?;
    assert_eq!(r, vec![(id, true, vec![(8 * MIB as u32, 0)])]);
    // Rewriting a block with its own content is not a change; other content is.
    let mut same = vec![0u8; BS as usize];
    cat.open("vm1")?.read(4 * BS, &mut same)?;
    assert_eq!(c.write(4 * BS, &same, 0)?, 0);
    assert_eq!(c.write(6 * BS, &pattern(6, 10), 0)?, 0);
    let r = block_status_chunks(&mut c, 0, (8 * BS) as u32, CMD_FLAG_REQ_ONE)?
        .map_err(|e| format!("{e}"))?;
    assert_eq!(r, vec![(id, true, vec![((6 * BS) as u32, 0)])]);
    let r = block_status_chunks(&mut c, 0, (8 * BS) as u32, 0)?.map_err(|e| format!("{e}"))?;
    assert_eq!(
        r,
        vec![(
            id,
            true,
            vec![
                ((6 * BS) as u32, 0),
                (BS as u32, STATE_DIRTY),
                (BS as u32, 0)
            ]
        )]
    );
    Ok(())
}

// Real clients. Each test skips (saying why) when its tool is missing, unless CI=true.

/// Whether `tool` can run; without it, fail on CI and skip elsewhere.
fn have(tool: &str) -> bool {
    let found = Command::new(tool)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{tool} is required on CI (scripts/install-deps.sh installs it)"
        );
        eprintln!("skipped: {tool} is not installed (scripts/install-deps.sh installs it)");
    }
    found
}

/// A server over `cat` on a Unix socket in `dir`.
fn start_unix(
    cat: Arc<MemCatalog>,
    dir: &Path,
) -> Result<(ServerHandle, String), Box<dyn std::error::Error>> {
    let sock = dir.join("nbd.sock");
    let server = Server::bind(
        cat,
        ServerConfig::default(),
        &[Endpoint::Unix(sock.clone())],
    )?;
    let sock = sock.to_str().ok_or("socket path is not UTF-8")?.to_string();
    Ok((server.spawn()?, sock))
}

fn run(cmd: &mut Command) -> Result<String, Box<dyn std::error::Error>> {
    let out = cmd.output()?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        return Err(format!(
            "{cmd:?} failed ({}):\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    Ok(stdout)
}

/// Merge `(offset, len)` runs that touch.
fn merged(mut runs: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    runs.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (o, l) in runs {
        match out.last_mut() {
            Some(last) if last.0 + last.1 == o => last.1 += l,
            _ => out.push((o, l)),
        }
    }
    out
}

#[test]
fn nbdinfo_maps_the_dirty_bitmap_and_lists_snapshots() -> TestResult {
    if !have("nbdinfo") {
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let (_h, sock) = start_unix(snapshot_catalog(), dir.path())?;
    let map = run(Command::new("nbdinfo")
        .arg("--map=qemu:dirty-bitmap:s1")
        .arg(format!("nbd+unix:///vm1?socket={sock}")))?;
    // Lines: offset length flags description.
    let mut dirty = Vec::new();
    let mut covered = 0u64;
    for line in map.lines().filter(|l| !l.trim().is_empty()) {
        let f: Vec<&str> = line.split_whitespace().collect();
        assert!(f.len() >= 3, "nbdinfo map line {line:?}");
        let (offset, len, flags): (u64, u64, u32) = (f[0].parse()?, f[1].parse()?, f[2].parse()?);
        assert_eq!(offset, covered, "extents are contiguous: {map}");
        covered += len;
        match flags {
            1 => {
                assert!(line.contains("dirty"), "{line}");
                dirty.push((offset, len));
            }
            0 => assert!(line.contains("clean"), "{line}"),
            other => panic!("flags {other} in {line:?}"),
        }
    }
    assert_eq!(covered, 8 * MIB, "the map covers the export:\n{map}");
    assert_eq!(merged(dirty), DIRTY_S1.to_vec(), "nbdinfo map:\n{map}");

    // Nothing dirty since s2.
    let map = run(Command::new("nbdinfo")
        .arg("--map=qemu:dirty-bitmap:s2")
        .arg(format!("nbd+unix:///vm1?socket={sock}")))?;
    assert_eq!(map.lines().count(), 1, "{map}");
    assert!(map.contains("clean"), "{map}");

    let list = run(Command::new("nbdinfo")
        .arg("--list")
        .arg(format!("nbd+unix:///?socket={sock}")))?;
    for export in ["vm1", "vm1@s1", "vm1@s2", "vm2"] {
        assert!(
            list.contains(&format!("export=\"{export}\"")),
            "{export} in nbdinfo --list:\n{list}"
        );
    }
    assert!(
        !list.contains(".hidden") && !list.contains(".internal"),
        "{list}"
    );
    assert!(
        list.contains("qemu:dirty-bitmap:s1"),
        "contexts listed:\n{list}"
    );

    let info = run(Command::new("nbdinfo").arg(format!("nbd+unix:///vm1@s1?socket={sock}")))?;
    assert!(info.contains("is_read_only: true"), "{info}");
    Ok(())
}

#[test]
fn qemu_img_reads_the_snapshot_export_and_maps_the_dirty_bitmap() -> TestResult {
    if !have("qemu-img") {
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let cat = snapshot_catalog();
    let mut snap = vec![0u8; 8 * MIB as usize];
    cat.open("vm1@s1")?.read(0, &mut snap)?;
    let raw = dir.path().join("s1.raw");
    std::fs::write(&raw, &snap)?;
    let (_h, sock) = start_unix(cat, dir.path())?;
    let out = run(Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&raw)
        .arg(format!("nbd+unix:///vm1@s1?socket={sock}")))?;
    assert!(out.contains("identical"), "{out}");
    // The live volume differs from its snapshot.
    let st = Command::new("qemu-img")
        .args(["compare", "-q", "-f", "raw", "-F", "raw"])
        .arg(&raw)
        .arg(format!("nbd+unix:///vm1?socket={sock}"))
        .status()?;
    assert_eq!(st.code(), Some(1), "compare against the live volume");

    // qemu's client reads the bitmap in place of base:allocation: dirty = "data": false.
    let map = run(Command::new("qemu-img").args([
        "map",
        "--output=json",
        "--image-opts",
        &format!(
            "driver=nbd,server.type=unix,server.path={sock},export=vm1,\
             x-dirty-bitmap=qemu:dirty-bitmap:s1"
        ),
    ]))?;
    let mut dirty = Vec::new();
    for line in map.lines().filter(|l| l.contains("\"start\"")) {
        let field = |name: &str| -> Option<&str> {
            let at = line.find(&format!("\"{name}\":"))? + name.len() + 3;
            let rest = line[at..].trim_start();
            let end = rest.find([',', '}']).unwrap_or(rest.len());
            Some(rest[..end].trim())
        };
        let (start, len) = (
            field("start").ok_or("start")?.parse::<u64>()?,
            field("length").ok_or("length")?.parse::<u64>()?,
        );
        if field("data") == Some("false") {
            dirty.push((start, len));
        }
    }
    assert_eq!(merged(dirty), DIRTY_S1.to_vec(), "qemu-img map:\n{map}");
    Ok(())
}

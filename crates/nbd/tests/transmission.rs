//! The transmission phase: every command, structured and simple replies, pipelining.

mod common;

use common::*;
use condense_api::mem::MemCatalog;
use condense_api::{Catalog, ExtentKind, Volume};
use condense_nbd::proto::*;
use condense_nbd::ServerConfig;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

const HOLE: u32 = STATE_HOLE | STATE_ZERO;

#[test]
fn write_read_round_trip_aligned_and_unaligned() -> TestResult {
    let cat = catalog();
    let h = start(cat.clone(), ServerConfig::default());
    let mut c = Client::open(addr(&h), "vm1")?;
    let mut model = vec![0u8; 8 * MIB as usize];
    let writes: &[(u64, usize)] = &[
        (0, 4096),
        (4096 * 3, 65536),
        (1, 1),
        (4095, 2),
        (12345, 100_000),
        (8 * MIB - 7, 7),
    ];
    for (i, &(off, n)) in writes.iter().enumerate() {
        let d = pattern(i as u64, n);
        let flags = if i % 2 == 0 { CMD_FLAG_FUA } else { 0 };
        assert_eq!(c.write(off, &d, flags)?, 0);
        model[off as usize..off as usize + n].copy_from_slice(&d);
    }
    for &(off, n) in &[
        (0u64, 8 * MIB as u32),
        (3, 5000),
        (4090, 20),
        (8 * MIB - 100, 100),
        (5 * MIB, 4096),
    ] {
        let got = c.read(off, n)?.map_err(|e| format!("read error {e}"))?;
        assert!(
            got == model[off as usize..off as usize + n as usize],
            "read {off}+{n}"
        );
    }
    // What the client wrote is what the volume holds.
    let mut direct = vec![0u8; 8 * MIB as usize];
    cat.open("vm1")?.read(0, &mut direct)?;
    assert!(direct == model);
    assert_eq!(c.status(CMD_FLUSH, 0, 0, 0, &[])?, 0);
    Ok(())
}

#[test]
fn structured_reads_send_holes_for_zero_and_unmapped_blocks() -> TestResult {
    let h = start(catalog(), ServerConfig::default());
    let mut c = Client::open(addr(&h), "vm1")?;
    assert_eq!(c.write(4096, &pattern(1, 4096), 0)?, 0);
    assert_eq!(
        c.status(CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE, 8192, 4096, &[])?,
        0
    );
    let r = c.request(CMD_READ, 0, 0, 16384, &[])?;
    let kinds: Vec<(u16, u64)> = r
        .iter()
        .map(|c| match c {
            Reply::Chunk { kind, payload, .. } => (*kind, be64(payload)),
            other => panic!("simple reply {other:?}"),
        })
        .collect();
    assert_eq!(
        kinds,
        vec![
            (REPLY_TYPE_OFFSET_HOLE, 0),
            (REPLY_TYPE_OFFSET_DATA, 4096),
            (REPLY_TYPE_OFFSET_HOLE, 8192)
        ]
    );
    assert!(r.last().is_some_and(Reply::done));
    assert_eq!(r.iter().filter(|c| c.done()).count(), 1);
    let mut expect = vec![0u8; 16384];
    expect[4096..8192].copy_from_slice(&pattern(1, 4096));
    assert_eq!(assemble_read(&r, 0, 16384), Ok(expect.clone()));
    // DF: one content chunk, zeros inline.
    let r = c.request(CMD_READ, CMD_FLAG_DF, 0, 16384, &[])?;
    assert_eq!(r.len(), 1);
    assert_eq!(assemble_read(&r, 0, 16384), Ok(expect));
    // A zero-length read succeeds with no content.
    let r = c.request(CMD_READ, 0, 100, 0, &[])?;
    assert!(matches!(
        r.as_slice(),
        [Reply::Chunk {
            kind: REPLY_TYPE_NONE,
            ..
        }]
    ));
    Ok(())
}

#[test]
fn block_status_maps_extent_kinds_to_base_allocation() -> TestResult {
    let h = start(catalog(), ServerConfig::default());
    let mut c = Client::open(addr(&h), "vm1")?;
    assert_eq!(c.write(0, &pattern(2, 8192), 0)?, 0);
    // NO_HOLE keeps blocks allocated: ZERO. Without it they become holes.
    assert_eq!(
        c.status(CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE, 8192, 8192, &[])?,
        0
    );
    assert_eq!(c.write(16384, &pattern(3, 8192), 0)?, 0);
    assert_eq!(c.status(CMD_WRITE_ZEROES, 0, 16384, 4096, &[])?, 0);
    // TRIM releases blocks.
    assert_eq!(c.status(CMD_TRIM, 0, 20480, 4096, &[])?, 0);
    let d = c
        .block_status(0, 65536, 0)?
        .map_err(|e| format!("error {e}"))?;
    assert_eq!(
        d,
        vec![(8192, 0), (8192, STATE_ZERO), (65536 - 16384, HOLE)]
    );
    // Unaligned query: clipped to the request.
    let d = c
        .block_status(100, 8192, 0)?
        .map_err(|e| format!("error {e}"))?;
    assert_eq!(d, vec![(8092, 0), (100, STATE_ZERO)]);
    // REQ_ONE: exactly one descriptor, never longer than asked.
    let d = c
        .block_status(0, 4096, CMD_FLAG_REQ_ONE)?
        .map_err(|e| format!("error {e}"))?;
    assert_eq!(d, vec![(4096, 0)]);
    let d = c
        .block_status(8192, 65536, CMD_FLAG_REQ_ONE)?
        .map_err(|e| format!("error {e}"))?;
    assert_eq!(d, vec![(8192, STATE_ZERO)]);
    // The whole 8 MiB volume.
    let d = c
        .block_status(0, 8 << 20, 0)?
        .map_err(|e| format!("error {e}"))?;
    assert_eq!(d.iter().map(|x| u64::from(x.0)).sum::<u64>(), 8 * MIB);
    Ok(())
}

#[test]
fn write_zeroes_fast_zero_and_fua_succeed_and_read_zero() -> TestResult {
    let h = start(catalog(), ServerConfig::default());
    let mut c = Client::open(addr(&h), "vm1")?;
    assert_eq!(c.write(0, &vec![0xaa; 65536], 0)?, 0);
    assert_eq!(
        c.status(
            CMD_WRITE_ZEROES,
            CMD_FLAG_FAST_ZERO | CMD_FLAG_FUA,
            100,
            60000,
            &[]
        )?,
        0
    );
    let got = c.read(0, 65536)?.map_err(|e| format!("error {e}"))?;
    assert!(got[..100].iter().all(|&b| b == 0xaa));
    assert!(got[100..60100].iter().all(|&b| b == 0));
    assert!(got[60100..].iter().all(|&b| b == 0xaa));
    // Zero-length trims and zeroes are no-ops that succeed.
    assert_eq!(c.status(CMD_TRIM, 0, 0, 0, &[])?, 0);
    assert_eq!(c.status(CMD_WRITE_ZEROES, 0, 0, 0, &[])?, 0);
    // CACHE is advertised and succeeds.
    assert_ne!(c.flags & TFLAG_SEND_CACHE, 0);
    assert_eq!(c.status(CMD_CACHE, 0, 0, 4096, &[])?, 0);
    Ok(())
}

#[test]
fn simple_replies_without_structured_negotiation() -> TestResult {
    let h = start(catalog(), ServerConfig::default());
    let mut c = Client::connect(addr(&h))?;
    assert_eq!(c.go("vm2", &[])?.last().map(|r| r.kind), Some(REP_ACK));
    assert_eq!(c.flags & TFLAG_SEND_DF, 0);
    let d = pattern(5, 3000);
    assert_eq!(c.write(1000, &d, 0)?, 0);
    let r = c.request(CMD_READ, 0, 1000, 3000, &[])?;
    assert!(matches!(&r[..], [Reply::Simple { error: 0, data, .. }] if *data == d));
    // Errors are simple replies with no data.
    let r = c.request(CMD_READ, 0, MIB, 1, &[])?;
    assert!(matches!(&r[..], [Reply::Simple { error: EINVAL, data, .. }] if data.is_empty()));
    // DF and block status need structured replies.
    assert_eq!(c.status(CMD_READ, CMD_FLAG_DF, 0, 1, &[])?, EINVAL);
    assert_eq!(c.status(CMD_BLOCK_STATUS, 0, 0, 4096, &[])?, EINVAL);
    // The stream is still in step.
    assert_eq!(c.read(1000, 3000)?, Ok(d));
    Ok(())
}

#[test]
fn pipelined_requests_all_get_their_replies() -> TestResult {
    let h = start(catalog(), ServerConfig::default());
    let mut c = Client::open(addr(&h), "vm1")?;
    let n = 200u64;
    // Writes of distinct blocks, all sent before reading any reply.
    for i in 0..n {
        c.send_request(CMD_WRITE, 0, i, i * 4096, 4096, &pattern(i, 4096))?;
    }
    let mut seen = HashMap::new();
    while seen.len() < n as usize {
        let r = c.read_reply()?;
        assert_eq!(r.error(), 0);
        assert!(r.done());
        assert!(seen.insert(r.cookie(), ()).is_none(), "duplicate reply");
    }
    // Then pipelined reads, reassembled per cookie.
    for i in 0..n {
        c.send_request(CMD_READ, 0, 1000 + i, i * 4096, 4096, &[])?;
    }
    let mut chunks: BTreeMap<u64, Vec<Reply>> = BTreeMap::new();
    let mut done = 0;
    while done < n {
        let r = c.read_reply()?;
        if r.done() {
            done += 1;
        }
        chunks.entry(r.cookie()).or_default().push(r);
    }
    for i in 0..n {
        let r = &chunks[&(1000 + i)];
        assert_eq!(assemble_read(r, i * 4096, 4096), Ok(pattern(i, 4096)));
    }
    Ok(())
}

#[test]
fn disc_answers_outstanding_requests_then_closes() -> TestResult {
    let cat = catalog();
    let h = start(cat.clone(), ServerConfig::default());
    let mut c = Client::open(addr(&h), "vm1")?;
    for i in 0..32u64 {
        c.send_request(CMD_WRITE, 0, i, i * 65536, 65536, &pattern(i, 65536))?;
    }
    c.send_request(CMD_DISC, 0, 99, 0, 0, &[])?;
    for _ in 0..32 {
        assert_eq!(c.read_reply()?.error(), 0);
    }
    c.expect_closed();
    let v = cat.open("vm1")?;
    let mut b = vec![0u8; 65536];
    v.read(31 * 65536, &mut b)?;
    assert_eq!(b, pattern(31, 65536));
    Ok(())
}

#[test]
fn many_clients_at_once_on_different_and_shared_exports() -> TestResult {
    let h = start(catalog(), ServerConfig::default());
    let a = addr(&h);
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            std::thread::spawn(move || -> Result<(), String> {
                let name = if t % 2 == 0 { "vm1" } else { "vm2" };
                let mut c = Client::open(a, name).map_err(|e| e.to_string())?;
                for i in 0..20u64 {
                    // Each thread owns its own 16 KiB stripe of the first MiB.
                    let off = (t / 2) * 65536 * 4 + (i % 4) * 16384;
                    let d = pattern(t * 100 + i, 16384);
                    if c.write(off, &d, 0).map_err(|e| e.to_string())? != 0 {
                        return Err("write failed".into());
                    }
                    if c.read(off, 16384).map_err(|e| e.to_string())? != Ok(d) {
                        return Err(format!("thread {t} read back wrong data"));
                    }
                }
                Ok(())
            })
        })
        .collect();
    for t in threads {
        t.join().map_err(|_| "thread panicked")??;
    }
    Ok(())
}

#[test]
fn read_only_server_refuses_writes_with_eperm() -> TestResult {
    let cat = catalog();
    cat.open("vm1")?.write(0, b"keep", false)?;
    let config = ServerConfig {
        read_only: true,
        ..ServerConfig::default()
    };
    let h = start(cat.clone(), config);
    let mut c = Client::open(addr(&h), "vm1")?;
    assert_ne!(c.flags & TFLAG_READ_ONLY, 0);
    assert_eq!(c.flags & (TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES), 0);
    assert_eq!(c.write(0, b"lose", 0)?, EPERM);
    assert_eq!(c.status(CMD_TRIM, 0, 0, 4096, &[])?, EPERM);
    assert_eq!(c.status(CMD_WRITE_ZEROES, 0, 0, 4096, &[])?, EPERM);
    assert_eq!(c.read(0, 4)?, Ok(b"keep".to_vec()));
    assert_eq!(c.status(CMD_FLUSH, 0, 0, 0, &[])?, 0);
    Ok(())
}

/// A catalog whose volume "bad" fails every call with the error its name suffix asks for.
struct Faulty(Arc<MemCatalog>);
struct FaultyVolume(Arc<dyn Volume>, fn() -> condense_api::VolumeError);

impl Volume for FaultyVolume {
    fn name(&self) -> &str {
        self.0.name()
    }
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn block_size(&self) -> u32 {
        self.0.block_size()
    }
    fn is_read_only(&self) -> bool {
        false
    }
    fn flush_is_pool_wide(&self) -> bool {
        false
    }
    fn read(&self, _: u64, _: &mut [u8]) -> condense_api::Result<()> {
        Err((self.1)())
    }
    fn write(&self, _: u64, _: &[u8], _: bool) -> condense_api::Result<()> {
        Err((self.1)())
    }
    fn write_zeroes(&self, _: u64, _: u64, _: bool, _: bool) -> condense_api::Result<()> {
        Err((self.1)())
    }
    fn trim(&self, _: u64, _: u64, _: bool) -> condense_api::Result<()> {
        Err((self.1)())
    }
    fn flush(&self) -> condense_api::Result<()> {
        Err((self.1)())
    }
    fn block_status(&self, o: u64, l: u64) -> condense_api::Result<Vec<condense_api::Extent>> {
        Ok(vec![condense_api::Extent {
            offset: o,
            len: l,
            kind: ExtentKind::Data,
        }])
    }
}

impl Catalog for Faulty {
    fn list(&self) -> condense_api::Result<Vec<condense_api::VolumeInfo>> {
        self.0.list()
    }
    fn open(&self, name: &str) -> condense_api::Result<Arc<dyn Volume>> {
        let v = self.0.open(name)?;
        let err: fn() -> condense_api::VolumeError = match name {
            "corrupt" => {
                || condense_api::VolumeError::Corrupt("checksum mismatch in segment 3".into())
            }
            "full" => || condense_api::VolumeError::NoSpace("disk full".into()),
            "rofs" => || condense_api::VolumeError::ReadOnly,
            _ => return Ok(v),
        };
        Ok(Arc::new(FaultyVolume(v, err)))
    }
    fn create(&self, name: &str, size: u64) -> condense_api::Result<()> {
        self.0.create(name, size)
    }
    fn delete(&self, name: &str) -> condense_api::Result<()> {
        self.0.delete(name)
    }
    fn resize(&self, name: &str, size: u64, force: bool) -> condense_api::Result<()> {
        self.0.resize(name, size, force)
    }
    fn usage(&self) -> condense_api::Result<condense_api::PoolUsage> {
        self.0.usage()
    }
    fn flush(&self) -> condense_api::Result<()> {
        self.0.flush()
    }
    fn meta_get(&self, key: &str) -> condense_api::Result<Option<Vec<u8>>> {
        self.0.meta_get(key)
    }
    fn meta_put(&self, key: &str, value: Option<&[u8]>) -> condense_api::Result<()> {
        self.0.meta_put(key, value)
    }
}

#[test]
fn volume_errors_become_nbd_errors_with_messages() -> TestResult {
    let mem = Arc::new(MemCatalog::new(4096));
    for n in ["corrupt", "full", "rofs"] {
        mem.create(n, MIB)?;
    }
    let h = start(Arc::new(Faulty(mem)), ServerConfig::default());
    for (name, errno) in [("corrupt", EIO), ("full", ENOSPC), ("rofs", EPERM)] {
        let mut c = Client::open(addr(&h), name)?;
        // Not pool-wide: no multi-conn promise.
        assert_eq!(c.flags & TFLAG_CAN_MULTI_CONN, 0);
        assert_eq!(c.write(0, b"x", 0)?, errno, "{name} write");
        assert_eq!(c.status(CMD_FLUSH, 0, 0, 0, &[])?, errno, "{name} flush");
        assert_eq!(c.status(CMD_TRIM, 0, 0, 4096, &[])?, errno, "{name} trim");
        let r = c.request(CMD_READ, 0, 0, 4096, &[])?;
        assert_eq!(r.len(), 1, "a failed read sends only its error chunk");
        assert_eq!(r[0].error(), errno);
        if let Reply::Chunk { payload, .. } = &r[0] {
            let msg = String::from_utf8_lossy(&payload[6..]);
            assert!(!msg.is_empty(), "error chunk carries a message");
        }
    }
    Ok(())
}

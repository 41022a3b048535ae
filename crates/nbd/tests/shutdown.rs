//! Graceful shutdown: stop accepting, answer every request in flight, close, flush the pool.

mod common;

use common::*;
use condense_api::mem::MemCatalog;
use condense_api::{Catalog, Volume};
use condense_nbd::proto::*;
use condense_nbd::ServerConfig;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A MemCatalog that counts pool flushes and slows writes down, so that shutdown finds
/// requests in flight.
struct Counting {
    inner: Arc<MemCatalog>,
    flushes: AtomicUsize,
}

struct SlowVolume(Arc<dyn Volume>);

impl Volume for SlowVolume {
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
        self.0.is_read_only()
    }
    fn flush_is_pool_wide(&self) -> bool {
        true
    }
    fn read(&self, o: u64, b: &mut [u8]) -> condense_api::Result<()> {
        self.0.read(o, b)
    }
    fn write(&self, o: u64, d: &[u8], fua: bool) -> condense_api::Result<()> {
        std::thread::sleep(Duration::from_millis(20));
        self.0.write(o, d, fua)
    }
    fn write_zeroes(&self, o: u64, l: u64, u: bool, f: bool) -> condense_api::Result<()> {
        self.0.write_zeroes(o, l, u, f)
    }
    fn trim(&self, o: u64, l: u64, f: bool) -> condense_api::Result<()> {
        self.0.trim(o, l, f)
    }
    fn flush(&self) -> condense_api::Result<()> {
        self.0.flush()
    }
    fn block_status(&self, o: u64, l: u64) -> condense_api::Result<Vec<condense_api::Extent>> {
        self.0.block_status(o, l)
    }
}

impl Catalog for Counting {
    fn list(&self) -> condense_api::Result<Vec<condense_api::VolumeInfo>> {
        self.inner.list()
    }
    fn open(&self, name: &str) -> condense_api::Result<Arc<dyn Volume>> {
        Ok(Arc::new(SlowVolume(self.inner.open(name)?)))
    }
    fn create(&self, name: &str, size: u64) -> condense_api::Result<()> {
        self.inner.create(name, size)
    }
    fn delete(&self, name: &str) -> condense_api::Result<()> {
        self.inner.delete(name)
    }
    fn resize(&self, name: &str, size: u64, force: bool) -> condense_api::Result<()> {
        self.inner.resize(name, size, force)
    }
    fn usage(&self) -> condense_api::Result<condense_api::PoolUsage> {
        self.inner.usage()
    }
    fn flush(&self) -> condense_api::Result<()> {
        self.flushes.fetch_add(1, Ordering::SeqCst);
        self.inner.flush()
    }
    fn meta_get(&self, key: &str) -> condense_api::Result<Option<Vec<u8>>> {
        self.inner.meta_get(key)
    }
    fn meta_put(&self, key: &str, value: Option<&[u8]>) -> condense_api::Result<()> {
        self.inner.meta_put(key, value)
    }
}

#[test]
fn shutdown_answers_in_flight_requests_closes_and_flushes() -> TestResult {
    let inner = catalog();
    let cat = Arc::new(Counting {
        inner: inner.clone(),
        flushes: AtomicUsize::new(0),
    });
    let h = start(cat.clone(), ServerConfig::default());
    let a = addr(&h);
    let mut c = Client::open(a, "vm1")?;
    let mut idle = Client::connect(a)?; // still negotiating
    let n = 40u64;
    // 32 KiB writes: a worker thread runs them (writes up to 16 KiB run on the connection's
    // task, which would still be busy with them at shutdown rather than have them in flight).
    const LEN: u32 = 32 * 1024;
    for i in 0..n {
        let at = i * u64::from(LEN);
        c.send_request(CMD_WRITE, 0, i, at, LEN, &pattern(i, LEN as usize))?;
    }
    // Let the server read them all, then shut down while the slow writes are in flight.
    std::thread::sleep(Duration::from_millis(100));
    let stopper = std::thread::spawn(move || h.shutdown());
    let mut replies = 0;
    while replies < n {
        let r = c.read_reply()?;
        assert_eq!(r.error(), 0, "in-flight write failed at shutdown");
        replies += 1;
    }
    c.expect_closed();
    idle.expect_closed();
    stopper.join().map_err(|_| "shutdown panicked")??;
    assert!(
        cat.flushes.load(Ordering::SeqCst) >= 1,
        "pool flushed at shutdown"
    );
    // Every acknowledged write is in the volume.
    let v = inner.open("vm1")?;
    for i in 0..n {
        let mut b = vec![0u8; LEN as usize];
        v.read(i * u64::from(LEN), &mut b)?;
        assert_eq!(b, pattern(i, LEN as usize));
    }
    // Nobody listens any more.
    assert!(std::net::TcpStream::connect(a).is_err());
    Ok(())
}

#[test]
fn dropping_the_handle_shuts_down() -> TestResult {
    let h = start(catalog(), ServerConfig::default());
    let a = addr(&h);
    let mut c = Client::open(a, "vm2")?;
    drop(h);
    c.expect_closed();
    assert!(std::net::TcpStream::connect(a).is_err());
    Ok(())
}

#[test]
fn a_stalled_client_cannot_hold_shutdown_past_the_drain_timeout() -> TestResult {
    let config = ServerConfig {
        drain_timeout: Duration::from_millis(300),
        ..ServerConfig::default()
    };
    let h = start(catalog(), config);
    let mut c = Client::open(addr(&h), "vm1")?;
    // A write header whose payload never comes.
    let mut m = REQUEST_MAGIC.to_be_bytes().to_vec();
    m.extend_from_slice(&[0, 0, 0, 1]);
    m.extend_from_slice(&[0; 8]);
    m.extend_from_slice(&[0; 8]);
    m.extend_from_slice(&4096u32.to_be_bytes());
    std::io::Write::write_all(&mut c.s, &m)?;
    std::thread::sleep(Duration::from_millis(50));
    let t = std::time::Instant::now();
    h.shutdown()?;
    assert!(t.elapsed() < Duration::from_secs(10));
    c.expect_closed();
    Ok(())
}

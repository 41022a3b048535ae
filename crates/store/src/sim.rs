//! A simulated disk for crash testing, behind the same [`Dir`]/[`File`] seam as the real one.
//!
//! Fault model (every choice comes from one seed, so a failing run replays exactly):
//! - **Lost writes**: a write or `set_len` not followed by `sync` of its file may vanish in a
//!   crash; a created, renamed or removed name not followed by `sync_dir` may revert.
//! - **Torn writes**: an unsynced write may persist only in part (a 512-byte-aligned prefix).
//! - **Stop**: after the Nth I/O call every call fails, like a machine that lost power; the
//!   engine must then refuse to go on and the test takes a crash image.
//!
//! [`SimDir::crash`] builds the disk a reboot would see: durable state, plus, per file, a
//! random prefix of its unsynced operations (the last one possibly torn), plus a random prefix
//! of the unsynced directory operations.
//!
//! To pin an ordering between threads, a test may hold the reads of a file
//! ([`SimDir::hold_reads`]): they wait until it lets them go.

use crate::io::{Dir, File};
use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// A small deterministic generator (splitmix64), so the simulation needs no outside crate.
#[derive(Clone, Debug)]
pub struct SimRng(u64);

impl SimRng {
    pub fn new(seed: u64) -> SimRng {
        SimRng(seed ^ 0x9e37_79b9_7f4a_7c15)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

#[derive(Clone, Debug)]
enum FileOp {
    Write(u64, Vec<u8>),
    SetLen(u64),
}

#[derive(Clone, Debug, Default)]
struct FileData {
    live: Vec<u8>,
    durable: Vec<u8>,
    pending: Vec<FileOp>,
}

fn apply(buf: &mut Vec<u8>, op: &FileOp) {
    match op {
        FileOp::Write(off, data) => {
            let end = *off as usize + data.len();
            if buf.len() < end {
                buf.resize(end, 0);
            }
            buf[*off as usize..end].copy_from_slice(data);
        }
        FileOp::SetLen(len) => buf.resize(*len as usize, 0),
    }
}

#[derive(Clone, Debug)]
enum DirOp {
    Link(String, usize),
    Unlink(String),
    Rename(String, String, usize),
}

#[derive(Default)]
struct DiskState {
    files: Vec<Arc<Mutex<FileData>>>,
    live: BTreeMap<String, usize>,
    durable: BTreeMap<String, usize>,
    pending: Vec<DirOp>,
}

/// The simulated disk.
pub struct SimDir {
    state: Mutex<DiskState>,
    calls: AtomicU64,
    /// Calls numbered at or above this fail (u64::MAX: never).
    stop_at: AtomicU64,
    /// The disk's size for `available_bytes` (u64::MAX: 1 TiB always free).
    capacity: AtomicU64,
    /// Files (by index in `DiskState::files`) whose reads wait ([`SimDir::hold_reads`]).
    reads_held: Mutex<BTreeSet<usize>>,
    reads_let_go: Condvar,
}

struct SimFile {
    data: Arc<Mutex<FileData>>,
    disk: Arc<SimDir>,
    /// Its index in `DiskState::files`.
    id: usize,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn power_lost() -> io::Error {
    io::Error::other("simulated power loss")
}

impl SimDir {
    pub fn new() -> Arc<SimDir> {
        Arc::new(SimDir {
            state: Mutex::new(DiskState::default()),
            calls: AtomicU64::new(0),
            stop_at: AtomicU64::new(u64::MAX),
            capacity: AtomicU64::new(u64::MAX),
            reads_held: Mutex::new(BTreeSet::new()),
            reads_let_go: Condvar::new(),
        })
    }

    /// Make the disk `bytes` large: `available_bytes` is then what the live files leave.
    pub fn set_capacity(&self, bytes: u64) {
        self.capacity.store(bytes, Ordering::SeqCst);
    }

    /// Fail every I/O call from the `n`th (counted from now) on.
    pub fn stop_after(&self, n: u64) {
        let now = self.calls.load(Ordering::SeqCst);
        self.stop_at.store(now.saturating_add(n), Ordering::SeqCst);
    }

    /// I/O calls made so far.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }

    fn tick(&self) -> io::Result<()> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        if n >= self.stop_at.load(Ordering::SeqCst) {
            return Err(power_lost());
        }
        Ok(())
    }

    /// The disk as it would be found after power loss now, with unsynced state chosen by `rng`.
    pub fn crash(&self, rng: &mut SimRng) -> Arc<SimDir> {
        let st = lock(&self.state);
        // Directory: durable entries plus a random prefix of the pending operations.
        let mut names = st.durable.clone();
        let keep_ops = rng.below(st.pending.len() as u64 + 1) as usize;
        for op in &st.pending[..keep_ops] {
            match op {
                DirOp::Link(n, id) => {
                    names.insert(n.clone(), *id);
                }
                DirOp::Unlink(n) => {
                    names.remove(n);
                }
                DirOp::Rename(from, to, id) => {
                    names.remove(from);
                    names.insert(to.clone(), *id);
                }
            }
        }
        let mut new = DiskState::default();
        let mut remap: BTreeMap<usize, usize> = BTreeMap::new();
        for (name, id) in names {
            let new_id = *remap.entry(id).or_insert_with(|| {
                let f = lock(&st.files[id]);
                let mut content = f.durable.clone();
                let keep = rng.below(f.pending.len() as u64 + 1) as usize;
                for (i, op) in f.pending[..keep].iter().enumerate() {
                    let last = i + 1 == keep;
                    match op {
                        FileOp::Write(off, data) if last && data.len() > 512 && rng.chance(50) => {
                            let sectors = data.len().div_ceil(512);
                            let cut = (rng.below(sectors as u64) as usize * 512).min(data.len());
                            apply(&mut content, &FileOp::Write(*off, data[..cut].to_vec()));
                        }
                        op => apply(&mut content, op),
                    }
                }
                new.files.push(Arc::new(Mutex::new(FileData {
                    live: content.clone(),
                    durable: content,
                    pending: Vec::new(),
                })));
                new.files.len() - 1
            });
            new.live.insert(name.clone(), new_id);
            new.durable.insert(name, new_id);
        }
        Arc::new(SimDir {
            state: Mutex::new(new),
            calls: AtomicU64::new(0),
            stop_at: AtomicU64::new(u64::MAX),
            capacity: AtomicU64::new(u64::MAX),
            reads_held: Mutex::new(BTreeSet::new()),
            reads_let_go: Condvar::new(),
        })
    }

    /// Flip one bit of a file, durably (for corruption tests).
    pub fn flip_bit(&self, name: &str, offset: u64, bit: u8) -> io::Result<()> {
        let st = lock(&self.state);
        let id = *st
            .live
            .get(name)
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        let mut f = lock(&st.files[id]);
        let i = offset as usize;
        if i >= f.live.len() {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        f.live[i] ^= 1 << (bit % 8);
        if i < f.durable.len() {
            f.durable[i] ^= 1 << (bit % 8);
        }
        Ok(())
    }

    /// Make reads of file `name` wait (`hold`) until they are let go (`!hold`): a test's
    /// way to keep a background reader of it in the middle of its work.
    pub fn hold_reads(&self, name: &str, hold: bool) -> io::Result<()> {
        let id = *lock(&self.state)
            .live
            .get(name)
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        let mut held = lock(&self.reads_held);
        if hold {
            held.insert(id);
        } else {
            held.remove(&id);
            self.reads_let_go.notify_all();
        }
        Ok(())
    }

    fn wait_for_reads(&self, id: usize) {
        let mut held = lock(&self.reads_held);
        while held.contains(&id) {
            held = self
                .reads_let_go
                .wait(held)
                .unwrap_or_else(|e| e.into_inner());
        }
    }

    /// The live length of a file.
    pub fn file_len(&self, name: &str) -> Option<u64> {
        let st = lock(&self.state);
        st.live
            .get(name)
            .map(|&id| lock(&st.files[id]).live.len() as u64)
    }
}

impl File for SimFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.disk.wait_for_reads(self.id);
        self.disk.tick()?;
        let f = lock(&self.data);
        let end = offset as usize + buf.len();
        if end > f.live.len() {
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
        }
        buf.copy_from_slice(&f.live[offset as usize..end]);
        Ok(())
    }
    fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        self.disk.tick()?;
        let mut f = lock(&self.data);
        let op = FileOp::Write(offset, data.to_vec());
        apply(&mut f.live, &op);
        f.pending.push(op);
        Ok(())
    }
    fn len(&self) -> io::Result<u64> {
        self.disk.tick()?;
        Ok(lock(&self.data).live.len() as u64)
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.disk.tick()?;
        let mut f = lock(&self.data);
        let op = FileOp::SetLen(len);
        apply(&mut f.live, &op);
        f.pending.push(op);
        Ok(())
    }
    fn sync(&self) -> io::Result<()> {
        self.disk.tick()?;
        let mut f = lock(&self.data);
        f.durable = f.live.clone();
        f.pending.clear();
        Ok(())
    }
}

/// A scratch file of the simulated disk ([`Dir::scratch_file`]): bytes in RAM that no crash
/// or injected failure touches, since nothing of them outlives the open.
#[derive(Default)]
struct SimScratch(Mutex<Vec<u8>>);

impl File for SimScratch {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let f = lock(&self.0);
        let at = usize::try_from(offset).map_err(|_| io::ErrorKind::InvalidInput)?;
        match f.get(at..at.saturating_add(buf.len())) {
            Some(b) => {
                buf.copy_from_slice(b);
                Ok(())
            }
            None => Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
        }
    }
    fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        apply(&mut lock(&self.0), &FileOp::Write(offset, data.to_vec()));
        Ok(())
    }
    fn len(&self) -> io::Result<u64> {
        Ok(lock(&self.0).len() as u64)
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        apply(&mut lock(&self.0), &FileOp::SetLen(len));
        Ok(())
    }
    fn sync(&self) -> io::Result<()> {
        Ok(())
    }
}

/// A handle to a [`SimDir`] usable as a [`Dir`] (files keep a reference to their disk).
#[derive(Clone)]
pub struct SimHandle(pub Arc<SimDir>);

impl Dir for SimHandle {
    fn scratch_file(&self) -> io::Result<Option<Arc<dyn File>>> {
        Ok(Some(Arc::new(SimScratch::default())))
    }
    fn open(&self, name: &str, create: bool) -> io::Result<Arc<dyn File>> {
        self.0.tick()?;
        let mut st = lock(&self.0.state);
        let id = match st.live.get(name) {
            Some(&id) => id,
            None if create => {
                st.files.push(Arc::new(Mutex::new(FileData::default())));
                let id = st.files.len() - 1;
                st.live.insert(name.to_string(), id);
                st.pending.push(DirOp::Link(name.to_string(), id));
                id
            }
            None => return Err(io::Error::from(io::ErrorKind::NotFound)),
        };
        Ok(Arc::new(SimFile {
            data: st.files[id].clone(),
            disk: self.0.clone(),
            id,
        }))
    }
    fn exists(&self, name: &str) -> io::Result<bool> {
        self.0.tick()?;
        Ok(lock(&self.0.state).live.contains_key(name))
    }
    fn remove(&self, name: &str) -> io::Result<()> {
        self.0.tick()?;
        let mut st = lock(&self.0.state);
        if st.live.remove(name).is_none() {
            return Err(io::Error::from(io::ErrorKind::NotFound));
        }
        st.pending.push(DirOp::Unlink(name.to_string()));
        Ok(())
    }
    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        self.0.tick()?;
        let mut st = lock(&self.0.state);
        let id = st
            .live
            .remove(from)
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        st.live.insert(to.to_string(), id);
        // A rename persists as one step: both halves or neither.
        st.pending
            .push(DirOp::Rename(from.to_string(), to.to_string(), id));
        Ok(())
    }
    fn list(&self, prefix: &str) -> io::Result<Vec<String>> {
        self.0.tick()?;
        let st = lock(&self.0.state);
        Ok(st
            .live
            .keys()
            .filter(|n| n.starts_with(prefix))
            .cloned()
            .collect())
    }
    fn sync_dir(&self) -> io::Result<()> {
        self.0.tick()?;
        let mut st = lock(&self.0.state);
        st.durable = st.live.clone();
        st.pending.clear();
        Ok(())
    }
    fn total_bytes(&self) -> io::Result<u64> {
        let st = lock(&self.0.state);
        Ok(st
            .live
            .values()
            .map(|&id| lock(&st.files[id]).live.len() as u64)
            .sum())
    }
    fn available_bytes(&self) -> io::Result<u64> {
        let capacity = self.0.capacity.load(Ordering::SeqCst);
        if capacity == u64::MAX {
            return Ok(1 << 40);
        }
        Ok(capacity.saturating_sub(self.total_bytes()?))
    }
    fn describe(&self) -> String {
        "simulated disk".to_string()
    }
}

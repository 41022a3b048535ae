//! An array of 64-bit words whose pages spill to a scratch file past a RAM budget: what lets
//! the space attribution ([`crate::attribution`]) cover a pool far beyond RAM.
//!
//! Owns: the words, in pages of `page_words`; at most `budget_pages` of them in RAM, the rest
//! in a scratch file ([`condense_store::io::Dir::scratch_file`]: no name, gone when closed, never read
//! by another open). A page goes to the file sealed (AES-256-GCM) under a key made for this
//! array alone and never stored, its nonce a counter and the page number its associated data:
//! the file tells nothing about the pool to whoever reads the disk, and a page damaged or
//! swapped behind the array's back is an error, never a wrong word.
//!
//! Invariants:
//! - A word never set reads 0.
//! - A page is in RAM (the newest copy), or in the file, or nowhere (all zero).
//! - Without a file every page stays in RAM (the simulator, repair): the budget is not kept.
//! - The first error (the file failing, a page failing its seal, an index past what a file
//!   can hold) is kept, not returned ([`Spill::error`]); words read after it are 0. The
//!   caller drops what it built and says why.

use condense_store::io::File;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// Bytes a sealed page takes in the file beyond its words: the nonce and the tag.
const SEAL_BYTES: usize = NONCE_LEN + 16;

/// Words per page by default: 4 KiB pages, so a page missed by a random chunk id costs one
/// small read and seal, not a large one.
pub const PAGE_WORDS: usize = 512;

struct Slot {
    page: u64,
    words: Box<[u64]>,
    dirty: bool,
    /// Used since the clock hand last passed (second chance).
    used: bool,
}

/// The array. See the module documentation.
pub struct Spill {
    file: Option<Arc<dyn File>>,
    key: Option<LessSafeKey>,
    /// The next nonce: never repeats under this array's key.
    nonce: u64,
    page_words: usize,
    budget_pages: usize,
    /// Page number → its slot in `slots`.
    index: HashMap<u64, usize>,
    slots: Vec<Slot>,
    hand: usize,
    /// The last page looked up and its slot (sequential ids hit it).
    last: Option<(u64, usize)>,
    /// Pages written to the file at least once.
    on_file: HashSet<u64>,
    /// Why there is no file, when the budget still holds ([`Spill::in_ram_up_to`]).
    no_file: Option<String>,
    error: Option<String>,
}

impl std::fmt::Debug for Spill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spill")
            .field("ram_bytes", &self.ram_bytes())
            .field("file_bytes", &self.file_bytes())
            .field("error", &self.error)
            .finish()
    }
}

impl Default for Spill {
    /// Every page in RAM.
    fn default() -> Spill {
        Spill::in_ram(PAGE_WORDS)
    }
}

impl Spill {
    /// Pages of `page_words` words, all kept in RAM.
    pub fn in_ram(page_words: usize) -> Spill {
        Spill {
            file: None,
            key: None,
            nonce: 0,
            page_words: page_words.max(1),
            budget_pages: usize::MAX,
            index: HashMap::new(),
            slots: Vec::new(),
            hand: 0,
            last: None,
            on_file: HashSet::new(),
            no_file: None,
            error: None,
        }
    }

    /// Pages of `page_words` words, at most `budget_pages` (at least 2) of them in RAM and the
    /// rest in `file`, an empty scratch file this array alone uses.
    pub fn on_file(file: Arc<dyn File>, page_words: usize, budget_pages: usize) -> Spill {
        let mut s = Spill::in_ram(page_words);
        s.budget_pages = budget_pages.max(2);
        let mut key = [0u8; 32];
        match getrandom::fill(&mut key) {
            Ok(()) => match UnboundKey::new(&AES_256_GCM, &key) {
                Ok(k) => {
                    s.key = Some(LessSafeKey::new(k));
                    s.file = Some(file);
                }
                Err(_) => s.fail("the scratch file's key was refused".into()),
            },
            Err(e) => s.fail(format!("no random key for the scratch file: {e}")),
        }
        zeroize::Zeroize::zeroize(&mut key);
        s
    }

    /// Pages kept in RAM up to `budget_pages` (at least 2), for want of a scratch file: past
    /// that the array fails with `why` (the reason there is no file) instead of growing.
    pub fn in_ram_up_to(page_words: usize, budget_pages: usize, why: String) -> Spill {
        let mut s = Spill::in_ram(page_words);
        s.budget_pages = budget_pages.max(2);
        s.no_file = Some(why);
        s
    }

    /// Word `i` (0 if never set).
    pub fn get(&mut self, i: u64) -> u64 {
        let (page, at) = self.split(i);
        let absent = self.last.is_none_or(|(p, _)| p != page)
            && !self.index.contains_key(&page)
            && !self.on_file.contains(&page);
        if absent {
            // Never set: no page is made for a read.
            return 0;
        }
        match self.slot(page) {
            Some(s) => self.slots[s].words[at],
            None => 0,
        }
    }

    /// Set word `i` to `v`.
    pub fn set(&mut self, i: u64, v: u64) {
        let (page, at) = self.split(i);
        if let Some(s) = self.slot(page) {
            let slot = &mut self.slots[s];
            slot.words[at] = v;
            slot.dirty = true;
        }
    }

    /// The first error met, if any: words read since may be wrong.
    pub fn error(&self) -> Option<&str> {
        self.error.as_deref()
    }

    /// RAM the pages in RAM hold.
    pub fn ram_bytes(&self) -> u64 {
        (self.slots.len() * self.page_words * 8) as u64
    }

    /// Bytes of the scratch file (pages that went to it at least once).
    pub fn file_bytes(&self) -> u64 {
        self.on_file.len() as u64 * self.sealed_bytes() as u64
    }

    fn split(&self, i: u64) -> (u64, usize) {
        let per = self.page_words as u64;
        (i / per, (i % per) as usize)
    }

    fn sealed_bytes(&self) -> usize {
        self.page_words * 8 + SEAL_BYTES
    }

    fn fail(&mut self, what: String) {
        if self.error.is_none() {
            tracing::warn!("scratch pages of the space attribution: {what}");
            self.error = Some(what);
        }
    }

    /// The slot holding `page`, read in (or made, all zero) if it is not in RAM; `None` after
    /// an error.
    fn slot(&mut self, page: u64) -> Option<usize> {
        if self.error.is_some() {
            return None;
        }
        if let Some((p, s)) = self.last {
            if p == page {
                self.slots[s].used = true;
                return Some(s);
            }
        }
        let s = match self.index.get(&page) {
            Some(&s) => s,
            None => self.load(page)?,
        };
        self.slots[s].used = true;
        self.last = Some((page, s));
        Some(s)
    }

    fn load(&mut self, page: u64) -> Option<usize> {
        if self.slots.len() >= self.budget_pages && self.file.is_none() {
            if let Some(why) = self.no_file.take() {
                self.fail(format!("more than {} pages, and {why}", self.budget_pages));
                return None;
            }
        }
        let s = if self.slots.len() < self.budget_pages || self.file.is_none() {
            self.slots.push(Slot {
                page,
                words: vec![0; self.page_words].into_boxed_slice(),
                dirty: false,
                used: false,
            });
            self.slots.len() - 1
        } else {
            let s = self.victim();
            self.evict(s)?;
            self.slots[s].words.fill(0);
            s
        };
        self.slots[s].page = page;
        self.slots[s].dirty = false;
        self.index.insert(page, s);
        if self.on_file.contains(&page) {
            self.read_page(s)?;
        }
        Some(s)
    }

    /// A slot to reuse: the clock hand's first not used since it last passed.
    fn victim(&mut self) -> usize {
        loop {
            let s = self.hand;
            self.hand = (self.hand + 1) % self.slots.len();
            if std::mem::take(&mut self.slots[s].used) {
                continue;
            }
            return s;
        }
    }

    /// Write slot `s`'s page to the file if it changed, and forget it is in RAM.
    fn evict(&mut self, s: usize) -> Option<()> {
        let page = self.slots[s].page;
        self.index.remove(&page);
        self.last = None;
        if !self.slots[s].dirty {
            return Some(());
        }
        let Some(offset) = self.offset(page) else {
            self.fail(format!("page {page} is past what a scratch file can hold"));
            return None;
        };
        let mut buf = Vec::with_capacity(self.sealed_bytes());
        buf.extend_from_slice(&[0; NONCE_LEN]);
        for w in self.slots[s].words.iter() {
            buf.extend_from_slice(&w.to_le_bytes());
        }
        let mut nonce = [0u8; NONCE_LEN];
        nonce[..8].copy_from_slice(&self.nonce.to_le_bytes());
        self.nonce += 1;
        buf[..NONCE_LEN].copy_from_slice(&nonce);
        let (Some(key), Some(file)) = (&self.key, &self.file) else {
            self.fail("no scratch file".into());
            return None;
        };
        let sealed = key.seal_in_place_separate_tag(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(page.to_le_bytes()),
            &mut buf[NONCE_LEN..],
        );
        let written = match sealed {
            Ok(tag) => {
                buf.extend_from_slice(tag.as_ref());
                file.write_at(&buf, offset).map_err(|e| e.to_string())
            }
            Err(_) => Err("sealing failed".to_string()),
        };
        if let Err(e) = written {
            self.fail(format!("writing page {page} at offset {offset}: {e}"));
            return None;
        }
        self.on_file.insert(page);
        Some(())
    }

    /// Read slot `s`'s page from the file and check its seal.
    fn read_page(&mut self, s: usize) -> Option<()> {
        let page = self.slots[s].page;
        let offset = self.offset(page)?;
        let mut buf = vec![0u8; self.sealed_bytes()];
        let (Some(key), Some(file)) = (&self.key, &self.file) else {
            self.fail("no scratch file".into());
            return None;
        };
        if let Err(e) = file.read_at(&mut buf, offset) {
            self.fail(format!("reading page {page} at offset {offset}: {e}"));
            return None;
        }
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&buf[..NONCE_LEN]);
        let opened = key.open_in_place(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(page.to_le_bytes()),
            &mut buf[NONCE_LEN..],
        );
        let Ok(plain) = opened else {
            self.fail(format!(
                "page {page} at offset {offset} failed its check (changed on disk?)"
            ));
            return None;
        };
        for (w, b) in self.slots[s].words.iter_mut().zip(plain.chunks_exact(8)) {
            let mut le = [0u8; 8];
            le.copy_from_slice(b);
            *w = u64::from_le_bytes(le);
        }
        Some(())
    }

    fn offset(&self, page: u64) -> Option<u64> {
        page.checked_mul(self.sealed_bytes() as u64)
            .filter(|&o| o < 1 << 50)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use condense_store::io::{Dir, RealDir};
    use rand::{Rng, SeedableRng};

    fn scratch(dir: &tempfile::TempDir) -> Arc<dyn File> {
        let d = RealDir::new(dir.path());
        match d.scratch_file() {
            Ok(Some(f)) => f,
            other => panic!("no scratch file: {:?}", other.err()),
        }
    }

    #[test]
    fn words_spilled_past_the_budget_read_back_as_set() {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut s = Spill::on_file(scratch(&dir), 16, 3);
        let mut model: HashMap<u64, u64> = HashMap::new();
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for _ in 0..20_000 {
            let i = rng.random_range(0..2_000u64);
            if rng.random_bool(0.5) {
                let v = rng.random::<u64>();
                s.set(i, v);
                model.insert(i, v);
            } else {
                assert_eq!(s.get(i), model.get(&i).copied().unwrap_or(0), "word {i}");
            }
        }
        assert!(s.error().is_none(), "{:?}", s.error());
        assert!(s.ram_bytes() <= 3 * 16 * 8, "RAM kept to the budget");
        assert!(s.file_bytes() > 0, "pages went to the file");
    }

    #[test]
    fn a_page_changed_in_the_file_is_an_error_not_a_wrong_word() {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = scratch(&dir);
        let mut s = Spill::on_file(file.clone(), 4, 2);
        for i in 0..40 {
            s.set(i, i + 1);
        }
        // Page 0 went to the file first; flip a byte of its sealed words.
        let mut b = [0u8; 1];
        file.read_at(&mut b, NONCE_LEN as u64 + 3).expect("read");
        b[0] ^= 1;
        file.write_at(&b, NONCE_LEN as u64 + 3).expect("write");
        assert_eq!(s.get(0), 0);
        assert!(s.error().is_some_and(|e| e.contains("failed its check")));
    }

    #[test]
    fn without_a_scratch_file_the_budget_is_a_limit() {
        let mut s = Spill::in_ram_up_to(4, 2, "no scratch file: read-only".into());
        for i in 0..8 {
            s.set(i, i + 1);
        }
        assert_eq!(s.get(7), 8, "two pages fit");
        assert!(s.error().is_none());
        s.set(8, 1);
        assert!(s.error().is_some_and(|e| e.contains("read-only")));
        assert_eq!(s.ram_bytes(), 2 * 4 * 8, "never grew past the budget");
    }

    #[test]
    fn without_a_file_every_page_stays_in_ram() {
        let mut s = Spill::in_ram(4);
        for i in 0..100 {
            s.set(i * 3, i);
        }
        for i in 0..100 {
            assert_eq!(s.get(i * 3), i);
        }
        assert_eq!(s.get(1_000_000), 0);
        assert!(s.error().is_none());
    }
}

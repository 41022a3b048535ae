//! Paged copy-on-write trees and the one bounded page cache they are read through.
//!
//! Owns: every metadata page in memory (block-map pages of all volumes and chunk-table pages),
//! the tree shapes (height and root pointer per tree), writing pages out of place, and the
//! cache budget.
//!
//! A tree is a radix tree of 4 KiB pages. Level 0 holds leaves (fixed-size records: 512 block
//! map entries, or 128 chunk-table records); every level above holds 256 pointers of 16 bytes
//! (page number, CRC-32C of the child page, reserved). A null pointer (page 0) is a subtree of
//! all-zero leaves. The root pointer and height live in the checkpoint root, so the CRCs form a
//! Merkle tree: every page read is checked against its parent.
//!
//! Invariants:
//! - A cached node's parent is cached (`children` counts cached children and pins the
//!   parent), and a tree's root node is cached while the tree exists.
//! - A dirty node is written to a new page unless its current page was allocated in this
//!   epoch ([`PageAlloc`] decides); writing it updates the pointer in its parent, which
//!   becomes dirty. A checkpoint writes dirty nodes level by level, leaves first, so the
//!   roots it records cover every change.
//! - Eviction (clock) drops only nodes without cached children; a dirty victim is written
//!   first. Callers evict only between metadata changes ([`PageCache::evict_to_budget`]), so
//!   applying a change never writes pages.
//! - Nothing in a page is trusted before its CRC matches the parent's pointer.
//! - In an encrypted pool every stored page is sealed ([`condense_format::crypto`]) with its first
//!   unit and kind as associated data, and is authenticated before anything else.
//!
//! Sharing (snapshots and clones). Two trees may name the same stored page: a clone copies
//! the source's root pointer and counts one more reference on that page. `refs` holds the
//! number of parents (tree roots or interior pages) of every page named more than once; a
//! page absent from it has one. A shared page is never changed or freed in place:
//! - Changing a node whose page is shared first *unshares* it: the node becomes a private,
//!   never-written copy (page 0) and the page loses one reference; each child of the copy
//!   gains one (interior nodes), or, for a leaf, the entries' chunks each gain one reference
//!   (handed to the caller through [`PageCache::take_unshared_leaves`]). Ancestors are
//!   unshared before their children, so a dirty node and all its ancestors are exclusive.
//! - Releasing a tree ([`PageCache::release_tree`]) drops one reference on its root; only a
//!   page whose last reference goes is freed, and only then are its children released.
//! - A clone is made only of a tree with no dirty node (right after its pages were written),
//!   so every page it shares is on disk and no longer "fresh" (never rewritten in place).
//!
//! Writing outside the lock. Encoding and writing thousands of pages takes tens of
//! milliseconds, too long to hold whatever lock guards the cache, so a checkpoint first writes
//! most dirty pages in batches, one level at a time, leaves first: [`PageCache::take_dirty`]
//! copies dirty nodes' bytes; the caller encodes them without the lock
//! ([`PageBatch::encode`]), allocates new runs with it ([`PageCache::allocate_batch`]: never
//! a run in use, so no reader can meet a half-written page), writes them without it
//! ([`PageBatch::write`]), and installs them with it ([`PageCache::install_batch`]). The nodes
//! stay dirty until installed, so eviction meanwhile writes a victim itself as usual; a node
//! takes its new page only if it is still dirty with the bytes that were written, else the
//! run is freed. Installing is writing the node (its parent becomes dirty), so the
//! checkpoint that follows writes only what changed meanwhile and the interior nodes above.

mod compaction;

use crate::page_alloc::PageAlloc;
use condense_format::crypto::{self, Crypto, Kind};
use condense_format::error::{Error, Result};
use condense_store::io::File;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use condense_format::page::PTR_BYTES;
pub use condense_format::page::{decode_page, encode_page, Ptr, PAGE_BYTES, UNIT};

/// Page images to write: (page number, bytes).
pub type PageImages = Vec<(u64, Box<[u8]>)>;
/// The cache keeps at least this many pages (16 MiB) however large the dedup index grows.
pub const PAGES_FLOOR: usize = 4096;
pub const FANOUT: u64 = 256;

/// Which tree: a volume id, or [`CHUNK_TREE`].
pub type TreeId = u64;
/// The chunk table's tree.
pub const CHUNK_TREE: TreeId = u64::MAX;

/// Words between a record and the one it is delta-coded against, per kind of page.
pub fn stride(tree: TreeId, level: u8) -> usize {
    match (tree, level) {
        (_, l) if l > 0 => PTR_BYTES / 8,
        (CHUNK_TREE, _) => 4,
        _ => 1,
    }
}

/// The shape of one tree, saved in the checkpoint root.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TreeInfo {
    /// Levels, at least 1 (a root that is a leaf).
    pub height: u8,
    pub root: Ptr,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    tree: TreeId,
    level: u8,
    index: u64,
}

/// Hashes a page key with one multiply per word (FxHash's scheme): the keys are small
/// integers from this process, so SipHash's protection against chosen keys buys nothing and
/// it showed up in write-path profiles.
#[derive(Clone, Copy, Default)]
struct KeyHash;

impl std::hash::BuildHasher for KeyHash {
    type Hasher = KeyHasher;
    fn build_hasher(&self) -> KeyHasher {
        KeyHasher(0)
    }
}

#[derive(Default)]
struct KeyHasher(u64);

impl std::hash::Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(u64::from(*b));
        }
    }
    fn write_u8(&mut self, n: u8) {
        self.write_u64(u64::from(n));
    }
    fn write_u64(&mut self, n: u64) {
        const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(SEED);
    }
}

struct Node {
    key: Key,
    data: Box<[u8]>,
    /// Where this node was read from or last written to (0: never written).
    page: u64,
    /// Sectors of that run.
    units: u16,
    dirty: bool,
    /// Cached children (a node with any is never evicted).
    children: u32,
    referenced: bool,
}

/// Counters of the cache, for `stats`.
#[derive(Clone, Copy, Debug, Default)]
pub struct CacheCounters {
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    /// Pages written (checkpoints and eviction of dirty pages), and their stored bytes.
    pub pages_written: u64,
    pub bytes_written: u64,
}

pub struct PageCache {
    /// Parents of every page named more than once (see "Sharing" above).
    refs: BTreeMap<u64, u32>,
    /// Copies of leaves unshared since the last [`PageCache::take_unshared_leaves`].
    unshared_leaves: Vec<Box<[u8]>>,
    file: Arc<dyn File>,
    map: HashMap<Key, usize, KeyHash>,
    slots: Vec<Option<Node>>,
    free_slots: Vec<usize>,
    hand: usize,
    budget_pages: usize,
    /// RAM of other metadata (the dedup index) counted against the budget.
    reserved_pages: usize,
    /// Never write: dirty pages stay in memory (a read-only open that replayed a journal).
    read_only: bool,
    pub alloc: PageAlloc,
    trees: BTreeMap<TreeId, TreeInfo>,
    pub counters: CacheCounters,
    /// Seals and opens pages in an encrypted pool.
    crypto: Option<Arc<Crypto>>,
    /// The cache tier on a fast device: a second level for pages faulted in from meta.dat.
    l2: Option<Arc<dyn PageTier>>,
}

/// A second level for metadata pages faulted in from meta.dat (the cache tier,
/// `condense_store::cache_tier`, implements it, below): the page cache knows only these two calls.
pub trait PageTier: Send + Sync {
    /// The stored bytes of the page at 64-byte unit `page`, if held for a page with this CRC
    /// and length (checked again by the caller).
    fn lookup_page(&self, page: u64, crc32: u32, units: u16) -> Option<Vec<u8>>;
    /// Offer a page's stored bytes that passed every check.
    fn offer_page(&self, page: u64, crc32: u32, stored: &[u8]);
}

/// The cache tier as the page cache's second level.
impl PageTier for condense_store::cache_tier::ChunkCache {
    fn lookup_page(&self, page: u64, crc32: u32, units: u16) -> Option<Vec<u8>> {
        condense_store::cache_tier::ChunkCache::lookup_page(self, page, crc32, units)
    }
    fn offer_page(&self, page: u64, crc32: u32, stored: &[u8]) {
        condense_store::cache_tier::ChunkCache::offer_page(self, page, crc32, stored)
    }
}

fn crc(data: &[u8]) -> u32 {
    crc32c::crc32c(data)
}

impl PageCache {
    pub fn new(
        file: Arc<dyn File>,
        alloc: PageAlloc,
        trees: BTreeMap<TreeId, TreeInfo>,
        budget_bytes: u64,
    ) -> PageCache {
        PageCache {
            refs: BTreeMap::new(),
            unshared_leaves: Vec::new(),
            file,
            map: HashMap::default(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            hand: 0,
            budget_pages: ((budget_bytes / PAGE_BYTES as u64) as usize).max(2),
            reserved_pages: 0,
            read_only: false,
            alloc,
            trees,
            counters: CacheCounters::default(),
            crypto: None,
            l2: None,
        }
    }

    /// Seal every page written from now on and open every page read (an encrypted pool).
    pub fn set_crypto(&mut self, crypto: Arc<Crypto>) {
        self.crypto = Some(crypto);
    }

    /// Count `bytes` of other metadata RAM (the dedup index) against the budget: pages get
    /// what is left, but never less than [`PAGES_FLOOR`] (or the whole budget if smaller).
    pub fn set_reserved_bytes(&mut self, bytes: u64) {
        self.reserved_pages = (bytes / PAGE_BYTES as u64) as usize;
    }

    /// Pages the cache may hold now.
    pub fn page_limit(&self) -> usize {
        self.budget_pages
            .saturating_sub(self.reserved_pages)
            .max(self.budget_pages.min(PAGES_FLOOR))
    }

    /// Keep dirty pages in memory instead of writing them (read-only opens).
    pub fn set_read_only(&mut self) {
        self.read_only = true;
    }

    pub fn trees(&self) -> &BTreeMap<TreeId, TreeInfo> {
        &self.trees
    }

    pub fn tree(&self, tree: TreeId) -> Option<TreeInfo> {
        self.trees.get(&tree).copied()
    }

    /// Pages held in memory.
    pub fn cached_pages(&self) -> usize {
        self.map.len()
    }

    pub fn budget_bytes(&self) -> u64 {
        (self.budget_pages * PAGE_BYTES) as u64
    }

    /// Bytes of RAM the cache holds (pages and bookkeeping).
    pub fn ram_bytes(&self) -> u64 {
        (self.map.len() * (PAGE_BYTES + 64) + self.slots.capacity() * 8) as u64
            + self.alloc.ram_bytes()
    }

    fn node(&self, slot: usize) -> &Node {
        self.slots[slot].as_ref().expect("live cache slot") // invariant: map points at live slots
    }

    fn node_mut(&mut self, slot: usize) -> &mut Node {
        self.slots[slot].as_mut().expect("live cache slot")
    }

    /// Start an empty tree able to hold `leaves` leaves.
    pub fn create_tree(&mut self, tree: TreeId, leaves: u64) {
        self.drop_cached(tree);
        self.trees.insert(
            tree,
            TreeInfo {
                height: height_for(leaves),
                root: Ptr::NULL,
            },
        );
    }

    /// Grow `tree` so it can hold `leaves` leaves (adds levels above the old root).
    pub fn grow_tree(&mut self, tree: TreeId, leaves: u64) -> Result<()> {
        let Some(mut info) = self.tree(tree) else {
            return Err(Error::corrupt(
                "metadata",
                format!("tree {tree} does not exist"),
            ));
        };
        let want = height_for(leaves);
        while info.height < want {
            let old_root = Key {
                tree,
                level: info.height - 1,
                index: 0,
            };
            // The old root becomes child 0 of a new root one level up.
            let new_root = Key {
                tree,
                level: info.height,
                index: 0,
            };
            let mut data = vec![0u8; PAGE_BYTES].into_boxed_slice();
            info.root.write(&mut data, 0);
            let cached_old = self.map.contains_key(&old_root);
            self.insert(Node {
                key: new_root,
                data,
                page: 0,
                units: 0,
                dirty: true,
                children: u32::from(cached_old),
                referenced: true,
            });
            info.height += 1;
            info.root = Ptr::NULL;
            self.trees.insert(tree, info);
        }
        Ok(())
    }

    /// Indexes of the leaves in `[from, to)` that exist (present on disk or in memory),
    /// walking only interior nodes.
    pub fn present_leaves(&mut self, tree: TreeId, from: u64, to: u64) -> Result<Vec<u64>> {
        let mut out = Vec::new();
        self.leaves_in(tree, from, to, &mut |i, _| {
            out.push(i);
            Ok(true)
        })?;
        Ok(out)
    }

    /// Visit the existing leaves in `[from, to)` in order with their bytes. Leaves not in the
    /// cache are read (and checked) without being cached, so a scan does not flush the cache.
    /// `f` returns false to stop.
    pub fn for_each_leaf(
        &mut self,
        tree: TreeId,
        from: u64,
        to: u64,
        f: &mut dyn FnMut(u64, &[u8]) -> Result<bool>,
    ) -> Result<()> {
        self.for_each_leaf_page(tree, from, to, &mut |i, _, d| f(i, d))
    }

    /// [`PageCache::for_each_leaf`] that also gives each leaf's stored page (0 for a leaf
    /// memory holds unwritten): leaves shared between trees have the same page.
    pub fn for_each_leaf_page(
        &mut self,
        tree: TreeId,
        from: u64,
        to: u64,
        f: &mut LeafPageVisitor<'_>,
    ) -> Result<()> {
        let file = self.file.clone();
        let crypto = self.crypto.clone();
        let mut g = |i: u64, src: LeafSrc<'_>| -> Result<bool> {
            match src {
                LeafSrc::Cached(d, page, dirty) => f(i, if dirty { 0 } else { page }, d),
                LeafSrc::Disk(p) => {
                    let buf = read_checked(&*file, crypto.as_deref(), p, tree, 0, i)?;
                    f(i, p.page, &buf)
                }
            }
        };
        self.leaves_in(tree, from, to, &mut |i, src| g(i, src))
    }

    /// How many parents (tree roots and interior pointers, over all trees but the chunk
    /// table) name each stored page; for `verify` to check the shared-page counts.
    pub fn count_parents(&mut self) -> Result<HashMap<u64, u32>> {
        let mut parents = HashMap::new();
        let trees: Vec<(TreeId, TreeInfo)> = self
            .trees
            .iter()
            .filter(|(&t, _)| t != CHUNK_TREE)
            .map(|(&t, &i)| (t, i))
            .collect();
        for (tree, info) in trees {
            self.count_below(tree, info.height - 1, 0, info.root, &mut parents)?;
        }
        Ok(parents)
    }

    fn count_below(
        &mut self,
        tree: TreeId,
        level: u8,
        index: u64,
        ptr: Ptr,
        parents: &mut HashMap<u64, u32>,
    ) -> Result<()> {
        let cached = self.map.get(&Key { tree, level, index }).copied();
        let page = match cached {
            Some(s) if self.node(s).dirty => 0,
            Some(s) => self.node(s).page,
            None => ptr.page,
        };
        if page != 0 {
            let n = parents.entry(page).or_insert(0);
            *n += 1;
            if *n > 1 {
                return Ok(()); // its children were counted the first time
            }
        } else if cached.is_none() {
            return Ok(());
        }
        if level == 0 {
            return Ok(());
        }
        let data = match cached {
            Some(s) => self.node(s).data.clone(),
            None => read_checked(&*self.file, self.crypto.as_deref(), ptr, tree, level, index)?,
        };
        for (child, p) in self.children(tree, level, index, &data) {
            self.count_below(tree, level - 1, child, p, parents)?;
        }
        Ok(())
    }

    /// The children of interior node (`level`, `index`) with bytes `data` that exist: a
    /// stored pointer, or a node in memory. (child index, pointer as stored.)
    fn children(&self, tree: TreeId, level: u8, index: u64, data: &[u8]) -> Vec<(u64, Ptr)> {
        (0..FANOUT)
            .map(|c| (index * FANOUT + c, Ptr::read(data, c as usize)))
            .filter(|&(child, p)| {
                p.page != 0
                    || self.map.contains_key(&Key {
                        tree,
                        level: level - 1,
                        index: child,
                    })
            })
            .collect()
    }

    fn leaves_in(
        &mut self,
        tree: TreeId,
        from: u64,
        to: u64,
        f: &mut dyn FnMut(u64, LeafSrc<'_>) -> Result<bool>,
    ) -> Result<()> {
        let Some(info) = self.tree(tree) else {
            return Ok(());
        };
        let to = to.min(capacity(info.height));
        if from >= to {
            return Ok(());
        }
        if info.height == 1 {
            if let Some(slot) = self.find(tree, 0, 0, false)? {
                let n = self.node(slot);
                f(0, LeafSrc::Cached(&n.data, n.page, n.dirty))?;
            }
            return Ok(());
        }
        self.visit(tree, info.height - 1, 0, from, to, f).map(drop)
    }

    /// Visit leaves in `[from, to)` under node (`level`, `index`); false when `f` stopped.
    fn visit(
        &mut self,
        tree: TreeId,
        level: u8,
        index: u64,
        from: u64,
        to: u64,
        f: &mut dyn FnMut(u64, LeafSrc<'_>) -> Result<bool>,
    ) -> Result<bool> {
        let Some(slot) = self.find(tree, level, index, false)? else {
            return Ok(true);
        };
        let (_, _, slots) = children_meeting(level, index, from, to);
        for c in slots {
            let child = index * FANOUT + c;
            let key = Key {
                tree,
                level: level - 1,
                index: child,
            };
            let cached = self.map.get(&key).copied();
            let p = Ptr::read(&self.node(slot).data, c as usize);
            if cached.is_none() && p.page == 0 {
                continue;
            }
            let go = if level > 1 {
                self.visit(tree, level - 1, child, from, to, f)?
            } else {
                match cached {
                    Some(ls) => {
                        let n = self.slots[ls].as_ref().expect("live cache slot");
                        f(child, LeafSrc::Cached(&n.data, n.page, n.dirty))?
                    }
                    None => f(child, LeafSrc::Disk(p))?,
                }
            };
            if !go {
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn drop_cached(&mut self, tree: TreeId) {
        let keys: Vec<Key> = self
            .map
            .keys()
            .filter(|k| k.tree == tree)
            .copied()
            .collect();
        for k in keys {
            if let Some(slot) = self.map.remove(&k) {
                self.slots[slot] = None;
                self.free_slots.push(slot);
            }
        }
    }

    fn insert(&mut self, node: Node) -> usize {
        let key = node.key;
        let slot = match self.free_slots.pop() {
            Some(s) => {
                self.slots[s] = Some(node);
                s
            }
            None => {
                self.slots.push(Some(node));
                self.slots.len() - 1
            }
        };
        self.map.insert(key, slot);
        slot
    }

    /// The node at (`tree`, `level`, `index`), loading it and its ancestors as needed. With
    /// `create`, a missing node is made (empty, dirty); without, a missing one is `None`.
    fn find(&mut self, tree: TreeId, level: u8, index: u64, create: bool) -> Result<Option<usize>> {
        let key = Key { tree, level, index };
        if let Some(&slot) = self.map.get(&key) {
            self.counters.hits += 1;
            let n = self.node_mut(slot);
            n.referenced = true;
            if create && !n.dirty {
                // A change below a shared page must copy that page: ancestors first.
                let height = self.tree(tree).map_or(0, |t| t.height);
                if level + 1 < height {
                    self.find(tree, level + 1, index / FANOUT, true)?;
                }
                self.unshare(slot);
                self.node_mut(slot).dirty = true;
            }
            return Ok(Some(slot));
        }
        let info = self.tree(tree).ok_or_else(|| {
            Error::corrupt(
                "metadata",
                format!("tree {} does not exist", tree_name(tree)),
            )
        })?;
        if level >= info.height {
            return Err(Error::corrupt(
                "metadata",
                format!("level {level} of {} is above its root", tree_name(tree)),
            ));
        }
        let top = info.height - 1;
        if level == top && index != 0 {
            return Ok(None); // outside the tree
        }
        let (ptr, parent) = if level == top {
            (info.root, None)
        } else {
            let Some(p) = self.find(tree, level + 1, index / FANOUT, create)? else {
                return Ok(None);
            };
            (
                Ptr::read(&self.node(p).data, (index % FANOUT) as usize),
                Some(p),
            )
        };
        let node = if ptr.page == 0 {
            if !create && level != top {
                return Ok(None);
            }
            Node {
                key,
                data: vec![0u8; PAGE_BYTES].into_boxed_slice(),
                page: 0,
                units: 0,
                dirty: create,
                children: 0,
                referenced: true,
            }
        } else {
            self.counters.misses += 1;
            let data = match &self.l2 {
                Some(l2) => read_through(
                    &*self.file,
                    &**l2,
                    self.crypto.as_deref(),
                    ptr,
                    tree,
                    level,
                    index,
                )?,
                None => read_checked(&*self.file, self.crypto.as_deref(), ptr, tree, level, index)?,
            };
            Node {
                key,
                data,
                page: ptr.page,
                units: ptr.units,
                dirty: create,
                children: 0,
                referenced: true,
            }
        };
        if let Some(p) = parent {
            let pn = self.node_mut(p);
            pn.children += 1;
            if create {
                pn.dirty = true;
            }
        }
        let slot = self.insert(node);
        if create {
            self.unshare(slot);
        }
        Ok(Some(slot))
    }

    // -----------------------------------------------------------------------------------------
    // Sharing between trees (snapshots and clones).

    /// True when more than one parent names stored page `page`.
    pub fn is_shared(&self, page: u64) -> bool {
        page != 0 && self.refs.contains_key(&page)
    }

    /// Pages named more than once, with their number of parents.
    pub fn shared_pages(&self) -> &BTreeMap<u64, u32> {
        &self.refs
    }

    /// Replace the shared-page counts (at open, from the checkpoint root).
    pub fn set_shared_pages(&mut self, refs: BTreeMap<u64, u32>) {
        self.refs = refs;
    }

    fn add_ref(&mut self, page: u64) {
        if page != 0 {
            *self.refs.entry(page).or_insert(1) += 1;
        }
    }

    /// Drop one reference on `page`; true if others remain (the page must stay).
    fn drop_ref(&mut self, page: u64) -> bool {
        match self.refs.get_mut(&page) {
            Some(r) => {
                *r -= 1;
                if *r <= 1 {
                    self.refs.remove(&page);
                }
                true
            }
            None => false,
        }
    }

    /// Make the node at `slot` a private copy if its page is shared (see "Sharing").
    fn unshare(&mut self, slot: usize) {
        let (page, level) = {
            let n = self.node(slot);
            (n.page, n.key.level)
        };
        if !self.is_shared(page) {
            return;
        }
        self.drop_ref(page);
        if level > 0 {
            let children: Vec<u64> = (0..FANOUT as usize)
                .map(|c| Ptr::read(&self.node(slot).data, c).page)
                .collect();
            for c in children {
                self.add_ref(c);
            }
        } else {
            let copy = self.node(slot).data.clone();
            self.unshared_leaves.push(copy);
        }
        let n = self.node_mut(slot);
        n.page = 0;
        n.units = 0;
    }

    /// Leaves unshared since the last call: each of their entries now has one more holder.
    pub fn take_unshared_leaves(&mut self) -> Vec<Box<[u8]>> {
        std::mem::take(&mut self.unshared_leaves)
    }

    /// Make `dst` a tree with the same content as `src`, sharing every page. `src` must have
    /// no unwritten change (call right after its pages were written).
    pub fn clone_tree(&mut self, src: TreeId, dst: TreeId) -> Result<()> {
        let info = self.tree(src).ok_or_else(|| {
            Error::corrupt(
                "metadata",
                format!("tree {} does not exist", tree_name(src)),
            )
        })?;
        if self
            .map
            .iter()
            .any(|(k, &s)| k.tree == src && self.node(s).dirty)
        {
            return Err(Error::corrupt(
                "metadata",
                format!("clone of {} while it has unwritten pages", tree_name(src)),
            ));
        }
        self.drop_cached(dst);
        self.add_ref(info.root.page);
        self.trees.insert(dst, info);
        Ok(())
    }

    /// Remove `tree`: its root loses a reference, and every page whose last reference goes
    /// is freed, children after parents. `leaf` sees each freed leaf (to drop the
    /// references its entries hold); leaves still shared stay with their other holders.
    pub fn release_tree(
        &mut self,
        tree: TreeId,
        leaf: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        let Some(info) = self.tree(tree) else {
            return Ok(());
        };
        self.walk_exclusive(tree, info.height - 1, 0, info.root, true, leaf)?;
        self.drop_cached(tree);
        self.trees.remove(&tree);
        Ok(())
    }

    /// Give tree `from` the id `to` (a deleted volume's map kept for a release in steps):
    /// its shape and its nodes in memory, dirty ones included, move over unchanged.
    pub fn rename_tree(&mut self, from: TreeId, to: TreeId) -> Result<()> {
        let info = self.tree(from).ok_or_else(|| {
            Error::corrupt(
                "metadata",
                format!("tree {} does not exist", tree_name(from)),
            )
        })?;
        if self.trees.contains_key(&to) {
            return Err(Error::corrupt(
                "metadata",
                format!("tree {} exists already", tree_name(to)),
            ));
        }
        let keys: Vec<Key> = self
            .map
            .keys()
            .filter(|k| k.tree == from)
            .copied()
            .collect();
        for k in keys {
            if let Some(slot) = self.map.remove(&k) {
                let key = Key { tree: to, ..k };
                self.node_mut(slot).key = key;
                self.map.insert(key, slot);
            }
        }
        self.trees.remove(&from);
        self.trees.insert(to, info);
        Ok(())
    }

    /// Release the leaves of `tree` in `[from, to)`: each leaf only this tree holds is freed
    /// and seen by `leaf` (to drop the references its entries hold); a shared subtree loses
    /// this tree's reference. The pointers to what went are cleared, so the tree keeps only
    /// what is left to release, and the nodes that changed are written at the next
    /// checkpoint. A shared subtree reaching past `to` goes whole (one reference: no walk).
    /// The tree stays (empty once every leaf went); [`PageCache::release_tree`] removes it.
    pub fn release_span(
        &mut self,
        tree: TreeId,
        from: u64,
        to: u64,
        leaf: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        let Some(info) = self.tree(tree) else {
            return Ok(());
        };
        let to = to.min(capacity(info.height));
        if from >= to {
            return Ok(());
        }
        let top = info.height - 1;
        let root_key = Key {
            tree,
            level: top,
            index: 0,
        };
        let root_page = match self.map.get(&root_key) {
            Some(&s) => self.node(s).page,
            None => info.root.page,
        };
        if top == 0 || (from == 0 && to == capacity(info.height)) || self.is_shared(root_page) {
            self.walk_exclusive(tree, top, 0, info.root, true, leaf)?;
            self.drop_cached(tree);
            self.trees.insert(
                tree,
                TreeInfo {
                    root: Ptr::NULL,
                    ..info
                },
            );
            return Ok(());
        }
        if self.find(tree, top, 0, false)?.is_none() {
            return Ok(());
        }
        self.release_below(tree, top, 0, from, to, leaf)
    }

    /// [`PageCache::release_span`] below interior node (`level`, `index`), which is cached
    /// and held by this tree alone.
    fn release_below(
        &mut self,
        tree: TreeId,
        level: u8,
        index: u64,
        from: u64,
        to: u64,
        leaf: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        let key = Key { tree, level, index };
        let slot = *self.map.get(&key).ok_or_else(|| {
            Error::corrupt(
                "metadata",
                format!("a node of {} being released is not cached", tree_name(tree)),
            )
        })?;
        let (span, base, slots) = children_meeting(level, index, from, to);
        for c in slots {
            let child = index * FANOUT + c;
            let child_key = Key {
                tree,
                level: level - 1,
                index: child,
            };
            let cached = self.map.get(&child_key).copied();
            let p = Ptr::read(&self.node(slot).data, c as usize);
            let page = cached.map_or(p.page, |s| self.node(s).page);
            if cached.is_none() && p.page == 0 {
                continue;
            }
            let lo = base + c * span;
            let whole = from <= lo && lo + span <= to;
            if whole || self.is_shared(page) {
                self.walk_exclusive(tree, level - 1, child, p, true, leaf)?;
                if cached.is_some() {
                    self.uncache_subtree(child_key);
                    let n = self.node_mut(slot);
                    n.children = n.children.saturating_sub(1);
                }
                let n = self.node_mut(slot);
                Ptr::NULL.write(&mut n.data, c as usize);
                n.dirty = true;
            } else {
                self.find(tree, level - 1, child, false)?;
                self.release_below(tree, level - 1, child, from, to, leaf)?;
            }
        }
        Ok(())
    }

    /// Drop the node `key` and every node below it from memory (their pages were released).
    fn uncache_subtree(&mut self, key: Key) {
        if key.level > 0 {
            for c in 0..FANOUT {
                let child = Key {
                    tree: key.tree,
                    level: key.level - 1,
                    index: key.index * FANOUT + c,
                };
                if self.map.contains_key(&child) {
                    self.uncache_subtree(child);
                }
            }
        }
        if let Some(slot) = self.map.remove(&key) {
            self.slots[slot] = None;
            self.free_slots.push(slot);
        }
    }

    /// What releasing `tree` would free, without changing anything: `leaf` sees each leaf
    /// that would go; returns the metadata units that would be freed.
    pub fn exclusive_leaves(
        &mut self,
        tree: TreeId,
        leaf: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<u64> {
        let Some(info) = self.tree(tree) else {
            return Ok(0);
        };
        self.walk_exclusive(tree, info.height - 1, 0, info.root, false, leaf)
    }

    /// The pages below node (`level`, `index`) of `tree` (reached through `ptr`) that only
    /// this tree holds; with `release`, drop the references and free them. Returns units.
    fn walk_exclusive(
        &mut self,
        tree: TreeId,
        level: u8,
        index: u64,
        ptr: Ptr,
        release: bool,
        leaf: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<u64> {
        let cached = self.map.get(&Key { tree, level, index }).copied();
        let (page, units) = match cached {
            Some(s) => (self.node(s).page, self.node(s).units),
            None => (ptr.page, ptr.units),
        };
        if cached.is_none() && page == 0 {
            return Ok(0);
        }
        if self.is_shared(page) {
            if release {
                self.drop_ref(page);
            }
            return Ok(0);
        }
        let data = match cached {
            Some(s) => self.node(s).data.clone(),
            None => read_checked(&*self.file, self.crypto.as_deref(), ptr, tree, level, index)?,
        };
        let mut freed = u64::from(units);
        if level == 0 {
            leaf(&data)?;
        } else {
            for (child, p) in self.children(tree, level, index, &data) {
                freed += self.walk_exclusive(tree, level - 1, child, p, release, leaf)?;
            }
        }
        if release && page != 0 {
            self.alloc.free(page, units);
        }
        Ok(freed)
    }

    /// The leaves of `tree` in `[from, to)` that exist, with where they are stored: the page
    /// (0 for one never written) and whether memory holds a change not yet written. Two
    /// trees whose leaf has the same page and no change hold the same entries.
    pub fn leaf_pages(&mut self, tree: TreeId, from: u64, to: u64) -> Result<Vec<LeafPage>> {
        self.leaf_pages_first(tree, from, to, usize::MAX)
    }

    /// [`PageCache::leaf_pages`], stopping after the first `max` leaves that exist: the walk
    /// costs the interior nodes above those leaves, never the width of the range.
    pub fn leaf_pages_first(
        &mut self,
        tree: TreeId,
        from: u64,
        to: u64,
        max: usize,
    ) -> Result<Vec<LeafPage>> {
        let mut out = Vec::new();
        if max == 0 {
            return Ok(out);
        }
        self.leaves_in(tree, from, to, &mut |index, src| {
            out.push(match src {
                LeafSrc::Cached(_, page, dirty) => LeafPage { index, page, dirty },
                LeafSrc::Disk(p) => LeafPage {
                    index,
                    page: p.page,
                    dirty: false,
                },
            });
            Ok(out.len() < max)
        })?;
        Ok(out)
    }

    /// Leaf `index` of `tree` for reading; `None` if it was never written (all zeros).
    pub fn leaf(&mut self, tree: TreeId, index: u64) -> Result<Option<&[u8]>> {
        let info = self.tree(tree).ok_or_else(|| {
            Error::corrupt(
                "metadata",
                format!("tree {} does not exist", tree_name(tree)),
            )
        })?;
        if index >= capacity(info.height) {
            return Ok(None);
        }
        Ok(self
            .find(tree, 0, index, false)?
            .map(|s| &self.node(s).data[..]))
    }

    /// Leaf `index` of `tree` for changing (made if missing; marked dirty). The tree must
    /// already be tall enough ([`PageCache::grow_tree`]).
    pub fn leaf_mut(&mut self, tree: TreeId, index: u64) -> Result<&mut [u8]> {
        let slot = self.find(tree, 0, index, true)?.ok_or_else(|| {
            Error::corrupt(
                "metadata",
                format!("leaf {index} past the end of {}", tree_name(tree)),
            )
        })?;
        Ok(&mut self.node_mut(slot).data[..])
    }

    /// Make sure leaf `index` and its ancestors are in memory (so a later change to it does
    /// no I/O); errors are damage or I/O.
    pub fn prefetch(&mut self, tree: TreeId, index: u64) -> Result<()> {
        self.leaf(tree, index).map(drop)
    }

    fn write_node(&mut self, slot: usize, out: Option<&mut PageImages>) -> Result<()> {
        let (key, old_page) = {
            let n = self.node(slot);
            (n.key, n.page)
        };
        let (codec, stored, plain_len, need) =
            encode_stored(&self.node(slot).data, key, self.crypto.is_some());
        // In place only if no root on disk can name the old run and the page still fits
        // (padded to the run, so the pointer's length and CRC cover the whole run);
        // otherwise a new run, and the old one is freed once the new copy is written.
        let (page, units) = match self.alloc.fresh_len(old_page) {
            Some(n) if old_page != 0 && n >= need => (old_page, n),
            _ => (self.alloc.allocate(need), need),
        };
        let stored = match seal_padded(self.crypto.as_deref(), stored, plain_len, key, page, units)
        {
            Ok(s) => s,
            Err(e) => {
                if page != old_page {
                    self.alloc.free(page, units);
                }
                return Err(e);
            }
        };
        let sum = crc(&stored);
        match out {
            Some(out) => out.push((page, stored.into_boxed_slice())),
            None => {
                if let Err(e) = self.file.write_at(&stored, page * UNIT as u64) {
                    if page != old_page {
                        self.alloc.free(page, units);
                    }
                    return Err(Error::io(
                        format!("writing metadata at byte {}", page * UNIT as u64),
                        e,
                    ));
                }
            }
        }
        self.counters.pages_written += 1;
        self.counters.bytes_written += u64::from(units) * UNIT as u64;
        let ptr = Ptr {
            page,
            crc: sum,
            units,
            codec,
        };
        self.settle_written(slot, ptr)
    }

    /// Node `slot` is stored at `ptr` now: its old run is freed (unless rewritten in place),
    /// it is clean, and its parent (or its tree's root) points at it.
    fn settle_written(&mut self, slot: usize, ptr: Ptr) -> Result<()> {
        let (key, old_page, old_units) = {
            let n = self.node(slot);
            (n.key, n.page, n.units)
        };
        if ptr.page != old_page {
            self.alloc.free(old_page, old_units);
        }
        let n = self.node_mut(slot);
        n.page = ptr.page;
        n.units = ptr.units;
        n.dirty = false;
        let info = self.tree(key.tree).ok_or_else(|| {
            Error::corrupt("metadata", format!("tree {} vanished", tree_name(key.tree)))
        })?;
        if key.level + 1 == info.height {
            self.trees.insert(key.tree, TreeInfo { root: ptr, ..info });
        } else {
            let parent = Key {
                tree: key.tree,
                level: key.level + 1,
                index: key.index / FANOUT,
            };
            let ps = *self.map.get(&parent).ok_or_else(|| {
                Error::corrupt(
                    "metadata",
                    format!(
                        "parent of a cached page of {} is not cached",
                        tree_name(key.tree)
                    ),
                )
            })?;
            let pn = self.node_mut(ps);
            ptr.write(&mut pn.data, (key.index % FANOUT) as usize);
            pn.dirty = true;
        }
        Ok(())
    }

    /// Write out nodes until the cache is within budget. Call only between changes.
    pub fn evict_to_budget(&mut self) -> Result<()> {
        let mut budget_sweeps = self.slots.len() * 2 + 2;
        let limit = self.page_limit();
        while self.map.len() > limit && budget_sweeps > 0 {
            budget_sweeps -= 1;
            if self.slots.is_empty() {
                break;
            }
            self.hand = (self.hand + 1) % self.slots.len();
            let slot = self.hand;
            let Some(n) = self.slots[slot].as_mut() else {
                continue;
            };
            let is_root = self
                .trees
                .get(&n.key.tree)
                .is_some_and(|t| n.key.level + 1 == t.height);
            if is_root || n.children > 0 || (n.dirty && self.read_only) {
                continue;
            }
            if n.referenced {
                n.referenced = false;
                continue;
            }
            if n.dirty {
                self.write_node(slot, None)?;
            }
            let key = self.node(slot).key;
            self.map.remove(&key);
            self.slots[slot] = None;
            self.free_slots.push(slot);
            self.counters.evictions += 1;
            let parent = Key {
                tree: key.tree,
                level: key.level + 1,
                index: key.index / FANOUT,
            };
            if let Some(&ps) = self.map.get(&parent) {
                let pn = self.node_mut(ps);
                pn.children = pn.children.saturating_sub(1);
            }
            budget_sweeps = self.slots.len() * 2 + 2;
        }
        Ok(())
    }

    /// Assign pages to every dirty node, leaves first, and return the page images to write
    /// (the roots in [`PageCache::trees`] then name them). Starts a new allocation epoch;
    /// the returned list of freed pages goes to `alloc.release` once the checkpoint is durable.
    pub fn prepare_checkpoint(&mut self) -> Result<(PageImages, Vec<(u64, u16)>)> {
        let mut out = Vec::new();
        let max_level = self.trees.values().map(|t| t.height).max().unwrap_or(0);
        for level in 0..max_level {
            let mut dirty: Vec<usize> = self
                .map
                .iter()
                .filter(|(k, &s)| k.level == level && self.node(s).dirty)
                .map(|(_, &s)| s)
                .collect();
            dirty.sort_unstable_by_key(|&s| {
                let k = self.node(s).key;
                (k.tree, k.index)
            });
            for slot in dirty {
                self.write_node(slot, Some(&mut out))?;
            }
        }
        let freed = self.alloc.take_pending();
        Ok((out, freed))
    }

    /// Write prepared page images to `meta.dat` (not synced), runs of adjacent ones at once.
    pub fn write_pages(&self, pages: &mut PageImages) -> Result<()> {
        write_images(&*self.file, pages)
    }

    // -----------------------------------------------------------------------------------------
    // Writing dirty pages without holding the cache ("Writing outside the lock" above).

    /// Copies of up to `max` dirty nodes of `level` (none in a read-only cache), to be
    /// encoded ([`PageBatch::encode`]), given places ([`PageCache::allocate_batch`]),
    /// written ([`PageBatch::write`]) and installed ([`PageCache::install_batch`]). The nodes
    /// stay dirty meanwhile.
    pub fn take_dirty(&self, level: u8, max: usize) -> PageBatch {
        let mut slots: Vec<usize> = if self.read_only {
            Vec::new()
        } else {
            self.map
                .iter()
                .filter(|(k, &s)| k.level == level && self.node(s).dirty)
                .map(|(_, &s)| s)
                .collect()
        };
        slots.sort_unstable_by_key(|&s| {
            let k = self.node(s).key;
            (k.tree, k.index)
        });
        slots.truncate(max);
        let pages = slots
            .into_iter()
            .map(|s| BatchPage {
                key: self.node(s).key,
                image: self.node(s).data.clone(),
                stored: Vec::new(),
                plain_len: 0,
                ptr: Ptr::NULL,
            })
            .collect();
        PageBatch {
            file: self.file.clone(),
            crypto: self.crypto.clone(),
            pages,
        }
    }

    /// Give every encoded page of `batch` a new run (never one in use: nothing reads it
    /// before it is installed).
    pub fn allocate_batch(&mut self, batch: &mut PageBatch) {
        for p in &mut batch.pages {
            p.ptr.page = self.alloc.allocate(p.ptr.units);
        }
    }

    /// Point every node of a written `batch` that is still dirty with the bytes it had when
    /// taken at its new page (it becomes clean, its parent dirty); the runs of the others
    /// (changed, written or dropped meanwhile) are freed. Returns the pages installed.
    pub fn install_batch(&mut self, batch: PageBatch) -> Result<usize> {
        let mut installed = 0;
        for p in batch.pages {
            self.counters.pages_written += 1;
            self.counters.bytes_written += u64::from(p.ptr.units) * UNIT as u64;
            let slot = self.map.get(&p.key).copied();
            match slot {
                Some(s) if self.node(s).dirty && self.node(s).data == p.image => {
                    self.settle_written(s, p.ptr)?;
                    installed += 1;
                }
                _ => self.alloc.free(p.ptr.page, p.ptr.units),
            }
        }
        Ok(installed)
    }

    /// Give back the runs of a batch that could not be written.
    pub fn abandon_batch(&mut self, batch: PageBatch) {
        for p in batch.pages {
            self.alloc.free(p.ptr.page, p.ptr.units);
        }
    }

    /// Cut `meta.dat` after the last unit in use or held (only ever unreferenced space).
    pub fn trim_file(&self) -> Result<()> {
        let end = self.alloc.end().max(crate::page_alloc::HEADER_UNITS) * UNIT as u64;
        let len = self
            .file
            .len()
            .map_err(|e| Error::io("measuring meta.dat", e))?;
        if len > end {
            self.file
                .set_len(end)
                .map_err(|e| Error::io("trimming the free tail of meta.dat", e))?;
        }
        Ok(())
    }

    /// Use (or, `None`, stop using) the cache tier as a second level for page faults.
    pub fn set_l2(&mut self, l2: Option<Arc<dyn PageTier>>) {
        self.l2 = l2;
    }

    pub fn file(&self) -> &Arc<dyn File> {
        &self.file
    }

    /// Dirty pages in memory.
    pub fn dirty_pages(&self) -> usize {
        self.slots.iter().flatten().filter(|n| n.dirty).count()
    }
}

/// Dirty pages copied out of the cache to be encoded and written without holding it: see
/// [`PageCache::take_dirty`].
pub struct PageBatch {
    file: Arc<dyn File>,
    crypto: Option<Arc<Crypto>>,
    pages: Vec<BatchPage>,
}

struct BatchPage {
    key: Key,
    /// The node's bytes when taken.
    image: Box<[u8]>,
    /// Encoded (then sealed and padded by [`PageBatch::write`]).
    stored: Vec<u8>,
    /// Bytes of `stored` to seal.
    plain_len: usize,
    /// Where it goes: `units` and `codec` once encoded, `page` once allocated, `crc` once
    /// written.
    ptr: Ptr,
}

impl PageBatch {
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    /// Encode (compress) every page: this sets how many units each needs.
    pub fn encode(&mut self) {
        let sealed = self.crypto.is_some();
        for p in &mut self.pages {
            let (codec, stored, plain_len, need) = encode_stored(&p.image, p.key, sealed);
            p.stored = stored;
            p.plain_len = plain_len;
            p.ptr.codec = codec;
            p.ptr.units = need;
        }
    }

    /// Seal (encrypted pool) and write every allocated page to `meta.dat` (not synced).
    pub fn write(&mut self) -> Result<()> {
        let mut images = Vec::with_capacity(self.pages.len());
        for p in &mut self.pages {
            let stored = std::mem::take(&mut p.stored);
            let stored = seal_padded(
                self.crypto.as_deref(),
                stored,
                p.plain_len,
                p.key,
                p.ptr.page,
                p.ptr.units,
            )?;
            p.ptr.crc = crc(&stored);
            images.push((p.ptr.page, stored.into_boxed_slice()));
        }
        write_images(&*self.file, &mut images)
    }
}

/// A node's bytes encoded for storing: (codec, stored form, bytes of it to seal, units the
/// page needs once sealed (`sealed`) and padded).
fn encode_stored(data: &[u8], key: Key, sealed: bool) -> (u8, Vec<u8>, usize, u16) {
    let (codec, stored) = encode_page(data, stride(key.tree, key.level));
    // Sealed (encrypted pool): sealed length u16, then nonce, ciphertext of the stored form
    // without its padding, tag; padded to whole units.
    let plain_len = if codec == 0 {
        PAGE_BYTES
    } else {
        2 + usize::from(u16::from_le_bytes([stored[0], stored[1]]))
    };
    let need = if sealed {
        (2 + plain_len + crypto::OVERHEAD).div_ceil(UNIT)
    } else {
        stored.len() / UNIT
    } as u16;
    (codec, stored, plain_len, need)
}

/// The bytes written for a page encoded by [`encode_stored`] going to run `page` of `units`:
/// sealed in an encrypted pool, padded to the run (so the pointer's CRC covers all of it).
fn seal_padded(
    crypto: Option<&Crypto>,
    mut stored: Vec<u8>,
    plain_len: usize,
    key: Key,
    page: u64,
    units: u16,
) -> Result<Vec<u8>> {
    if let Some(c) = crypto {
        let mut sealed = vec![0u8; 2];
        let ctx = page_ctx(page, key.tree, key.level);
        c.seal(Kind::Page, &ctx, &stored[..plain_len], &mut sealed)?;
        let len = (sealed.len() - 2) as u16;
        sealed[..2].copy_from_slice(&len.to_le_bytes());
        stored = sealed;
    }
    stored.resize(usize::from(units) * UNIT, 0);
    Ok(stored)
}

/// Write page images to `file` (not synced), runs of adjacent ones at once.
fn write_images(file: &dyn File, pages: &mut PageImages) -> Result<()> {
    pages.sort_unstable_by_key(|p| p.0);
    let mut i = 0;
    while i < pages.len() {
        let mut buf = pages[i].1.to_vec();
        let mut end = pages[i].0 + (pages[i].1.len() / UNIT) as u64;
        let mut j = i + 1;
        while j < pages.len() && pages[j].0 == end && buf.len() < 4 << 20 {
            buf.extend_from_slice(&pages[j].1);
            end += (pages[j].1.len() / UNIT) as u64;
            j += 1;
        }
        file.write_at(&buf, pages[i].0 * UNIT as u64).map_err(|e| {
            Error::io(
                format!("writing metadata at byte {}", pages[i].0 * UNIT as u64),
                e,
            )
        })?;
        i = j;
    }
    Ok(())
}

enum LeafSrc<'a> {
    /// Data, page, dirty.
    Cached(&'a [u8], u64, bool),
    Disk(Ptr),
}

/// Sees (leaf index, stored page or 0, bytes); returns false to stop.
pub type LeafPageVisitor<'a> = dyn FnMut(u64, u64, &[u8]) -> Result<bool> + 'a;

/// Where one leaf of a tree is: see [`PageCache::leaf_pages`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeafPage {
    pub index: u64,
    pub page: u64,
    pub dirty: bool,
}

/// Read the page `p` points to, check it against the pointer's CRC and decode it.
/// The associated data of a sealed page: where it is (its first unit in `meta.dat`) and what
/// it is (chunk table or block map, level). Not the tree: a shared page serves several.
pub fn page_ctx(page: u64, tree: TreeId, level: u8) -> [u8; 10] {
    condense_format::page::page_ctx(page, tree == CHUNK_TREE, level)
}

/// [`read_checked`] through the cache tier: the page's stored bytes from the cache if it holds
/// them (the cache checks them against the pointer's CRC, and [`open_stored`] does again),
/// else from meta.dat, offered to the cache once they pass every check.
fn read_through(
    file: &dyn File,
    l2: &dyn PageTier,
    crypto: Option<&Crypto>,
    p: Ptr,
    tree: TreeId,
    level: u8,
    index: u64,
) -> Result<Box<[u8]>> {
    if let Some(stored) = l2.lookup_page(p.page, p.crc, p.units) {
        if let Ok(page) = open_stored(&stored, crypto, p, tree, level, index) {
            return Ok(page);
        }
    }
    let (stored, page) = read_opened(file, crypto, p, tree, level, index)?;
    l2.offer_page(p.page, p.crc, &stored);
    Ok(page)
}

fn page_what(p: Ptr, tree: TreeId, level: u8, index: u64) -> String {
    format!(
        "metadata page at byte {} of meta.dat ({} level {level} page {index})",
        p.page * UNIT as u64,
        tree_name(tree)
    )
}

/// The page's stored bytes, as meta.dat holds them.
fn read_stored(file: &dyn File, p: Ptr, tree: TreeId, level: u8, index: u64) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; usize::from(p.units) * UNIT];
    file.read_at(&mut buf, p.page * UNIT as u64)
        .map_err(|e| Error::io(page_what(p, tree, level, index), e))?;
    Ok(buf)
}

fn read_checked(
    file: &dyn File,
    crypto: Option<&Crypto>,
    p: Ptr,
    tree: TreeId,
    level: u8,
    index: u64,
) -> Result<Box<[u8]>> {
    read_opened(file, crypto, p, tree, level, index).map(|(_, page)| page)
}

/// The page's stored bytes and the page, checked; bytes that fail their check are read again
/// from the file's other copy where it has one (an S3 pool's `meta.dat` mirror: the bucket's
/// extent object, which also mends the mirror), before the damage is an error.
fn read_opened(
    file: &dyn File,
    crypto: Option<&Crypto>,
    p: Ptr,
    tree: TreeId,
    level: u8,
    index: u64,
) -> Result<(Vec<u8>, Box<[u8]>)> {
    let mut buf = read_stored(file, p, tree, level, index)?;
    match open_stored(&buf, crypto, p, tree, level, index) {
        Ok(page) => Ok((buf, page)),
        Err(e) if e.is_damage() => match file.read_other_copy(&mut buf, p.page * UNIT as u64) {
            Ok(true) => {
                let page = open_stored(&buf, crypto, p, tree, level, index)?;
                tracing::warn!("{e}; read the page from the other copy instead (mended)");
                Ok((buf, page))
            }
            Ok(false) => Err(e),
            Err(io) => {
                tracing::warn!("{e}; its other copy could not be read either: {io}");
                Err(e)
            }
        },
        Err(e) => Err(e),
    }
}

/// Check (authenticate, CRC) and decode a page's stored bytes.
pub fn open_stored(
    buf: &[u8],
    crypto: Option<&Crypto>,
    p: Ptr,
    tree: TreeId,
    level: u8,
    index: u64,
) -> Result<Box<[u8]>> {
    let what = || page_what(p, tree, level, index);
    // Encrypted: authenticate first, so changed bytes are reported as such.
    let opened = match crypto {
        Some(c) => {
            let len = match buf {
                [a, b, ..] => usize::from(u16::from_le_bytes([*a, *b])),
                _ => return Err(Error::corrupt(what(), "a sealed page of no bytes")),
            };
            let sealed = buf
                .get(2..2 + len)
                .ok_or_else(|| Error::corrupt(what(), "sealed length past the page"))?;
            Some(c.open(Kind::Page, &page_ctx(p.page, tree, level), sealed, what)?)
        }
        None => None,
    };
    let found = crc(buf);
    if found != p.crc {
        return Err(Error::Checksum {
            what: what(),
            expected: p.crc,
            found,
        });
    }
    decode_page(
        p.codec,
        opened.as_deref().unwrap_or(buf),
        stride(tree, level),
    )
    .ok_or_else(|| Error::corrupt(what(), "the stored page does not decode"))
}

/// The child slots of interior node (`level`, `index`) whose leaves meet `[from, to)`, with
/// the leaves under one child and the first leaf under the node.
fn children_meeting(
    level: u8,
    index: u64,
    from: u64,
    to: u64,
) -> (u64, u64, std::ops::RangeInclusive<u64>) {
    let span = FANOUT.pow(u32::from(level - 1));
    let base = index * FANOUT * span;
    let first = from.saturating_sub(base) / span;
    let last = ((to - 1).saturating_sub(base) / span).min(FANOUT - 1);
    (span, base, first..=last)
}

fn tree_name(tree: TreeId) -> String {
    if tree == CHUNK_TREE {
        "the chunk table".into()
    } else if tree >= condense_format::RELEASE_TREE_FIRST {
        format!("the block map of a deleted volume being released (tree {tree})")
    } else {
        format!("the block map of volume id {tree}")
    }
}

/// Leaves a tree of `height` levels can address.
pub fn capacity(height: u8) -> u64 {
    FANOUT.saturating_pow(u32::from(height.saturating_sub(1)))
}

/// Levels needed for `leaves` leaves.
pub fn height_for(leaves: u64) -> u8 {
    let mut h = 1u8;
    while capacity(h) < leaves {
        h += 1;
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page_of_words(f: impl Fn(usize) -> u64) -> Vec<u8> {
        (0..PAGE_BYTES / 8)
            .flat_map(|i| f(i).to_le_bytes())
            .collect()
    }

    #[test]
    fn pages_round_trip_and_sequential_maps_take_one_unit() {
        let sequential = page_of_words(|i| 1000 + i as u64);
        let (codec, stored) = encode_page(&sequential, 1);
        assert_eq!((codec, stored.len()), (1, UNIT));
        assert_eq!(
            decode_page(codec, &stored, 1).as_deref(),
            Some(&sequential[..])
        );
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let random = page_of_words(|_| 0);
        let random: Vec<u8> = random
            .iter()
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let (codec, stored) = encode_page(&random, 4);
        assert_eq!((codec, stored.len()), (0, PAGE_BYTES));
        assert_eq!(decode_page(codec, &stored, 4).as_deref(), Some(&random[..]));
        // Damaged stored bytes never panic.
        let (codec, mut stored) = encode_page(&sequential, 1);
        stored[0] ^= 0xff;
        let _ = decode_page(codec, &stored, 1);
        assert!(decode_page(7, &stored, 1).is_none());
    }

    /// A cache over an empty `meta.dat` on the simulated disk (the compaction tests too).
    pub(super) fn sim_cache() -> Result<PageCache> {
        let dir = condense_store::sim::SimHandle(condense_store::sim::SimDir::new());
        let file = condense_store::io::Dir::open(&dir, "meta.dat", true)
            .map_err(|e| Error::io("opening meta.dat", e))?;
        Ok(PageCache::new(
            file,
            PageAlloc::from_bitmap(Vec::new()),
            BTreeMap::new(),
            64 << 20,
        ))
    }

    fn fill(cache: &mut PageCache, tree: TreeId, leaf: u64, byte: u8) -> Result<()> {
        cache.leaf_mut(tree, leaf)?.fill(byte);
        Ok(())
    }

    /// Units the trees name, header included: what the allocator must count as used.
    fn named_units(cache: &mut PageCache) -> Result<u64> {
        let mut units = crate::page_alloc::HEADER_UNITS;
        for tree in cache.trees().keys().copied().collect::<Vec<_>>() {
            units += cache.exclusive_leaves(tree, &mut |_| Ok(()))?;
        }
        Ok(units)
    }

    /// A batch written outside the lock gives its pages to the nodes still as they were taken;
    /// a node changed meanwhile stays dirty (the checkpoint after writes it), a tree dropped
    /// meanwhile gets nothing, and no run leaks.
    #[test]
    fn a_batch_installs_only_the_nodes_it_wrote() -> Result<()> {
        let mut cache = sim_cache()?;
        cache.create_tree(1, 1024);
        cache.create_tree(2, 1024);
        for leaf in 0..20 {
            fill(&mut cache, 1, leaf * 7, leaf as u8 + 1)?;
        }
        fill(&mut cache, 2, 0, 99)?;
        let mut batch = cache.take_dirty(0, usize::MAX);
        assert_eq!(batch.len(), 21);
        // Meanwhile: a leaf changes again, another tree goes.
        fill(&mut cache, 1, 3 * 7, 200)?;
        cache.release_tree(2, &mut |_| Ok(()))?;
        batch.encode();
        cache.allocate_batch(&mut batch);
        batch.write()?;
        assert_eq!(cache.install_batch(batch)?, 19);
        let dirty_leaves = cache.take_dirty(0, usize::MAX);
        assert_eq!(dirty_leaves.len(), 1, "only the leaf changed meanwhile");
        assert!(
            cache.dirty_pages() > 1,
            "the installed leaves' parents are dirty"
        );
        let (mut pages, _) = cache.prepare_checkpoint()?;
        cache.write_pages(&mut pages)?;
        assert_eq!(cache.dirty_pages(), 0);
        assert_eq!(cache.alloc.used_units(), named_units(&mut cache)?);
        // What the new roots name reads back, through a cache that only has them.
        let mut reopened = PageCache::new(
            cache.file().clone(),
            PageAlloc::from_bitmap(cache.alloc.bitmap().to_vec()),
            cache.trees().clone(),
            64 << 20,
        );
        for leaf in 0..20 {
            let want = if leaf == 3 { 200 } else { leaf as u8 + 1 };
            let got = reopened.leaf(1, leaf * 7)?.map(|d| d.to_vec());
            assert_eq!(got, Some(vec![want; PAGE_BYTES]), "leaf {}", leaf * 7);
        }
        assert!(reopened.tree(2).is_none());
        Ok(())
    }

    /// A batch that could not be written gives its runs back and leaves its nodes dirty.
    #[test]
    fn an_abandoned_batch_gives_its_runs_back() -> Result<()> {
        let mut cache = sim_cache()?;
        cache.create_tree(1, 1024);
        for leaf in 0..5 {
            fill(&mut cache, 1, leaf, 1)?;
        }
        let used = cache.alloc.used_units();
        let mut batch = cache.take_dirty(0, 3);
        assert_eq!(batch.len(), 3, "at most max pages");
        batch.encode();
        cache.allocate_batch(&mut batch);
        assert!(cache.alloc.used_units() > used);
        cache.abandon_batch(batch);
        assert_eq!(cache.alloc.used_units(), used);
        assert_eq!(cache.take_dirty(0, usize::MAX).len(), 5);
        Ok(())
    }

    /// Found writing the meta_page fuzz target: in an encrypted pool, a pointer of 0 units read
    /// a stored page of no bytes and indexed its length prefix out of bounds (a panic).
    #[test]
    fn a_sealed_page_of_no_bytes_is_an_error() -> Result<()> {
        let c = Crypto::reader(
            &[1; 32],
            [2; 16],
            condense_format::crypto::NonceScheme::Session,
        )?;
        for stored in [&[][..], &[0][..]] {
            let p = Ptr {
                page: 3,
                crc: crc(stored),
                units: 0,
                codec: 1,
            };
            assert!(open_stored(stored, Some(&c), p, CHUNK_TREE, 0, 0).is_err());
        }
        Ok(())
    }
}

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

use crate::error::{Error, Result};
use crate::io::File;
use crate::page_alloc::PageAlloc;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

pub const PAGE_BYTES: usize = 4096;
/// Page images to write: (page number, bytes).
pub type PageImages = Vec<(u64, Box<[u8]>)>;
/// The cache keeps at least this many pages (16 MiB) however large the dedup index grows.
pub const PAGES_FLOOR: usize = 4096;
pub const FANOUT: u64 = 256;
const PTR_BYTES: usize = 16;

/// Which tree: a volume id, or [`CHUNK_TREE`].
pub type TreeId = u64;
/// The chunk table's tree.
pub const CHUNK_TREE: TreeId = u64::MAX;

/// A pointer to a page: its number in `meta.dat` (0 = none) and the CRC-32C of its bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ptr {
    pub page: u64,
    pub crc: u32,
}

impl Ptr {
    pub const NULL: Ptr = Ptr { page: 0, crc: 0 };

    fn read(buf: &[u8], i: usize) -> Ptr {
        let at = i * PTR_BYTES;
        let mut p = [0u8; 8];
        p.copy_from_slice(&buf[at..at + 8]);
        let mut c = [0u8; 4];
        c.copy_from_slice(&buf[at + 8..at + 12]);
        Ptr {
            page: u64::from_le_bytes(p),
            crc: u32::from_le_bytes(c),
        }
    }

    fn write(self, buf: &mut [u8], i: usize) {
        let at = i * PTR_BYTES;
        buf[at..at + 8].copy_from_slice(&self.page.to_le_bytes());
        buf[at + 8..at + 12].copy_from_slice(&self.crc.to_le_bytes());
        buf[at + 12..at + 16].fill(0);
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

struct Node {
    key: Key,
    data: Box<[u8]>,
    /// The page this node was read from or last written to (0: never written).
    page: u64,
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
    /// Pages written (checkpoints and eviction of dirty pages).
    pub pages_written: u64,
}

pub struct PageCache {
    file: Arc<dyn File>,
    map: HashMap<Key, usize>,
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
            file,
            map: HashMap::new(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            hand: 0,
            budget_pages: ((budget_bytes / PAGE_BYTES as u64) as usize).max(2),
            reserved_pages: 0,
            read_only: false,
            alloc,
            trees,
            counters: CacheCounters::default(),
        }
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
            info.root.write_to(&mut data, 0);
            let cached_old = self.map.contains_key(&old_root);
            self.insert(Node {
                key: new_root,
                data,
                page: 0,
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

    /// Remove `tree`, freeing every page it owns. `leaf` sees each leaf that exists (to drop
    /// the references its entries hold) before the tree goes.
    pub fn delete_tree(
        &mut self,
        tree: TreeId,
        mut leaf: impl FnMut(u64, &[u8]) -> Result<()>,
    ) -> Result<()> {
        let Some(info) = self.tree(tree) else {
            return Ok(());
        };
        self.for_each_leaf(tree, 0, u64::MAX, &mut |i, data| {
            leaf(i, data).map(|_| true)
        })?;
        let mut pages = vec![info.root.page];
        self.walk_pointers(tree, info.height - 1, 0, &mut |_, _, p| pages.push(p.page))?;
        for p in pages {
            self.alloc.free(p);
        }
        self.drop_cached(tree);
        self.trees.remove(&tree);
        Ok(())
    }

    /// Every non-null pointer below node (`level`, `index`): (child level, child index, ptr).
    /// Interior nodes are read through the cache; leaves are not read.
    fn walk_pointers(
        &mut self,
        tree: TreeId,
        level: u8,
        index: u64,
        f: &mut dyn FnMut(u8, u64, Ptr),
    ) -> Result<()> {
        if level == 0 {
            return Ok(());
        }
        let Some(slot) = self.find(tree, level, index, false)? else {
            return Ok(());
        };
        let ptrs: Vec<(u64, Ptr)> = (0..FANOUT)
            .map(|c| (c, Ptr::read(&self.node(slot).data, c as usize)))
            .collect();
        for (c, p) in ptrs {
            let child = index * FANOUT + c;
            if p.page != 0 {
                f(level - 1, child, p);
            }
            let cached = self.map.contains_key(&Key {
                tree,
                level: level - 1,
                index: child,
            });
            if level > 1 && (p.page != 0 || cached) {
                self.walk_pointers(tree, level - 1, child, f)?;
            }
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
        let mut buf = vec![0u8; PAGE_BYTES];
        let file = self.file.clone();
        let mut g = |i: u64, src: LeafSrc<'_>| -> Result<bool> {
            match src {
                LeafSrc::Cached(d) => f(i, d),
                LeafSrc::Disk(p) => {
                    read_checked(&*file, p, &mut buf, tree, 0, i)?;
                    f(i, &buf)
                }
            }
        };
        self.leaves_in(tree, from, to, &mut |i, src| g(i, src))
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
                f(0, LeafSrc::Cached(&self.node(slot).data))?;
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
        let span = FANOUT.pow(u32::from(level - 1)); // leaves under one child
        let base = index * FANOUT * span;
        let first = from.saturating_sub(base) / span;
        let last = ((to - 1).saturating_sub(base) / span).min(FANOUT - 1);
        for c in first..=last {
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
                        f(child, LeafSrc::Cached(&n.data))?
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
            if create {
                n.dirty = true;
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
                dirty: create,
                children: 0,
                referenced: true,
            }
        } else {
            self.counters.misses += 1;
            let mut data = vec![0u8; PAGE_BYTES].into_boxed_slice();
            read_checked(&*self.file, ptr, &mut data, tree, level, index)?;
            Node {
                key,
                data,
                page: ptr.page,
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
        Ok(Some(self.insert(node)))
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
        // In place only if no root on disk can name the old page; otherwise a new page, and
        // the old one is freed once the new copy is written.
        let page = if old_page != 0 && self.alloc.is_fresh(old_page) {
            old_page
        } else {
            self.alloc.allocate()
        };
        let sum = crc(&self.node(slot).data);
        match out {
            Some(out) => out.push((page, self.node(slot).data.clone())),
            None => {
                if let Err(e) = self
                    .file
                    .write_at(&self.node(slot).data, page * PAGE_BYTES as u64)
                {
                    if page != old_page {
                        self.alloc.free(page);
                    }
                    return Err(Error::io(format!("writing metadata page {page}"), e));
                }
            }
        }
        if page != old_page {
            self.alloc.free(old_page);
        }
        self.counters.pages_written += 1;
        let n = self.node_mut(slot);
        n.page = page;
        n.dirty = false;
        let ptr = Ptr { page, crc: sum };
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
            ptr.write_to(&mut pn.data, (key.index % FANOUT) as usize);
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
    pub fn prepare_checkpoint(&mut self) -> Result<(PageImages, Vec<u64>)> {
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

    /// Write prepared page images to `meta.dat` (not synced).
    pub fn write_pages(&self, pages: &[(u64, Box<[u8]>)]) -> Result<()> {
        // Coalesce runs of consecutive pages into one write.
        let mut i = 0;
        while i < pages.len() {
            let mut j = i + 1;
            while j < pages.len() && pages[j].0 == pages[j - 1].0 + 1 && j - i < 256 {
                j += 1;
            }
            let mut buf = Vec::with_capacity((j - i) * PAGE_BYTES);
            for (_, data) in &pages[i..j] {
                buf.extend_from_slice(data);
            }
            self.file
                .write_at(&buf, pages[i].0 * PAGE_BYTES as u64)
                .map_err(|e| Error::io(format!("writing metadata page {}", pages[i].0), e))?;
            i = j;
        }
        Ok(())
    }

    pub fn file(&self) -> &Arc<dyn File> {
        &self.file
    }

    /// Dirty pages in memory.
    pub fn dirty_pages(&self) -> usize {
        self.slots.iter().flatten().filter(|n| n.dirty).count()
    }
}

impl Ptr {
    fn write_to(self, buf: &mut [u8], i: usize) {
        self.write(buf, i)
    }
}

enum LeafSrc<'a> {
    Cached(&'a [u8]),
    Disk(Ptr),
}

/// Read page `p` into `buf` and check it against the pointer's CRC.
fn read_checked(
    file: &dyn File,
    p: Ptr,
    buf: &mut [u8],
    tree: TreeId,
    level: u8,
    index: u64,
) -> Result<()> {
    file.read_at(buf, p.page * PAGE_BYTES as u64).map_err(|e| {
        Error::io(
            format!(
                "reading metadata page {} ({} level {level} page {index})",
                p.page,
                tree_name(tree)
            ),
            e,
        )
    })?;
    let found = crc(buf);
    if found != p.crc {
        return Err(Error::Checksum {
            what: format!(
                "metadata page {} ({} level {level} page {index})",
                p.page,
                tree_name(tree)
            ),
            expected: p.crc,
            found,
        });
    }
    Ok(())
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

fn tree_name(tree: TreeId) -> String {
    if tree == CHUNK_TREE {
        "the chunk table".into()
    } else {
        format!("the block map of volume id {tree}")
    }
}

//! The `files/` directory tree: names, inodes and their attributes, kept in memory and written
//! through to the pool's metadata records (see [`crate::format`]).
//!
//! Crash ordering. Records reach the pool in the order they are put, so every operation puts
//! them in the order that leaves, at any crash point, a tree that mounts:
//! - create: the new inode record, then (for a directory) its empty entry list, then the parent's
//!   entry list. A crash before the last put leaves an unreachable inode record (a few bytes).
//! - remove: the parent's entry list, then the inode record is deleted, then its volume. A crash
//!   in between leaves an orphan `.file.<n>` volume, deleted at the next mount.
//! - rename: the destination list, then the source list. A crash in between leaves the inode
//!   under both names; loading keeps the first one seen and drops the other.
//!
//! File lengths and times change on every write; they are kept in memory ("dirty") and written
//! on fsync, on the last close, on fsyncdir and at unmount, like the inode updates of any file
//! system that journals metadata lazily.

use crate::format::{
    dir_key, file_volume_name, inode_key, parse_file_volume_name, valid_name, DirRec, InodeRec,
    Kind, Super, Timestamp, NAME_BYTES_MAX, SUPER_KEY, SYMLINK_TARGET_BYTES_MAX,
};
use crate::FuseError;
use condense_api::{Catalog, VolumeError};
use fuser::Errno;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

/// Inode number of the directory that `files/` shows.
pub const TREE_ROOT: u64 = 3;
/// First inode number handed out to files and directories under `files/`.
pub const FIRST_INO: u64 = 16;
/// Inode numbers are reserved in the superblock in batches of this many, so that a create does
/// not rewrite the superblock. Numbers are never reused, even after a crash.
const INO_BATCH: u64 = 1024;
/// Tree inode numbers stay below this; volume files use the numbers above it.
pub const TREE_INO_MAX: u64 = 1 << 56;

/// Map a Volume API error to the errno a FUSE reply carries.
pub fn errno_of(e: &VolumeError) -> Errno {
    Errno::from_i32(e.errno())
}

/// One inode of the tree in memory.
#[derive(Debug, Clone)]
pub struct Node {
    pub rec: InodeRec,
    /// The directory holding this inode (for a directory, what `..` names).
    pub parent: u64,
    /// Entries of a directory; `None` for other kinds.
    pub children: Option<BTreeMap<Vec<u8>, u64>>,
    /// Attributes changed in memory and not yet written to the pool.
    pub dirty: bool,
    /// Open file handles on this inode.
    pub open: u32,
    /// Removed from its directory while open: destroyed at the last close.
    pub unlinked: bool,
}

impl Node {
    pub fn is_dir(&self) -> bool {
        self.rec.kind == Kind::Dir
    }
}

/// What a caller of a namespace change must do after releasing the tree: delete the content
/// volume of an inode that is gone.
#[derive(Debug, Default, PartialEq, Eq)]
#[must_use]
pub struct Released {
    pub volumes: Vec<String>,
}

/// Attribute changes asked by setattr (size is handled by the file layer).
#[derive(Debug, Default, Clone, Copy)]
pub struct AttrChange {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub atime: Option<Timestamp>,
    pub mtime: Option<Timestamp>,
}

/// The whole tree, behind one lock in the file system.
pub struct Tree {
    catalog: Arc<dyn Catalog>,
    nodes: HashMap<u64, Node>,
    next_ino: u64,
    reserved_until: u64,
    read_only: bool,
}

fn put(catalog: &dyn Catalog, key: &str, value: Option<&[u8]>) -> Result<(), Errno> {
    catalog.meta_put(key, value).map_err(|e| {
        tracing::error!("writing file tree record {key}: {e}");
        errno_of(&e)
    })
}

fn check_name(name: &[u8]) -> Result<(), Errno> {
    if name.len() > NAME_BYTES_MAX {
        return Err(Errno::ENAMETOOLONG);
    }
    if !valid_name(name) {
        return Err(Errno::EINVAL);
    }
    Ok(())
}

/// The root directory of a new tree, owned by `uid`:`gid`.
fn empty_root(uid: u32, gid: u32) -> InodeRec {
    let now = Timestamp::now();
    InodeRec {
        kind: Kind::Dir,
        mode: 0o755,
        uid,
        gid,
        size: 0,
        atime: now,
        mtime: now,
        ctime: now,
        target: Vec::new(),
    }
}

/// The in-memory node of the root directory, its entries not yet loaded.
fn root_node(rec: InodeRec) -> Node {
    Node {
        rec,
        parent: fuser::INodeNo::ROOT.0,
        children: Some(BTreeMap::new()),
        dirty: false,
        open: 0,
        unlinked: false,
    }
}

/// First use: store the root's inode record, its empty entry list and the superblock.
fn store_empty_tree(catalog: &dyn Catalog, root: &InodeRec) -> Result<Super, FuseError> {
    catalog.meta_put(&inode_key(TREE_ROOT), Some(&root.encode()))?;
    catalog.meta_put(&dir_key(TREE_ROOT), Some(&DirRec::default().encode()))?;
    let sup = Super {
        next_ino: FIRST_INO,
    };
    catalog.meta_put(SUPER_KEY, Some(&sup.encode()))?;
    catalog.flush()?;
    Ok(sup)
}

/// Read the root's inode record and every directory reachable from it, breadth first,
/// dropping entries whose inode is out of range, already linked or has no record.
fn load_nodes(catalog: &dyn Catalog, next_ino: u64) -> Result<HashMap<u64, Node>, FuseError> {
    let root_key = inode_key(TREE_ROOT);
    let root = match catalog.meta_get(&root_key)? {
        Some(bytes) => InodeRec::decode(&root_key, &bytes)?,
        None => {
            return Err(FuseError::Corrupt(
                "file tree: the root directory's inode record is missing".into(),
            ))
        }
    };
    if root.kind != Kind::Dir {
        return Err(FuseError::Corrupt(
            "file tree: the root inode is not a directory".into(),
        ));
    }
    let mut nodes = HashMap::new();
    nodes.insert(TREE_ROOT, root_node(root));
    let mut queue = VecDeque::from([TREE_ROOT]);
    while let Some(dir) = queue.pop_front() {
        let children = load_dir(catalog, dir, next_ino, &mut nodes, &mut queue)?;
        // A directory is queued only once its node is in.
        debug_assert!(nodes.contains_key(&dir));
        if let Some(node) = nodes.get_mut(&dir) {
            node.children = Some(children);
        }
    }
    Ok(nodes)
}

/// Read directory `dir`'s entry list and its entries' inode records into `nodes`, queueing
/// the subdirectories; returns its entries.
fn load_dir(
    catalog: &dyn Catalog,
    dir: u64,
    next_ino: u64,
    nodes: &mut HashMap<u64, Node>,
    queue: &mut VecDeque<u64>,
) -> Result<BTreeMap<Vec<u8>, u64>, FuseError> {
    let key = dir_key(dir);
    let entries = match catalog.meta_get(&key)? {
        Some(bytes) => DirRec::decode(&key, &bytes)?.entries,
        None => {
            // mkdir stopped between the inode record and the entry list.
            tracing::warn!("file tree: directory {dir} has no entry list; empty");
            Vec::new()
        }
    };
    let mut children = BTreeMap::new();
    for (name, ino) in entries {
        if !(FIRST_INO..next_ino).contains(&ino) || nodes.contains_key(&ino) {
            tracing::warn!(
                "file tree: dropping entry {:?} of directory {dir}: inode {ino} \
                 is out of range or already linked",
                String::from_utf8_lossy(&name)
            );
            continue;
        }
        let ikey = inode_key(ino);
        let Some(bytes) = catalog.meta_get(&ikey)? else {
            tracing::warn!(
                "file tree: dropping entry {:?} of directory {dir}: inode {ino} \
                 has no record",
                String::from_utf8_lossy(&name)
            );
            continue;
        };
        let rec = InodeRec::decode(&ikey, &bytes)?;
        let is_dir = rec.kind == Kind::Dir;
        nodes.insert(
            ino,
            Node {
                rec,
                parent: dir,
                children: is_dir.then(BTreeMap::new),
                dirty: false,
                open: 0,
                unlinked: false,
            },
        );
        if is_dir {
            queue.push_back(ino);
        }
        children.insert(name, ino);
    }
    Ok(children)
}

impl Tree {
    /// Load the tree from the pool, creating an empty one on first use, and delete the content
    /// volumes no inode refers to (left by a crash during a remove).
    pub fn load(
        catalog: Arc<dyn Catalog>,
        read_only: bool,
        uid: u32,
        gid: u32,
    ) -> Result<Tree, FuseError> {
        let sup = match catalog.meta_get(SUPER_KEY)? {
            Some(bytes) => Super::decode(SUPER_KEY, &bytes)?,
            None => {
                let root = empty_root(uid, gid);
                if read_only {
                    // Nothing may be written: show an empty tree without storing it.
                    let nodes = HashMap::from([(TREE_ROOT, root_node(root))]);
                    return Ok(Tree {
                        catalog,
                        nodes,
                        next_ino: FIRST_INO,
                        reserved_until: FIRST_INO,
                        read_only,
                    });
                }
                store_empty_tree(&*catalog, &root)?
            }
        };
        if sup.next_ino < FIRST_INO || sup.next_ino >= TREE_INO_MAX {
            return Err(FuseError::Corrupt(format!(
                "file tree superblock: next inode {} outside {FIRST_INO}..{TREE_INO_MAX}",
                sup.next_ino
            )));
        }

        let nodes = load_nodes(&*catalog, sup.next_ino)?;
        let tree = Tree {
            catalog: catalog.clone(),
            nodes,
            next_ino: sup.next_ino,
            reserved_until: sup.next_ino,
            read_only,
        };
        if !read_only {
            tree.delete_orphan_volumes()?;
        }
        Ok(tree)
    }

    /// Delete the `.file.<n>` content volumes whose inode is not a file of the tree.
    fn delete_orphan_volumes(&self) -> Result<(), FuseError> {
        for info in self.catalog.list()? {
            let Some(ino) = parse_file_volume_name(&info.name) else {
                continue;
            };
            let live = self
                .nodes
                .get(&ino)
                .is_some_and(|n| n.rec.kind == Kind::File);
            if !live {
                tracing::info!("file tree: deleting orphan content volume {}", info.name);
                self.catalog.delete(&info.name)?;
            }
        }
        Ok(())
    }

    pub fn get(&self, ino: u64) -> Option<&Node> {
        self.nodes.get(&ino)
    }

    pub fn node(&self, ino: u64) -> Result<&Node, Errno> {
        self.nodes.get(&ino).ok_or(Errno::ENOENT)
    }

    fn node_mut(&mut self, ino: u64) -> Result<&mut Node, Errno> {
        self.nodes.get_mut(&ino).ok_or(Errno::ENOENT)
    }

    fn writable(&self) -> Result<(), Errno> {
        if self.read_only {
            Err(Errno::EROFS)
        } else {
            Ok(())
        }
    }

    /// Number of inodes in the tree (for statfs).
    pub fn inode_count(&self) -> usize {
        self.nodes.len()
    }

    /// The entries of directory `ino`.
    pub fn children(&self, ino: u64) -> Result<&BTreeMap<Vec<u8>, u64>, Errno> {
        self.node(ino)?.children.as_ref().ok_or(Errno::ENOTDIR)
    }

    /// Subdirectories of `ino` (for the link count).
    pub fn subdirs(&self, ino: u64) -> u32 {
        let Some(Some(children)) = self.nodes.get(&ino).map(|n| n.children.as_ref()) else {
            return 0;
        };
        let n = children
            .values()
            .filter(|c| self.nodes.get(c).is_some_and(Node::is_dir))
            .count();
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    pub fn lookup(&self, parent: u64, name: &[u8]) -> Result<u64, Errno> {
        if name.len() > NAME_BYTES_MAX {
            return Err(Errno::ENAMETOOLONG);
        }
        self.children(parent)?
            .get(name)
            .copied()
            .ok_or(Errno::ENOENT)
    }

    fn alloc_ino(&mut self) -> Result<u64, Errno> {
        if self.next_ino >= self.reserved_until {
            let until = self.next_ino + INO_BATCH;
            if until >= TREE_INO_MAX {
                return Err(Errno::ENOSPC);
            }
            put(
                &*self.catalog,
                SUPER_KEY,
                Some(&Super { next_ino: until }.encode()),
            )?;
            self.reserved_until = until;
        }
        let ino = self.next_ino;
        self.next_ino += 1;
        Ok(ino)
    }

    fn write_inode(&mut self, ino: u64) -> Result<(), Errno> {
        let node = self.node_mut(ino)?;
        let bytes = node.rec.encode();
        node.dirty = false;
        put(&*self.catalog, &inode_key(ino), Some(&bytes))
    }

    fn write_dir(&self, ino: u64) -> Result<(), Errno> {
        let children = self.children(ino)?;
        let rec = DirRec {
            entries: children.iter().map(|(n, &i)| (n.clone(), i)).collect(),
        };
        put(&*self.catalog, &dir_key(ino), Some(&rec.encode()))
    }

    fn touch_dir(&mut self, ino: u64, now: Timestamp) {
        if let Some(node) = self.nodes.get_mut(&ino) {
            node.rec.mtime = now;
            node.rec.ctime = now;
            node.dirty = true;
        }
    }

    /// Create a directory, file or symlink named `name` in `parent`.
    #[allow(clippy::too_many_arguments)]
    pub fn create(
        &mut self,
        parent: u64,
        name: &[u8],
        kind: Kind,
        mode: u32,
        uid: u32,
        gid: u32,
        target: &[u8],
    ) -> Result<u64, Errno> {
        self.writable()?;
        check_name(name)?;
        if kind == Kind::Symlink && target.len() > SYMLINK_TARGET_BYTES_MAX {
            return Err(Errno::ENAMETOOLONG);
        }
        if self.children(parent)?.contains_key(name) {
            return Err(Errno::EEXIST);
        }
        let now = Timestamp::now();
        let ino = self.alloc_ino()?;
        let rec = InodeRec {
            kind,
            mode: mode & 0o7777,
            uid,
            gid,
            size: if kind == Kind::Symlink {
                target.len() as u64
            } else {
                0
            },
            atime: now,
            mtime: now,
            ctime: now,
            target: if kind == Kind::Symlink {
                target.to_vec()
            } else {
                Vec::new()
            },
        };
        put(&*self.catalog, &inode_key(ino), Some(&rec.encode()))?;
        if kind == Kind::Dir {
            put(
                &*self.catalog,
                &dir_key(ino),
                Some(&DirRec::default().encode()),
            )?;
        }
        self.nodes.insert(
            ino,
            Node {
                rec,
                parent,
                children: (kind == Kind::Dir).then(BTreeMap::new),
                dirty: false,
                open: 0,
                unlinked: false,
            },
        );
        if let Some(Some(children)) = self.nodes.get_mut(&parent).map(|n| n.children.as_mut()) {
            children.insert(name.to_vec(), ino);
        }
        if let Err(e) = self.write_dir(parent) {
            // Undo in memory so that what is shown matches what is stored.
            if let Some(Some(children)) = self.nodes.get_mut(&parent).map(|n| n.children.as_mut()) {
                children.remove(name);
            }
            self.nodes.remove(&ino);
            return Err(e);
        }
        self.touch_dir(parent, now);
        Ok(ino)
    }

    /// Drop inode `ino`, which no directory names any more, or mark it for the last close.
    fn release_inode(&mut self, ino: u64, out: &mut Released) -> Result<(), Errno> {
        let node = self.node_mut(ino)?;
        if node.open > 0 {
            node.unlinked = true;
            return Ok(());
        }
        let kind = node.rec.kind;
        self.nodes.remove(&ino);
        if kind == Kind::Dir {
            put(&*self.catalog, &dir_key(ino), None)?;
        }
        put(&*self.catalog, &inode_key(ino), None)?;
        if kind == Kind::File {
            out.volumes.push(file_volume_name(ino));
        }
        Ok(())
    }

    /// Remove `name` from `parent`: a directory when `dir` (it must be empty), else a non-directory.
    pub fn remove(&mut self, parent: u64, name: &[u8], dir: bool) -> Result<Released, Errno> {
        self.writable()?;
        let ino = self.lookup(parent, name)?;
        let node = self.node(ino)?;
        match (dir, node.is_dir()) {
            (true, false) => return Err(Errno::ENOTDIR),
            (false, true) => return Err(Errno::EISDIR),
            (true, true) if node.children.as_ref().is_some_and(|c| !c.is_empty()) => {
                return Err(Errno::ENOTEMPTY)
            }
            _ => {}
        }
        let now = Timestamp::now();
        if let Some(Some(children)) = self.nodes.get_mut(&parent).map(|n| n.children.as_mut()) {
            children.remove(name);
        }
        if let Err(e) = self.write_dir(parent) {
            if let Some(Some(children)) = self.nodes.get_mut(&parent).map(|n| n.children.as_mut()) {
                children.insert(name.to_vec(), ino);
            }
            return Err(e);
        }
        self.touch_dir(parent, now);
        let mut out = Released::default();
        self.release_inode(ino, &mut out)?;
        Ok(out)
    }

    /// True when `ino` is `ancestor` or lies below it.
    fn is_within(&self, mut ino: u64, ancestor: u64) -> bool {
        // Bounded by the tree's depth, which is bounded by its size.
        for _ in 0..=self.nodes.len() {
            if ino == ancestor {
                return true;
            }
            match self.nodes.get(&ino) {
                Some(n) if ino != TREE_ROOT => ino = n.parent,
                _ => return false,
            }
        }
        false
    }

    /// Rename `parent/name` to `newparent/newname`, replacing a compatible target unless
    /// `noreplace`.
    pub fn rename(
        &mut self,
        parent: u64,
        name: &[u8],
        newparent: u64,
        newname: &[u8],
        noreplace: bool,
    ) -> Result<Released, Errno> {
        self.writable()?;
        check_name(newname)?;
        let ino = self.lookup(parent, name)?;
        self.children(newparent)?;
        let moving_dir = self.node(ino)?.is_dir();
        if moving_dir && self.is_within(newparent, ino) {
            return Err(Errno::EINVAL);
        }
        let replaced = self.children(newparent)?.get(newname).copied();
        if let Some(old) = replaced {
            if old == ino {
                return Ok(Released::default());
            }
            if noreplace {
                return Err(Errno::EEXIST);
            }
            let target = self.node(old)?;
            match (moving_dir, target.is_dir()) {
                (true, false) => return Err(Errno::ENOTDIR),
                (false, true) => return Err(Errno::EISDIR),
                (true, true) if target.children.as_ref().is_some_and(|c| !c.is_empty()) => {
                    return Err(Errno::ENOTEMPTY)
                }
                _ => {}
            }
        }
        let now = Timestamp::now();
        // Destination first: a crash between the two puts leaves two names, never none.
        if let Some(Some(children)) = self.nodes.get_mut(&newparent).map(|n| n.children.as_mut()) {
            children.insert(newname.to_vec(), ino);
        }
        if parent != newparent {
            if let Err(e) = self.write_dir(newparent) {
                if let Some(Some(children)) =
                    self.nodes.get_mut(&newparent).map(|n| n.children.as_mut())
                {
                    match replaced {
                        Some(old) => children.insert(newname.to_vec(), old),
                        None => children.remove(newname),
                    };
                }
                return Err(e);
            }
        }
        if let Some(Some(children)) = self.nodes.get_mut(&parent).map(|n| n.children.as_mut()) {
            children.remove(name);
        }
        self.write_dir(parent)?;
        self.touch_dir(parent, now);
        self.touch_dir(newparent, now);
        if let Some(node) = self.nodes.get_mut(&ino) {
            node.parent = newparent;
            node.rec.ctime = now;
            node.dirty = true;
        }
        let mut out = Released::default();
        if let Some(old) = replaced {
            self.release_inode(old, &mut out)?;
        }
        Ok(out)
    }

    /// Apply chmod/chown/utimens changes and write the inode.
    pub fn set_attr(&mut self, ino: u64, change: AttrChange) -> Result<(), Errno> {
        self.writable()?;
        let node = self.node_mut(ino)?;
        if let Some(mode) = change.mode {
            node.rec.mode = mode & 0o7777;
        }
        if let Some(uid) = change.uid {
            node.rec.uid = uid;
        }
        if let Some(gid) = change.gid {
            node.rec.gid = gid;
        }
        if let Some(t) = change.atime {
            node.rec.atime = t;
        }
        if let Some(t) = change.mtime {
            node.rec.mtime = t;
        }
        node.rec.ctime = Timestamp::now();
        self.write_inode(ino)
    }

    /// Record a new length (and, when `touch`, new mtime/ctime) of a file, in memory.
    pub fn set_size(&mut self, ino: u64, size: u64, touch: bool) -> Result<(), Errno> {
        let node = self.node_mut(ino)?;
        node.rec.size = size;
        if touch {
            let now = Timestamp::now();
            node.rec.mtime = now;
            node.rec.ctime = now;
        }
        node.dirty = true;
        Ok(())
    }

    /// Grow the recorded length of a file to at least `end` after a write, in memory.
    pub fn wrote(&mut self, ino: u64, end: u64) -> Result<(), Errno> {
        let node = self.node_mut(ino)?;
        if end > node.rec.size {
            node.rec.size = end;
        }
        let now = Timestamp::now();
        node.rec.mtime = now;
        node.rec.ctime = now;
        node.dirty = true;
        Ok(())
    }

    /// Write inode `ino` if it changed in memory.
    pub fn persist(&mut self, ino: u64) -> Result<(), Errno> {
        if self.read_only {
            return Ok(());
        }
        match self.nodes.get(&ino) {
            Some(n) if n.dirty && !n.unlinked => self.write_inode(ino),
            _ => Ok(()),
        }
    }

    /// Write every inode that changed in memory.
    pub fn persist_all(&mut self) -> Result<(), Errno> {
        if self.read_only {
            return Ok(());
        }
        let dirty: Vec<u64> = self
            .nodes
            .iter()
            .filter(|(_, n)| n.dirty && !n.unlinked)
            .map(|(&i, _)| i)
            .collect();
        for ino in dirty {
            self.write_inode(ino)?;
        }
        Ok(())
    }

    /// Count an open handle on `ino`.
    pub fn opened(&mut self, ino: u64) -> Result<(), Errno> {
        let node = self.node_mut(ino)?;
        node.open = node.open.saturating_add(1);
        Ok(())
    }

    /// Drop an open handle on `ino`; write its attributes at the last close, or destroy it if
    /// it was removed while open.
    pub fn closed(&mut self, ino: u64) -> Result<Released, Errno> {
        let node = self.node_mut(ino)?;
        node.open = node.open.saturating_sub(1);
        let mut out = Released::default();
        if node.open == 0 {
            if node.unlinked {
                node.unlinked = false;
                if !self.read_only {
                    self.release_inode(ino, &mut out)?;
                }
            } else {
                self.persist(ino)?;
            }
        }
        Ok(out)
    }
}

/// Where each regular file of the `files/` tree is, by the name of its hidden volume:
/// `.file.N` → `files/dir/name`, for reports that name damage (`condense verify`, the scrub).
/// Read-only and forgiving: a record that cannot be decoded, a loop or a name that is not
/// UTF-8 is skipped or shown lossily; at most `limit` files are returned.
pub fn file_paths(catalog: &dyn Catalog, limit: usize) -> HashMap<String, String> {
    let mut out = HashMap::new();
    let mut seen = std::collections::HashSet::from([TREE_ROOT]);
    let mut todo = VecDeque::from([(TREE_ROOT, "files".to_string())]);
    while let Some((dir, path)) = todo.pop_front() {
        let key = dir_key(dir);
        let Some(rec) = catalog
            .meta_get(&key)
            .ok()
            .flatten()
            .and_then(|b| DirRec::decode(&key, &b).ok())
        else {
            continue;
        };
        for (name, ino) in rec.entries {
            if out.len() >= limit || !seen.insert(ino) {
                continue;
            }
            let child = format!("{path}/{}", String::from_utf8_lossy(&name));
            let ikey = inode_key(ino);
            let kind = catalog
                .meta_get(&ikey)
                .ok()
                .flatten()
                .and_then(|b| InodeRec::decode(&ikey, &b).ok())
                .map(|r| r.kind);
            match kind {
                Some(Kind::Dir) => todo.push_back((ino, child)),
                Some(Kind::File) => {
                    out.insert(file_volume_name(ino), child);
                }
                _ => {}
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use condense_api::mem::MemCatalog;

    fn fresh() -> (Arc<MemCatalog>, Tree) {
        let cat = Arc::new(MemCatalog::new(4096));
        let tree = Tree::load(cat.clone(), false, 0, 0).expect("load");
        (cat, tree)
    }

    fn reload(cat: &Arc<MemCatalog>) -> Tree {
        Tree::load(cat.clone(), false, 0, 0).expect("reload")
    }

    #[test]
    fn file_paths_names_every_file_by_its_volume() {
        let (cat, mut t) = fresh();
        let d = t
            .create(TREE_ROOT, b"dir", Kind::Dir, 0o750, 1, 2, b"")
            .expect("mkdir");
        let f = t
            .create(d, b"disk.img", Kind::File, 0o640, 1, 2, b"")
            .expect("create");
        let g = t
            .create(TREE_ROOT, b"top", Kind::File, 0o640, 1, 2, b"")
            .expect("create");
        t.create(TREE_ROOT, b"link", Kind::Symlink, 0o777, 1, 2, b"top")
            .expect("symlink");
        let paths = file_paths(&*cat, 100);
        assert_eq!(paths.len(), 2, "{paths:?}");
        assert_eq!(paths[&file_volume_name(f)], "files/dir/disk.img");
        assert_eq!(paths[&file_volume_name(g)], "files/top");
        assert_eq!(file_paths(&*cat, 1).len(), 1, "bounded");
        // A directory record that no longer decodes is skipped, not an error.
        cat.meta_put(&dir_key(d), Some(b"junk")).expect("put");
        assert_eq!(file_paths(&*cat, 100).len(), 1);
    }

    #[test]
    fn namespace_survives_reload() -> Result<(), Errno> {
        let (cat, mut t) = fresh();
        let d = t.create(TREE_ROOT, b"dir", Kind::Dir, 0o750, 1, 2, b"")?;
        let f = t.create(d, b"file", Kind::File, 0o640, 1, 2, b"")?;
        let l = t.create(TREE_ROOT, b"link", Kind::Symlink, 0o777, 1, 2, b"dir/file")?;
        t.wrote(f, 12345)?;
        t.persist_all()?;
        let t2 = reload(&cat);
        assert_eq!(t2.lookup(TREE_ROOT, b"dir")?, d);
        assert_eq!(t2.lookup(d, b"file")?, f);
        assert_eq!(t2.node(f)?.rec.size, 12345);
        assert_eq!(t2.node(f)?.rec.mode, 0o640);
        assert_eq!(t2.node(l)?.rec.target, b"dir/file");
        assert_eq!(t2.node(d)?.parent, TREE_ROOT);
        assert_eq!(t2.subdirs(TREE_ROOT), 1);
        Ok(())
    }

    #[test]
    fn inode_numbers_are_never_reused_across_reloads() -> Result<(), Errno> {
        let (cat, mut t) = fresh();
        let a = t.create(TREE_ROOT, b"a", Kind::File, 0o644, 0, 0, b"")?;
        drop(t);
        let mut t = reload(&cat);
        let b = t.create(TREE_ROOT, b"b", Kind::File, 0o644, 0, 0, b"")?;
        assert!(b > a);
        Ok(())
    }

    #[test]
    fn remove_rules() -> Result<(), Errno> {
        let (_cat, mut t) = fresh();
        let d = t.create(TREE_ROOT, b"d", Kind::Dir, 0o755, 0, 0, b"")?;
        t.create(d, b"f", Kind::File, 0o644, 0, 0, b"")?;
        assert_eq!(t.remove(TREE_ROOT, b"d", true), Err(Errno::ENOTEMPTY));
        assert_eq!(t.remove(TREE_ROOT, b"d", false), Err(Errno::EISDIR));
        assert_eq!(t.remove(d, b"f", true), Err(Errno::ENOTDIR));
        assert_eq!(t.remove(d, b"nope", false), Err(Errno::ENOENT));
        let f = t.lookup(d, b"f")?;
        let released = t.remove(d, b"f", false)?;
        assert_eq!(released.volumes, vec![file_volume_name(f)]);
        assert!(t.remove(TREE_ROOT, b"d", true)?.volumes.is_empty());
        assert_eq!(t.lookup(TREE_ROOT, b"d"), Err(Errno::ENOENT));
        Ok(())
    }

    #[test]
    fn names_are_checked() {
        let (_cat, mut t) = fresh();
        let long = vec![b'n'; NAME_BYTES_MAX + 1];
        assert_eq!(
            t.create(TREE_ROOT, &long, Kind::File, 0o644, 0, 0, b""),
            Err(Errno::ENAMETOOLONG)
        );
        assert_eq!(t.lookup(TREE_ROOT, &long), Err(Errno::ENAMETOOLONG));
        let max = vec![b'n'; NAME_BYTES_MAX];
        assert!(t
            .create(TREE_ROOT, &max, Kind::File, 0o644, 0, 0, b"")
            .is_ok());
        assert_eq!(
            t.create(TREE_ROOT, &max, Kind::File, 0o644, 0, 0, b""),
            Err(Errno::EEXIST)
        );
    }

    #[test]
    fn rename_rules_and_persistence() -> Result<(), Errno> {
        let (cat, mut t) = fresh();
        let a = t.create(TREE_ROOT, b"a", Kind::Dir, 0o755, 0, 0, b"")?;
        let b = t.create(a, b"b", Kind::Dir, 0o755, 0, 0, b"")?;
        let f = t.create(a, b"f", Kind::File, 0o644, 0, 0, b"")?;
        let g = t.create(TREE_ROOT, b"g", Kind::File, 0o644, 0, 0, b"")?;
        // A directory cannot move under itself.
        assert_eq!(
            t.rename(TREE_ROOT, b"a", b, b"x", false),
            Err(Errno::EINVAL)
        );
        assert_eq!(
            t.rename(a, b"f", TREE_ROOT, b"a", false),
            Err(Errno::EISDIR)
        );
        assert_eq!(
            t.rename(a, b"b", TREE_ROOT, b"g", false),
            Err(Errno::ENOTDIR)
        );
        assert_eq!(t.rename(a, b"f", TREE_ROOT, b"g", true), Err(Errno::EEXIST));
        // Replacing a file releases its volume.
        let released = t.rename(a, b"f", TREE_ROOT, b"g", false)?;
        assert_eq!(released.volumes, vec![file_volume_name(g)]);
        assert_eq!(t.lookup(TREE_ROOT, b"g")?, f);
        assert_eq!(t.lookup(a, b"f"), Err(Errno::ENOENT));
        // Moving a directory updates its parent.
        assert!(t
            .rename(a, b"b", TREE_ROOT, b"b2", false)?
            .volumes
            .is_empty());
        assert_eq!(t.node(b)?.parent, TREE_ROOT);
        t.persist_all()?;
        let t2 = reload(&cat);
        assert_eq!(t2.lookup(TREE_ROOT, b"g")?, f);
        assert_eq!(t2.lookup(TREE_ROOT, b"b2")?, b);
        assert!(t2.children(a)?.is_empty());
        Ok(())
    }

    #[test]
    fn removed_while_open_lives_until_last_close() -> Result<(), Errno> {
        let (_cat, mut t) = fresh();
        let f = t.create(TREE_ROOT, b"f", Kind::File, 0o644, 0, 0, b"")?;
        t.opened(f)?;
        assert!(t.remove(TREE_ROOT, b"f", false)?.volumes.is_empty());
        assert!(t.get(f).is_some());
        assert_eq!(t.closed(f)?.volumes, vec![file_volume_name(f)]);
        assert!(t.get(f).is_none());
        Ok(())
    }

    #[test]
    fn orphan_volumes_are_deleted_and_double_links_dropped_at_load() -> Result<(), FuseError> {
        let (cat, mut t) = fresh();
        let f = t.create(TREE_ROOT, b"f", Kind::File, 0o644, 0, 0, b"")?;
        let d = t.create(TREE_ROOT, b"d", Kind::Dir, 0o755, 0, 0, b"")?;
        cat.create(&file_volume_name(f), 4096)?;
        cat.create(&file_volume_name(999_999), 4096)?;
        cat.create("user-volume", 4096)?;
        // Simulate a rename cut between its two puts: `f` named in both directories.
        let both = DirRec {
            entries: vec![(b"f-again".to_vec(), f)],
        };
        cat.meta_put(&dir_key(d), Some(&both.encode()))?;
        let t2 = reload(&cat);
        let names: Vec<String> = cat.list()?.into_iter().map(|v| v.name).collect();
        assert_eq!(names, vec![file_volume_name(f), "user-volume".to_string()]);
        assert_eq!(t2.lookup(TREE_ROOT, b"f")?, f);
        assert_eq!(t2.lookup(d, b"f-again"), Err(Errno::ENOENT));
        Ok(())
    }

    #[test]
    fn damaged_records_fail_the_load_with_a_clear_error() -> Result<(), FuseError> {
        let (cat, _t) = fresh();
        cat.meta_put(&inode_key(TREE_ROOT), Some(b"garbage"))?;
        match Tree::load(cat.clone(), false, 0, 0) {
            Err(FuseError::Format(e)) => assert_eq!(e.key, inode_key(TREE_ROOT)),
            other => panic!("expected a format error, got {:?}", other.err()),
        }
        Ok(())
    }
}

//! Hosts that share one pool in a bucket (docs/S3.md "Many hosts"): the registry of members
//! (`members/SS-W`), joining it ([`join`]), and the other members as this host sees them
//! ([`Membership::peers`]).
//!
//! Each host writes its own part of the pool, a tree laid out as a whole pool: the first
//! host's at the top of the prefix (slot 0), every host that joined under `hosts/SS/`. The
//! trees share the first host's superblock (its pool UUID, fingerprint key and settings, in
//! an encrypted pool its wrapped data key), so a chunk has one fingerprint on every host and
//! a record of one host's segment checks and opens on every other.
//!
//! Invariants:
//! - **A slot is one host's.** A joining host takes the lowest slot above every one in the
//!   registry ([`join_store`]). On a store with conditional PUT it creates the slot lock
//!   `members/SS` ([`slot_lock_object`]) if absent, and the slot is the creator's (a slot with a
//!   lock is the member's the lock names). Elsewhere it registers, waits [`SETTLE`], and lists
//!   again: of two registrations of one slot the lower writer id wins and the other host
//!   withdraws and tries the next slot (the rule of the lease claims, [`super::lease`]); a
//!   registration whose window (LIST to end of PUT, [`Window`]) exceeded [`WINDOW_BOUND`] is
//!   withdrawn and made again. Registry objects are put once, never replaced.
//! - The high byte of every segment id is its host's slot, so no two hosts ever name a
//!   segment alike ([`condense_format::SEGMENT_SLOT_SHIFT`]).
//! - Another member is only ever read: through a read-only open of its tree from a local
//!   directory of its own under `peers/SS/` in this host's local directory; or, once its
//!   lease expired, written by taking that lease from a directory under `takeover/SS/`.
//! - Volume claims ([`ClaimRegistry`], `volumes/`) and their turn objects are put by a part's
//!   writer only within its lease's write fence, each object once; a claim's turn object is
//!   deleted before the claim, and only if it names the claim's writer.

use super::conf::{backend, remote_error, RemoteConf, REMOTE_CONF_NAME};
use super::shared::Shared;
use crate::claim_window::{Window, SETTLE, WINDOW_BOUND};
use crate::io::{Peer, VolumeClaims};
use condense_format::bucket::{
    decode_lock, encode_lock, member_dir, parse_slot_lock, slot_lock_object, Member, MEMBERS_PREFIX,
};
use condense_format::error::{Error, Result};
use condense_format::hosts::VolumeClaim;
use condense_object_store::ObjectBackend;
use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

/// Registrations tried before a join gives up.
const JOIN_TRIES: usize = 8;
/// The cache of the local directory a peer's tree is read through.
const PEER_CACHE_BYTES: u64 = 64 << 20;
/// The name the first host (slot 0, which made the pool and never registers) goes by.
pub const FIRST_HOST: &str = "first-host";
/// The subdirectory of the local directory that holds one directory per other member.
pub const PEERS_SUBDIR: &str = "peers";
/// The subdirectory of the local directory that holds a writer's directory per other member,
/// for taking its volumes over.
pub const TAKEOVER_SUBDIR: &str = "takeover";

/// `s3://BUCKET/PREFIX` and a member slot → the URL of that member's tree.
pub fn member_url(pool_url: &str, slot: u8) -> String {
    match member_dir(slot).as_str() {
        "" => pool_url.to_string(),
        d => format!("{}/{d}", pool_url.trim_end_matches('/')),
    }
}

/// The URL of a member's tree → (the pool's URL, the member's slot).
pub fn split_member_url(url: &str) -> (String, u8) {
    let trimmed = url.trim_end_matches('/');
    if let Some((pool, slot)) = trimmed.rsplit_once("/hosts/") {
        if let Ok(slot @ 1..) = u8::from_str_radix(slot, 16) {
            if member_dir(slot) == format!("hosts/{}", &trimmed[pool.len() + 7..]) {
                return (pool.to_string(), slot);
            }
        }
    }
    (url.to_string(), 0)
}

/// This host's place in the pool: its slot, and how to reach the pool's prefix.
pub struct Membership {
    pub slot: u8,
    pool_url: String,
    /// The store at the pool's prefix (the registry), connected at the first listing: the
    /// read-only opens of other hosts' parts never list the registry.
    root: OnceLock<Arc<dyn ObjectBackend>>,
    /// This host's `remote.conf` (endpoint, region and credentials for the peers' too).
    conf: RemoteConf,
    /// This host's local directory.
    local: PathBuf,
    /// Registry objects read so far (they never change).
    known: KnownCache,
    /// Makes a local directory that opens another member's part read-only (the caller's:
    /// `connect --read-only`'s).
    prepare: PrepareLocal,
}

/// Make the local directory `path` for the part `conf` names, with a cache of `size` bytes.
pub(super) type PrepareLocal = fn(&Path, &RemoteConf, u64) -> Result<()>;

impl Membership {
    /// The membership of the tree `conf` names, for a host whose local directory is `local`.
    pub fn new(conf: &RemoteConf, local: &Path, prepare: PrepareLocal) -> Membership {
        let (pool_url, slot) = split_member_url(&conf.url);
        Membership {
            slot,
            root: OnceLock::new(),
            pool_url,
            conf: conf.clone(),
            local: local.to_path_buf(),
            known: Mutex::new(BTreeMap::new()),
            prepare,
        }
    }

    /// The hosts that joined the pool, one per slot (one LIST, a GET per new registration).
    pub fn registered(&self) -> Result<Vec<Member>> {
        let root = match self.root.get() {
            Some(r) => r.clone(),
            None => {
                let conf = RemoteConf {
                    url: self.pool_url.clone(),
                    read_only: true,
                    ..self.conf.clone()
                };
                let store = backend(&conf, false)?;
                self.root.get_or_init(|| store).clone()
            }
        };
        registered(&*root, &self.pool_url, &self.known)
    }

    /// The other members, each with a local directory that opens its tree read-only (made
    /// under `peers/SS/` the first time).
    pub fn peers(&self) -> io::Result<Vec<Peer>> {
        let to_io = |e: Error| io::Error::other(e.to_string());
        let mut all: Vec<(u8, String)> = self
            .registered()
            .map_err(to_io)?
            .into_iter()
            .map(|m| (m.slot, m.host))
            .collect();
        if all.is_empty() {
            return Ok(Vec::new()); // nobody joined: the pool is the first host's alone
        }
        all.push((0, FIRST_HOST.to_string()));
        let mut peers = Vec::new();
        for (slot, host) in all.into_iter().filter(|(s, _)| *s != self.slot) {
            let url = member_url(&self.pool_url, slot);
            let dir_for = |sub: &str, read_only: bool| -> io::Result<PathBuf> {
                let local = self.local.join(sub).join(format!("{slot:02x}"));
                if !local.join(REMOTE_CONF_NAME).is_file() {
                    crate::io::create_private_dir(&self.local.join(sub))?;
                    let conf = RemoteConf {
                        url: url.clone(),
                        read_only,
                        durability_to_store: None,
                        ..self.conf.clone()
                    };
                    (self.prepare)(&local, &conf, PEER_CACHE_BYTES).map_err(to_io)?;
                }
                Ok(local)
            };
            peers.push(Peer {
                slot,
                host,
                local: dir_for(PEERS_SUBDIR, true)?,
                takeover: dir_for(TAKEOVER_SUBDIR, false)?,
                url,
            });
        }
        peers.sort_by_key(|p| p.slot);
        Ok(peers)
    }
}

impl Membership {
    /// The volume claims of the pool as the writer `writer` of this part (`shared`: its
    /// lease's write fence) puts and deletes them.
    pub fn claims(&self, shared: Arc<Shared>, writer: u64) -> Result<ClaimRegistry> {
        let conf = RemoteConf {
            url: self.pool_url.clone(),
            read_only: false,
            ..self.conf.clone()
        };
        Ok(ClaimRegistry {
            store: backend(&conf, true)?,
            url: self.pool_url.clone(),
            shared,
            slot: self.slot,
            writer,
        })
    }
}

/// The volume claims of a shared pool, for one part's writer ([`crate::io::VolumeClaims`]).
pub struct ClaimRegistry {
    /// The store at the pool's prefix.
    store: Arc<dyn ObjectBackend>,
    url: String,
    /// The writer's part: its write fence guards every PUT and DELETE.
    shared: Arc<Shared>,
    slot: u8,
    writer: u64,
}

impl VolumeClaims for ClaimRegistry {
    fn list(&self, name: Option<&str>) -> io::Result<Vec<VolumeClaim>> {
        let prefix = VolumeClaim::prefix(name);
        let listed = self
            .store
            .list(prefix.trim_end_matches('/'))
            .map_err(|e| io::Error::other(remote_error(&self.url, e).to_string()))?;
        Ok(listed
            .into_iter()
            .filter_map(|(o, _)| VolumeClaim::parse_object(&o))
            .filter(|c| name.is_none_or(|n| c.name == n))
            .collect())
    }

    fn put(&self, name: &str, turn: u32) -> io::Result<VolumeClaim> {
        let c = VolumeClaim {
            name: name.to_string(),
            turn,
            slot: self.slot,
            writer: self.writer,
        };
        self.shared.may_write(&format!("claiming volume {name}"))?;
        let body = format!("condense-volume-claim 1\nhost={}\n", hostname_here());
        self.store
            .put(&c.object(), body.as_bytes())
            .map_err(|e| io::Error::other(remote_error(&self.url, e).to_string()))?;
        Ok(c)
    }

    fn writer(&self) -> u64 {
        self.writer
    }

    fn delete(&self, claim: &VolumeClaim) -> io::Result<()> {
        self.shared
            .may_write(&format!("deleting the claim of volume {}", claim.name))?;
        // The turn object first: a crash between the two leaves a claim, which the next
        // writer of this slot deletes at its first sync, never a turn object without one
        // that refuses the name.
        // (Only where turn objects are made: a store without conditional PUT has none, and
        // the timed protocol never reads them.)
        if self.conditional()
            && self.turn_holder(&claim.name, claim.turn)? == Some((claim.slot, claim.writer))
        {
            self.delete_turn(&claim.name, claim.turn)?;
        }
        self.store.delete(&claim.object()).map_err(|e| self.err(e))
    }

    fn conditional(&self) -> bool {
        self.store.conditional_put_honoured()
    }

    fn take_turn(&self, name: &str, turn: u32) -> io::Result<Option<(u8, u64)>> {
        self.shared.may_write(&format!("claiming volume {name}"))?;
        let obj = VolumeClaim::turn_object(name, turn);
        let body = encode_lock(self.writer, self.slot, &hostname_here());
        // Twice: a turn object deleted between our create and our read is created again.
        for _ in 0..2 {
            if self
                .store
                .put_if_absent(&obj, &body)
                .map_err(|e| self.err(e))?
            {
                return Ok(Some((self.slot, self.writer)));
            }
            match self.store.get(&obj) {
                Ok(b) => return Ok(decode_lock(&b).map(|(w, s)| (s, w))),
                Err(e) if e.is_not_found() => continue,
                Err(e) => return Err(self.err(e)),
            }
        }
        Ok(None)
    }

    fn turns(&self, name: Option<&str>) -> io::Result<Vec<(String, u32)>> {
        let prefix = VolumeClaim::prefix(name);
        let listed = self
            .store
            .list(prefix.trim_end_matches('/'))
            .map_err(|e| self.err(e))?;
        Ok(listed
            .into_iter()
            .filter_map(|(o, _)| VolumeClaim::parse_turn_object(&o))
            .filter(|(n, _)| name.is_none_or(|want| n == want))
            .collect())
    }

    fn turn_holder(&self, name: &str, turn: u32) -> io::Result<Option<(u8, u64)>> {
        match self.store.get(&VolumeClaim::turn_object(name, turn)) {
            Ok(b) => Ok(decode_lock(&b).map(|(w, s)| (s, w))),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(self.err(e)),
        }
    }

    fn delete_turn(&self, name: &str, turn: u32) -> io::Result<()> {
        self.shared
            .may_write(&format!("deleting the turn object of volume {name}"))?;
        self.store
            .delete(&VolumeClaim::turn_object(name, turn))
            .map_err(|e| self.err(e))
    }
}

impl ClaimRegistry {
    /// The claims at `store` (the pool's prefix) of the writer `writer` of slot `slot`.
    #[cfg(any(test, feature = "sim"))]
    pub(super) fn on(
        store: Arc<dyn ObjectBackend>,
        url: &str,
        shared: Arc<Shared>,
        slot: u8,
        writer: u64,
    ) -> ClaimRegistry {
        ClaimRegistry {
            store,
            url: url.to_string(),
            shared,
            slot,
            writer,
        }
    }

    fn err(&self, e: condense_object_store::Error) -> io::Error {
        io::Error::other(remote_error(&self.url, e).to_string())
    }
}

fn hostname_here() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// A registry object read (they are never replaced): a member's registration, or a slot
/// lock's writer id; `None` if unreadable.
#[derive(Clone, Debug)]
enum Known {
    Member(Option<Member>),
    Lock(Option<u64>),
}

type KnownCache = Mutex<BTreeMap<String, Known>>;

/// The registry of the pool at `store`: one member per slot. A slot with a lock is the
/// member's whose writer the lock names (none, if that host never put its registration); a
/// slot without one (registered on a store without conditional PUT) is the lowest writer's.
/// `known` caches the objects read (they are never replaced).
fn registered(store: &dyn ObjectBackend, url: &str, known: &KnownCache) -> Result<Vec<Member>> {
    let listed = store
        .list(MEMBERS_PREFIX.trim_end_matches('/'))
        .map_err(|e| remote_error(url, e))?;
    let mut by_slot: BTreeMap<u8, Member> = BTreeMap::new();
    let mut members = Vec::new();
    let mut locks: BTreeMap<u8, Option<u64>> = BTreeMap::new();
    for (obj, size) in listed {
        let lock = parse_slot_lock(&obj);
        if (Member::parse_object(&obj).is_none() && lock.is_none()) || size > 4096 {
            continue;
        }
        let cached = known
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&obj)
            .cloned();
        let read = match cached {
            Some(k) => k,
            None => {
                let bytes = match store.get(&obj) {
                    Ok(b) => b,
                    Err(e) if e.is_not_found() => continue, // withdrawn meanwhile
                    Err(e) => return Err(remote_error(url, e)),
                };
                let k = match lock {
                    Some(_) => Known::Lock(decode_lock(&bytes).map(|(w, _)| w)),
                    None => Known::Member(Member::decode(&obj, &bytes)),
                };
                if matches!(k, Known::Member(None) | Known::Lock(None)) {
                    tracing::warn!("{url}: registry object {obj} is not readable: ignored");
                }
                known
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(obj.clone(), k.clone());
                k
            }
        };
        match (read, lock) {
            (Known::Lock(w), Some(slot)) => {
                locks.insert(slot, w);
            }
            (Known::Member(Some(m)), _) => members.push(m),
            _ => {}
        }
    }
    for m in members {
        if let Some(w) = locks.get(&m.slot) {
            if *w != Some(m.writer) {
                continue; // the slot is the lock's writer's
            }
        }
        match by_slot.get(&m.slot) {
            Some(held) if held.writer <= m.writer => {}
            _ => {
                by_slot.insert(m.slot, m);
            }
        }
    }
    Ok(by_slot.into_values().collect())
}

/// [`registered`] with a fresh cache.
#[cfg(test)]
pub(super) fn registered_for_test(store: &dyn ObjectBackend, url: &str) -> Result<Vec<Member>> {
    registered(store, url, &Mutex::new(BTreeMap::new()))
}

/// The hosts registered in the pool `conf` names (`conf.url` is the pool's, or any
/// member's), for `condense hosts`.
pub fn list_members(conf: &RemoteConf) -> Result<Vec<Member>> {
    let (pool_url, _) = split_member_url(&conf.url);
    let conf = RemoteConf {
        url: pool_url.clone(),
        ..conf.clone()
    };
    registered(
        &*backend(&conf, false)?,
        &pool_url,
        &Mutex::new(BTreeMap::new()),
    )
}

/// Register `host` in the pool `conf.url` names: the slot it won (see the module docs).
pub fn join(conf: &RemoteConf, host: &str) -> Result<u8> {
    let store = backend(conf, true)?;
    join_store(&*store, &conf.url, host)
}

/// [`join`] on the registry at `store` (the pool's prefix; `url` for messages): on a store
/// with conditional PUT the slot is the creator's of its slot lock `members/SS`; elsewhere by
/// the timed protocol, whose window (the registry's LIST to the end of the PUT) must stay
/// within [`WINDOW_BOUND`] or the registration is withdrawn and made again.
pub fn join_store(store: &dyn ObjectBackend, url: &str, host: &str) -> Result<u8> {
    let known = Mutex::new(BTreeMap::new());
    let mut slow = String::new();
    for _ in 0..JOIN_TRIES {
        // The window holds one LIST: the next slot is above every slot named in the registry
        // (registrations and locks, by their names alone, readable or not), so no body is read
        // inside it.
        let window = Window::open();
        let listed = store
            .list(MEMBERS_PREFIX.trim_end_matches('/'))
            .map_err(|e| remote_error(url, e))?;
        let taken = listed.iter().filter_map(|(o, _)| {
            Member::parse_object(o)
                .map(|(slot, _)| slot)
                .or_else(|| parse_slot_lock(o))
        });
        let slot = match taken.max() {
            None => 1,
            Some(u8::MAX) => {
                return Err(Error::Invalid(format!(
                    "{url}: all 255 host slots are taken; no more hosts can join this pool"
                )))
            }
            Some(s) => s + 1,
        };
        let mut id = [0u8; 8];
        getrandom::fill(&mut id)
            .map_err(|e| Error::io("reading random bytes", io::Error::other(e.to_string())))?;
        let me = Member {
            slot,
            writer: u64::from_le_bytes(id),
            host: host.to_string(),
            joined_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        };
        if store.conditional_put_honoured() {
            let lock = slot_lock_object(slot);
            let body = encode_lock(me.writer, slot, host);
            if !store
                .put_if_absent(&lock, &body)
                .map_err(|e| remote_error(url, e))?
            {
                continue; // another host took this slot: the next one
            }
            if let Err(e) = store.put(&me.object(), me.encode().as_bytes()) {
                // The slot stays locked (and unused); a registration landing late names a
                // writer the lock does not, so it is never a member.
                let _ = store.delete(&me.object());
                return Err(remote_error(url, e));
            }
            return Ok(slot);
        }
        if let Err(e) = store.put(&me.object(), me.encode().as_bytes()) {
            // The PUT may still land after its error: withdraw it (docs/S3.md, assumption 3).
            let _ = store.delete(&me.object());
            return Err(remote_error(url, e));
        }
        if !window.within(WINDOW_BOUND) {
            slow = window.shown();
            tracing::warn!(
                "{url}: listing the registry and registering slot {slot:02x} took {slow} (more \
                 than {WINDOW_BOUND:?}: paused, or a slow store): withdrawn, trying again"
            );
            store
                .delete(&me.object())
                .map_err(|e| remote_error(url, e))?;
            continue;
        }
        std::thread::sleep(SETTLE);
        let now = registered(store, url, &known)?;
        if now.iter().any(|m| m.slot == slot && m.writer == me.writer) {
            return Ok(slot);
        }
        // Another host registered this slot at once with a lower id: withdraw, try the next.
        store
            .delete(&me.object())
            .map_err(|e| remote_error(url, e))?;
    }
    if !slow.is_empty() {
        return Err(Error::Busy(format!(
            "{url}: listing the registry and registering took more than {WINDOW_BOUND:?} (the \
             last {slow}): the process was paused or the store is too slow to join safely; \
             run the join again"
        )));
    }
    Err(Error::Invalid(format!(
        "{url}: {JOIN_TRIES} hosts joined at the same moment as this one; run the join again"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn member_urls_round_trip() {
        assert_eq!(member_url("s3://b/p", 0), "s3://b/p");
        assert_eq!(member_url("s3://b/p/", 3), "s3://b/p/hosts/03");
        for slot in [0u8, 1, 0x2a, 255] {
            let url = member_url("s3://b/p", slot);
            assert_eq!(split_member_url(&url), ("s3://b/p".to_string(), slot));
        }
        // Not a member's tree: the URL is a pool's own.
        for url in [
            "s3://b/hosts/zz",
            "s3://b/p/hosts/00",
            "s3://b/p/hosts/1",
            "s3://b/p",
        ] {
            assert_eq!(split_member_url(url), (url.to_string(), 0));
        }
    }

    #[test]
    fn a_slot_registered_twice_is_the_lower_writers() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", e))?;
        let url = format!("file://{}", dir.path().display());
        let store = condense_object_store::LocalBackend::open(dir.path())
            .map_err(|e| remote_error(&url, e))?;
        for (slot, writer, host) in [(1u8, 9u64, "b"), (1, 4, "a"), (2, 1, "c")] {
            let m = Member {
                slot,
                writer,
                host: host.into(),
                joined_unix: 1,
            };
            store
                .put(&m.object(), m.encode().as_bytes())
                .map_err(|e| remote_error(&url, e))?;
        }
        store
            .put("members/03-zz", b"junk")
            .map_err(|e| remote_error(&url, e))?;
        let got = registered(&store, &url, &Mutex::new(BTreeMap::new()))?;
        let hosts: Vec<(u8, &str)> = got.iter().map(|m| (m.slot, m.host.as_str())).collect();
        assert_eq!(hosts, vec![(1, "a"), (2, "c")]);
        // A slot lock decides its slot whatever the writer ids say; a lock without its
        // registration leaves the slot without a member.
        let d = Member {
            slot: 2,
            writer: 7,
            host: "d".into(),
            joined_unix: 1,
        };
        store
            .put(&d.object(), d.encode().as_bytes())
            .map_err(|e| remote_error(&url, e))?;
        for (slot, writer) in [(2u8, 7u64), (4, 5)] {
            store
                .put(&slot_lock_object(slot), &encode_lock(writer, slot, "x"))
                .map_err(|e| remote_error(&url, e))?;
        }
        let got = registered(&store, &url, &Mutex::new(BTreeMap::new()))?;
        let hosts: Vec<(u8, &str)> = got.iter().map(|m| (m.slot, m.host.as_str())).collect();
        assert_eq!(hosts, vec![(1, "a"), (2, "d")]);
        // The next joiner takes slot 5: above the locked, unused slot 4.
        assert_eq!(join_store(&store, &url, "e")?, 5);
        Ok(())
    }
}

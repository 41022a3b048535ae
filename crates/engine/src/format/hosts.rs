//! The metadata records of a pool several hosts share (docs/S3.md "Many hosts"; docs/FORMAT.md,
//! "Checkpoint root"), text values of the root's named records: this host's condemned segments
//! (`hosts/condemned`), its progress with each other host (`hosts/peer/SS`), the volumes it
//! handed to another host (`hosts/released/NAME`) and adopted from one (`hosts/adopted/SS/NAME`).
//!
//! Invariants: a value that does not parse is read as less (fewer condemned segments, less
//! progress, no hand-over), which only delays a deletion or a move, never loses data; sequence
//! numbers never go back (`next` is above every number listed).

use super::JournalRecord;
use std::collections::{BTreeMap, BTreeSet};

/// The named records of a root.
pub type Meta = BTreeMap<String, Vec<u8>>;

/// The metadata record of this host's condemned segments.
pub const CONDEMNED_KEY: &str = "hosts/condemned";
/// The metadata record of this host's progress with the peer in slot `SS`: `hosts/peer/SS`.
pub const PEER_KEY_PREFIX: &str = "hosts/peer/";

/// This host's segments condemned by its GC, each with its sequence number, and the next one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Condemned {
    pub next: u64,
    pub segs: BTreeMap<u32, u64>,
}

impl Condemned {
    pub fn read(meta: &Meta) -> Condemned {
        meta.get(CONDEMNED_KEY)
            .map(|v| Condemned::decode(v))
            .unwrap_or_default()
    }

    /// Text: `next=N`, then a `SEG SEQ` line (decimal) per segment. Lines not understood are
    /// skipped (a damaged record condemns less, which only delays a deletion).
    pub fn decode(v: &[u8]) -> Condemned {
        let mut c = Condemned::default();
        for line in String::from_utf8_lossy(v).lines() {
            if let Some(n) = line.strip_prefix("next=") {
                c.next = n.parse().unwrap_or(0);
            } else if let Some((seg, seq)) = line.split_once(' ') {
                if let (Ok(seg), Ok(seq)) = (seg.parse(), seq.parse()) {
                    c.segs.insert(seg, seq);
                }
            }
        }
        c.next = c
            .next
            .max(c.segs.values().map(|s| s + 1).max().unwrap_or(0));
        c
    }

    /// The journal record that stores it.
    pub fn record(&self) -> JournalRecord {
        JournalRecord::MetaPut {
            key: CONDEMNED_KEY.into(),
            value: Some(self.encode()),
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut s = format!("next={}\n", self.next);
        for (seg, seq) in &self.segs {
            s += &format!("{seg} {seq}\n");
        }
        s.into_bytes()
    }
}

/// The segments this host condemned (not victims of its GC again; not dead space).
pub fn condemned_in(meta: &Meta) -> BTreeSet<u32> {
    Condemned::read(meta).segs.into_keys().collect()
}

/// How far this host has folded a peer in: its chunk ids below `through` are folded, and its
/// condemned segments with a sequence number below `acked` are let go.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    pub through: u64,
    pub acked: u64,
}

impl Progress {
    pub fn key(slot: u8) -> String {
        format!("{PEER_KEY_PREFIX}{slot:02x}")
    }

    pub fn read(meta: &Meta, slot: u8) -> Progress {
        let mut p = Progress::default();
        let Some(v) = meta.get(&Progress::key(slot)) else {
            return p;
        };
        for line in String::from_utf8_lossy(v).lines() {
            match line.split_once('=') {
                Some(("through", n)) => p.through = n.parse().unwrap_or(0),
                Some(("acked", n)) => p.acked = n.parse().unwrap_or(0),
                _ => {}
            }
        }
        p
    }

    pub fn record(&self, slot: u8) -> JournalRecord {
        JournalRecord::MetaPut {
            key: Progress::key(slot),
            value: Some(format!("through={}\nacked={}\n", self.through, self.acked).into_bytes()),
        }
    }
}

/// The metadata record of a volume this host released to another (`hosts/released/NAME`:
/// `to=SS`, the slot, and `host=` its name): written no more here, deleted here once that
/// host's root holds the volume.
pub const RELEASED_PREFIX: &str = "hosts/released/";
/// The metadata record of a volume this host adopted from another: `hosts/adopted/SS/NAME`.
pub const ADOPTED_PREFIX: &str = "hosts/adopted/";

/// The host a volume was released to, if it was (its writes are refused here).
pub fn released_to(meta: &Meta, name: &str) -> Option<String> {
    // On the write path: no allocation unless some volume was released at all.
    let (first, _) = meta
        .range::<str, _>((
            std::ops::Bound::Included(RELEASED_PREFIX),
            std::ops::Bound::Unbounded,
        ))
        .next()?;
    if !first.starts_with(RELEASED_PREFIX) {
        return None;
    }
    let v = meta.get(&format!("{RELEASED_PREFIX}{name}"))?;
    let text = String::from_utf8_lossy(v);
    Some(
        text.lines()
            .find_map(|l| l.strip_prefix("host="))
            .unwrap_or("another host")
            .to_string(),
    )
}

/// The slot a volume was released to.
pub fn released_slot(meta: &Meta, name: &str) -> Option<u8> {
    let v = meta.get(&format!("{RELEASED_PREFIX}{name}"))?;
    String::from_utf8_lossy(v)
        .lines()
        .find_map(|l| l.strip_prefix("to="))
        .and_then(|s| u8::from_str_radix(s, 16).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn condemned_records_round_trip_and_damage_condemns_less() {
        let mut c = Condemned::default();
        c.segs.insert(0x0100_0003, 0);
        c.segs.insert(0x0100_0007, 1);
        c.next = 2;
        assert_eq!(Condemned::decode(&c.encode()), c);
        let mut damaged = c.encode();
        damaged.extend_from_slice(b"garbage\n12 x\n");
        assert_eq!(Condemned::decode(&damaged), c);
        // A lost `next=` line never hands out a sequence number twice.
        assert_eq!(Condemned::decode(b"5 3\n").next, 4);
    }
}

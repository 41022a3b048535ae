//! The metadata records of a pool several hosts share (docs/S3.md "Many hosts"; docs/FORMAT.md,
//! "Checkpoint root"), text values of the root's named records: this host's condemned segments
//! (`hosts/condemned`), its progress with each other host (`hosts/peer/SS`), the volumes it
//! handed to another host (`hosts/released/NAME`) and adopted from one (`hosts/adopted/SS/NAME`),
//! those half made by a hand-over (`hosts/pending/NAME`), the hosts it forgot
//! (`hosts/forgotten/SS`) and its acknowledgements of forgets (`hosts/forgot/SS`), and names
//! another host's part holds too (`hosts/conflict/NAME`).
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

/// The value of an adopted volume's record: `adopted`, then `turn=N`, the turn of the
/// hand-over (its released record's). Records before the turn was kept hold `adopted` alone.
pub fn adopted_value(turn: u32) -> Vec<u8> {
    format!("adopted\nturn={turn}\n").into_bytes()
}

/// The turn an adopted record names (`None`: a record of an older binary, or none).
pub fn adopted_turn(meta: &Meta, from_slot: u8, name: &str) -> Option<u32> {
    let v = meta.get(&format!("{ADOPTED_PREFIX}{from_slot:02x}/{name}"))?;
    std::str::from_utf8(v)
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("turn="))
        .and_then(|t| t.parse().ok())
}

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
    released_field(meta, name, "to=").and_then(|s| u8::from_str_radix(&s, 16).ok())
}

/// The claim turn the host a volume was released to claims it at (`turn=`; 1 in a record
/// written before volume claims).
pub fn released_turn(meta: &Meta, name: &str) -> Option<u32> {
    meta.get(&format!("{RELEASED_PREFIX}{name}"))?;
    Some(
        released_field(meta, name, "turn=")
            .and_then(|s| s.parse().ok())
            .unwrap_or(1),
    )
}

/// The value of a released volume's record: `to=SS`, `host=NAME`, `turn=N` lines.
pub fn released_value(slot: u8, host: &str, turn: u32) -> Vec<u8> {
    format!("to={slot:02x}\nhost={host}\nturn={turn}\n").into_bytes()
}

fn released_field(meta: &Meta, name: &str, field: &str) -> Option<String> {
    let v = meta.get(&format!("{RELEASED_PREFIX}{name}"))?;
    String::from_utf8_lossy(v)
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .map(str::to_string)
}

/// The metadata record of a volume this host is making by a hand-over that has not finished
/// (`hosts/pending/NAME`): an adoption or a clone from another host, killed or failed half
/// way. Written in the same commit as the volume's creation and removed in the commit that
/// completes it; while it is there the volume's writes are refused, and the next `volume
/// adopt` / `volume clone --from-host` of it, or `hosts sync`, makes it again from its source.
pub const PENDING_PREFIX: &str = "hosts/pending/";
/// The metadata record of a host forgotten by this one (`hosts/forgotten/SS`): its
/// acknowledgements are no longer awaited, its volumes may be adopted without a hand-over,
/// and with `reclaim=1` its part's segments that no other host names are deleted.
pub const FORGOTTEN_PREFIX: &str = "hosts/forgotten/";
/// The metadata record by which a host acknowledges a forget (`hosts/forgot/SS`): from the
/// root that holds it on, this host adds no chunk that names a segment of that part.
pub const FORGOT_ACK_PREFIX: &str = "hosts/forgot/";
/// The metadata record of a volume name this host holds that another host's part holds too,
/// where the claim rule gave the name to the other host (`hosts/conflict/NAME`: `winner=SS`,
/// `host=NAME`): its writes are refused here until one of the two is deleted or renamed.
pub const CONFLICT_PREFIX: &str = "hosts/conflict/";

/// What a half-made volume ([`PENDING_PREFIX`]) is being made from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pending {
    /// `adopt` (a hand-over, or a forgotten host's volume) or `clone` (`--from-host`).
    pub op: String,
    /// The source host's slot and the source volume (or `VOL@SNAP`) there.
    pub from: u8,
    pub source: String,
    /// The claim turn the volume was claimed at.
    pub turn: u32,
}

impl Pending {
    pub fn key(name: &str) -> String {
        format!("{PENDING_PREFIX}{name}")
    }

    pub fn encode(&self) -> Vec<u8> {
        format!(
            "op={}\nfrom={:02x}\nsource={}\nturn={}\n",
            self.op, self.from, self.source, self.turn
        )
        .into_bytes()
    }

    /// `None` if a field is missing or does not parse (the volume is then left alone).
    pub fn decode(v: &[u8]) -> Option<Pending> {
        let text = String::from_utf8_lossy(v);
        let field = |f: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(f))
                .map(str::to_string)
        };
        let op = field("op=").filter(|o| o == "adopt" || o == "clone")?;
        Some(Pending {
            op,
            from: u8::from_str_radix(&field("from=")?, 16).ok()?,
            source: field("source=").filter(|s| !s.is_empty())?,
            turn: field("turn=")?.parse().ok()?,
        })
    }

    /// Every half-made volume of a root: name → what it is made from.
    pub fn all(meta: &Meta) -> BTreeMap<String, Option<Pending>> {
        with_prefix(meta, PENDING_PREFIX)
            .map(|(name, v)| (name.to_string(), Pending::decode(v)))
            .collect()
    }
}

/// The records of `meta` under `prefix`: (the rest of the key, the value).
pub fn with_prefix<'a>(
    meta: &'a Meta,
    prefix: &'a str,
) -> impl Iterator<Item = (&'a str, &'a [u8])> {
    meta.range(prefix.to_string()..)
        .take_while(move |(k, _)| k.starts_with(prefix))
        .map(move |(k, v)| (&k[prefix.len()..], v.as_slice()))
}

/// A forgotten host ([`FORGOTTEN_PREFIX`]): its name, when, and whether its part's space is
/// to be reclaimed (its volumes not adopted by then given up).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Forgotten {
    pub host: String,
    pub at_unix: u64,
    pub reclaim: bool,
    /// The reclaim ran (its segments no host named were deleted).
    pub reclaimed: bool,
}

impl Forgotten {
    pub fn key(slot: u8) -> String {
        format!("{FORGOTTEN_PREFIX}{slot:02x}")
    }

    pub fn encode(&self) -> Vec<u8> {
        format!(
            "host={}\nat={}\nreclaim={}\nreclaimed={}\n",
            self.host,
            self.at_unix,
            u8::from(self.reclaim),
            u8::from(self.reclaimed)
        )
        .into_bytes()
    }

    /// A damaged value still forgets the host (the record's presence is what counts), but
    /// reclaims nothing.
    pub fn decode(v: &[u8]) -> Forgotten {
        let text = String::from_utf8_lossy(v);
        let field = |f: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(f))
                .map(str::to_string)
        };
        Forgotten {
            host: field("host=").unwrap_or_default(),
            at_unix: field("at=").and_then(|s| s.parse().ok()).unwrap_or(0),
            reclaim: field("reclaim=").as_deref() == Some("1"),
            reclaimed: field("reclaimed=").as_deref() == Some("1"),
        }
    }

    /// The hosts a root forgets, by slot.
    pub fn all(meta: &Meta) -> BTreeMap<u8, Forgotten> {
        with_prefix(meta, FORGOTTEN_PREFIX)
            .filter_map(|(slot, v)| {
                Some((u8::from_str_radix(slot, 16).ok()?, Forgotten::decode(v)))
            })
            .collect()
    }
}

/// The slots whose forget a root acknowledges ([`FORGOT_ACK_PREFIX`]).
pub fn forgets_acked(meta: &Meta) -> BTreeSet<u8> {
    with_prefix(meta, FORGOT_ACK_PREFIX)
        .filter_map(|(slot, _)| u8::from_str_radix(slot, 16).ok())
        .collect()
}

/// Why writes to volume `name` are refused by a hand-over record other than a release: it is
/// half made ([`PENDING_PREFIX`]), or its name is another host's ([`CONFLICT_PREFIX`]). On
/// the write path: no allocation unless such a record exists at all.
pub fn writes_refused(meta: &Meta, name: &str) -> Option<String> {
    for prefix in [PENDING_PREFIX, CONFLICT_PREFIX] {
        if with_prefix(meta, prefix).next().is_none() {
            continue;
        }
        let Some(v) = meta.get(&format!("{prefix}{name}")) else {
            continue;
        };
        if prefix == PENDING_PREFIX {
            return Some(
                "it is half made by a hand-over that stopped (an adopt or a clone from another host): run that command again, or `condense hosts sync`, to finish it".into(),
            );
        }
        let text = String::from_utf8_lossy(v);
        let host = text
            .lines()
            .find_map(|l| l.strip_prefix("host="))
            .unwrap_or("another host");
        return Some(format!(
            "host {host} holds a volume of this name too, and the claim rule gave the name to it (docs/S3.md \"Volume claims\"): delete or rename one of the two copies"
        ));
    }
    None
}

/// A host's claim of a volume name in a shared pool (docs/S3.md "Volume claims"): the object
/// `volumes/HEXNAME/TTTTTTTT-SS-WWWWWWWWWWWWWWWW`, put once and never replaced: the name (hex
/// of its bytes), the claim's turn (0 for a new volume, one more at each move), the claiming
/// host's slot and its writer id. Of the claims of one name, the highest turn wins, then the
/// lowest slot, then the lowest writer ([`VolumeClaim::wins_over`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeClaim {
    pub name: String,
    pub turn: u32,
    pub slot: u8,
    pub writer: u64,
}

impl VolumeClaim {
    /// The prefix of the claims of `name` (`None`: of every name).
    pub fn prefix(name: Option<&str>) -> String {
        match name {
            Some(n) => format!("{}{}/", super::bucket::VOLUMES_PREFIX, hex(n.as_bytes())),
            None => super::bucket::VOLUMES_PREFIX.to_string(),
        }
    }

    pub fn object(&self) -> String {
        format!(
            "{}{:08x}-{:02x}-{:016x}",
            VolumeClaim::prefix(Some(&self.name)),
            self.turn,
            self.slot,
            self.writer
        )
    }

    /// On a store with conditional PUT, the object whose creation takes turn `turn` of
    /// `name`: `volumes/HEXNAME/TTTTTTTT`, created if absent by the one host that wins that
    /// turn, holding its writer id and slot ([`super::bucket::encode_lock`]).
    pub fn turn_object(name: &str, turn: u32) -> String {
        format!("{}{turn:08x}", VolumeClaim::prefix(Some(name)))
    }

    /// (name, turn) of a turn object's name; `None` for any other name.
    pub fn parse_turn_object(obj: &str) -> Option<(String, u32)> {
        let rest = obj.strip_prefix(super::bucket::VOLUMES_PREFIX)?;
        let (name, turn) = rest.split_once('/')?;
        if turn.len() != 8 {
            return None;
        }
        Some((
            String::from_utf8(unhex(name)?).ok()?,
            u32::from_str_radix(turn, 16).ok()?,
        ))
    }

    /// The claim an object name holds; `None` for any other name.
    pub fn parse_object(obj: &str) -> Option<VolumeClaim> {
        let rest = obj.strip_prefix(super::bucket::VOLUMES_PREFIX)?;
        let (name, tag) = rest.split_once('/')?;
        let mut parts = tag.split('-');
        let (turn, slot, writer) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || turn.len() != 8 || slot.len() != 2 || writer.len() != 16 {
            return None;
        }
        Some(VolumeClaim {
            name: String::from_utf8(unhex(name)?).ok()?,
            turn: u32::from_str_radix(turn, 16).ok()?,
            slot: u8::from_str_radix(slot, 16).ok()?,
            writer: u64::from_str_radix(writer, 16).ok()?,
        })
    }

    /// The claim rule: the higher turn, then the lower slot, then the lower writer.
    pub fn wins_over(&self, other: &VolumeClaim) -> bool {
        (
            self.turn,
            std::cmp::Reverse(self.slot),
            std::cmp::Reverse(self.writer),
        ) > (
            other.turn,
            std::cmp::Reverse(other.slot),
            std::cmp::Reverse(other.writer),
        )
    }

    /// The winner of `claims` (all of one name).
    pub fn winner(claims: &[VolumeClaim]) -> Option<&VolumeClaim> {
        claims
            .iter()
            .reduce(|best, c| if c.wins_over(best) { c } else { best })
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.is_empty() || !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
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

    #[test]
    fn hand_over_records_round_trip_and_damage_does_less() {
        let p = Pending {
            op: "adopt".into(),
            from: 0x2a,
            source: "vm 1@snap".into(),
            turn: 7,
        };
        assert_eq!(Pending::decode(&p.encode()), Some(p.clone()));
        for bad in [
            &b""[..],
            b"op=adopt\nfrom=zz\nsource=v\nturn=1\n",
            b"op=rm\nfrom=01\nsource=v\nturn=1\n",
            b"op=clone\nfrom=01\nsource=\nturn=1\n",
            b"op=clone\nfrom=01\nsource=v\n",
            b"\xff\xfe",
        ] {
            assert_eq!(Pending::decode(bad), None, "{bad:?}");
        }
        let f = Forgotten {
            host: "h".into(),
            at_unix: 5,
            reclaim: true,
            reclaimed: false,
        };
        assert_eq!(Forgotten::decode(&f.encode()), f);
        // A damaged forget still forgets (the key counts), reclaiming nothing.
        assert_eq!(Forgotten::decode(b"\xffjunk"), Forgotten::default());
        let mut meta = Meta::new();
        meta.insert(Forgotten::key(3), f.encode());
        meta.insert(format!("{FORGOTTEN_PREFIX}zz"), f.encode());
        meta.insert(format!("{FORGOT_ACK_PREFIX}03"), b"dropped=0\n".to_vec());
        assert_eq!(
            Forgotten::all(&meta).into_keys().collect::<Vec<_>>(),
            vec![3]
        );
        assert_eq!(forgets_acked(&meta), BTreeSet::from([3]));
        assert_eq!(writes_refused(&meta, "v"), None);
        meta.insert(Pending::key("v"), p.encode());
        meta.insert(
            format!("{CONFLICT_PREFIX}w"),
            b"winner=01\nhost=hb\n".to_vec(),
        );
        assert!(writes_refused(&meta, "v").is_some_and(|w| w.contains("half made")));
        assert!(writes_refused(&meta, "w").is_some_and(|w| w.contains("host hb")));
        assert_eq!(writes_refused(&meta, "x"), None);
    }

    #[test]
    fn volume_claims_round_trip_and_the_rule_orders_them() {
        let c = VolumeClaim {
            name: "vm 1@x/é".into(),
            turn: 3,
            slot: 2,
            writer: 0xabc,
        };
        assert_eq!(VolumeClaim::parse_object(&c.object()), Some(c.clone()));
        assert!(c.object().starts_with(&VolumeClaim::prefix(Some(&c.name))));
        for bad in [
            "volumes/",
            "volumes/zz/00000000-00-0000000000000000",
            "volumes/61/0000000-00-0000000000000000",
            "volumes/61/00000000-00-0000000000000000-1",
            "volumes//00000000-00-0000000000000000",
            "volumes/6/00000000-00-0000000000000000",
            "members/61/00000000-00-0000000000000000",
        ] {
            assert_eq!(VolumeClaim::parse_object(bad), None, "{bad}");
        }
        let at = |turn, slot, writer| VolumeClaim {
            name: "v".into(),
            turn,
            slot,
            writer,
        };
        // A higher turn (a move) wins over a lower slot; in one turn the lower slot, then
        // the lower writer.
        assert!(at(1, 5, 9).wins_over(&at(0, 0, 0)));
        assert!(at(0, 1, 9).wins_over(&at(0, 2, 0)));
        assert!(at(0, 1, 3).wins_over(&at(0, 1, 4)));
        let all = [at(0, 2, 0), at(1, 3, 7), at(1, 3, 5), at(0, 0, 1)];
        assert_eq!(VolumeClaim::winner(&all), Some(&at(1, 3, 5)));
        assert_eq!(VolumeClaim::winner(&[]), None);
        // A turn object is no claim, and a claim no turn object.
        let t = VolumeClaim::turn_object("v", 3);
        assert_eq!(t, "volumes/76/00000003");
        assert_eq!(VolumeClaim::parse_object(&t), None);
        assert_eq!(VolumeClaim::parse_turn_object(&t), Some(("v".into(), 3)));
        assert_eq!(VolumeClaim::parse_turn_object(&c.object()), None);
        let mut meta = Meta::new();
        meta.insert(format!("{RELEASED_PREFIX}v"), released_value(4, "h", 7));
        assert_eq!(released_slot(&meta, "v"), Some(4));
        assert_eq!(released_turn(&meta, "v"), Some(7));
        assert_eq!(released_to(&meta, "v").as_deref(), Some("h"));
        assert_eq!(released_turn(&meta, "w"), None);
    }
}

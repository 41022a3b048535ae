//! The records of the pool's history of accepted losses (`damage/<UTC time>` metadata
//! records, docs/REPAIR.md): what each `condense repair` gave up, one line per lost range.

/// Blocks of one volume or snapshot that repair could not salvage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LostRange {
    /// The volume, or `VOLUME@SNAPSHOT` for a snapshot.
    pub volume: String,
    pub first_block: u64,
    pub blocks: u64,
    /// Why, and what the blocks read now.
    pub reason: String,
}

/// The pool's metadata records that keep what each repair lost, named `damage/<UTC time>`:
/// an administrator who accepted the loss still sees it in `condense verify` until
/// `condense repair --clear-history` forgets it (as `zpool status -v` lists permanent errors
/// until `zpool clear`).
pub const DAMAGE_PREFIX: &str = "damage/";

/// What one repair lost, as kept in the pool's history.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DamageRecord {
    /// When the repair ran (UTC, as in the name of its backup directory).
    pub when: String,
    pub lost: Vec<LostRange>,
}

/// A history record's bytes: one line per lost range, `volume TAB first TAB blocks TAB
/// reason` (names and reasons hold no tab or newline: they are replaced by spaces).
pub fn encode_damage(lost: &[LostRange]) -> Vec<u8> {
    let clean = |s: &str| s.replace(['\t', '\n'], " ");
    lost.iter()
        .map(|l| {
            format!(
                "{}\t{}\t{}\t{}\n",
                clean(&l.volume),
                l.first_block,
                l.blocks,
                clean(&l.reason)
            )
        })
        .collect::<String>()
        .into_bytes()
}

/// Decode a history record (lines that do not parse are skipped: it is informational).
pub fn decode_damage(bytes: &[u8]) -> Vec<LostRange> {
    String::from_utf8_lossy(bytes)
        .lines()
        .filter_map(|line| {
            let mut f = line.splitn(4, '\t');
            Some(LostRange {
                volume: f.next()?.to_string(),
                first_block: f.next()?.parse().ok()?,
                blocks: f.next()?.parse().ok()?,
                reason: f.next()?.to_string(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_round_trips_and_bad_lines_are_skipped() {
        let lost = vec![
            LostRange {
                volume: "vm@snap".into(),
                first_block: 7,
                blocks: 3,
                reason: "record damaged\tread fails".into(),
            },
            LostRange {
                volume: "other".into(),
                first_block: 0,
                blocks: 1,
                reason: "lost".into(),
            },
        ];
        let mut bytes = encode_damage(&lost);
        let back = decode_damage(&bytes);
        assert_eq!(back.len(), 2);
        assert_eq!(
            back[0].reason, "record damaged read fails",
            "tabs become spaces"
        );
        assert_eq!(back[1], lost[1]);
        bytes.extend_from_slice(b"vm\tnot-a-number\t1\tx\n\xff\xfe\n");
        assert_eq!(decode_damage(&bytes).len(), 2);
    }
}

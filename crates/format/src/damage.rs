//! The records of the pool's history of accepted losses (`damage/<UTC time>` metadata
//! records, docs/REPAIR.md): what each `condense repair` gave up, one line per lost range.
//! With them the arithmetic of lost block ranges ([`merge`], [`subtract`]) and the UTC stamp
//! in the records' names ([`utc_stamp`]).

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

/// `YYYYMMDDTHHMMSSZ` for seconds since the Unix epoch: the time in a history record's name
/// (and in the name of a repair's backup directory).
pub fn utc_stamp(secs: u64) -> String {
    let days = (secs / 86400) as i64;
    let rem = secs % 86400;
    // Civil date from days since 1970-01-01 (proleptic Gregorian calendar).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}{m:02}{d:02}T{:02}{:02}{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// Sort and merge overlapping or touching block ranges `[first, end)` (lost ranges).
pub fn merge(r: &mut [(u64, u64)]) -> Vec<(u64, u64)> {
    r.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for &(s, e) in r.iter() {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

/// `[s, e)` minus the sorted, merged `cut`.
pub fn subtract(s: u64, e: u64, cut: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut at = s;
    for &(cs, ce) in cut {
        if ce <= at || cs >= e {
            continue;
        }
        if cs > at {
            out.push((at, cs));
        }
        at = at.max(ce);
    }
    if at < e {
        out.push((at, e));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_merge_and_subtract() {
        assert_eq!(merge(&mut [(5, 7), (0, 2), (2, 3)]), vec![(0, 3), (5, 7)]);
        assert_eq!(subtract(0, 10, &[(2, 4), (6, 12)]), vec![(0, 2), (4, 6)]);
        assert_eq!(subtract(3, 5, &[(0, 10)]), vec![]);
    }

    #[test]
    fn utc_stamp_is_a_calendar_date() {
        assert_eq!(utc_stamp(0), "19700101T000000Z");
        assert_eq!(utc_stamp(1_700_000_000), "20231114T221320Z");
    }

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

    #[test]
    fn damage_records_round_trip_and_garbage_is_skipped() {
        let lost = vec![
            LostRange {
                volume: "vm@s1".into(),
                first_block: 100,
                blocks: 3,
                reason: "its chunk has a damaged record\t(crc)".into(),
            },
            LostRange {
                volume: ".file.7".into(),
                first_block: 0,
                blocks: 1,
                reason: "r".into(),
            },
        ];
        let mut got = decode_damage(&encode_damage(&lost));
        assert_eq!(got[0].reason, "its chunk has a damaged record (crc)");
        got[0].reason = lost[0].reason.clone();
        assert_eq!(got, lost);
        assert!(decode_damage(b"x\ty\n\xff\t1\n").is_empty());
    }
}

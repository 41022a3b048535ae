//! `snapshot list`: every snapshot (of one volume) with the space only it holds.

use super::{human, Report};
use condense_api::SnapshotInfo;
use serde::{Serialize, Serializer};
use std::fmt::Write;

/// The snapshots listed, each with the bytes deleting it would free (`None`: not known).
pub struct SnapshotList {
    pub rows: Vec<(SnapshotInfo, Option<u64>)>,
}

#[derive(Serialize)]
struct Wire<'a> {
    schema: &'static str,
    snapshots: Vec<Row<'a>>,
}

#[derive(Serialize)]
struct Row<'a> {
    name: String,
    volume: &'a str,
    snapshot: &'a str,
    created_unix: u64,
    created: String,
    size_bytes: u64,
    written_bytes: u64,
    freeable_bytes: Option<u64>,
}

impl Serialize for SnapshotList {
    fn serialize<S: Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
        let rows = self.rows.iter().map(|(s, freeable)| Row {
            name: s.full_name(),
            volume: &s.volume,
            snapshot: &s.snapshot,
            created_unix: s.created_unix,
            created: local_time(s.created_unix).1,
            size_bytes: s.size_bytes,
            written_bytes: s.written_bytes,
            freeable_bytes: *freeable,
        });
        Wire {
            schema: "condense.snapshots/1",
            snapshots: rows.collect(),
        }
        .serialize(ser)
    }
}

impl Report for SnapshotList {
    fn text(&self) -> String {
        let mut o = format!(
            "{:<32} {:<19} {:>12} {:>12} {:>12}\n",
            "NAME", "CREATED", "SIZE", "WRITTEN", "FREEABLE"
        );
        for (s, freeable) in &self.rows {
            let _ = writeln!(
                o,
                "{:<32} {:<19} {:>12} {:>12} {:>12}",
                s.full_name(),
                local_time(s.created_unix).0,
                human(s.size_bytes),
                human(s.written_bytes),
                freeable.map_or_else(|| "-".to_string(), human)
            );
        }
        if self.rows.is_empty() {
            o.push_str("(no snapshots; make one with `condense snapshot create VOLUME NAME`)\n");
        }
        o
    }
}

/// `unix` seconds in local time: ("2024-05-01 14:03:07", "2024-05-01T14:03:07+02:00").
pub fn local_time(unix: u64) -> (String, String) {
    let t = libc::time_t::try_from(unix).unwrap_or(libc::time_t::MAX);
    // SAFETY: an all-zero `tm` is a valid value; localtime_r only writes into it.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    // SAFETY: both pointers are valid for the call; localtime_r is thread-safe.
    let ok = !unsafe { libc::localtime_r(&t, &mut tm) }.is_null();
    if !ok {
        return (unix.to_string(), unix.to_string());
    }
    let day = format!(
        "{:04}-{:02}-{:02}",
        i64::from(tm.tm_year) + 1900,
        tm.tm_mon + 1,
        tm.tm_mday
    );
    let time = format!("{:02}:{:02}:{:02}", tm.tm_hour, tm.tm_min, tm.tm_sec);
    let off = tm.tm_gmtoff;
    let sign = if off < 0 { '-' } else { '+' };
    let off = off.unsigned_abs();
    (
        format!("{day} {time}"),
        format!(
            "{day}T{time}{sign}{:02}:{:02}",
            off / 3600,
            (off % 3600) / 60
        ),
    )
}

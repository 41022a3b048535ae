//! Entry points shared by the cargo-fuzz targets (`fuzz/fuzz_targets/`) and the bounded
//! random-input test that runs on stable Rust in CI (`tests/fuzz_smoke.rs`).
//!
//! Each function takes arbitrary bytes, must never panic on them, and asserts the properties
//! the rest of the server relies on.

use crate::proto::*;
use crate::wire::{self, ClientOption, Command, Negotiated, Verdict};
use condense_api::{Extent, ExtentKind};

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    for (i, x) in a.iter_mut().enumerate() {
        *x = b.get(at + i).copied().unwrap_or(0);
    }
    u32::from_be_bytes(a)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    (u64::from(u32_at(b, at)) << 32) | u64::from(u32_at(b, at + 4))
}

/// The pure parsers: options, request headers and checks, extent conversions.
pub fn parsers(data: &[u8]) {
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    match sel % 3 {
        0 => option(rest),
        1 => requests(rest),
        _ => extents(rest),
    }
}

fn option(rest: &[u8]) {
    if rest.len() < 4 {
        return;
    }
    let code = u32_at(rest, 0) % 16;
    let payload = &rest[4..];
    match wire::parse_option(code, payload) {
        Ok(ClientOption::Go(r) | ClientOption::Info(r)) => {
            assert!(r.name.len() <= STRING_BYTES_MAX);
            assert!(!r.name.contains('\0'));
            // Exactly the bytes announced were consumed.
            assert_eq!(4 + r.name.len() + 2 + 2 * r.info.len(), payload.len());
        }
        Ok(ClientOption::ListMetaContext(m) | ClientOption::SetMetaContext(m)) => {
            assert!(m.export.len() <= STRING_BYTES_MAX);
            let q: usize = m.queries.iter().map(|q| 4 + q.len()).sum();
            assert_eq!(4 + m.export.len() + 4 + q, payload.len());
            let snapshots = vec!["s1".to_string(), "x".to_string()];
            for q in &m.queries {
                for list in [true, false] {
                    if let Ok(found) = wire::match_meta_query(q, list, &snapshots) {
                        for c in found {
                            assert!(c.name().len() <= STRING_BYTES_MAX);
                        }
                    }
                }
            }
            let _ = wire::select_meta_contexts(&m.queries, false, &snapshots);
        }
        Ok(ClientOption::List | ClientOption::StructuredReply | ClientOption::StartTls) => {
            assert!(payload.is_empty());
        }
        Ok(ClientOption::ExportName(n)) => assert_eq!(n.len(), payload.len()),
        Ok(ClientOption::Abort | ClientOption::Unknown(_)) | Err(_) => {}
    }
}

fn requests(rest: &[u8]) {
    if rest.len() < 9 {
        return;
    }
    let flags = rest[8];
    let n = Negotiated {
        size: u64_at(rest, 0) >> (flags & 0x3f).min(63),
        read_only: flags & 0x40 != 0,
        structured: flags & 0x80 != 0,
        block_status: flags & 0x80 != 0 && rest[0] & 1 != 0,
        payload_bytes_max: 32 << 20,
    };
    for chunk in rest[9..].chunks(REQUEST_HEADER_BYTES) {
        let mut raw = [0u8; REQUEST_HEADER_BYTES];
        raw[..chunk.len()].copy_from_slice(chunk);
        if raw[0] & 1 == 0 {
            raw[..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        }
        let Ok(h) = wire::parse_request_header(&raw) else {
            continue;
        };
        match wire::check_request(&h, &n) {
            Verdict::Run(cmd) => {
                let (offset, len) = match cmd {
                    Command::Read { offset, len, .. }
                    | Command::Write { offset, len, .. }
                    | Command::Trim { offset, len, .. }
                    | Command::Cache { offset, len }
                    | Command::WriteZeroes { offset, len, .. }
                    | Command::BlockStatus { offset, len, .. } => (offset, len),
                    Command::Disc | Command::Flush => (0, 0),
                };
                assert!(offset
                    .checked_add(u64::from(len))
                    .is_some_and(|e| e <= n.size));
                if n.read_only {
                    assert!(!matches!(
                        cmd,
                        Command::Write { .. } | Command::Trim { .. } | Command::WriteZeroes { .. }
                    ));
                }
                if let Command::Read { len, .. } | Command::Write { len, .. } = cmd {
                    assert!(len <= n.payload_bytes_max);
                }
                if let Command::BlockStatus { .. } = cmd {
                    assert!(n.block_status && len > 0);
                }
            }
            Verdict::Reject { error, skip, .. } => {
                assert_ne!(error, 0);
                assert!(skip == 0 || h.kind == CMD_WRITE);
            }
            Verdict::Disconnect(_) => assert!(h.kind == CMD_WRITE),
        }
    }
}

fn extents(rest: &[u8]) {
    if rest.len() < 13 {
        return;
    }
    let offset = u64::from(u32_at(rest, 0));
    let len = u32_at(rest, 4);
    let req_one = rest[8] & 1 != 0;
    let mut list = Vec::new();
    let mut pos = offset.saturating_sub(u64::from(rest[9]));
    for e in rest[13..].chunks(3) {
        let n = u64::from(u16::from_be_bytes([e[0], *e.get(1).unwrap_or(&0)])) + 1;
        let kind = match e.get(2).copied().unwrap_or(0) % 4 {
            0 => ExtentKind::Data,
            1 => ExtentKind::Zero,
            2 => ExtentKind::Unmapped,
            // An engine that breaks its contract: a gap before the next extent.
            _ => {
                pos += n;
                continue;
            }
        };
        list.push(Extent {
            offset: pos,
            len: n,
            kind,
        });
        pos += n;
    }
    let d = wire::block_status_descriptors(&list, offset, u64::from(len), req_one);
    if len == 0 {
        assert!(d.is_empty());
    } else {
        assert!(!d.is_empty());
        assert!(d.iter().all(|x| x.0 > 0));
        let total: u64 = d.iter().map(|x| u64::from(x.0)).sum();
        if req_one {
            assert_eq!(d.len(), 1);
            assert!(total <= u64::from(len));
        } else {
            assert_eq!(total, u64::from(len));
        }
    }
    // The same runs as a dirty bitmap (data = changed): the same coverage rules.
    let changes: Vec<condense_api::Change> = list
        .iter()
        .map(|e| condense_api::Change {
            offset: e.offset,
            len: e.len,
            changed: e.kind == ExtentKind::Data,
        })
        .collect();
    let d = wire::dirty_bitmap_descriptors(&changes, offset, u64::from(len), req_one);
    let total: u64 = d.iter().map(|x| u64::from(x.0)).sum();
    assert!(d.iter().all(|x| x.0 > 0 && x.1 & !STATE_DIRTY == 0));
    if len == 0 {
        assert!(d.is_empty());
    } else if req_one {
        assert_eq!(d.len(), 1);
        assert!(total <= u64::from(len));
    } else {
        assert_eq!(total, u64::from(len));
    }
    let plan = wire::plan_read(&list, offset, len);
    let mut at = offset;
    for p in &plan {
        assert_eq!(p.offset, at, "read pieces are contiguous");
        assert!(p.len > 0);
        at += u64::from(p.len);
    }
    assert_eq!(at, offset + u64::from(len), "read pieces cover the request");
}

/// A whole connection: the bytes are what a client sends (after an optional valid handshake
/// prefix so that most inputs reach the transmission phase), against an in-memory volume.
/// Returns the number of bytes the server sent.
pub fn session(data: &[u8]) -> usize {
    use condense_api::mem::MemCatalog;
    use condense_api::Catalog;
    use std::sync::Arc;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let Some((&sel, rest)) = data.split_first() else {
        return 0;
    };
    let catalog = Arc::new(MemCatalog::new(4096));
    if catalog.create("vm", 1 << 20).is_err() || catalog.snapshot_create("vm", "s").is_err() {
        return 0;
    }
    let mut input = Vec::new();
    if sel & 1 == 1 {
        input.extend_from_slice(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes());
        let option = |input: &mut Vec<u8>, code: u32, d: &[u8]| {
            input.extend_from_slice(&OPTS_MAGIC.to_be_bytes());
            input.extend_from_slice(&code.to_be_bytes());
            input.extend_from_slice(&(d.len() as u32).to_be_bytes());
            input.extend_from_slice(d);
        };
        if sel & 2 == 2 {
            option(&mut input, OPT_STRUCTURED_REPLY, &[]);
            // base:allocation, and with bit 2 the dirty bitmap against snapshot "s" too.
            let mut queries = vec![META_BASE_ALLOCATION.to_string()];
            if sel & 4 == 4 {
                queries.push(format!("{META_DIRTY_BITMAP_PREFIX}s"));
            }
            let mut m = Vec::new();
            m.extend_from_slice(&2u32.to_be_bytes());
            m.extend_from_slice(b"vm");
            m.extend_from_slice(&(queries.len() as u32).to_be_bytes());
            for q in &queries {
                m.extend_from_slice(&(q.len() as u32).to_be_bytes());
                m.extend_from_slice(q.as_bytes());
            }
            option(&mut input, OPT_SET_META_CONTEXT, &m);
        }
        let mut go = Vec::new();
        go.extend_from_slice(&2u32.to_be_bytes());
        go.extend_from_slice(b"vm");
        go.extend_from_slice(&0u16.to_be_bytes());
        option(&mut input, OPT_GO, &go);
    }
    input.extend_from_slice(rest);

    let Ok(rt) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    else {
        return 0;
    };
    rt.block_on(async move {
        let (mut client, server) = tokio::io::duplex(64 * 1024);
        let config = crate::ServerConfig {
            worker_threads: 1,
            ..crate::ServerConfig::default()
        };
        let serving = tokio::spawn(crate::serve_stream(server, catalog, config));
        let (mut rd, mut wr) = tokio::io::split(&mut client);
        let send = async {
            let _ = wr.write_all(&input).await;
            let _ = wr.shutdown().await;
        };
        let recv = async {
            let mut sink = vec![0u8; 64 * 1024];
            let mut total = 0;
            while let Ok(n) = rd.read(&mut sink).await {
                if n == 0 {
                    break;
                }
                total += n;
            }
            total
        };
        let ((), total) = tokio::join!(send, recv);
        drop(client);
        // A panic inside the connection surfaces here.
        if let Err(e) = serving.await {
            if e.is_panic() {
                std::panic::resume_unwind(e.into_panic());
            }
        }
        total
    })
}

//! The fixed newstyle handshake: every option this server implements, and its error replies.

mod common;

use common::*;
use condense_nbd::proto::*;
use condense_nbd::ServerConfig;

#[test]
fn list_shows_volumes_but_not_internal_ones() -> TestResult {
    let h = start(catalog(), ServerConfig::default());
    let mut c = Client::connect(addr(&h))?;
    let r = c.option(OPT_LIST, &[])?;
    let names: Vec<String> = r
        .iter()
        .filter(|r| r.kind == REP_SERVER)
        .map(|r| {
            let n = be32(&r.data) as usize;
            String::from_utf8(r.data[4..4 + n].to_vec()).expect("utf8")
        })
        .collect();
    assert_eq!(names, vec!["vm1", "vm2"]);
    assert_eq!(r.last().map(|r| r.kind), Some(REP_ACK));
    // LIST takes no data.
    let r = c.option(OPT_LIST, b"x")?;
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].kind, REP_ERR_INVALID);
    // The hidden volume cannot be opened either.
    let r = c.go(".internal", &[])?;
    assert_eq!(r.last().map(|r| r.kind), Some(REP_ERR_UNKNOWN));
    Ok(())
}

#[test]
fn info_then_go_report_size_flags_and_block_sizes() -> TestResult {
    let h = start(catalog(), ServerConfig::default());
    let mut c = Client::connect(addr(&h))?;
    let r = c.option(OPT_INFO, &go_data("vm1", &[INFO_NAME, INFO_BLOCK_SIZE]))?;
    assert_eq!(r.last().map(|r| r.kind), Some(REP_ACK));
    let info = |ty: u16| {
        r.iter()
            .find(|i| i.kind == REP_INFO && be16(&i.data) == ty)
            .map(|i| i.data[2..].to_vec())
    };
    let export = info(INFO_EXPORT).expect("NBD_INFO_EXPORT");
    assert_eq!(be64(&export), 8 * MIB);
    let flags = be16(&export[8..]);
    for f in [
        TFLAG_HAS_FLAGS,
        TFLAG_SEND_FLUSH,
        TFLAG_SEND_FUA,
        TFLAG_SEND_TRIM,
        TFLAG_SEND_WRITE_ZEROES,
        TFLAG_SEND_FAST_ZERO,
        TFLAG_CAN_MULTI_CONN, // MemVolume's flush is pool-wide
    ] {
        assert_ne!(flags & f, 0, "flag {f:#x} in {flags:#x}");
    }
    assert_eq!(flags & TFLAG_READ_ONLY, 0);
    assert_eq!(flags & TFLAG_SEND_DF, 0, "DF needs structured replies");
    let bs = info(INFO_BLOCK_SIZE).expect("NBD_INFO_BLOCK_SIZE");
    assert_eq!(
        (be32(&bs), be32(&bs[4..]), be32(&bs[8..])),
        (1, 4096, 32 << 20)
    );
    assert_eq!(info(INFO_NAME), Some(b"vm1".to_vec()));

    // Unknown export: an error, and the handshake goes on.
    let r = c.option(OPT_INFO, &go_data("nope", &[]))?;
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].kind, REP_ERR_UNKNOWN);
    let r = c.go("nope", &[])?;
    assert_eq!(r.last().map(|r| r.kind), Some(REP_ERR_UNKNOWN));

    c.structured_reply()?;
    let r = c.go("vm2", &[])?;
    assert_eq!(r.last().map(|r| r.kind), Some(REP_ACK));
    assert_eq!(c.size, MIB);
    assert_ne!(c.flags & TFLAG_SEND_DF, 0);
    // Transmission works right after GO.
    assert_eq!(c.status(CMD_FLUSH, 0, 0, 0, &[])?, 0);
    Ok(())
}

#[test]
fn default_export_exists_only_with_one_volume() -> TestResult {
    let h = start(catalog(), ServerConfig::default());
    let mut c = Client::connect(addr(&h))?;
    let r = c.go("", &[])?;
    assert_eq!(r.last().map(|r| r.kind), Some(REP_ERR_UNKNOWN));

    let one = std::sync::Arc::new(condense_api::mem::MemCatalog::new(4096));
    condense_api::Catalog::create(one.as_ref(), "only", MIB)?;
    let h = start(one, ServerConfig::default());
    let mut c = Client::connect(addr(&h))?;
    let r = c.go("", &[INFO_NAME])?;
    assert_eq!(r.last().map(|r| r.kind), Some(REP_ACK));
    assert!(r
        .iter()
        .any(|i| i.kind == REP_INFO && be16(&i.data) == INFO_NAME && &i.data[2..] == b"only"));
    Ok(())
}

#[test]
fn export_name_ends_the_handshake_with_or_without_zeroes() -> TestResult {
    let h = start(catalog(), ServerConfig::default());
    for (client_flags, zeroes) in [
        (FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES, 0),
        (FLAG_C_FIXED_NEWSTYLE, 124),
    ] {
        let mut c = Client::connect_with_flags(addr(&h), client_flags)?;
        c.send_option(OPT_EXPORT_NAME, b"vm2")?;
        let r = c.read_n(10 + zeroes)?;
        assert_eq!(be64(&r), MIB);
        assert_ne!(be16(&r[8..]) & TFLAG_HAS_FLAGS, 0);
        assert!(r[10..].iter().all(|&b| b == 0));
        // Simple replies: a write and a read.
        assert_eq!(c.write(10, b"hello", 0)?, 0);
        assert_eq!(c.read(10, 5)?, Ok(b"hello".to_vec()));
    }
    // An unknown export has no error reply: the server hangs up.
    let mut c = Client::connect(addr(&h))?;
    c.send_option(OPT_EXPORT_NAME, b"nope")?;
    c.expect_closed();
    still_serving(addr(&h))
}

#[test]
fn abort_is_acknowledged_then_closed() -> TestResult {
    let h = start(catalog(), ServerConfig::default());
    let mut c = Client::connect(addr(&h))?;
    let r = c.option(OPT_ABORT, &[])?;
    assert_eq!(r[0].kind, REP_ACK);
    c.expect_closed();
    Ok(())
}

#[test]
fn structured_reply_takes_no_data_and_only_once() -> TestResult {
    let h = start(catalog(), ServerConfig::default());
    let mut c = Client::connect(addr(&h))?;
    assert_eq!(
        c.option(OPT_STRUCTURED_REPLY, b"x")?[0].kind,
        REP_ERR_INVALID
    );
    c.structured_reply()?;
    assert_eq!(
        c.option(OPT_STRUCTURED_REPLY, &[])?[0].kind,
        REP_ERR_INVALID
    );
    Ok(())
}

#[test]
fn meta_contexts_list_and_set() -> TestResult {
    let h = start(catalog(), ServerConfig::default());
    let mut c = Client::connect(addr(&h))?;
    // Before structured replies: refused.
    assert_eq!(
        c.set_meta("vm1", &["base:allocation"])?[0].kind,
        REP_ERR_INVALID
    );
    assert_eq!(
        c.option(OPT_LIST_META_CONTEXT, &meta_data("vm1", &[]))?[0].kind,
        REP_ERR_INVALID
    );
    c.structured_reply()?;
    let context_names = |r: &[OptReply]| -> Vec<(u32, String)> {
        r.iter()
            .filter(|r| r.kind == REP_META_CONTEXT)
            .map(|r| {
                (
                    be32(&r.data),
                    String::from_utf8_lossy(&r.data[4..]).into_owned(),
                )
            })
            .collect()
    };
    // LIST with no query, with the base: wildcard, with the exact name.
    for q in [&[][..], &["base:"][..], &["base:allocation"][..]] {
        let r = c.option(OPT_LIST_META_CONTEXT, &meta_data("vm1", q))?;
        assert_eq!(
            context_names(&r),
            vec![(0, "base:allocation".to_string())],
            "{q:?}"
        );
        assert_eq!(r.last().map(|r| r.kind), Some(REP_ACK));
    }
    // Unknown namespaces and leaves select nothing; a query without colon is invalid.
    let r = c.option(
        OPT_LIST_META_CONTEXT,
        &meta_data("vm1", &["qemu:dirty-bitmap:a", "base:nope"]),
    )?;
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].kind, REP_ACK);
    assert_eq!(c.set_meta("vm1", &["nocolon"])?[0].kind, REP_ERR_INVALID);
    // SET ignores the wildcard, selects the exact name with a nonzero id.
    let r = c.set_meta("vm1", &["base:"])?;
    assert_eq!(context_names(&r), vec![]);
    let r = c.set_meta("vm1", &["base:allocation"])?;
    assert_eq!(
        context_names(&r),
        vec![(META_ID_BASE_ALLOCATION, "base:allocation".to_string())]
    );
    // Unknown export.
    assert_eq!(
        c.set_meta("nope", &["base:allocation"])?[0].kind,
        REP_ERR_UNKNOWN
    );
    // Truncated data.
    let mut d = meta_data("vm1", &["base:allocation"]);
    d.truncate(d.len() - 3);
    assert_eq!(c.option(OPT_SET_META_CONTEXT, &d)?[0].kind, REP_ERR_INVALID);
    // The failed SETs cleared the selection: block status is refused after GO.
    assert_eq!(c.go("vm1", &[])?.last().map(|r| r.kind), Some(REP_ACK));
    assert_eq!(c.status(CMD_BLOCK_STATUS, 0, 0, 4096, &[])?, EINVAL);
    Ok(())
}

#[test]
fn meta_context_for_another_export_does_not_carry_over() -> TestResult {
    let h = start(catalog(), ServerConfig::default());
    let mut c = Client::connect(addr(&h))?;
    c.structured_reply()?;
    assert_eq!(c.set_meta("vm1", &["base:allocation"])?.len(), 2);
    assert_eq!(c.go("vm2", &[])?.last().map(|r| r.kind), Some(REP_ACK));
    assert_eq!(c.status(CMD_BLOCK_STATUS, 0, 0, 4096, &[])?, EINVAL);
    Ok(())
}

#[test]
fn unknown_options_and_tls_are_unsupported_and_the_handshake_continues() -> TestResult {
    let h = start(catalog(), ServerConfig::default());
    let mut c = Client::connect(addr(&h))?;
    for opt in [0, 4, 11, 12, 999, u32::MAX] {
        let r = c.option(opt, b"some data")?;
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].kind, REP_ERR_UNSUP, "option {opt}");
    }
    assert_eq!(c.option(OPT_STARTTLS, &[])?[0].kind, REP_ERR_UNSUP);
    assert_eq!(c.go("vm1", &[])?.last().map(|r| r.kind), Some(REP_ACK));
    Ok(())
}

#[test]
fn unknown_client_flags_close_the_connection() -> TestResult {
    let h = start(catalog(), ServerConfig::default());
    let mut c = Client::connect_with_flags(addr(&h), 1 << 7)?;
    c.expect_closed();
    still_serving(addr(&h))
}

#[test]
fn unix_socket_endpoint() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("nbd.sock");
    // A stale socket file from a dead server is replaced.
    drop(std::os::unix::net::UnixListener::bind(&path)?);
    let server = condense_nbd::Server::bind(
        catalog(),
        ServerConfig::default(),
        &[condense_nbd::Endpoint::Unix(path.clone())],
    )?;
    let h = server.spawn()?;
    use std::io::{Read, Write};
    let mut s = std::os::unix::net::UnixStream::connect(&path)?;
    let mut g = [0u8; 18];
    s.read_exact(&mut g)?;
    assert_eq!(&g[..8], b"NBDMAGIC");
    s.write_all(&FLAG_C_FIXED_NEWSTYLE.to_be_bytes())?;
    drop(s);
    h.shutdown()?;
    assert!(!path.exists(), "socket file removed at shutdown");
    Ok(())
}

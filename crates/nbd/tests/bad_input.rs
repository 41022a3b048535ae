//! Bad input: truncated, oversized, misaligned and out-of-range requests, unknown commands and
//! options, garbage. Each gets the protocol's error reply or a clean disconnect, the pool is
//! unchanged by refused requests, and the server keeps serving other clients.

mod common;

use common::*;
use condense_api::Catalog;
use condense_nbd::proto::*;
use condense_nbd::ServerConfig;
use rand::{Rng, SeedableRng};
use std::io::Write;

#[test]
fn out_of_range_requests_get_einval_or_enospc_and_change_nothing() -> TestResult {
    let cat = catalog();
    let h = start(cat.clone(), ServerConfig::default());
    let mut c = Client::open(addr(&h), "vm2")?;
    let size = MIB;
    assert_eq!(c.read(size - 1, 2)?, Err(EINVAL));
    assert_eq!(c.read(size, 1)?, Err(EINVAL));
    assert_eq!(c.read(u64::MAX - 10, 100)?, Err(EINVAL));
    // Writes past the end: ENOSPC, and the payload is consumed so the stream stays in step.
    assert_eq!(c.write(size - 10, &[0xee; 20], 0)?, ENOSPC);
    assert_eq!(c.write(u64::MAX, &[0xee; 20], 0)?, ENOSPC);
    assert_eq!(c.status(CMD_WRITE_ZEROES, 0, size, 4096, &[])?, ENOSPC);
    assert_eq!(c.status(CMD_TRIM, 0, size - 4096, 8192, &[])?, EINVAL);
    assert_eq!(c.status(CMD_CACHE, 0, size, 1, &[])?, EINVAL);
    assert_eq!(c.block_status(size, 4096, 0)?, Err(EINVAL));
    assert_eq!(c.block_status(0, 0, 0)?, Err(EINVAL));
    // Nothing was written.
    let v = cat.open_mem("vm2")?;
    assert!(v.blocks().is_empty(), "refused requests changed the volume");
    // The last bytes of the export are reachable.
    assert_eq!(c.write(size - 3, b"end", 0)?, 0);
    assert_eq!(c.read(size - 3, 3)?, Ok(b"end".to_vec()));
    still_serving(addr(&h))
}

#[test]
fn misaligned_requests_are_served_exactly() -> TestResult {
    // The server advertises a minimum block size of 1: odd offsets and lengths are valid.
    let cat = catalog();
    let h = start(cat.clone(), ServerConfig::default());
    let mut c = Client::open(addr(&h), "vm2")?;
    let d = pattern(7, 4097);
    assert_eq!(c.write(4093, &d, CMD_FLAG_FUA)?, 0);
    assert_eq!(c.status(CMD_WRITE_ZEROES, 0, 4095, 3, &[])?, 0);
    assert_eq!(c.status(CMD_TRIM, 0, 8000, 99, &[])?, 0);
    let mut expect = d.clone();
    expect[2..5].fill(0);
    let trim_at = 8000 - 4093;
    expect[trim_at..trim_at + 99].fill(0);
    assert!(
        c.read(4093, 4097)? == Ok(expect.clone()),
        "read back differs"
    );
    let mut direct = vec![0u8; 4097];
    cat.open("vm2")?.read(4093, &mut direct)?;
    assert!(direct == expect, "volume differs");
    Ok(())
}

#[test]
fn oversized_requests() -> TestResult {
    let h = start(catalog(), ServerConfig::default());
    let mut c = Client::open(addr(&h), "vm1")?;
    // A read larger than the maximum payload: EINVAL, connection stays.
    assert_eq!(c.read(0, (32 << 20) + 1)?, Err(EINVAL));
    assert_eq!(c.read(0, u32::MAX)?, Err(EINVAL));
    // Trim and write zeroes of lengths beyond the payload limit are fine (no payload).
    assert_eq!(c.status(CMD_TRIM, 0, 0, 8 << 20, &[])?, 0);
    // A write payload over the maximum cannot be answered: the server hangs up.
    c.send_request(CMD_WRITE, 0, 1, 0, (32 << 20) + 1, &[0u8; 1024])?;
    c.expect_closed();
    still_serving(addr(&h))
}

#[test]
fn unknown_commands_and_flags_get_einval() -> TestResult {
    let h = start(catalog(), ServerConfig::default());
    let mut c = Client::open(addr(&h), "vm1")?;
    for cmd in [8u16, 9, 100, u16::MAX] {
        assert_eq!(c.status(cmd, 0, 0, 4096, &[])?, EINVAL, "command {cmd}");
    }
    // Flags not valid for the command.
    assert_eq!(c.status(CMD_READ, CMD_FLAG_NO_HOLE, 0, 1, &[])?, EINVAL);
    assert_eq!(c.status(CMD_TRIM, CMD_FLAG_REQ_ONE, 0, 1, &[])?, EINVAL);
    assert_eq!(c.status(CMD_FLUSH, 1 << 12, 0, 0, &[])?, EINVAL);
    // A write with a bad flag: its payload is skipped, the error returned, nothing written.
    assert_eq!(c.write(0, &[0x55; 4096], CMD_FLAG_DF)?, EINVAL);
    assert_eq!(c.read(0, 4096)?, Ok(vec![0u8; 4096]));
    // Flush with offset or length set.
    assert_eq!(c.status(CMD_FLUSH, 0, 4096, 0, &[])?, EINVAL);
    assert_eq!(c.status(CMD_FLUSH, 0, 0, 1, &[])?, EINVAL);
    Ok(())
}

#[test]
fn bad_request_magic_disconnects_only_that_client() -> TestResult {
    let h = start(catalog(), ServerConfig::default());
    let mut bystander = Client::open(addr(&h), "vm1")?;
    let mut c = Client::open(addr(&h), "vm1")?;
    c.s.write_all(&[0xde; 28])?;
    c.expect_closed();
    assert_eq!(bystander.write(0, b"still here", 0)?, 0);
    assert_eq!(bystander.read(0, 10)?, Ok(b"still here".to_vec()));
    Ok(())
}

#[test]
fn truncated_messages_then_hangup_leave_the_server_serving() -> TestResult {
    let h = start(catalog(), ServerConfig::default());
    let a = addr(&h);
    // Half a client-flags field.
    {
        let mut c = Client::connect(a)?;
        drop(c.read_n(0)?);
        let _ = c.s.shutdown(std::net::Shutdown::Both);
    }
    // An option header promising more data than is sent.
    {
        let mut c = Client::connect(a)?;
        let mut m = OPTS_MAGIC.to_be_bytes().to_vec();
        m.extend_from_slice(&OPT_GO.to_be_bytes());
        m.extend_from_slice(&100u32.to_be_bytes());
        m.extend_from_slice(&[1, 2, 3]);
        c.s.write_all(&m)?;
    }
    // Half a request header.
    {
        let mut c = Client::open(a, "vm1")?;
        c.s.write_all(&REQUEST_MAGIC.to_be_bytes())?;
        c.s.write_all(&[0; 5])?;
    }
    // A write header with half its payload.
    {
        let mut c = Client::open(a, "vm1")?;
        let mut m = REQUEST_MAGIC.to_be_bytes().to_vec();
        m.extend_from_slice(&0u16.to_be_bytes());
        m.extend_from_slice(&CMD_WRITE.to_be_bytes());
        m.extend_from_slice(&7u64.to_be_bytes());
        m.extend_from_slice(&0u64.to_be_bytes());
        m.extend_from_slice(&8192u32.to_be_bytes());
        m.extend_from_slice(&[0x77; 4096]);
        c.s.write_all(&m)?;
    }
    // A bad option magic.
    {
        let mut c = Client::connect(a)?;
        c.s.write_all(&[0u8; 16])?;
        c.expect_closed();
    }
    still_serving(a)?;
    // The half-sent write wrote nothing.
    let mut c = Client::open(a, "vm1")?;
    assert_eq!(c.read(0, 8192)?, Ok(vec![0u8; 8192]));
    Ok(())
}

#[test]
fn oversized_option_data_is_too_big_or_disconnects() -> TestResult {
    let h = start(catalog(), ServerConfig::default());
    let mut c = Client::connect(addr(&h))?;
    // Larger than accepted: skipped and refused.
    let r = c.option(OPT_GO, &vec![0u8; 100_000])?;
    assert_eq!(r[0].kind, REP_ERR_TOO_BIG);
    // An export name over 4096 bytes is invalid.
    let r = c.option(OPT_INFO, &go_data(&"x".repeat(5000), &[]))?;
    assert_eq!(r[0].kind, REP_ERR_INVALID);
    // Still negotiating.
    assert_eq!(c.go("vm1", &[])?.last().map(|r| r.kind), Some(REP_ACK));
    // A header claiming gigabytes of data: hard disconnect, nothing is buffered.
    let mut c = Client::connect(addr(&h))?;
    let mut m = OPTS_MAGIC.to_be_bytes().to_vec();
    m.extend_from_slice(&OPT_GO.to_be_bytes());
    m.extend_from_slice(&u32::MAX.to_be_bytes());
    c.s.write_all(&m)?;
    c.expect_closed();
    still_serving(addr(&h))
}

/// Random garbage, random valid-looking requests with random fields, all from seeded RNGs.
/// The server may answer or hang up, but must never wedge or stop serving.
#[test]
fn random_garbage_streams_never_stop_the_server() -> TestResult {
    let h = start(catalog(), ServerConfig::default());
    let a = addr(&h);
    for seed in 0..40u64 {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut c = if seed % 2 == 0 {
            Client::connect(a)?
        } else {
            Client::open(a, "vm2")?
        };
        c.s.set_read_timeout(Some(std::time::Duration::from_millis(200)))?;
        let mut bytes = Vec::new();
        for _ in 0..rng.random_range(1..20) {
            if seed % 2 == 1 && rng.random_bool(0.7) {
                // A request with a valid magic and random everything else.
                bytes.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
                bytes.extend_from_slice(&rng.random_range(0u16..32).to_be_bytes());
                bytes.extend_from_slice(&rng.random_range(0u16..10).to_be_bytes());
                bytes.extend_from_slice(&rng.random::<u64>().to_be_bytes());
                let offset: u64 = if rng.random_bool(0.5) {
                    rng.random_range(0..MIB + 10)
                } else {
                    rng.random()
                };
                bytes.extend_from_slice(&offset.to_be_bytes());
                bytes.extend_from_slice(&rng.random_range(0u32..70_000).to_be_bytes());
            } else if seed % 2 == 0 && rng.random_bool(0.7) {
                // An option with a valid magic, random number and data.
                let data: Vec<u8> = (0..rng.random_range(0..64)).map(|_| rng.random()).collect();
                bytes.extend_from_slice(&OPTS_MAGIC.to_be_bytes());
                bytes.extend_from_slice(&rng.random_range(0u32..12).to_be_bytes());
                bytes.extend_from_slice(&(data.len() as u32).to_be_bytes());
                bytes.extend_from_slice(&data);
            } else {
                let n = rng.random_range(0..100);
                bytes.extend((0..n).map(|_| rng.random::<u8>()));
            }
        }
        // The server may close on us mid-write; that is an acceptable answer.
        let _ = c.s.write_all(&bytes);
        let _ = c.s.shutdown(std::net::Shutdown::Write);
        let mut sink = Vec::new();
        let _ = std::io::Read::read_to_end(&mut c.s, &mut sink);
    }
    still_serving(a)
}

//! NBD over TLS-PSK at the protocol level: the server admits exactly the clients that hold the
//! key of a username in its key file, only with forward-secret suites, names each client by
//! its username for export rules, and refuses every option before STARTTLS. The client is
//! OpenSSL (the real-client test with qemu and libnbd, both GnuTLS, is tests/security/psk.sh).

mod common;

use common::*;
use condense_nbd::proto::*;
use condense_nbd::{ExportRules, ServerConfig, TlsConfig, TlsMode};
use openssl::ssl::{SslConnector, SslMethod, SslVersion};
use std::io::{self, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::Arc;

type Tls = openssl::ssl::SslStream<TcpStream>;

const ALICE: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";
const BOB: &str = "ffeeddccbbaa99887766554433221100ffeeddccbbaa99887766554433221100";

fn hex(key: &str) -> Vec<u8> {
    (0..key.len())
        .step_by(2)
        .filter_map(|i| u8::from_str_radix(&key[i..i + 2], 16).ok())
        .collect()
}

fn server(rules: &[&str]) -> ServerConfig {
    let mut r = ExportRules::default();
    for rule in rules {
        r.add(rule).expect("rule");
    }
    let text = format!("alice:{ALICE}\nbob:{BOB}\n");
    let tls = TlsConfig::psk(Path::new("keys.psk"), text.as_bytes(), r).expect("PSK settings");
    assert_eq!(tls.mode, TlsMode::Require);
    assert!(tls.authenticates_clients());
    ServerConfig {
        tls: Some(Arc::new(tls)),
        ..ServerConfig::default()
    }
}

/// How the client side of a handshake is set up.
#[derive(Clone, Copy)]
enum Offer {
    /// What GnuTLS clients do by default: TLS 1.3 (and 1.2).
    Default,
    /// TLS 1.2 only, with these suites.
    Tls12(&'static str),
}

/// Send STARTTLS, expect ACK, and run the client side of TLS-PSK as `user` with `key` (hex).
fn start_tls(mut c: Client, user: &str, key: &str, offer: Offer) -> io::Result<Tls> {
    let r = c.option(OPT_STARTTLS, &[])?;
    assert_eq!(final_kind(&r), Some(REP_ACK), "STARTTLS: {r:?}");
    let mut b = SslConnector::builder(SslMethod::tls_client()).map_err(io::Error::other)?;
    if let Offer::Tls12(suites) = offer {
        b.set_max_proto_version(Some(SslVersion::TLS1_2))
            .map_err(io::Error::other)?;
        b.set_cipher_list(suites).map_err(io::Error::other)?;
    }
    let (user, key) = (user.to_string(), hex(key));
    b.set_psk_client_callback(move |_ssl, _hint, identity, psk| {
        identity[..user.len()].copy_from_slice(user.as_bytes());
        identity[user.len()] = 0;
        psk[..key.len()].copy_from_slice(&key);
        Ok(key.len())
    });
    let mut config = b
        .build()
        .configure()
        .map_err(io::Error::other)?
        .verify_hostname(false);
    config.set_verify(openssl::ssl::SslVerifyMode::NONE);
    config
        .connect("localhost", c.s)
        .map_err(|e| io::Error::other(e.to_string()))
}

/// Whether a client is kept out: its handshake fails, or the first option over it does (TLS
/// 1.3 reports a server's refusal on the client's first read).
fn refused(h: &condense_nbd::ServerHandle, user: &str, key: &str, offer: Offer) -> bool {
    let Ok(c) = Client::connect(addr(h)) else {
        return false;
    };
    match start_tls(c, user, key, offer) {
        Err(_) => true,
        Ok(mut tls) => option(&mut tls, OPT_LIST, &[]).is_err(),
    }
}

#[test]
fn a_client_with_its_key_is_served_over_tls13() -> TestResult {
    let h = start(catalog(), server(&[]));
    let mut c = Client::connect(addr(&h))?;
    // FORCEDTLS: nothing before STARTTLS.
    let r = c.option(OPT_LIST, &[])?;
    assert_eq!(final_kind(&r), Some(REP_ERR_TLS_REQD));
    assert!(String::from_utf8_lossy(&r[0].data).contains("tls-creds-psk"));
    let mut tls = start_tls(c, "alice", ALICE, Offer::Default)?;
    assert_eq!(tls.ssl().version_str(), "TLSv1.3");
    assert_eq!(listed(&mut tls)?, vec!["vm1", "vm2"]);
    let r = option(&mut tls, OPT_GO, &go_data("vm1", &[]))?;
    assert_eq!(final_kind(&r), Some(REP_ACK), "{r:?}");

    // Transmission over TLS-PSK: write a block, read it back (simple replies).
    let block: Vec<u8> = (0..65536u32).map(|i| (i * 7 % 251) as u8).collect();
    let header = |kind: u16, cookie: u64, len: u32, out: &mut Vec<u8>| {
        out.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        out.extend_from_slice(&0u16.to_be_bytes());
        out.extend_from_slice(&kind.to_be_bytes());
        out.extend_from_slice(&cookie.to_be_bytes());
        out.extend_from_slice(&8192u64.to_be_bytes());
        out.extend_from_slice(&len.to_be_bytes());
    };
    let mut req = Vec::new();
    header(CMD_WRITE, 1, block.len() as u32, &mut req);
    req.extend_from_slice(&block);
    tls.write_all(&req)?;
    tls.flush()?;
    let r = read_exact_vec(&mut tls, 16)?;
    assert_eq!(be32(&r), SIMPLE_REPLY_MAGIC);
    assert_eq!((be32(&r[4..]), be64(&r[8..])), (0, 1), "write");
    let mut req = Vec::new();
    header(CMD_READ, 2, block.len() as u32, &mut req);
    tls.write_all(&req)?;
    tls.flush()?;
    let r = read_exact_vec(&mut tls, 16)?;
    assert_eq!((be32(&r[4..]), be64(&r[8..])), (0, 2), "read");
    assert_eq!(read_exact_vec(&mut tls, block.len())?, block);
    Ok(())
}

#[test]
fn wrong_keys_and_unknown_users_are_refused() -> TestResult {
    let h = start(catalog(), server(&[]));
    assert!(
        !refused(&h, "alice", ALICE, Offer::Default),
        "alice's own key"
    );
    assert!(
        refused(&h, "alice", BOB, Offer::Default),
        "alice with bob's key"
    );
    assert!(
        refused(&h, "carol", ALICE, Offer::Default),
        "an unknown user"
    );
    assert!(refused(&h, "", ALICE, Offer::Default), "an empty username");
    let tls12 = Offer::Tls12("ECDHE-PSK-CHACHA20-POLY1305");
    assert!(refused(&h, "alice", BOB, tls12), "a wrong key over TLS 1.2");
    assert!(
        refused(&h, "carol", ALICE, tls12),
        "an unknown user over TLS 1.2"
    );
    Ok(())
}

#[test]
fn tls12_is_served_only_with_a_forward_secret_suite() -> TestResult {
    let h = start(catalog(), server(&[]));
    let c = Client::connect(addr(&h))?;
    let mut tls = start_tls(c, "bob", BOB, Offer::Tls12("ECDHE-PSK-CHACHA20-POLY1305"))?;
    assert_eq!(tls.ssl().version_str(), "TLSv1.2");
    assert_eq!(listed(&mut tls)?, vec!["vm1", "vm2"]);
    // Plain PSK (no ephemeral key exchange) and CBC suites are not served.
    for suites in [
        "PSK-AES128-GCM-SHA256:PSK-AES256-GCM-SHA384:PSK-CHACHA20-POLY1305",
        "ECDHE-PSK-AES128-CBC-SHA256",
    ] {
        assert!(refused(&h, "bob", BOB, Offer::Tls12(suites)), "{suites}");
    }
    Ok(())
}

#[test]
fn export_rules_name_psk_users() -> TestResult {
    let h = start(catalog(), server(&["alice=vm1", "*=vm2"]));
    let mut alice = start_tls(Client::connect(addr(&h))?, "alice", ALICE, Offer::Default)?;
    assert_eq!(listed(&mut alice)?, vec!["vm1"]);
    let r = option(&mut alice, OPT_INFO, &go_data("vm2", &[]))?;
    assert_eq!(final_kind(&r), Some(REP_ERR_UNKNOWN));
    let mut bob = start_tls(Client::connect(addr(&h))?, "bob", BOB, Offer::Default)?;
    assert_eq!(listed(&mut bob)?, vec!["vm2"]);
    let r = option(&mut bob, OPT_GO, &go_data("vm1", &[]))?;
    assert_eq!(final_kind(&r), Some(REP_ERR_UNKNOWN));
    Ok(())
}

#[test]
fn psk_settings_that_cannot_hold_are_refused() {
    let keys = format!("alice:{ALICE}\n");
    let mut carol = ExportRules::default();
    carol.add("carol=vm1").expect("rule");
    let err = TlsConfig::psk(Path::new("k.psk"), keys.as_bytes(), carol).err();
    assert!(
        err.as_ref()
            .is_some_and(|e| e.to_string().contains("\"carol\"")),
        "{err:?}"
    );
    let err = TlsConfig::psk(Path::new("k.psk"), b"alice:00\n", ExportRules::default()).err();
    let shown = err.map(|e| e.to_string()).unwrap_or_default();
    assert!(
        shown.contains("k.psk") && shown.contains("line 1"),
        "{shown}"
    );
}

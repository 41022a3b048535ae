//! NBD over TLS at the protocol level: what the server answers before and after STARTTLS in
//! each mode, client certificates, per-client exports, and a transmission over TLS. Clients
//! are the strict test client of `common` for the plaintext part and rustls for the rest;
//! certificates are made with rcgen.

mod common;

use common::*;
use condense_nbd::proto::*;
use condense_nbd::{ExportRules, ServerConfig, TlsConfig, TlsMode};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;

type Tls = rustls::StreamOwned<rustls::ClientConnection, TcpStream>;

/// A client identity: certificate (DER) and key (PKCS#8 DER).
struct Identity {
    cert: CertificateDer<'static>,
    key: Vec<u8>,
}

/// A CA, a server certificate for localhost from it, and client identities.
struct Pki {
    dir: tempfile::TempDir,
    ca: CertificateDer<'static>,
    alice: Identity,
    bob: Identity,
    /// From another CA.
    mallory: Identity,
}

fn ca(name: &str) -> Result<CertifiedIssuer<'static, KeyPair>, rcgen::Error> {
    let mut p = CertificateParams::new(Vec::<String>::new())?;
    p.distinguished_name
        .push(rcgen::DnType::CommonName, format!("{name} CA"));
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    CertifiedIssuer::self_signed(p, KeyPair::generate()?)
}

fn leaf(
    issuer: &CertifiedIssuer<'static, KeyPair>,
    cn: &str,
    sans: &[&str],
    usage: rcgen::ExtendedKeyUsagePurpose,
) -> Result<Identity, rcgen::Error> {
    let mut p = CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>())?;
    p.distinguished_name.push(rcgen::DnType::CommonName, cn);
    p.extended_key_usages = vec![usage];
    let key = KeyPair::generate()?;
    let cert = p.signed_by(&key, issuer)?;
    Ok(Identity {
        cert: cert.der().clone(),
        key: key.serialize_der(),
    })
}

fn pki() -> Result<Pki, Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let main = ca("main")?;
    let other = ca("other")?;
    let mut p = CertificateParams::new(vec!["localhost".to_string()])?;
    p.distinguished_name
        .push(rcgen::DnType::CommonName, "localhost");
    let key = KeyPair::generate()?;
    let server = p.signed_by(&key, &main)?;
    std::fs::write(dir.path().join("server-cert.pem"), server.pem())?;
    std::fs::write(dir.path().join("server-key.pem"), key.serialize_pem())?;
    std::fs::write(dir.path().join("ca-cert.pem"), main.pem())?;
    let client = rcgen::ExtendedKeyUsagePurpose::ClientAuth;
    Ok(Pki {
        ca: main.der().clone(),
        alice: leaf(&main, "alice", &[], client.clone())?,
        bob: leaf(&main, "bob", &["bob.example"], client.clone())?,
        mallory: leaf(&other, "mallory", &[], client)?,
        dir,
    })
}

impl Pki {
    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
    fn server(&self, mode: TlsMode, client_ca: bool, rules: &[&str]) -> ServerConfig {
        let mut r = ExportRules::default();
        for rule in rules {
            r.add(rule).expect("rule");
        }
        let ca = self.path("ca-cert.pem");
        let tls = TlsConfig::from_files(
            &self.path("server-cert.pem"),
            &self.path("server-key.pem"),
            client_ca.then_some(ca.as_path()),
            mode,
            r,
        )
        .expect("TLS settings");
        ServerConfig {
            tls: Some(Arc::new(tls)),
            ..ServerConfig::default()
        }
    }
}

/// Send STARTTLS on a plaintext client, expect ACK, and run the client side of TLS.
fn start_tls(mut c: Client, pki: &Pki, id: Option<&Identity>) -> io::Result<Tls> {
    let r = c.option(OPT_STARTTLS, &[])?;
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].kind, REP_ACK, "STARTTLS: {r:?}");
    let mut roots = rustls::RootCertStore::empty();
    roots.add(pki.ca.clone()).map_err(io::Error::other)?;
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::aws_lc_rs::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(io::Error::other)?
    .with_root_certificates(roots);
    let config = match id {
        None => builder.with_no_client_auth(),
        Some(id) => builder
            .with_client_auth_cert(
                vec![id.cert.clone()],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(id.key.clone())),
            )
            .map_err(io::Error::other)?,
    };
    let name = ServerName::try_from("localhost").map_err(io::Error::other)?;
    let conn = rustls::ClientConnection::new(Arc::new(config), name).map_err(io::Error::other)?;
    let mut tls = rustls::StreamOwned::new(conn, c.s);
    while tls.conn.is_handshaking() {
        tls.conn.complete_io(&mut tls.sock)?;
    }
    Ok(tls)
}

/// Whether the peer closed the connection: reading hits EOF or an error.
fn closed<S: Read>(s: &mut S) -> bool {
    let mut b = [0u8; 1];
    !matches!(s.read(&mut b), Ok(1))
}

fn plain(addr: std::net::SocketAddr) -> io::Result<Client> {
    Client::connect(addr)
}

#[test]
fn require_refuses_every_option_before_starttls_then_serves_over_tls() -> TestResult {
    let pki = pki()?;
    let h = start(catalog(), pki.server(TlsMode::Require, false, &[]));
    let mut c = plain(addr(&h))?;
    for (opt, data) in [
        (OPT_LIST, Vec::new()),
        (OPT_STRUCTURED_REPLY, Vec::new()),
        (OPT_INFO, go_data("vm1", &[])),
        (OPT_GO, go_data("vm1", &[])),
        (OPT_SET_META_CONTEXT, meta_data("vm1", &["base:allocation"])),
        (99, b"whatever".to_vec()),
    ] {
        let r = c.option(opt, &data)?;
        assert_eq!(r.len(), 1, "option {opt}: {r:?}");
        assert_eq!(r[0].kind, REP_ERR_TLS_REQD, "option {opt}");
        assert!(String::from_utf8_lossy(&r[0].data).contains("requires TLS"));
    }
    let mut tls = start_tls(c, &pki, None)?;
    assert_eq!(listed(&mut tls)?, vec!["vm1", "vm2"]);
    // Nothing is TLS_REQD once TLS is active, and STARTTLS again is invalid.
    let r = option(&mut tls, OPT_STARTTLS, &[])?;
    assert_eq!(final_kind(&r), Some(REP_ERR_INVALID));
    let r = option(&mut tls, OPT_GO, &go_data("vm1", &[]))?;
    assert_eq!(final_kind(&r), Some(REP_ACK), "{r:?}");

    // Transmission over TLS: write a block, read it back (simple replies).
    let block: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
    let mut req = Vec::new();
    let header = |kind: u16, cookie: u64, len: u32, out: &mut Vec<u8>| {
        out.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        out.extend_from_slice(&0u16.to_be_bytes());
        out.extend_from_slice(&kind.to_be_bytes());
        out.extend_from_slice(&cookie.to_be_bytes());
        out.extend_from_slice(&8192u64.to_be_bytes());
        out.extend_from_slice(&len.to_be_bytes());
    };
    header(CMD_WRITE, 1, 4096, &mut req);
    req.extend_from_slice(&block);
    tls.write_all(&req)?;
    tls.flush()?;
    let r = read_exact_vec(&mut tls, 16)?;
    assert_eq!(be32(&r), SIMPLE_REPLY_MAGIC);
    assert_eq!(be32(&r[4..]), 0, "write error");
    assert_eq!(be64(&r[8..]), 1);
    let mut req = Vec::new();
    header(CMD_READ, 2, 4096, &mut req);
    tls.write_all(&req)?;
    tls.flush()?;
    let r = read_exact_vec(&mut tls, 16)?;
    assert_eq!((be32(&r[4..]), be64(&r[8..])), (0, 2));
    assert_eq!(read_exact_vec(&mut tls, 4096)?, block);
    Ok(())
}

#[test]
fn require_closes_on_export_name_before_starttls_and_abort_is_acknowledged() -> TestResult {
    let pki = pki()?;
    let h = start(catalog(), pki.server(TlsMode::Require, false, &[]));
    let mut c = plain(addr(&h))?;
    c.send_option(OPT_EXPORT_NAME, b"vm1")?;
    assert!(closed(&mut c.s), "EXPORT_NAME before STARTTLS must hang up");
    let mut c = plain(addr(&h))?;
    let r = c.option(OPT_ABORT, &[])?;
    assert_eq!(final_kind(&r), Some(REP_ACK));
    Ok(())
}

#[test]
fn without_tls_settings_starttls_is_unsupported() -> TestResult {
    let h = start(catalog(), ServerConfig::default());
    let mut c = plain(addr(&h))?;
    let r = c.option(OPT_STARTTLS, &[])?;
    assert_eq!(final_kind(&r), Some(REP_ERR_UNSUP));
    // The connection goes on in plaintext.
    assert_eq!(final_kind(&c.option(OPT_LIST, &[])?), Some(REP_ACK));
    Ok(())
}

#[test]
fn allow_serves_plaintext_and_upgrades_on_request() -> TestResult {
    let pki = pki()?;
    let h = start(catalog(), pki.server(TlsMode::Allow, false, &[]));
    let mut c = plain(addr(&h))?;
    assert_eq!(final_kind(&c.option(OPT_LIST, &[])?), Some(REP_ACK));
    // Structured replies negotiated before TLS do not carry over: after STARTTLS a meta
    // context needs them negotiated again.
    c.structured_reply()?;
    let mut tls = start_tls(c, &pki, None)?;
    let r = option(
        &mut tls,
        OPT_SET_META_CONTEXT,
        &meta_data("vm1", &["base:allocation"]),
    )?;
    assert_eq!(final_kind(&r), Some(REP_ERR_INVALID), "{r:?}");
    assert_eq!(listed(&mut tls)?, vec!["vm1", "vm2"]);
    Ok(())
}

#[test]
fn client_ca_admits_only_its_certificates() -> TestResult {
    let pki = pki()?;
    let h = start(catalog(), pki.server(TlsMode::Require, true, &[]));
    // No certificate: the server aborts the handshake (TLS 1.3 reports it on first read).
    let refused = |id: Option<&Identity>| -> bool {
        let Ok(c) = plain(addr(&h)) else {
            return false;
        };
        match start_tls(c, &pki, id) {
            Err(_) => true,
            Ok(mut tls) => option(&mut tls, OPT_LIST, &[]).is_err(),
        }
    };
    assert!(refused(None), "a client without a certificate was admitted");
    assert!(
        refused(Some(&pki.mallory)),
        "another CA's client was admitted"
    );
    let mut tls = start_tls(plain(addr(&h))?, &pki, Some(&pki.alice))?;
    assert_eq!(listed(&mut tls)?, vec!["vm1", "vm2"]);
    Ok(())
}

#[test]
fn export_rules_restrict_what_a_client_lists_and_opens() -> TestResult {
    let pki = pki()?;
    // bob is named by the DNS name of his certificate.
    let rules = ["alice=vm1", "bob.example=vm2"];
    let h = start(catalog(), pki.server(TlsMode::Require, true, &rules));
    let mut alice = start_tls(plain(addr(&h))?, &pki, Some(&pki.alice))?;
    assert_eq!(listed(&mut alice)?, vec!["vm1"]);
    let r = option(&mut alice, OPT_INFO, &go_data("vm2", &[]))?;
    assert_eq!(final_kind(&r), Some(REP_ERR_UNKNOWN));
    let r = option(&mut alice, OPT_GO, &go_data("vm1", &[]))?;
    assert_eq!(final_kind(&r), Some(REP_ACK));

    let mut bob = start_tls(plain(addr(&h))?, &pki, Some(&pki.bob))?;
    assert_eq!(listed(&mut bob)?, vec!["vm2"]);
    // EXPORT_NAME of a forbidden export hangs up, as for a missing one.
    bob.write_all(&OPTS_MAGIC.to_be_bytes())?;
    bob.write_all(&OPT_EXPORT_NAME.to_be_bytes())?;
    bob.write_all(&3u32.to_be_bytes())?;
    bob.write_all(b"vm1")?;
    bob.flush()?;
    assert!(closed(&mut bob));
    Ok(())
}

#[test]
fn bad_certificate_files_are_refused_with_the_file_named() -> TestResult {
    let pki = pki()?;
    let load = |cert: &Path, key: &Path| {
        TlsConfig::from_files(cert, key, None, TlsMode::Require, ExportRules::default())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    let missing = pki.path("missing.pem");
    assert!(load(&missing, &pki.path("server-key.pem")).contains("missing.pem"));
    // The CA's certificate with the server's key: a mismatch.
    let e = load(&pki.path("ca-cert.pem"), &pki.path("server-key.pem"));
    assert!(e.contains("does not fit"), "{e}");
    // A key file given as the certificate.
    let e = load(&pki.path("server-key.pem"), &pki.path("server-key.pem"));
    assert!(e.contains("holds no PEM CERTIFICATE"), "{e}");
    Ok(())
}

/// Large and odd-sized reads over TLS, pipelined, with simple and with structured replies
/// (data and hole chunks): every reply spans many TLS records and shares them with its
/// header and with the replies around it; the bytes read must be the bytes written.
#[test]
fn pipelined_large_reads_over_tls_are_byte_identical() -> TestResult {
    let pki = pki()?;
    let h = start(catalog(), pki.server(TlsMode::Require, false, &[]));
    // vm1 (8 MiB): data in [0, 3 MiB) and [5 MiB - 4097, 6 MiB + 12345), holes elsewhere.
    let mut image = vec![0u8; 8 * MIB as usize];
    let writes = [
        (0u64, 3 * MIB as usize),
        (5 * MIB - 4097, MIB as usize + 16442),
    ];
    for structured in [true, false] {
        let mut tls = start_tls(plain(addr(&h))?, &pki, None)?;
        if structured {
            let r = option(&mut tls, OPT_STRUCTURED_REPLY, &[])?;
            assert_eq!(final_kind(&r), Some(REP_ACK), "{r:?}");
        }
        let r = option(&mut tls, OPT_GO, &go_data("vm1", &[]))?;
        assert_eq!(final_kind(&r), Some(REP_ACK), "{r:?}");
        if structured {
            // The first connection writes; the second reads what it wrote.
            for (i, &(offset, len)) in writes.iter().enumerate() {
                let data = pattern(i as u64 + 1, len);
                image[offset as usize..offset as usize + len].copy_from_slice(&data);
                tls.write_all(&encode_request(
                    CMD_WRITE,
                    0,
                    100 + i as u64,
                    offset,
                    len as u32,
                    &data,
                ))?;
            }
            tls.flush()?;
            for _ in writes {
                let r = read_reply_from(&mut tls, |_| 0)?;
                assert_eq!(r.error(), 0, "write: {r:?}");
            }
        }
        // Reads: a whole MiB, one across data and a hole at odd ends, a few bytes on each
        // side of a data/hole edge, the whole volume, and one with DF (one data chunk).
        let reads: Vec<(u64, u32, u16)> = vec![
            (MIB, MIB as u32, 0),
            (12345, 3 * MIB as u32 + 777, 0),
            (3 * MIB - 100, 200, 0),
            (0, 8 * MIB as u32, 0),
            (5 * MIB - 5000, 20000, 0),
            (
                4 * MIB + 1,
                MIB as u32 + 3,
                if structured { CMD_FLAG_DF } else { 0 },
            ),
        ];
        for (cookie, &(offset, len, flags)) in reads.iter().enumerate() {
            tls.write_all(&encode_request(
                CMD_READ,
                flags,
                cookie as u64,
                offset,
                len,
                &[],
            ))?;
        }
        tls.flush()?;
        let mut replies: Vec<Vec<Reply>> = vec![Vec::new(); reads.len()];
        let mut done = 0;
        while done < reads.len() {
            let r = read_reply_from(&mut tls, |cookie| reads[cookie as usize].1 as usize)?;
            let cookie = r.cookie() as usize;
            assert!(cookie < reads.len(), "reply for cookie {cookie}");
            if r.done() {
                done += 1;
            }
            replies[cookie].push(r);
        }
        for (cookie, &(offset, len, flags)) in reads.iter().enumerate() {
            let got = assemble_read(&replies[cookie], offset, len)
                .map_err(|e| format!("read {cookie}: error {e}"))?;
            let want = &image[offset as usize..offset as usize + len as usize];
            assert!(
                got == want,
                "read {cookie} ({offset}+{len}, structured {structured}) differs"
            );
            if flags == CMD_FLAG_DF {
                assert_eq!(replies[cookie].len(), 1, "DF: one chunk");
            }
        }
    }
    Ok(())
}

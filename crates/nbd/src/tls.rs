//! NBD over TLS: the server's credentials, client authentication and per-client export rules.
//!
//! TLS is negotiated in-band with `NBD_OPT_STARTTLS` (NetworkBlockDevice/nbd `doc/proto.md`,
//! "TLS support"); this module owns everything about it except the option haggling itself
//! (in `handshake`). The server authenticates in one of two ways:
//!
//! - **Certificates** ([`TlsConfig::from_files`], rustls): it loads the server certificate
//!   chain and key (PEM), and an optional client CA, and checks them *before* the server
//!   starts: an unreadable file, a file without a certificate or key, or a key that does not
//!   belong to the certificate is a [`TlsError`] naming the file and what to do.
//! - **Pre-shared keys** ([`TlsConfig::psk`], OpenSSL, in [`crate::psk`]): client and server
//!   share a key per username, as qemu's `tls-creds-psk`, libnbd's `tls-psk-file` and nbdkit's
//!   `--tls-psk` do; no certificate at all. Always `Require`.
//!
//! Modes:
//! - [`TlsMode::Require`] is the protocol's FORCEDTLS mode: every option before STARTTLS except
//!   ABORT is answered `NBD_REP_ERR_TLS_REQD` and `NBD_OPT_EXPORT_NAME` closes the connection,
//!   so a client that does not start TLS gets no data and no export names.
//!   [`TlsMode::Allow`] is SELECTIVETLS with no TLS-only export: plaintext clients are served
//!   as without TLS, and clients may upgrade.
//! - With a client CA, the TLS handshake fails for a client that presents no certificate or
//!   one not signed by that CA; with pre-shared keys, for a client with an unknown username or
//!   the wrong key. Only then does the client have a name ([`client_names`]: the certificate's
//!   subject CN and its DNS subject alternative names; or its PSK username), so export rules
//!   ([`ExportRules`]) need one of the two, and `Allow` is refused with either (a plaintext
//!   client would bypass it).
//!
//! Invariants: certificate TLS offers rustls' safe default protocol versions (TLS 1.2 and 1.3)
//! over the `aws-lc-rs` provider; PSK TLS offers only forward-secret AEAD suites (see
//! [`crate::psk`]); a connection that acknowledged STARTTLS never speaks plaintext again (the
//! handshake failing closes it); what a connection may see ([`Access`]) is fixed when its TLS
//! handshake completes.

use crate::psk::{PskAcceptor, PskError, PskKeys, PskStream};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::collections::BTreeSet;
use std::fmt;
use std::io::IoSlice;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, BufReader, ReadBuf};

/// An encrypted connection: TLS over the socket with a read buffer under it, authenticated by
/// certificates (rustls) or by a pre-shared key (OpenSSL).
pub enum TlsStream<S> {
    Certificate(Box<tokio_rustls::server::TlsStream<BufReader<S>>>),
    Psk(PskStream<S>),
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for TlsStream<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            TlsStream::Certificate(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
            TlsStream::Psk(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for TlsStream<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            TlsStream::Certificate(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
            TlsStream::Psk(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            TlsStream::Certificate(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
            TlsStream::Psk(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            TlsStream::Certificate(s) => s.is_write_vectored(),
            TlsStream::Psk(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            TlsStream::Certificate(s) => Pin::new(s.as_mut()).poll_flush(cx),
            TlsStream::Psk(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            TlsStream::Certificate(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            TlsStream::Psk(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// Bytes read from the socket at once under TLS.
const SOCKET_READ_BUFFER_BYTES: usize = 256 * 1024;

/// Whether clients must start TLS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TlsMode {
    /// FORCEDTLS: nothing but STARTTLS (or ABORT) before TLS.
    Require,
    /// SELECTIVETLS: plaintext clients are served too; TLS is the client's choice.
    Allow,
}

/// A certificate or key file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {what} {}: {source}", path.display())]
    Read {
        what: &'static str,
        path: PathBuf,
        source: rustls::pki_types::pem::Error,
    },
    #[error("{what} {} holds no PEM {expected}; give a PEM file (-----BEGIN {expected}-----)", path.display())]
    Empty {
        what: &'static str,
        path: PathBuf,
        expected: &'static str,
    },
    #[error("the key {} does not fit the certificate {}: {source}; give the key the certificate was made for", key.display(), cert.display())]
    KeyMismatch {
        cert: PathBuf,
        key: PathBuf,
        source: rustls::Error,
    },
    #[error("client CA {}: {reason}", path.display())]
    ClientCa { path: PathBuf, reason: String },
    #[error("PSK file {}: {source}", path.display())]
    Psk { path: PathBuf, source: PskError },
    #[error("invalid TLS settings: {0}")]
    Settings(String),
}

/// Which exports each client (by certificate name or PSK username) may see, from
/// `CLIENT=EXPORT[,EXPORT…]` rules. Empty: every client sees every export.
///
/// Once there is a rule, a client sees only the exports of the rules naming it (its subject
/// CN or one of its DNS names, or its PSK username); a client no rule names gets the exports
/// of the `*` rule, or none. An export `*` means every export; allowing a volume allows its snapshots
/// (`VOLUME@SNAPSHOT`) too.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExportRules {
    rules: Vec<(String, Vec<String>)>,
}

impl ExportRules {
    /// Add one rule written `CLIENT=EXPORT[,EXPORT…]`.
    pub fn add(&mut self, rule: &str) -> Result<(), TlsError> {
        let bad = |why: &str| {
            TlsError::Settings(format!(
                "export rule {rule:?} {why}; write CLIENT=EXPORT[,EXPORT...], \
                 CLIENT being a certificate CN or DNS name, a PSK username, or *"
            ))
        };
        let (client, exports) = rule.split_once('=').ok_or_else(|| bad("has no '='"))?;
        let client = client.trim();
        if client.is_empty() {
            return Err(bad("names no client"));
        }
        let exports: Vec<String> = exports
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(str::to_string)
            .collect();
        if exports.is_empty() {
            return Err(bad("names no export"));
        }
        self.rules.push((client.to_string(), exports));
        Ok(())
    }

    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// The clients the rules name, `*` left out.
    pub fn clients(&self) -> impl Iterator<Item = &str> {
        self.rules
            .iter()
            .map(|(client, _)| client.as_str())
            .filter(|c| *c != "*")
    }

    /// What a client with these names (certificate names, or its PSK username) may see.
    pub fn access_for(&self, names: &[String]) -> Access {
        if self.rules.is_empty() {
            return Access::All;
        }
        let mut allowed = BTreeSet::new();
        let mut named = false;
        for (client, exports) in &self.rules {
            if names.iter().any(|n| n == client) {
                named = true;
                allowed.extend(exports.iter().cloned());
            }
        }
        if !named {
            for (client, exports) in &self.rules {
                if client == "*" {
                    allowed.extend(exports.iter().cloned());
                }
            }
        }
        if allowed.contains("*") {
            Access::All
        } else {
            Access::Only(allowed)
        }
    }
}

/// The exports one connection may list and open.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Access {
    All,
    /// These exports, and the snapshots of the volumes among them.
    Only(BTreeSet<String>),
}

impl Access {
    pub fn allows(&self, export: &str) -> bool {
        match self {
            Access::All => true,
            Access::Only(set) => {
                set.contains(export)
                    || condense_api::split_snapshot_name(export)
                        .is_some_and(|(volume, _)| set.contains(volume))
            }
        }
    }
}

/// How the server authenticates itself and its clients.
#[derive(Clone)]
enum Credentials {
    /// A server certificate (rustls), and whether clients need one from the client CA.
    Certificate {
        acceptor: tokio_rustls::TlsAcceptor,
        client_auth: bool,
    },
    /// Pre-shared keys (OpenSSL): both sides prove they hold the key of a username.
    Psk { acceptor: PskAcceptor, users: usize },
}

/// The server side of TLS: credentials, mode, and export rules.
#[derive(Clone)]
pub struct TlsConfig {
    pub mode: TlsMode,
    credentials: Credentials,
    rules: ExportRules,
}

impl fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let credentials = match &self.credentials {
            Credentials::Certificate { client_auth, .. } => {
                format!("certificate (client CA: {client_auth})")
            }
            Credentials::Psk { users, .. } => format!("pre-shared keys of {users} user(s)"),
        };
        f.debug_struct("TlsConfig")
            .field("mode", &self.mode)
            .field("credentials", &credentials)
            .field("rules", &self.rules)
            .finish()
    }
}

fn read_certs(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let read = |source| TlsError::Read {
        what,
        path: path.to_path_buf(),
        source,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(read)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(read)?;
    if certs.is_empty() {
        return Err(TlsError::Empty {
            what,
            path: path.to_path_buf(),
            expected: "CERTIFICATE",
        });
    }
    Ok(certs)
}

impl TlsConfig {
    /// Load and check the server certificate chain `cert` (PEM, leaf first), its private key
    /// `key` (PEM: PKCS#8, PKCS#1 or SEC1) and, if given, the CA whose certificates clients
    /// must present. `rules` need a client CA; `Allow` is refused with one.
    pub fn from_files(
        cert: &Path,
        key: &Path,
        client_ca: Option<&Path>,
        mode: TlsMode,
        rules: ExportRules,
    ) -> Result<TlsConfig, TlsError> {
        if client_ca.is_some() && mode == TlsMode::Allow {
            return Err(TlsError::Settings(
                "a client CA admits only clients with a certificate from it, which a plaintext \
                 client of the 'allow' mode would bypass; use the 'require' mode"
                    .to_string(),
            ));
        }
        if client_ca.is_none() && !rules.is_empty() {
            return Err(TlsError::Settings(
                "export rules name clients by their certificate, which only a client CA \
                 verifies; give a client CA too (or use pre-shared keys, whose usernames \
                 the rules can name)"
                    .to_string(),
            ));
        }
        let chain = read_certs("certificate", cert)?;
        let private_key = PrivateKeyDer::from_pem_file(key).map_err(|source| match source {
            rustls::pki_types::pem::Error::NoItemsFound => TlsError::Empty {
                what: "key",
                path: key.to_path_buf(),
                expected: "PRIVATE KEY",
            },
            source => TlsError::Read {
                what: "key",
                path: key.to_path_buf(),
                source,
            },
        })?;
        // aws-lc-rs (already in the binary through object_store): its AES-GCM uses AVX-512
        // and VAES where the CPU has them (AES-GCM fell from 15 % to 10 % of serve's CPU on
        // TLS reads against ring's). Its default cipher suites are ring's, no weaker one.
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Settings(e.to_string()))?;
        let builder = match client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                for c in read_certs("client CA", ca)? {
                    roots.add(c).map_err(|e| TlsError::ClientCa {
                        path: ca.to_path_buf(),
                        reason: format!("not a usable CA certificate: {e}"),
                    })?;
                }
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider,
                )
                .build()
                .map_err(|e| TlsError::ClientCa {
                    path: ca.to_path_buf(),
                    reason: e.to_string(),
                })?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder
            .with_single_cert(chain, private_key)
            .map_err(|source| TlsError::KeyMismatch {
                cert: cert.to_path_buf(),
                key: key.to_path_buf(),
                source,
            })?;
        // NBD carries no ALPN; nothing else to negotiate.
        config.alpn_protocols.clear();
        Ok(TlsConfig {
            mode,
            credentials: Credentials::Certificate {
                acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
                client_auth: client_ca.is_some(),
            },
            rules,
        })
    }

    /// TLS-PSK with the keys of the file `path` (its text in `text`, read by the caller under
    /// the secret-file rule): clients must start TLS ([`TlsMode::Require`]) and prove they
    /// hold the key of a username in the file. `rules` may name those usernames; a rule that
    /// names a username the file does not have is refused (a typo would lock that client out).
    pub fn psk(path: &Path, text: &[u8], rules: ExportRules) -> Result<TlsConfig, TlsError> {
        let psk_error = |source| TlsError::Psk {
            path: path.to_path_buf(),
            source,
        };
        let keys = PskKeys::parse(text).map_err(psk_error)?;
        if let Some(unknown) = rules.clients().find(|c| !keys.has_user(c)) {
            return Err(TlsError::Settings(format!(
                "the export rule for {unknown:?} names a username that has no key in the PSK \
                 file {}; name a username of the file, or * for every other client",
                path.display()
            )));
        }
        let users = keys.len();
        Ok(TlsConfig {
            mode: TlsMode::Require,
            credentials: Credentials::Psk {
                acceptor: PskAcceptor::new(keys).map_err(psk_error)?,
                users,
            },
            rules,
        })
    }

    /// Whether clients must present a certificate from the client CA.
    pub fn client_auth(&self) -> bool {
        matches!(
            self.credentials,
            Credentials::Certificate {
                client_auth: true,
                ..
            }
        )
    }

    /// The number of PSK usernames, when clients authenticate with pre-shared keys.
    pub fn psk_users(&self) -> Option<usize> {
        match self.credentials {
            Credentials::Psk { users, .. } => Some(users),
            Credentials::Certificate { .. } => None,
        }
    }

    /// Whether only authenticated clients get past STARTTLS: a client CA or pre-shared keys,
    /// under `Require`.
    pub fn authenticates_clients(&self) -> bool {
        self.mode == TlsMode::Require && (self.client_auth() || self.psk_users().is_some())
    }

    /// Run the server side of the TLS handshake on a connection that acknowledged STARTTLS.
    /// Returns the encrypted stream, the client's names (certificate names, or its PSK
    /// username), and what it may see.
    pub(crate) async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
        &self,
        stream: S,
    ) -> std::io::Result<(TlsStream<S>, Vec<String>, Access)> {
        let (tls, names) = match &self.credentials {
            Credentials::Certificate { acceptor, .. } => {
                // rustls reads the socket 4 KiB at a time; a buffer under it turns the records
                // of a 1 MiB write into a few large reads instead of hundreds of system calls.
                let buffered = BufReader::with_capacity(SOCKET_READ_BUFFER_BYTES, stream);
                let tls = acceptor.accept(buffered).await?;
                let names = tls
                    .get_ref()
                    .1
                    .peer_certificates()
                    .and_then(|chain| chain.first())
                    .map(|leaf| client_names(leaf.as_ref()))
                    .unwrap_or_default();
                (TlsStream::Certificate(Box::new(tls)), names)
            }
            Credentials::Psk { acceptor, .. } => {
                let (tls, user) = acceptor.accept(stream).await?;
                (TlsStream::Psk(tls), vec![user])
            }
        };
        let access = self.rules.access_for(&names);
        Ok((tls, names, access))
    }
}

/// The names a client certificate (DER) goes by: its subject common names, then its DNS
/// subject alternative names. Empty for a certificate that cannot be parsed (it was verified
/// by then, so that means a form this parser does not know: the client gets no named rule).
pub fn client_names(der: &[u8]) -> Vec<String> {
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
        return Vec::new();
    };
    let mut names: Vec<String> = cert
        .subject()
        .iter_common_name()
        .filter_map(|cn| cn.as_str().ok())
        .map(str::to_string)
        .collect();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for n in &san.value.general_names {
            if let x509_parser::extensions::GeneralName::DNSName(d) = n {
                names.push((*d).to_string());
            }
        }
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(list: &[&str]) -> ExportRules {
        let mut r = ExportRules::default();
        for l in list {
            r.add(l).expect("rule");
        }
        r
    }

    #[test]
    fn no_rules_allow_everything() {
        assert_eq!(rules(&[]).access_for(&[]), Access::All);
    }

    #[test]
    fn a_named_client_sees_only_its_exports_and_their_snapshots() {
        let r = rules(&["alice=vm1, vm2", "bob=vm3", "*=public"]);
        let a = r.access_for(&["alice".to_string()]);
        assert!(a.allows("vm1") && a.allows("vm2") && a.allows("vm1@monday"));
        assert!(!a.allows("vm3") && !a.allows("public") && !a.allows("vm10"));
        let other = r.access_for(&["carol".to_string()]);
        assert!(other.allows("public") && !other.allows("vm1"));
        assert!(!rules(&["bob=vm3"]).access_for(&[]).allows("vm1"));
        assert_eq!(
            rules(&["alice=*"]).access_for(&["alice".into()]),
            Access::All
        );
    }

    #[test]
    fn bad_rules_are_refused() {
        let mut r = ExportRules::default();
        for bad in ["alice", "=vm1", "alice=", "alice= , "] {
            assert!(r.add(bad).is_err(), "{bad}");
        }
    }
}

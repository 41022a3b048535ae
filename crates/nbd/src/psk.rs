//! TLS-PSK: clients authenticate with a pre-shared key instead of a certificate.
//!
//! Owns the key file and the TLS server that checks clients against it.
//!
//! - [`PskKeys::parse`] reads the psktool format that GnuTLS, qemu (`tls-creds-psk`, which reads
//!   `DIR/keys.psk`), libnbd (`tls-psk-file=`) and nbdkit (`--tls-psk`) share: one
//!   `USERNAME:HEXKEY` line per client. The parser is strict: any other line is refused with
//!   its line number and what is wrong with it, never with the key's digits.
//! - [`PskAcceptor`] runs the server side of the handshake with OpenSSL, whose external-PSK
//!   support GnuTLS clients (qemu, libnbd) interoperate with; rustls has none. A client proves
//!   it holds the key of the username it sends; the username is then its name for
//!   `--allow-export` rules.
//!
//! Invariants:
//! - Keys are wiped from memory when the key set is dropped, never printed (`Debug` shows
//!   usernames only) and never written anywhere.
//! - Only forward-secret AEAD key exchanges are offered: TLS 1.3 with `psk_dhe_ke` (OpenSSL
//!   refuses the key-only `psk_ke` mode unless told otherwise, and it is not told) using the
//!   SHA-256 suites an external PSK requires, or TLS 1.2 `ECDHE-PSK-CHACHA20-POLY1305`. No
//!   session tickets, no session cache, no renegotiation: every connection proves the key.
//! - A connection is admitted only if the handshake completed with the key of a username in
//!   the file; an unknown username or a wrong key fails the handshake.

use openssl::ex_data::Index;
use openssl::ssl::{
    Ssl, SslContext, SslContextBuilder, SslMethod, SslOptions, SslSessionCacheMode, SslVersion,
};
use std::collections::BTreeMap;
use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncWrite, BufReader, BufWriter};
use zeroize::Zeroizing;

/// Longest username accepted (GnuTLS's limit for a PSK username).
pub const USERNAME_BYTES_MAX: usize = 128;
/// Shortest key accepted: 128 bits. psktool makes 256-bit keys by default.
pub const KEY_BYTES_MIN: usize = 16;
/// Longest key accepted (what every OpenSSL since 1.1.1 can take).
pub const KEY_BYTES_MAX: usize = 256;

/// TLS 1.3 suites: an external PSK is bound to SHA-256, so only the SHA-256 suites can use it.
const TLS13_SUITES: &str = "TLS_AES_128_GCM_SHA256:TLS_CHACHA20_POLY1305_SHA256";
/// TLS 1.2 suites: PSK with an ephemeral ECDH exchange and an AEAD cipher, the one such suite
/// both OpenSSL and GnuTLS have.
const TLS12_SUITES: &str = "ECDHE-PSK-CHACHA20-POLY1305";

/// Bytes read from the socket at once under TLS (as for certificate TLS).
const SOCKET_READ_BUFFER_BYTES: usize = 256 * 1024;
/// Bytes of TLS records gathered before a write to the socket. OpenSSL writes each 16 KiB
/// record on its own; gathering them sends a 1 MiB reply in a few system calls and large TCP
/// segments. OpenSSL flushes after each handshake flight and the NBD layers flush after each
/// batch of replies, so nothing waits in the buffer.
const SOCKET_WRITE_BUFFER_BYTES: usize = 256 * 1024;

/// A key file that cannot be used. Messages name the line and the problem, never the key.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PskError {
    #[error("line {line}: {reason}; each line is USERNAME:HEXKEY (make one with `psktool -u USERNAME -p FILE`)")]
    Line { line: usize, reason: String },
    #[error("line {line}: username {user:?} was already given a key on line {first}; keep one line per username")]
    Duplicate {
        user: String,
        line: usize,
        first: usize,
    },
    #[error(
        "it holds no key; add a line USERNAME:HEXKEY (make one with `psktool -u USERNAME -p FILE`)"
    )]
    Empty,
    #[error("cannot set up the TLS-PSK server: {0}")]
    OpenSsl(String),
}

/// The usernames and keys of a key file.
#[derive(Clone, Default)]
pub struct PskKeys {
    keys: BTreeMap<String, Zeroizing<Vec<u8>>>,
}

impl fmt::Debug for PskKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PskKeys")
            .field("users", &self.keys.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// Why a username cannot be used, if it cannot: 1 to [`USERNAME_BYTES_MAX`] bytes of ASCII
/// letters, digits and `.-_@+`, so that it can be written in an `--allow-export` rule and a
/// URI without quoting.
fn username_problem(user: &[u8]) -> Option<String> {
    if user.is_empty() {
        return Some("the username before ':' is empty".to_string());
    }
    if user.len() > USERNAME_BYTES_MAX {
        return Some(format!(
            "the username is {} bytes long, more than {USERNAME_BYTES_MAX}",
            user.len()
        ));
    }
    let allowed = |b: &u8| b.is_ascii_alphanumeric() || b".-_@+".contains(b);
    user.iter().find(|b| !allowed(b)).map(|b| {
        format!(
            "the username has the character '{}'; use ASCII letters, digits and . - _ @ +",
            char::from(*b).escape_default()
        )
    })
}

/// The key of one line, decoded from hex, or why it cannot be used (without its digits).
fn decode_key(hex: &[u8]) -> Result<Zeroizing<Vec<u8>>, String> {
    if hex.is_empty() {
        return Err("the key after ':' is empty".to_string());
    }
    if !hex.iter().all(u8::is_ascii_hexdigit) {
        return Err("the key has characters that are not hex digits (0-9, a-f)".to_string());
    }
    if !hex.len().is_multiple_of(2) {
        return Err(format!(
            "the key has an odd number of hex digits ({}); two digits make a byte",
            hex.len()
        ));
    }
    let bytes = hex.len() / 2;
    if bytes < KEY_BYTES_MIN {
        return Err(format!(
            "the key is {bytes} bytes, shorter than {KEY_BYTES_MIN} bytes ({} hex digits): \
             too easy to guess",
            KEY_BYTES_MIN * 2
        ));
    }
    if bytes > KEY_BYTES_MAX {
        return Err(format!(
            "the key is {bytes} bytes, longer than {KEY_BYTES_MAX}"
        ));
    }
    let digit = |c: u8| match c {
        b'0'..=b'9' => c - b'0',
        b'a'..=b'f' => c - b'a' + 10,
        _ => c - b'A' + 10,
    };
    let mut key = Zeroizing::new(Vec::with_capacity(bytes));
    for pair in hex.chunks_exact(2) {
        key.push((digit(pair[0]) << 4) | digit(pair[1]));
    }
    Ok(key)
}

impl PskKeys {
    /// Parse a key file: lines `USERNAME:HEXKEY` separated by `\n` (a final newline is
    /// optional; empty lines are skipped). Refused: a line without ':', a username that
    /// [`username_problem`] rejects, a key that is not an even number of hex digits or is
    /// shorter than [`KEY_BYTES_MIN`] or longer than [`KEY_BYTES_MAX`] bytes, a carriage
    /// return, a username given twice, a file with no key.
    pub fn parse(text: &[u8]) -> Result<PskKeys, PskError> {
        let mut keys = BTreeMap::new();
        let mut first_line = BTreeMap::new();
        for (index, line) in text.split(|&b| b == b'\n').enumerate() {
            let number = index + 1;
            let bad = |reason: String| PskError::Line {
                line: number,
                reason,
            };
            if line.is_empty() {
                continue;
            }
            if line.ends_with(b"\r") {
                return Err(bad("the line ends with a carriage return (a Windows line \
                                ending); save the file with Unix line endings"
                    .to_string()));
            }
            let Some(colon) = line.iter().position(|&b| b == b':') else {
                return Err(bad("there is no ':' between username and key".to_string()));
            };
            let (user, hex) = (&line[..colon], &line[colon + 1..]);
            if let Some(problem) = username_problem(user) {
                return Err(bad(problem));
            }
            // Checked above: ASCII only.
            let user = String::from_utf8_lossy(user).into_owned();
            let key = decode_key(hex).map_err(|reason| bad(format!("{reason} (user {user})")))?;
            if let Some(&first) = first_line.get(&user) {
                return Err(PskError::Duplicate {
                    user,
                    line: number,
                    first,
                });
            }
            first_line.insert(user.clone(), number);
            keys.insert(user, key);
        }
        if keys.is_empty() {
            return Err(PskError::Empty);
        }
        Ok(PskKeys { keys })
    }

    /// The key of a username, if the file has one.
    pub fn key(&self, user: &[u8]) -> Option<&[u8]> {
        let user = std::str::from_utf8(user).ok()?;
        self.keys.get(user).map(|k| k.as_slice())
    }

    /// Whether the file gives this username a key.
    pub fn has_user(&self, user: &str) -> bool {
        self.keys.contains_key(user)
    }

    /// How many usernames have a key.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

/// An encrypted connection authenticated by a pre-shared key, with read and write buffers
/// under it.
pub type PskStream<S> = tokio_openssl::SslStream<BufReader<BufWriter<S>>>;

/// The server side of TLS-PSK: an OpenSSL context holding the keys.
#[derive(Clone)]
pub struct PskAcceptor {
    context: SslContext,
    /// Where the handshake records the username whose key it was given.
    user_index: Index<Ssl, String>,
}

impl fmt::Debug for PskAcceptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PskAcceptor").finish_non_exhaustive()
    }
}

fn openssl_error(what: &str, e: impl fmt::Display) -> PskError {
    PskError::OpenSsl(format!("{what}: {e}"))
}

impl PskAcceptor {
    /// A TLS server that admits the clients of `keys`.
    pub fn new(keys: PskKeys) -> Result<PskAcceptor, PskError> {
        let user_index =
            Ssl::new_ex_index::<String>().map_err(|e| openssl_error("ex data index", e))?;
        let mut b = SslContextBuilder::new(SslMethod::tls_server())
            .map_err(|e| openssl_error("context", e))?;
        b.set_min_proto_version(Some(SslVersion::TLS1_2))
            .map_err(|e| openssl_error("protocol versions", e))?;
        b.set_ciphersuites(TLS13_SUITES)
            .map_err(|e| openssl_error("TLS 1.3 suites", e))?;
        b.set_cipher_list(TLS12_SUITES)
            .map_err(|e| openssl_error("TLS 1.2 suites", e))?;
        b.set_options(
            SslOptions::NO_TICKET
                | SslOptions::NO_RENEGOTIATION
                | SslOptions::CIPHER_SERVER_PREFERENCE,
        );
        b.set_num_tickets(0)
            .map_err(|e| openssl_error("session tickets", e))?;
        b.set_session_cache_mode(SslSessionCacheMode::OFF);
        let keys = Arc::new(keys);
        b.set_psk_server_callback(move |ssl, identity, out| {
            let Some(identity) = identity else {
                return Ok(0);
            };
            let Some(key) = keys.key(identity) else {
                tracing::info!(
                    user = %String::from_utf8_lossy(identity),
                    "TLS-PSK: unknown username"
                );
                return Ok(0);
            };
            if key.len() > out.len() {
                tracing::warn!("TLS-PSK: key longer than this OpenSSL takes");
                return Ok(0);
            }
            out[..key.len()].copy_from_slice(key);
            // Ok: the identity is a username of the file, so it is ASCII.
            ssl.set_ex_data(user_index, String::from_utf8_lossy(identity).into_owned());
            Ok(key.len())
        });
        Ok(PskAcceptor {
            context: b.build(),
            user_index,
        })
    }

    /// Run the server side of the handshake. Returns the encrypted stream and the username the
    /// client proved it holds the key of.
    pub async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
        &self,
        stream: S,
    ) -> std::io::Result<(PskStream<S>, String)> {
        let io_error = |e: openssl::ssl::Error| {
            e.into_io_error()
                .unwrap_or_else(|e| std::io::Error::other(e.to_string()))
        };
        let ssl = Ssl::new(&self.context).map_err(std::io::Error::other)?;
        let buffered = BufReader::with_capacity(
            SOCKET_READ_BUFFER_BYTES,
            BufWriter::with_capacity(SOCKET_WRITE_BUFFER_BYTES, stream),
        );
        let mut tls =
            tokio_openssl::SslStream::new(ssl, buffered).map_err(std::io::Error::other)?;
        Pin::new(&mut tls).accept().await.map_err(io_error)?;
        let user = tls.ssl().ex_data(self.user_index).cloned().ok_or_else(|| {
            std::io::Error::other("TLS-PSK handshake completed without a pre-shared key")
        })?;
        tracing::debug!(
            user,
            version = tls.ssl().version_str(),
            cipher = tls.ssl().current_cipher().map(|c| c.name()),
            "TLS-PSK established"
        );
        Ok((tls, user))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

    fn line_error(text: &str) -> (usize, String) {
        match PskKeys::parse(text.as_bytes()) {
            Err(PskError::Line { line, reason }) => (line, reason),
            other => panic!("{text:?}: expected a line error, got {other:?}"),
        }
    }

    #[test]
    fn psktool_files_parse() -> Result<(), PskError> {
        let text = format!("alice:{KEY}\nbob@site.example:{}\n", KEY.to_uppercase());
        let keys = PskKeys::parse(text.as_bytes())?;
        assert_eq!(keys.len(), 2);
        let alice = keys.key(b"alice").map(<[u8]>::to_vec);
        assert_eq!(
            alice.as_deref().map(|k| (k.len(), k[0], k[1], k[31])),
            Some((32, 0x00, 0x11, 0xff))
        );
        assert_eq!(keys.key(b"bob@site.example"), keys.key(b"alice"));
        assert!(keys.key(b"carol").is_none() && keys.key(b"alic").is_none());
        assert!(keys.key(&[0xff, 0xfe]).is_none());
        // No final newline, and blank lines, are fine.
        assert_eq!(
            PskKeys::parse(format!("\nalice:{KEY}\n\n").as_bytes())?.len(),
            1
        );
        assert_eq!(PskKeys::parse(format!("alice:{KEY}").as_bytes())?.len(), 1);
        Ok(())
    }

    #[test]
    fn hostile_lines_are_refused_with_their_number_and_never_the_key() {
        let secret = "5ec7e75ec7e75ec7e75ec7e75ec7e75e";
        let cases: &[(&str, &str)] = &[
            ("alice", "no ':'"),
            (
                ":5ec7e75ec7e75ec7e75ec7e75ec7e75e",
                "username before ':' is empty",
            ),
            ("alice:", "key after ':' is empty"),
            (
                "alice:5ec7e75ec7e75ec7e75ec7e75ec7e75",
                "odd number of hex digits (31)",
            ),
            ("alice:5ec7e75ec7e75ec7e75ec7e75ec7e75g", "not hex digits"),
            ("alice:5ec7e75ec7e75ec7 e75ec7e75ec7e75e", "not hex digits"),
            ("alice:0x5ec7e75ec7e75ec7e75ec7e75ec7e75e", "not hex digits"),
            ("alice:5ec7e75ec7e75e", "shorter than 16 bytes"),
            ("al ice:5ec7e75ec7e75ec7e75ec7e75ec7e75e", "character ' '"),
            ("al=ice:5ec7e75ec7e75ec7e75ec7e75ec7e75e", "character '='"),
            (
                "al\u{7}ice:5ec7e75ec7e75ec7e75ec7e75ec7e75e",
                "character '\\u{7}'",
            ),
            ("#alice:5ec7e75ec7e75ec7e75ec7e75ec7e75e", "character '#'"),
            (
                "alice:5ec7e75ec7e75ec7e75ec7e75ec7e75e\r",
                "carriage return",
            ),
            (
                "alice:5ec7e75ec7e75ec7e75ec7e75ec7e75e:00",
                "not hex digits",
            ),
        ];
        for (bad, want) in cases {
            let text = format!("bob:{KEY}\n{bad}\n");
            let (line, reason) = line_error(&text);
            assert_eq!(line, 2, "{bad:?}");
            assert!(reason.contains(want), "{bad:?}: {reason}");
            let shown = PskKeys::parse(text.as_bytes())
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(
                !shown.contains(&secret[..20]),
                "{bad:?} echoes the key: {shown}"
            );
            assert!(
                !shown.contains(&KEY[..20]),
                "{bad:?} echoes bob's key: {shown}"
            );
        }
        let nul = [b"alice\0:".as_slice(), KEY.as_bytes()].concat();
        assert!(matches!(
            PskKeys::parse(&nul),
            Err(PskError::Line { line: 1, .. })
        ));
        let latin1 = [b"al\xe9:".as_slice(), KEY.as_bytes()].concat();
        assert!(matches!(
            PskKeys::parse(&latin1),
            Err(PskError::Line { line: 1, .. })
        ));
    }

    #[test]
    fn long_lines_are_refused_without_echoing_them() {
        let long_user = format!("{}:{KEY}", "a".repeat(USERNAME_BYTES_MAX + 1));
        let (_, reason) = line_error(&long_user);
        assert!(reason.contains("more than 128"), "{reason}");
        assert!(!reason.contains(&"a".repeat(40)));
        let max_user = format!("{}:{KEY}", "a".repeat(USERNAME_BYTES_MAX));
        assert!(PskKeys::parse(max_user.as_bytes()).is_ok());
        let long_key = format!("alice:{}", "ab".repeat(KEY_BYTES_MAX + 1));
        let (_, reason) = line_error(&long_key);
        assert!(
            reason.contains("longer than 256") && !reason.contains("abab"),
            "{reason}"
        );
        let max_key = format!("alice:{}", "ab".repeat(KEY_BYTES_MAX));
        assert!(PskKeys::parse(max_key.as_bytes()).is_ok());
        let huge = "x".repeat(60_000);
        let (line, reason) = line_error(&huge);
        assert_eq!(line, 1);
        assert!(reason.len() < 200, "{reason}");
    }

    #[test]
    fn duplicate_users_and_empty_files_are_refused() {
        let text = format!("alice:{KEY}\nbob:{KEY}\nalice:{KEY}\n");
        assert_eq!(
            PskKeys::parse(text.as_bytes()).err(),
            Some(PskError::Duplicate {
                user: "alice".to_string(),
                line: 3,
                first: 1
            })
        );
        for empty in ["", "\n", "\n\n\n"] {
            assert_eq!(
                PskKeys::parse(empty.as_bytes()).err(),
                Some(PskError::Empty),
                "{empty:?}"
            );
        }
    }

    #[test]
    fn debug_shows_users_not_keys() -> Result<(), PskError> {
        let keys = PskKeys::parse(format!("alice:{KEY}\n").as_bytes())?;
        let shown = format!("{keys:?}");
        assert!(shown.contains("alice") && !shown.contains("0011") && !shown.contains("[0, 17"));
        Ok(())
    }
}

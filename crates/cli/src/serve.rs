//! `condense serve`'s options; serving is `condense_service::serve` (who may connect:
//! docs/SECURITY.md; TLS: docs/TLS.md).

use condense_service::serve::{ServeOptions, TlsChoice, TlsOptions};
use std::path::PathBuf;

#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// Serve over TCP on HOST:PORT (e.g. 0.0.0.0:10809, [::]:10809, 127.0.0.1:10809), to
    /// clients that must authenticate: with a certificate (--tls-cert, --tls-key and
    /// --tls-client-ca: only clients with a certificate from that CA get in; docs/TLS.md) or
    /// with a shared key (--tls-psk FILE). Refused without one of them; see
    /// --insecure-listen. Add --socket PATH to serve a Unix socket too. Without --listen,
    /// --insecure-listen and --socket, serve listens only on the Unix socket POOL/nbd.sock,
    /// which only this user and root can use.
    #[arg(long, value_name = "HOST:PORT", conflicts_with = "insecure_listen")]
    pub listen: Option<String>,
    /// Serve over TCP on HOST:PORT without requiring clients to authenticate: anyone who can
    /// reach the port can list, read and write every volume (with --tls-cert but no
    /// --tls-client-ca the traffic is encrypted, yet still open to anyone). For a test
    /// machine or a network where every host is trusted; the log says so at start. Prefer
    /// the Unix socket, or --listen with authentication.
    #[arg(long, value_name = "HOST:PORT")]
    pub insecure_listen: Option<String>,
    /// Listen on this Unix socket instead of POOL/nbd.sock (clients use
    /// nbd+unix:///NAME?socket=PATH). Mode 0600 whatever the umask: only this user and root
    /// can connect, unless --group. With --listen or --insecure-listen, serve both.
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// Let the members of GROUP (a name or a number) connect to the Unix socket too: it is
    /// made mode 0660 and group GROUP, e.g. libvirt-qemu or kvm for QEMU started by a VM
    /// manager. Needs --socket PATH in a directory the group can enter (e.g.
    /// /run/condense/vm.sock): the pool directory, which holds the default socket, is
    /// owner-only. Does not apply to TCP.
    #[arg(long, value_name = "GROUP")]
    pub group: Option<String>,
    /// Refuse every write; clients see read-only exports.
    #[arg(long)]
    pub read_only: bool,
    #[command(flatten)]
    pub cache: crate::MetadataCacheArg,
    #[command(flatten)]
    pub tier: crate::cache::CacheTierArg,
    #[command(flatten)]
    pub scrub: crate::scrub::ScrubArg,
    #[command(flatten)]
    pub config: condense_service::config::ConfigArg,
    #[command(flatten)]
    pub tls: TlsArgs,
    /// Serve Prometheus metrics at http://HOST:PORT/metrics (requests, bytes and latency per
    /// NBD command, connected clients, savings, dead bytes, GC, journal and checkpoint
    /// timings; docs/METRICS.md). Off by default; use a loopback address unless the network
    /// in between is trusted (there is no authentication).
    #[arg(long, value_name = "HOST:PORT")]
    pub metrics_listen: Option<String>,
    /// Most NBD connections served at once (default 64: qemu opens one per disk, nbdcopy
    /// four). Each connection may keep up to 32 MiB of requests in flight, all of them
    /// together 64 MiB plus 1 MiB each, so the cap bounds the server's memory. A connection
    /// takes its slot when the client chooses an export (after TLS, which authenticates it);
    /// beyond the cap the client is refused (NBD_REP_ERR_POLICY; counted in
    /// condense_nbd_connections_refused_total, and logged at most every 10 seconds).
    /// Connections still in the handshake have limits of their own: 10 seconds, 128 at once
    /// and 32 per address, the one idle longest closed first (docs/SECURITY.md).
    #[arg(long, value_name = "N", default_value_t = condense_nbd::DEFAULT_MAX_CONNECTIONS as u32,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: u32,
}

/// `--tls`: whether clients must start TLS.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsModeArg {
    /// Clients must send NBD_OPT_STARTTLS first; before it every option is refused with
    /// NBD_REP_ERR_TLS_REQD, and no export is listed or served.
    Require,
    /// Clients choose: TLS for those that ask for it, plaintext for the others.
    Allow,
}

/// NBD over TLS (STARTTLS). See docs/TLS.md for making certificates or keys and connecting
/// clients.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct TlsArgs {
    /// Serve NBD over TLS with this certificate (PEM: the server certificate first, then any
    /// intermediate CAs). Its subject alternative names must match the host name or address
    /// clients connect to: qemu and libnbd check them. Clients then use nbds:// URIs or qemu's
    /// tls-creds-x509.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM: PKCS#8, RSA or EC). Keep it readable by the server
    /// only.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Admit only clients whose certificate is signed by this CA (PEM). Clients without a
    /// certificate, or with one from another CA, fail the TLS handshake and see nothing.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
    /// Serve NBD over TLS authenticated by pre-shared keys instead of certificates (TLS-PSK, as
    /// qemu's tls-creds-psk, libnbd's tls-psk-file and nbdkit's --tls-psk). FILE has one line
    /// USERNAME:HEXKEY per client (`psktool -u alice -p FILE` adds one) and must be readable
    /// by its owner only. Every client must start TLS with a username of the file and its key;
    /// a wrong key, an unknown username or a plaintext client gets nothing. Give each client a
    /// file with its own line only. Not with --tls-cert.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["tls_cert", "tls_key", "tls_client_ca"])]
    pub tls_psk: Option<PathBuf>,
    /// Whether clients must use TLS: `require` (the default once --tls-cert is given, and
    /// always with --tls-psk) or `allow` (plaintext clients too; only with --tls-cert and
    /// without --tls-client-ca).
    #[arg(long, value_enum, value_name = "MODE")]
    pub tls: Option<TlsModeArg>,
    /// Restrict a client to some exports: CLIENT=EXPORT[,EXPORT...], CLIENT being the subject
    /// CN or a DNS name of its certificate (with --tls-client-ca) or its username in the
    /// --tls-psk file. Repeatable. Once given, a client sees only the exports of the rules
    /// naming it, and a client no rule names sees those of the `*=...` rule, or none. EXPORT
    /// `*` is every export; a volume brings its snapshots (VOLUME@SNAP). Other exports are
    /// neither listed nor opened.
    #[arg(long, value_name = "CLIENT=EXPORTS")]
    pub allow_export: Vec<String>,
}

impl ServeArgs {
    /// The options as the service takes them.
    pub fn options(&self) -> ServeOptions {
        ServeOptions {
            listen: self.listen.clone(),
            insecure_listen: self.insecure_listen.clone(),
            socket: self.socket.clone(),
            group: self.group.clone(),
            read_only: self.read_only,
            tls: self.tls.options(),
            metrics_listen: self.metrics_listen.clone(),
            max_connections: self.max_connections,
        }
    }
}

impl TlsArgs {
    fn options(&self) -> TlsOptions {
        TlsOptions {
            tls_cert: self.tls_cert.clone(),
            tls_key: self.tls_key.clone(),
            tls_client_ca: self.tls_client_ca.clone(),
            tls_psk: self.tls_psk.clone(),
            tls: self.tls.map(|t| match t {
                TlsModeArg::Require => TlsChoice::Require,
                TlsModeArg::Allow => TlsChoice::Allow,
            }),
            allow_export: self.allow_export.clone(),
        }
    }
}

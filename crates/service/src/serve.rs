//! `condense serve`: the pool's volumes as NBD exports until SIGINT or SIGTERM.
//!
//! The NBD protocol lives in `condense-nbd`; this module only turns arguments into endpoints,
//! runs the server on a tokio runtime, and on a signal shuts it down cleanly: stop accepting,
//! answer every request in flight, close the connections, flush the pool. With `--tls-cert`
//! and `--tls-key` (certificates) or `--tls-psk` (pre-shared keys) it serves NBD over TLS
//! (`docs/TLS.md`); [`TlsOptions::load`] checks the certificate or key files before the pool is
//! opened.
//!
//! Who can connect (docs/SECURITY.md), decided by [`ServeOptions::endpoints`] before the pool is
//! opened:
//! - by default only the Unix socket `POOL/nbd.sock`, mode 0600 inside the owner-only pool
//!   directory: the pool's owner and root;
//! - `--socket PATH`: that socket instead, 0600; `--group GROUP` makes it 0660 for GROUP;
//! - `--listen HOST:PORT`: TCP, only when clients must authenticate
//!   ([`TlsOptions::authenticates_clients`]);
//! - `--insecure-listen HOST:PORT`: TCP open to anyone who reaches it, with a warning.

use crate::error::{Context, Result, ServiceError};
use condense_api::Catalog;
use condense_engine::Pool;
use condense_nbd::unix_socket::{self, Access};
use condense_nbd::{Endpoint, ExportRules, Server, ServerConfig, TlsConfig, TlsMode};
use std::net::ToSocketAddrs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The Unix socket `serve` listens on by default, in the pool directory.
pub const DEFAULT_SOCKET_NAME: &str = "nbd.sock";

/// What `serve` serves and how (the CLI's `serve` options, docs/SECURITY.md for who may
/// connect).
#[derive(Debug, Clone, Default)]
pub struct ServeOptions {
    /// TCP `HOST:PORT` for clients that authenticate ([`TlsOptions::authenticates_clients`]).
    pub listen: Option<String>,
    /// TCP `HOST:PORT` open to anyone who reaches it.
    pub insecure_listen: Option<String>,
    /// The Unix socket instead of `POOL/nbd.sock`.
    pub socket: Option<PathBuf>,
    /// The group that may use the Unix socket too (a name or a number).
    pub group: Option<String>,
    pub read_only: bool,
    pub tls: TlsOptions,
    /// Serve Prometheus metrics at `http://HOST:PORT/metrics`.
    pub metrics_listen: Option<String>,
    /// Most NBD connections served at once.
    pub max_connections: u32,
}

/// Whether clients must start TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsChoice {
    /// Clients must send NBD_OPT_STARTTLS first.
    Require,
    /// TLS for clients that ask for it, plaintext for the others.
    Allow,
}

/// NBD over TLS (STARTTLS, docs/TLS.md): certificates or pre-shared keys, and which exports
/// each verified client may see.
#[derive(Debug, Clone, Default)]
pub struct TlsOptions {
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub tls_client_ca: Option<PathBuf>,
    pub tls_psk: Option<PathBuf>,
    /// `None`: require.
    pub tls: Option<TlsChoice>,
    /// Rules CLIENT=EXPORT[,EXPORT...].
    pub allow_export: Vec<String>,
}

impl TlsOptions {
    /// Whether every client that gets past STARTTLS has authenticated itself: a client CA
    /// under `require`, or pre-shared keys (always `require`). What `--listen` beyond this
    /// host calls for.
    pub fn authenticates_clients(&self) -> bool {
        let require = self.tls.unwrap_or(TlsChoice::Require) == TlsChoice::Require;
        (self.tls_cert.is_some() && self.tls_client_ca.is_some() && require)
            || self.tls_psk.is_some()
    }

    /// The TLS settings, with every file read and checked; `None` without --tls-cert or
    /// --tls-psk.
    pub fn load(&self) -> Result<Option<Arc<TlsConfig>>> {
        let mut rules = ExportRules::default();
        for r in &self.allow_export {
            rules.add(r).context("bad --allow-export")?;
        }
        if !rules.is_empty() && self.tls_client_ca.is_none() && self.tls_psk.is_none() {
            return Err(ServiceError::Invalid(
                "--allow-export names clients, and only verified clients have names: give \
                 --tls-client-ca (certificate names) or --tls-psk (PSK usernames)"
                    .into(),
            ));
        }
        if let Some(path) = &self.tls_psk {
            if self.tls == Some(TlsChoice::Allow) {
                return Err(ServiceError::Invalid(
                    "--tls allow would serve clients without a key, bypassing --tls-psk; \
                     TLS-PSK is always required (leave --tls out)"
                        .into(),
                ));
            }
            let text = condense_engine::secret_file::read(path, "PSK file")?;
            let config = TlsConfig::psk(path, &text, rules)
                .context("cannot set up TLS-PSK (check --tls-psk and --allow-export)")?;
            return Ok(Some(Arc::new(config)));
        }
        let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) else {
            if self.tls.is_some() {
                return Err(ServiceError::Invalid(
                    "--tls needs TLS settings: --tls-cert and --tls-key".into(),
                ));
            }
            return Ok(None);
        };
        let mode = match self.tls.unwrap_or(TlsChoice::Require) {
            TlsChoice::Require => TlsMode::Require,
            TlsChoice::Allow => TlsMode::Allow,
        };
        let config = TlsConfig::from_files(cert, key, self.tls_client_ca.as_deref(), mode, rules)
            .context("cannot set up TLS (check --tls-cert, --tls-key, --tls-client-ca)")?;
        Ok(Some(Arc::new(config)))
    }
}

/// Where `serve` listens and who may connect to its Unix socket.
#[derive(Debug, PartialEq, Eq)]
pub struct Endpoints {
    pub endpoints: Vec<Endpoint>,
    pub socket_access: Access,
    /// The TCP address of --insecure-listen, if clients there are not authenticated.
    pub insecure: Option<std::net::SocketAddr>,
}

impl ServeOptions {
    /// The endpoints to serve on for the pool in `pool_dir`, every rule of access checked:
    /// an error says what to change.
    pub fn endpoints(&self, pool_dir: &Path) -> Result<Endpoints> {
        let mut out = Endpoints {
            endpoints: Vec::new(),
            socket_access: Access::Owner,
            insecure: None,
        };
        if let Some(l) = &self.listen {
            if !self.tls.authenticates_clients() {
                return Err(ServiceError::Invalid(format!(
                    "--listen {l} would let clients in without authenticating them; either require \
                     client certificates (--tls-cert FILE --tls-key FILE --tls-client-ca CA_FILE, \
                     docs/TLS.md) or a shared key (--tls-psk FILE), or, on a network where anyone \
                     who can reach the port may read and write every volume, use \
                     --insecure-listen {l}"
                )));
            }
            out.endpoints
                .push(Endpoint::Tcp(tcp_address(l, "--listen")?));
        }
        if let Some(l) = &self.insecure_listen {
            let addr = tcp_address(l, "--insecure-listen")?;
            out.endpoints.push(Endpoint::Tcp(addr));
            if !self.tls.authenticates_clients() {
                out.insecure = Some(addr);
            }
        }
        let socket = match &self.socket {
            Some(p) => Some(p.clone()),
            None if out.endpoints.is_empty() => Some(default_socket(pool_dir)?),
            None => None,
        };
        if let Some(p) = socket {
            if !unix_socket::path_fits(&p) {
                return Err(ServiceError::Invalid(format!(
                    "the socket path {} is {} bytes long, more than a Unix socket path can hold \
                     ({}): give a shorter one with --socket PATH (e.g. /run/condense/NAME.sock)",
                    p.display(),
                    p.as_os_str().len(),
                    unix_socket::PATH_BYTES_MAX
                )));
            }
            out.endpoints.push(Endpoint::Unix(p));
        }
        if let Some(g) = &self.group {
            if self.socket.is_none() {
                return Err(ServiceError::Invalid(format!(
                    "--group {g} needs --socket PATH in a directory that group can enter (e.g. \
                     /run/condense/NAME.sock): the default socket is inside the pool directory, \
                     which is its owner's alone"
                )));
            }
            out.socket_access = Access::Group(group_id(g)?);
        }
        Ok(out)
    }
}

/// `POOL/nbd.sock`, absolute: clients connect from any directory.
fn default_socket(pool_dir: &Path) -> Result<PathBuf> {
    let dir = std::path::absolute(pool_dir)
        .with_context(|| format!("cannot resolve the pool path {}", pool_dir.display()))?;
    Ok(dir.join(DEFAULT_SOCKET_NAME))
}

fn tcp_address(l: &str, option: &str) -> Result<std::net::SocketAddr> {
    let addrs: Vec<_> = l
        .to_socket_addrs()
        .with_context(|| format!("{option} {l:?} is not HOST:PORT"))?
        .collect();
    addrs
        .first()
        .copied()
        .ok_or_else(|| ServiceError::Invalid(format!("{option} {l:?} resolves to no address")))
}

/// The gid of `--group`: a group name, or a number.
fn group_id(group: &str) -> Result<u32> {
    if let Ok(gid) = group.parse::<u32>() {
        return Ok(gid);
    }
    match nix::unistd::Group::from_name(group) {
        Ok(Some(g)) => Ok(g.gid.as_raw()),
        Ok(None) => Err(ServiceError::Invalid(format!(
            "--group {group}: no such group (see getent group)"
        ))),
        Err(e) => Err(ServiceError::Invalid(format!(
            "--group {group}: cannot look the group up: {e}"
        ))),
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("condense-nbd")
        .enable_all()
        .build()
        .context("cannot start the server runtime")
}

/// Resolves on the first SIGINT or SIGTERM (a clean stop); a second one ends the process at
/// once, whatever the clean stop is waiting for.
async fn stop_signal() {
    let (first, first_rx) = tokio::sync::oneshot::channel();
    let watcher = std::thread::Builder::new()
        .name("condense-signals".into())
        .spawn(move || watch_signals(first));
    if let Err(e) = watcher {
        eprintln!("condense serve: cannot watch SIGINT/SIGTERM ({e}); stopping");
        return;
    }
    let _ = first_rx.await;
}

/// On a thread of its own for the life of the process (the server's runtime ends before the
/// pool is closed): report the first signal, exit on the second.
fn watch_signals(first: tokio::sync::oneshot::Sender<()>) {
    use tokio::signal::unix::{signal, SignalKind};
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("condense serve: cannot watch SIGINT/SIGTERM ({e}); stopping");
            let _ = first.send(());
            return;
        }
    };
    rt.block_on(async {
        let (mut int, mut term) = match (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) {
            (Ok(int), Ok(term)) => (int, term),
            (Err(e), _) | (_, Err(e)) => {
                // Without signal handlers the server could not stop cleanly; stop now instead.
                eprintln!("condense serve: cannot watch SIGINT/SIGTERM ({e}); stopping");
                let _ = first.send(());
                return;
            }
        };
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
        let _ = first.send(());
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
        eprintln!(
            "condense serve: second signal: exiting now, without waiting for requests in flight \
             (writes not yet flushed may be lost; the pool recovers at its next open)"
        );
        std::process::exit(130);
    });
}

/// Serve every volume of the pool until SIGINT or SIGTERM, then shut down cleanly and flush.
/// `pool_dir` is the pool's directory as given (where the default socket goes).
pub fn run(pool: Arc<Pool>, pool_dir: &Path, args: &ServeOptions) -> Result<()> {
    let endpoints = args.endpoints(pool_dir)?;
    let tls = args.tls.load()?;
    let metrics = crate::metrics::Endpoint::start(args.metrics_listen.as_deref(), &pool, "serve")?;
    let catalog: Arc<dyn Catalog> = pool;
    let config = ServerConfig {
        read_only: args.read_only,
        tls: tls.clone(),
        socket_access: endpoints.socket_access,
        max_connections: args.max_connections as usize,
        ..ServerConfig::default()
    };
    let names: Vec<String> = catalog
        .list()
        .context("cannot list the pool's volumes")?
        .into_iter()
        .map(|v| v.name)
        .filter(|n| condense_nbd::is_exportable(n))
        .collect();
    let exports = names.len();
    let server =
        Server::bind(catalog, config, &endpoints.endpoints).with_context(|| match &args.group {
            Some(g) => format!(
                "cannot serve (with --group {g}, the user serve runs as must be root or a \
                 member of {g}: usermod -aG {g} USER)"
            ),
            None => "cannot serve".to_string(),
        })?;
    if let Some(m) = &metrics {
        m.register(server.metrics());
    }
    let rt = runtime()?;
    for e in server.endpoints() {
        eprintln!(
            "condense serve: {exports} volume(s) at {e}{}",
            if args.read_only { " (read-only)" } else { "" }
        );
        for uri in example_uris(e, &names, tls.is_some()) {
            eprintln!("condense serve:   {uri}");
        }
    }
    if let Some(group) = &args.group {
        eprintln!("condense serve: the Unix socket is mode 0660, group {group}");
    }
    if let Some(addr) = endpoints.insecure {
        eprintln!(
            "condense serve: warning: --insecure-listen: clients on {addr} are not \
             authenticated: anyone who can reach port {} can list, read and write every volume",
            addr.port()
        );
    }
    if let Some(t) = &tls {
        eprintln!("condense serve: {}", tls_summary(t));
    }
    eprintln!("condense serve: export names are volume names; stop with Ctrl-C or SIGTERM");
    // The pool is open and every listener is bound: connections queue from here on.
    crate::notify::ready(&format!("serving {exports} volume(s)"));
    rt.block_on(server.run(async {
        stop_signal().await;
        crate::notify::stopping("stopping: finishing requests in flight, then flushing");
        eprintln!("condense serve: stopping: finishing requests in flight, then flushing");
    }))
    .context("NBD server failed")?;
    eprintln!("condense serve: stopped; pool flushed");
    Ok(())
}

/// How many export URIs `serve` prints per endpoint.
const URIS_SHOWN_MAX: usize = 5;

/// The URIs of the first few exports at endpoint `e`, for the log.
fn example_uris(e: &Endpoint, names: &[String], tls: bool) -> Vec<String> {
    let mut out: Vec<String> = names
        .iter()
        .take(URIS_SHOWN_MAX)
        .map(|n| {
            let n = uri_escape(n);
            match e {
                Endpoint::Unix(p) => format!("nbd+unix:///{n}?socket={}", p.display()),
                Endpoint::Tcp(a) if tls => format!("nbds://{a}/{n}"),
                Endpoint::Tcp(a) => format!("nbd://{a}/{n}"),
            }
        })
        .collect();
    if names.len() > URIS_SHOWN_MAX {
        out.push(format!("... and {} more", names.len() - URIS_SHOWN_MAX));
    }
    out
}

/// A volume name as the path of an NBD URI: bytes other than letters, digits and `-._~`
/// percent-escaped.
fn uri_escape(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// One line for the log saying how clients must connect.
fn tls_summary(t: &TlsConfig) -> String {
    if let Some(users) = t.psk_users() {
        return format!(
            "TLS-PSK required, {users} username(s) from --tls-psk; clients connect to \
             nbds://USER@HOST:PORT/NAME?tls-psk-file=FILE or use qemu's tls-creds-psk"
        );
    }
    format!(
        "TLS {}{}; clients connect to nbds://HOST:PORT/NAME",
        match t.mode {
            TlsMode::Require => "required",
            TlsMode::Allow => "offered (plaintext allowed)",
        },
        if t.client_auth() {
            ", client certificates from --tls-client-ca only"
        } else {
            ""
        }
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::{bail, Context, Result};

    /// The options of `serve` given these words (option, value), as the CLI sets them.
    fn args(argv: &[&str]) -> Result<ServeOptions> {
        let mut o = ServeOptions::default();
        for pair in argv.chunks(2) {
            let value = || pair.get(1).map(|v| v.to_string()).context("no value");
            match pair[0] {
                "--listen" => o.listen = Some(value()?),
                "--insecure-listen" => o.insecure_listen = Some(value()?),
                "--socket" => o.socket = Some(value()?.into()),
                "--group" => o.group = Some(value()?),
                "--tls-cert" => o.tls.tls_cert = Some(value()?.into()),
                "--tls-key" => o.tls.tls_key = Some(value()?.into()),
                "--tls-client-ca" => o.tls.tls_client_ca = Some(value()?.into()),
                other => bail!("no option {other} here"),
            }
        }
        Ok(o)
    }

    #[test]
    fn the_default_is_the_pools_unix_socket_owner_only() -> Result<()> {
        let e = args(&[])?.endpoints(Path::new("/srv/pool"))?;
        assert_eq!(
            e.endpoints,
            vec![Endpoint::Unix("/srv/pool/nbd.sock".into())]
        );
        assert_eq!((e.socket_access, e.insecure), (Access::Owner, None));
        let e = args(&["--socket", "/run/c.sock"])?.endpoints(Path::new("p"))?;
        assert_eq!(e.endpoints, vec![Endpoint::Unix("/run/c.sock".into())]);
        let e = args(&["--socket", "/run/c.sock", "--group", "0"])?.endpoints(Path::new("p"))?;
        assert_eq!(e.socket_access, Access::Group(0));
        // The default socket is inside the owner-only pool directory: --group needs --socket.
        let e = args(&["--group", "0"])?.endpoints(Path::new("p"));
        assert!(crate::error::chain(&e.err().context("accepted")?).contains("--socket PATH"));
        Ok(())
    }

    #[test]
    fn tcp_needs_authentication_or_insecure_listen() -> Result<()> {
        let pool = Path::new("/srv/pool");
        let e = args(&["--listen", "127.0.0.1:1234"])?.endpoints(pool);
        let msg = crate::error::chain(&e.err().context("--listen without authentication")?);
        for way in [
            "--tls-client-ca",
            "--tls-psk",
            "--insecure-listen 127.0.0.1:1234",
        ] {
            assert!(msg.contains(way), "{msg}");
        }
        let tls = ["--tls-cert", "c", "--tls-key", "k"];
        let e = args(&[&tls[..], &["--listen", "127.0.0.1:1234"]].concat())?.endpoints(pool);
        assert!(
            e.is_err(),
            "TLS without client certificates is not authentication"
        );
        let ca = ["--tls-client-ca", "ca", "--listen", "127.0.0.1:1234"];
        let e = args(&[&tls[..], &ca[..]].concat())?.endpoints(pool)?;
        assert_eq!(e.endpoints, vec![Endpoint::Tcp("127.0.0.1:1234".parse()?)]);
        assert_eq!(e.insecure, None);
        let e =
            args(&["--insecure-listen", "127.0.0.1:1234", "--socket", "/s"])?.endpoints(pool)?;
        assert_eq!(e.endpoints.len(), 2);
        assert_eq!(e.insecure, Some("127.0.0.1:1234".parse()?));
        assert!(args(&["--insecure-listen", "no port"])?
            .endpoints(pool)
            .is_err());
        Ok(())
    }

    #[test]
    fn a_socket_path_too_long_names_the_fix() -> Result<()> {
        let pool = PathBuf::from("/").join("p".repeat(100));
        let e = args(&[])?
            .endpoints(&pool)
            .err()
            .context("long path accepted")?;
        let msg = crate::error::chain(&e);
        assert!(
            msg.contains("--socket PATH") && msg.contains("110 bytes"),
            "{msg}"
        );
        Ok(())
    }

    fn psk_args(path: &Path) -> TlsOptions {
        TlsOptions {
            tls_psk: Some(path.to_path_buf()),
            ..TlsOptions::default()
        }
    }

    #[test]
    fn only_a_client_ca_under_require_or_psk_authenticates_clients() {
        let cert = TlsOptions {
            tls_cert: Some("c.pem".into()),
            tls_key: Some("k.pem".into()),
            ..TlsOptions::default()
        };
        assert!(!TlsOptions::default().authenticates_clients());
        assert!(!cert.authenticates_clients());
        let ca = TlsOptions {
            tls_client_ca: Some("ca.pem".into()),
            ..cert.clone()
        };
        assert!(ca.authenticates_clients());
        let ca_allow = TlsOptions {
            tls: Some(TlsChoice::Allow),
            ..ca.clone()
        };
        assert!(!ca_allow.authenticates_clients());
        assert!(psk_args(Path::new("keys.psk")).authenticates_clients());
    }

    #[test]
    fn psk_files_are_checked_before_serving() -> Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("keys.psk");
        let key = "ab".repeat(32);
        std::fs::write(&path, format!("alice:{key}\nbob:{key}\n"))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644))?;
        let err = psk_args(&path)
            .load()
            .err()
            .map(|e| crate::error::chain(&e));
        assert!(
            err.as_deref().is_some_and(|e| e.contains("chmod 600")),
            "{err:?}"
        );
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
        let config = psk_args(&path).load()?;
        assert_eq!(config.as_ref().and_then(|c| c.psk_users()), Some(2));
        assert!(config.is_some_and(|c| c.authenticates_clients()));

        let allow = TlsOptions {
            tls: Some(TlsChoice::Allow),
            ..psk_args(&path)
        };
        assert!(allow.load().is_err(), "--tls allow with --tls-psk");
        let rules = |rule: &str| TlsOptions {
            allow_export: vec![rule.to_string()],
            ..psk_args(&path)
        };
        assert!(rules("alice=vm1").load().is_ok());
        assert!(rules("*=vm1").load().is_ok());
        let err = rules("carol=vm1")
            .load()
            .err()
            .map(|e| crate::error::chain(&e));
        assert!(
            err.as_deref().is_some_and(|e| e.contains("\"carol\"")),
            "{err:?}"
        );
        let no_identity = TlsOptions {
            allow_export: vec!["alice=vm1".to_string()],
            ..TlsOptions::default()
        };
        let err = no_identity.load().err().map(|e| crate::error::chain(&e));
        assert!(
            err.as_deref().is_some_and(|e| e.contains("--tls-psk")),
            "{err:?}"
        );

        std::fs::write(&path, format!("alice:{key}\nalice {key}\n"))?;
        let err = psk_args(&path)
            .load()
            .err()
            .map(|e| crate::error::chain(&e));
        assert!(
            err.as_deref()
                .is_some_and(|e| e.contains("line 2") && !e.contains(&key)),
            "{err:?}"
        );
        Ok(())
    }
}

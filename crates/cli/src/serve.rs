//! `condense serve`: the pool's volumes as NBD exports until SIGINT or SIGTERM.
//!
//! The NBD protocol lives in `condense-nbd`; this module only turns arguments into endpoints,
//! runs the server on a tokio runtime, and on a signal shuts it down cleanly: stop accepting,
//! answer every request in flight, close the connections, flush the pool. With `--tls-cert`
//! and `--tls-key` it serves NBD over TLS (`docs/TLS.md`); [`TlsArgs::load`] checks the
//! certificate files before the pool is opened.

use anyhow::{bail, Context, Result};
use condense_api::Catalog;
use condense_engine::Pool;
use condense_nbd::{Endpoint, ExportRules, Server, ServerConfig, ServerHandle, TlsConfig, TlsMode};
use std::net::ToSocketAddrs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Default TCP address: loopback only; serving other hosts is an explicit choice.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:10809";

#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// TCP address to listen on (HOST:PORT). Default 127.0.0.1:10809, unless only --socket is
    /// given. Use 0.0.0.0:10809 or [::]:10809 to serve other hosts; without --tls-cert the
    /// traffic is plaintext and unauthenticated, so serve other hosts with TLS (and
    /// --tls-client-ca to admit only your clients).
    #[arg(long, value_name = "HOST:PORT")]
    pub listen: Option<String>,
    /// Also (or only) listen on this Unix socket: nbd+unix:///NAME?socket=PATH.
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// Refuse every write; clients see read-only exports.
    #[arg(long)]
    pub read_only: bool,
    #[command(flatten)]
    pub cache: crate::MetadataCacheArg,
    #[command(flatten)]
    pub tier: crate::cache::CacheTierArg,
    #[command(flatten)]
    pub config: crate::config::ConfigArg,
    #[command(flatten)]
    pub tls: TlsArgs,
    /// Serve Prometheus metrics at http://HOST:PORT/metrics (requests, bytes and latency per
    /// NBD command, connected clients, savings, dead bytes, GC, journal and checkpoint
    /// timings; docs/METRICS.md). Off by default; use a loopback address unless the network
    /// in between is trusted (there is no authentication).
    #[arg(long, value_name = "HOST:PORT")]
    pub metrics_listen: Option<String>,
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

/// NBD over TLS (STARTTLS). See docs/TLS.md for making certificates and connecting clients.
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
    /// Whether clients must use TLS: `require` (the default once --tls-cert is given) or
    /// `allow` (plaintext clients too; not with --tls-client-ca).
    #[arg(long, value_enum, value_name = "MODE", requires = "tls_cert")]
    pub tls: Option<TlsModeArg>,
    /// Restrict a client to some exports: CLIENT=EXPORT[,EXPORT...], CLIENT being the subject
    /// CN or a DNS name of its certificate (needs --tls-client-ca). Repeatable. Once given, a
    /// client sees only the exports of the rules naming it, and a client no rule names sees
    /// those of the `*=...` rule, or none. EXPORT `*` is every export; a volume brings its
    /// snapshots (VOLUME@SNAP). Other exports are neither listed nor opened.
    #[arg(long, value_name = "CLIENT=EXPORTS", requires = "tls_client_ca")]
    pub allow_export: Vec<String>,
}

impl TlsArgs {
    /// The TLS settings, with every file read and checked; `None` without --tls-cert.
    pub fn load(&self) -> Result<Option<Arc<TlsConfig>>> {
        let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) else {
            return Ok(None);
        };
        let mode = match self.tls.unwrap_or(TlsModeArg::Require) {
            TlsModeArg::Require => TlsMode::Require,
            TlsModeArg::Allow => TlsMode::Allow,
        };
        let mut rules = ExportRules::default();
        for r in &self.allow_export {
            rules.add(r).context("bad --allow-export")?;
        }
        let config = TlsConfig::from_files(cert, key, self.tls_client_ca.as_deref(), mode, rules)
            .context("cannot set up TLS (check --tls-cert, --tls-key, --tls-client-ca)")?;
        Ok(Some(Arc::new(config)))
    }
}

impl ServeArgs {
    fn endpoints(&self) -> Result<Vec<Endpoint>> {
        let mut out = Vec::new();
        let listen = match (&self.listen, &self.socket) {
            (Some(l), _) => Some(l.as_str()),
            (None, None) => Some(DEFAULT_LISTEN),
            (None, Some(_)) => None,
        };
        if let Some(l) = listen {
            let addrs: Vec<_> = l
                .to_socket_addrs()
                .with_context(|| format!("--listen {l:?} is not HOST:PORT"))?
                .collect();
            let Some(first) = addrs.first() else {
                bail!("--listen {l:?} resolves to no address");
            };
            out.push(Endpoint::Tcp(*first));
        }
        if let Some(p) = &self.socket {
            out.push(Endpoint::Unix(p.clone()));
        }
        Ok(out)
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

/// Resolves on the first SIGINT or SIGTERM.
async fn stop_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) {
        (Ok(mut int), Ok(mut term)) => {
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
            }
        }
        (Err(e), _) | (_, Err(e)) => {
            // Without signal handlers the server could not stop cleanly; stop now instead.
            eprintln!("condense serve: cannot watch SIGINT/SIGTERM ({e}); stopping");
        }
    }
}

/// Serve every volume of the pool until SIGINT or SIGTERM, then shut down cleanly and flush.
pub fn run(pool: Arc<Pool>, args: &ServeArgs) -> Result<()> {
    let endpoints = args.endpoints()?;
    let tls = args.tls.load()?;
    let metrics = crate::metrics::Endpoint::start(args.metrics_listen.as_deref(), &pool, "serve")?;
    let catalog: Arc<dyn Catalog> = pool;
    let config = ServerConfig {
        read_only: args.read_only,
        tls: tls.clone(),
        ..ServerConfig::default()
    };
    let exports = catalog
        .list()
        .context("cannot list the pool's volumes")?
        .into_iter()
        .filter(|v| condense_nbd::is_exportable(&v.name))
        .count();
    let server = Server::bind(catalog, config, &endpoints)?;
    if let Some(m) = &metrics {
        m.register(server.metrics());
    }
    let rt = runtime()?;
    for e in server.endpoints() {
        eprintln!(
            "condense serve: {exports} volume(s) at {e}{}",
            if args.read_only { " (read-only)" } else { "" }
        );
    }
    if let Some(t) = &tls {
        eprintln!(
            "condense serve: TLS {}{}; clients connect to nbds://HOST:PORT/NAME",
            match t.mode {
                TlsMode::Require => "required",
                TlsMode::Allow => "offered (plaintext allowed)",
            },
            if t.client_auth() {
                ", client certificates from --tls-client-ca only"
            } else {
                ""
            }
        );
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

/// Start a server on a Unix socket in a thread of its own, for in-process clients such as
/// `qemu-img convert` during import and export. Dropping or shutting down the handle stops it
/// (answering requests in flight) and flushes the pool.
pub fn spawn_unix(catalog: Arc<dyn Catalog>, socket_path: &Path) -> Result<ServerHandle> {
    spawn_unix_with(catalog, socket_path, false)
}

/// [`spawn_unix`], optionally read-only (export never needs to write).
pub fn spawn_unix_with(
    catalog: Arc<dyn Catalog>,
    socket_path: &Path,
    read_only: bool,
) -> Result<ServerHandle> {
    let config = ServerConfig {
        read_only,
        ..ServerConfig::default()
    };
    let server = Server::bind(
        catalog,
        config,
        &[Endpoint::Unix(socket_path.to_path_buf())],
    )
    .with_context(|| format!("cannot serve on {}", socket_path.display()))?;
    server.spawn().context("cannot start the NBD server")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_default_to_loopback_unless_only_a_socket_is_given() -> Result<()> {
        let a = ServeArgs {
            listen: None,
            socket: None,
            read_only: false,
            cache: Default::default(),
            tier: crate::cache::CacheTierArg {
                cache: None,
                cache_size: None,
                cache_mode: condense_engine::CacheMode::WriteThrough,
            },
            config: Default::default(),
            tls: Default::default(),
            metrics_listen: None,
        };
        assert_eq!(a.endpoints()?, vec![Endpoint::Tcp(DEFAULT_LISTEN.parse()?)]);
        let a = ServeArgs {
            listen: None,
            socket: Some("/tmp/x.sock".into()),
            read_only: false,
            cache: Default::default(),
            tier: crate::cache::CacheTierArg {
                cache: None,
                cache_size: None,
                cache_mode: condense_engine::CacheMode::WriteThrough,
            },
            config: Default::default(),
            tls: Default::default(),
            metrics_listen: None,
        };
        assert_eq!(a.endpoints()?, vec![Endpoint::Unix("/tmp/x.sock".into())]);
        let a = ServeArgs {
            listen: Some("127.0.0.1:1234".into()),
            socket: Some("/tmp/x.sock".into()),
            read_only: false,
            cache: Default::default(),
            tier: crate::cache::CacheTierArg {
                cache: None,
                cache_size: None,
                cache_mode: condense_engine::CacheMode::WriteThrough,
            },
            config: Default::default(),
            tls: Default::default(),
            metrics_listen: None,
        };
        assert_eq!(a.endpoints()?.len(), 2);
        let a = ServeArgs {
            listen: Some("no port".into()),
            socket: None,
            read_only: false,
            cache: Default::default(),
            tier: crate::cache::CacheTierArg {
                cache: None,
                cache_size: None,
                cache_mode: condense_engine::CacheMode::WriteThrough,
            },
            config: Default::default(),
            tls: Default::default(),
            metrics_listen: None,
        };
        assert!(a.endpoints().is_err());
        Ok(())
    }

    #[test]
    fn spawned_unix_server_serves_and_flushes_on_shutdown() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("s.sock");
        let cat = Arc::new(condense_api::mem::MemCatalog::new(4096));
        cat.create("v", 1 << 20)?;
        let h = spawn_unix(cat, &path)?;
        let mut s = std::os::unix::net::UnixStream::connect(&path)?;
        let mut greeting = [0u8; 18];
        std::io::Read::read_exact(&mut s, &mut greeting)?;
        assert_eq!(&greeting[..8], b"NBDMAGIC");
        drop(s);
        h.shutdown()?;
        assert!(!path.exists());
        Ok(())
    }
}

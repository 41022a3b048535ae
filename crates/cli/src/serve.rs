//! `condense serve`: the pool's volumes as NBD exports until SIGINT or SIGTERM.
//!
//! The NBD protocol lives in `condense-nbd`; this module only turns arguments into endpoints,
//! runs the server on a tokio runtime, and on a signal shuts it down cleanly: stop accepting,
//! answer every request in flight, close the connections, flush the pool.

use anyhow::{bail, Context, Result};
use condense_api::Catalog;
use condense_engine::Pool;
use condense_nbd::{Endpoint, Server, ServerConfig, ServerHandle};
use std::net::ToSocketAddrs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Default TCP address: loopback only; serving other hosts is an explicit choice.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:10809";

#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// TCP address to listen on (HOST:PORT). Default 127.0.0.1:10809, unless only --socket is
    /// given. Use 0.0.0.0:10809 or [::]:10809 to serve other hosts (there is no TLS).
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
    /// Serve Prometheus metrics at http://HOST:PORT/metrics (requests, bytes and latency per
    /// NBD command, connected clients, savings, dead bytes, GC, journal and checkpoint
    /// timings; docs/METRICS.md). Off by default; use a loopback address unless the network
    /// in between is trusted (there is no authentication).
    #[arg(long, value_name = "HOST:PORT")]
    pub metrics_listen: Option<String>,
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
    let metrics = crate::metrics::Endpoint::start(args.metrics_listen.as_deref(), &pool, "serve")?;
    let catalog: Arc<dyn Catalog> = pool;
    let endpoints = args.endpoints()?;
    let config = ServerConfig {
        read_only: args.read_only,
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
    eprintln!("condense serve: export names are volume names; stop with Ctrl-C or SIGTERM");
    rt.block_on(server.run(async {
        stop_signal().await;
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
            metrics_listen: None,
        };
        assert_eq!(a.endpoints()?, vec![Endpoint::Tcp(DEFAULT_LISTEN.parse()?)]);
        let a = ServeArgs {
            listen: None,
            socket: Some("/tmp/x.sock".into()),
            read_only: false,
            cache: Default::default(),
            metrics_listen: None,
        };
        assert_eq!(a.endpoints()?, vec![Endpoint::Unix("/tmp/x.sock".into())]);
        let a = ServeArgs {
            listen: Some("127.0.0.1:1234".into()),
            socket: Some("/tmp/x.sock".into()),
            read_only: false,
            cache: Default::default(),
            metrics_listen: None,
        };
        assert_eq!(a.endpoints()?.len(), 2);
        let a = ServeArgs {
            listen: Some("no port".into()),
            socket: None,
            read_only: false,
            cache: Default::default(),
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

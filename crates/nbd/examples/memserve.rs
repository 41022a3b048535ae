//! Serve in-memory volumes over NBD, for trying real clients before a pool exists.
//!
//! ```text
//! cargo run -p condense-nbd --example memserve -- [--listen ADDR] [--socket PATH]
//!     [--read-only] [--block-size N] NAME:SIZE_MIB...
//! ```
//! Runs until SIGINT or SIGTERM, then shuts down cleanly. Prints `ready` once listening.

use condense_api::mem::MemCatalog;
use condense_api::Catalog;
use condense_nbd::{Endpoint, Server, ServerConfig};
use std::sync::Arc;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut endpoints = Vec::new();
    let mut config = ServerConfig::default();
    let mut block_size = 4096u32;
    let mut volumes = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--listen" => {
                endpoints.push(Endpoint::Tcp(args.next().ok_or("--listen ADDR")?.parse()?))
            }
            "--socket" => {
                endpoints.push(Endpoint::Unix(args.next().ok_or("--socket PATH")?.into()))
            }
            "--read-only" => config.read_only = true,
            "--block-size" => block_size = args.next().ok_or("--block-size N")?.parse()?,
            v => {
                let (name, mib) = v.split_once(':').ok_or("volumes are NAME:SIZE_MIB")?;
                volumes.push((name.to_string(), mib.parse::<u64>()? << 20));
            }
        }
    }
    if endpoints.is_empty() {
        endpoints.push(Endpoint::Tcp("127.0.0.1:10809".parse()?));
    }
    let catalog = Arc::new(MemCatalog::new(block_size));
    for (name, size) in &volumes {
        catalog.create(name, *size)?;
    }
    let server = Server::bind(catalog, config, &endpoints)?;
    for e in server.endpoints() {
        println!("listening on {e}");
    }
    println!("ready");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(server.run(async {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("cannot watch SIGTERM: {e}");
                    return;
                }
            };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }))?;
    println!("stopped");
    Ok(())
}

//! `condense-service`: the daemon half of the `condense` command, and the reports it prints.
//!
//! The CLI (crates/cli) parses arguments with clap, calls this crate and prints what it
//! renders; everything that runs for as long as a pool is served, and every report, lives here:
//!
//! - [`daemon`]: a long-lived frontend on a pool (`serve`, `mount`) with what runs beside it:
//!   background GC, scrub and hosts sync, the status publisher, the control socket;
//! - [`serve`] and [`mount`]: the NBD server and the FUSE mount, from options to a clean stop
//!   on SIGINT/SIGTERM; [`notify`] tells systemd; [`metrics`] serves Prometheus metrics;
//! - [`control`]: the control socket (`POOL/control.sock`): the server inside the daemon, the
//!   client the CLI tries first, and [`control::Ctx`], where a command's output goes and its
//!   pool comes from;
//! - [`status`]: `POOL/status.json`, what a daemon publishes for an older client
//!   (docs/FORMAT.md "status.json");
//! - [`config`]: a `--config FILE` of `serve`/`mount` turned into command-line words;
//! - [`open`] and [`keys`]: opening a pool, with the key from files or the terminal;
//! - [`tier`]: attaching a cache tier (`cache attach`, `--cache DIR`);
//! - [`render`]: every report as a `Serialize` type, rendered once as text and once as JSON;
//! - [`top`]: the I/O counters `condense top` samples, and the rows it shows.
//!
//! Errors are [`error::ServiceError`]s: each says what failed, where and what to do, with the
//! reason under it as its `source()`; the CLI shows the chain as its own (`condense: error:
//! ...`).

#![deny(clippy::unwrap_used)]

pub mod background_merge;
pub mod config;
pub mod control;
pub mod daemon;
pub mod error;
pub mod index;
pub mod keys;
pub mod metrics;
pub mod mount;
pub mod notify;
pub mod open;
pub mod render;
pub mod serve;
pub mod status;
pub mod tier;
pub mod top;

pub use error::{Result, ServiceError};

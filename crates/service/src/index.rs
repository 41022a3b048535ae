//! `condense index show|set|merge` and `init --index`: the pool's dedup index mode, dense or
//! sparse (docs/ARCHITECTURE.md "Sparse index", docs/FORMAT.md "Dedup index mode"), and the
//! merge pass that finds what the sparse index let through (ARCHITECTURE.md "Merge pass").
//!
//! Owns: the arguments of both (the CLI flattens them) and storing the setting, the named
//! record [`SETTING_KEY`], through a journaled change. The index is built by the first
//! write after an open, following the setting then: a change takes effect at the next open.

use crate::control::Ctx;
use crate::error::{io, Context, Result, ServiceError};
use crate::render::index::{IndexReport, MergeView};
use crate::render::write_report;
use condense_engine::index::{IndexSetting, DEFAULT_SPARSE_BUDGET, SETTING_KEY};
use condense_engine::sparse_index::MIN_BUDGET;
use condense_engine::Pool;

/// `init --index MODE --index-memory SIZE`.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct InitIndexArgs {
    /// The dedup index: dense (every chunk, ~7.8 bytes of RAM each) or sparse (a RAM budget
    /// set by --index-memory; finds duplicates through their neighbours). Change it later
    /// with `condense index set`.
    #[arg(long, value_name = "MODE", value_parser = ["dense", "sparse"])]
    pub index: Option<String>,
    /// The sparse index's RAM (default 32M; at least 256K).
    #[arg(long, value_name = "SIZE", value_parser = parse_memory)]
    pub index_memory: Option<u64>,
    /// Delta compression: a new block similar to a stored one (found by a sketch, in a
    /// 64 MiB index) is stored compressed against it (docs/FORMAT.md "Delta records").
    /// Builds before it cannot open the pool.
    #[arg(long)]
    pub delta: bool,
}

/// What `init` stores in the new pool: the dedup index setting (`None`: the default, dense,
/// without options) and whether delta compression is on.
#[derive(Clone, Copy, Debug)]
pub struct InitSettings {
    pub index: Option<IndexSetting>,
    pub delta: bool,
}

/// `estimate --index MODE --index-memory SIZE --delta`: the projected pool's, parsed as
/// `init`'s.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct EstimateIndexArgs {
    /// Dedup index of the projected pool, as `condense init --index`: dense (every chunk, its
    /// RAM shown) or sparse (a RAM budget, --index-memory): then the images' writes are
    /// replayed through it, each image as its own import in the order given, to show what
    /// it finds inline and what the pool would store.
    #[arg(long, value_name = "MODE", value_parser = ["dense", "sparse"])]
    pub index: Option<String>,
    /// The sparse index's RAM, as `condense init --index-memory` (default 32M; at least 256K).
    #[arg(long, value_name = "SIZE", value_parser = parse_memory)]
    pub index_memory: Option<u64>,
    /// Project delta compression, as `condense init --delta`: the images' blocks replayed
    /// through the write path's delta search (each image as its own import, in the order
    /// given), showing the payload bytes with and without deltas and the sketch index's RAM.
    /// Fixed chunkings only; not with --index sparse.
    #[arg(long)]
    pub delta: bool,
}

impl EstimateIndexArgs {
    /// The setting to project (dense without --index).
    pub fn setting(&self) -> Result<IndexSetting> {
        setting(self.index.as_deref().unwrap_or("dense"), self.index_memory)
    }
}

/// `condense index`.
#[derive(clap::Subcommand, Debug)]
pub enum IndexCommand {
    /// The pool's dedup index mode, its budget and the RAM it holds.
    Show {
        #[arg(long)]
        json: bool,
    },
    /// Change the pool's dedup index mode (dense or sparse); takes effect at the next open.
    Set {
        #[arg(value_name = "MODE", value_parser = ["dense", "sparse"])]
        mode: String,
        /// The sparse index's RAM (default 32M; at least 256K).
        #[arg(long, value_name = "SIZE", value_parser = parse_memory)]
        memory: Option<u64>,
        #[arg(long)]
        json: bool,
    },
    /// Find the duplicates the sparse index let through (a sort of every chunk's fingerprint
    /// within --memory) and merge each into the oldest copy of its data, then run GC to take
    /// their space back. Safe while VMs run: it works in short steps, pausing between them.
    Merge {
        /// RAM for the sort (default 64M); past it, runs go to a scratch file in the pool's
        /// directory (24 bytes per chunk, sealed).
        #[arg(long, value_name = "SIZE", value_parser = parse_memory)]
        memory: Option<u64>,
        /// Leave the space to the next GC (`condense gc`) instead of running one now.
        #[arg(long)]
        no_gc: bool,
        #[arg(long)]
        json: bool,
    },
}

/// The merge pass's sort budget by default.
pub const MERGE_MEMORY: u64 = 64 << 20;

fn parse_memory(s: &str) -> std::result::Result<u64, String> {
    let bytes = condense_api::size::parse_size(s)?;
    if bytes < MIN_BUDGET {
        return Err(format!(
            "an index memory of {bytes} bytes is too small: the minimum is 256K"
        ));
    }
    Ok(bytes)
}

/// The setting `mode` and `memory` name (sparse without a memory: 32M); an error for
/// --index-memory without sparse.
fn setting(mode: &str, memory: Option<u64>) -> Result<IndexSetting> {
    match (mode, memory) {
        ("sparse", m) => Ok(IndexSetting::Sparse {
            budget: m.unwrap_or(DEFAULT_SPARSE_BUDGET),
        }),
        (_, Some(_)) => Err(ServiceError::Invalid(
            "--index-memory is the sparse index's budget: add --index sparse, or drop it".into(),
        )),
        _ => Ok(IndexSetting::Dense),
    }
}

impl InitIndexArgs {
    /// The settings to store in the new pool, checked before the pool is created.
    pub fn setting(&self) -> Result<InitSettings> {
        let s = setting(self.index.as_deref().unwrap_or("dense"), self.index_memory)?;
        Ok(InitSettings {
            index: self.index.is_some().then_some(s),
            delta: self.delta,
        })
    }
}

/// Store `s` as the pool's setting (a journaled change of its named record).
pub fn store(pool: &Pool, s: IndexSetting) -> Result<()> {
    pool.meta_put(SETTING_KEY, Some(&s.encode()))
        .context("cannot store the dedup index mode")
}

/// [`store`] the setting `init --index` gave, if it gave one, and turn delta compression on
/// for `init --delta` ([`InitIndexArgs::setting`]). A new pool on S3 too: the records reach
/// the bucket with the close's checkpoint, so every later open (a connect from a fresh
/// directory too) has them.
pub fn store_given(pool: &Pool, s: InitSettings) -> Result<()> {
    if let Some(i) = s.index {
        store(pool, i)?;
    }
    if s.delta {
        pool.enable_deltas()
            .context("cannot turn delta compression on")?;
    }
    Ok(())
}

/// `condense index show|set`.
pub fn run(ctx: &mut Ctx, cmd: IndexCommand) -> Result<i32> {
    let (json, new) = match cmd {
        IndexCommand::Show { json } => (json, None),
        IndexCommand::Set { mode, memory, json } => (json, Some(setting(&mode, memory)?)),
        IndexCommand::Merge {
            memory,
            no_gc,
            json,
        } => return merge(ctx, memory.unwrap_or(MERGE_MEMORY), !no_gc, json),
    };
    let pool = ctx.pool(new.is_none())?;
    let stored = pool
        .meta_get(SETTING_KEY)
        .map_or(Ok(IndexSetting::Dense), |v| IndexSetting::decode(&v))?;
    let changed = new.is_some_and(|n| n != stored);
    if let Some(n) = new.filter(|_| changed) {
        store(&pool, n)?;
    }
    let s = pool.index_stats();
    let now = new.unwrap_or(stored);
    let report = IndexReport {
        mode: now.mode(),
        memory_bytes: now.budget(),
        // Not built yet: the first write builds it as the setting says.
        in_effect: if s.dedup_index == "not built" {
            now.mode().to_string()
        } else {
            s.dedup_index_mode.clone()
        },
        ram_bytes: s.dedup_index_bytes,
        changed,
    };
    write_report(ctx.out, &report, json, false).map_err(io("cannot write the output"))?;
    ctx.done(&pool)?;
    Ok(0)
}

/// `condense index merge`: the merge pass, then (with `gc`) a GC of every segment holding dead
/// records.
fn merge(ctx: &mut Ctx, memory: u64, gc: bool, json: bool) -> Result<i32> {
    let pool = ctx.pool(false)?;
    let merged = pool
        .merge_duplicates(memory, &|_, _| {})
        .context("the merge pass failed (the chunks merged so far stay merged; run it again)")?;
    let gc = match gc && merged.merged > 0 {
        true => Some(
            pool.gc(0)
                .context("the merge pass is done, but GC failed")?,
        ),
        false => None,
    };
    let view = MergeView::new(&merged, gc.as_ref());
    write_report(ctx.out, &view, json, false).map_err(io("cannot write the output"))?;
    ctx.done(&pool)?;
    Ok(0)
}

//! `condense estimate IMAGE...`: the options, and printing what the `condense-estimate`
//! library projects (docs/ESTIMATE.md).

use anyhow::Result;
use condense_engine::Compression;
use condense_estimate::Chunking;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct EstimateArgs {
    /// Disk images: raw (read directly, holes skipped) or qcow2, vmdk, vdi, vhdx, vpc (through
    /// qemu-img), read as the guest sees the disk, so different formats of the same guest
    /// deduplicate against each other. Only these files are read: an image that names another
    /// file (a backing file, VMDK extents) is refused unless --allow-backing-file.
    #[arg(required = true)]
    pub images: Vec<PathBuf>,
    // --format applies to every image given.
    #[command(flatten)]
    pub image: crate::image::ImageFileArgs,
    /// Machine-readable output (schema in docs/ESTIMATE.md).
    #[arg(long)]
    pub json: bool,
    /// How to cut images into chunks: fixed:SIZE (a pool's block size, 4K-64K; default
    /// fixed:4K) or cdc:AVG (content-defined, for comparison only). Repeat the option or give a
    /// comma list to compare several in one pass.
    #[arg(long, value_delimiter = ',', value_parser = Chunking::parse)]
    pub chunking: Vec<Chunking>,
    /// Share of unique chunks to compress when measuring compression, e.g. 10%. Default: every
    /// unique chunk with LZ4, 10% with zstd.
    #[arg(long, value_parser = condense_estimate::parse_percent)]
    pub sample: Option<f64>,
    /// Codec of the projected pool, as `condense init --compression`: lz4, zstd, zstd:LEVEL or
    /// none. The other codecs are reported too.
    #[arg(long, default_value = "lz4", value_parser = crate::parse_compression)]
    pub compression: Compression,
    #[command(flatten)]
    pub index: condense_service::index::EstimateIndexArgs,
}

pub fn run(args: &EstimateArgs) -> Result<()> {
    let options = condense_estimate::Options {
        images: args.images.clone(),
        chunking: args.chunking.clone(),
        sample: args.sample,
        compression: args.compression,
        image: args.image.options(),
        index: args.index.setting()?,
        delta: args.index.delta,
    };
    let bar = crate::image::bar(0, "estimating");
    let report = condense_estimate::run(&options, &|done, total| {
        bar.set_length(total);
        bar.set_position(done);
    });
    bar.finish_and_clear();
    match (report?, args.json) {
        (r, true) => println!("{}", serde_json::to_string_pretty(&r)?),
        (r, false) => print!("{}", r.text()),
    }
    Ok(())
}

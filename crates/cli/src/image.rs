//! The command line's side of `condense import` and `condense export`: the options that say
//! how an image file from outside is read (`--format`, `--allow-backing-file`; the checks
//! themselves are `condense_estimate::image`), and [`Bars`], the progress bars and warnings of
//! the pipeline, which is `condense_image`'s.

use anyhow::Result;
use condense_estimate::image::ImageOptions;
use condense_estimate::probe::Format;
use condense_image::Unit;
use condense_service::control::Ctx;
use indicatif::{ProgressBar, ProgressStyle};
use std::cell::RefCell;

/// How `import` and `estimate` read an image file from outside.
#[derive(clap::Args, Debug, Clone)]
pub struct ImageFileArgs {
    /// The image's format: raw, qcow2, vmdk, vdi, vhdx or vpc (VHD). Default: recognized by
    /// its first bytes; a file with no known header is raw. Give it when you know what the file
    /// is, above all for raw disks of VMs: a guest can write what looks like an image header
    /// into the first sector of its own disk, and such a disk is refused unless it is declared
    /// with --format raw.
    #[arg(long, value_name = "FMT", value_parser = Format::parse)]
    pub format: Option<Format>,
    /// Let the image read the other files it names: a qcow2 backing file or external data
    /// file, the extent files of a VMDK descriptor, a VMDK parent. Without it such images are
    /// refused, because whoever made the image chooses those names (/etc/shadow, another VM's
    /// disk) and their content would end up in the volume. Dangerous with any image you did
    /// not make yourself (from a guest, a customer, a download).
    #[arg(long)]
    pub allow_backing_file: bool,
}

impl ImageFileArgs {
    pub fn options(&self) -> ImageOptions {
        ImageOptions {
            format: self.format,
            allow_backing_file: self.allow_backing_file,
        }
    }
}

/// The progress of an import or export as a bar on the terminal (one per step), its warnings
/// on standard error.
#[derive(Default)]
pub struct Bars(RefCell<Option<ProgressBar>>);

impl condense_image::Progress for Bars {
    fn start(&self, what: &str, total: u64, unit: Unit) {
        let b = match unit {
            Unit::Bytes => bar(total, what),
            Unit::HundredthsOfPercent => {
                let b = ProgressBar::new(total);
                b.set_style(
                    ProgressStyle::with_template("{msg} [{bar:40}] {percent}% {elapsed}")
                        .unwrap_or_else(|_| ProgressStyle::default_bar()),
                );
                b.set_message(what.to_string());
                b
            }
        };
        if let Some(old) = self.0.replace(Some(b)) {
            old.finish_and_clear();
        }
    }
    fn set(&self, done: u64) {
        if let Some(b) = &*self.0.borrow() {
            b.set_position(done);
        }
    }
    fn finish(&self) {
        if let Some(b) = self.0.take() {
            b.finish_and_clear();
        }
    }
    fn warn(&self, message: &str) {
        eprintln!("condense: {message}");
    }
}

/// [`Ctx::release_deleted`] with a bar (offline: the release finishes before the command).
pub fn release_deleted(ctx: &Ctx, pool: &condense_engine::Pool) -> Result<&'static str> {
    let style = ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} blocks ETA {eta}");
    let b = ProgressBar::new(0).with_style(style.unwrap_or_else(|_| ProgressStyle::default_bar()));
    let how = ctx.release_deleted(pool, &|left, total| {
        b.set_length(total);
        b.set_position(total - left.min(total));
    })?;
    b.finish_and_clear();
    Ok(how)
}

/// A progress bar on stderr with bytes/s and ETA (hidden when stderr is not a terminal).
pub fn bar(len: u64, what: &str) -> ProgressBar {
    let b = ProgressBar::new(len);
    let style = ProgressStyle::with_template(
        "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .progress_chars("=> ");
    b.set_style(style);
    b.set_message(what.to_string());
    b
}

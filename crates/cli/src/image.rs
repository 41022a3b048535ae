//! Raw disk images in and out: `condense import` and `condense export`.
//!
//! Import reads only the data extents of a sparse file (SEEK_DATA/SEEK_HOLE), on a reader
//! thread that stays ahead of the engine, and writes them in 8 MiB pieces. The new volume is
//! marked as importing until the end, so an interrupted import is visible in `volume list`.
//! Export writes only Data extents into a file of the volume's size, so holes stay holes.

use crate::report::bar;
use crate::size::human;
use anyhow::{bail, Context, Result};
use condense_api::ExtentKind;
use condense_engine::Pool;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::mpsc;
use std::time::Instant;

const PIECE: u64 = 8 << 20;

/// True unless the file starts with the magic of an image format qemu-img converts
/// (qcow2, vmdk, vdi, vhdx, vpc): those go through `qemu-img convert`.
pub fn is_raw(path: &Path) -> Result<bool> {
    let f = File::open(path).with_context(|| format!("cannot open image {}", path.display()))?;
    let mut head = [0u8; 72];
    let n = f.read_at(&mut head, 0).unwrap_or(0);
    let h = &head[..n];
    let vdi = n >= 68 && u32::from_le_bytes([h[64], h[65], h[66], h[67]]) == 0xbeda_107f;
    let known = h.starts_with(b"QFI\xfb")
        || h.starts_with(b"KDMV")
        || h.starts_with(b"# Disk DescriptorFile")
        || h.starts_with(b"vhdxfile")
        || h.starts_with(b"conectix")
        || vdi;
    Ok(!known)
}

/// The image format an output file name asks for.
pub fn format_from_extension(path: &Path) -> String {
    match path
        .extension()
        .and_then(|e| e.to_str())
        .map(|e| e.to_ascii_lowercase())
        .as_deref()
    {
        Some(e @ ("qcow2" | "vmdk" | "vdi" | "vhdx")) => e.to_string(),
        _ => "raw".to_string(),
    }
}

pub fn importing_key(name: &str) -> String {
    format!("cli/importing/{name}")
}

/// The data extents of a file: (offset, length), via SEEK_DATA/SEEK_HOLE.
fn data_extents(f: &File, size: u64) -> Vec<(u64, u64)> {
    let fd = f.as_raw_fd();
    let mut out = Vec::new();
    let mut pos: i64 = 0;
    while (pos as u64) < size {
        // SAFETY: lseek on a descriptor we own.
        let data = unsafe { libc::lseek(fd, pos, libc::SEEK_DATA) };
        if data < 0 {
            break; // ENXIO: no more data
        }
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        let end = if hole < 0 { size as i64 } else { hole };
        out.push((data as u64, (end - data) as u64));
        pos = end;
    }
    if out.is_empty() && size > 0 && pos == 0 {
        // SEEK_DATA unsupported: treat everything as data.
        let probe = unsafe { libc::lseek(fd, 0, libc::SEEK_DATA) };
        if probe < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) {
            out.push((0, size));
        }
    }
    out
}

pub fn import_raw(pool: &Pool, path: &Path, name: &str) -> Result<()> {
    let f = File::open(path).with_context(|| format!("cannot open image {}", path.display()))?;
    let size = f.metadata()?.len();
    let bs = u64::from(pool.block_size());
    if size == 0 {
        bail!("image {} is empty", path.display());
    }
    if size % bs != 0 {
        bail!(
            "image {} is {size} bytes, not a multiple of the pool's block size ({bs}); pad it with `truncate -s %{bs} {}` and retry",
            path.display(),
            path.display()
        );
    }
    let before = pool.stats()?.physical_bytes;
    pool.create_volume(name, size)
        .with_context(|| format!("cannot create volume {name:?}"))?;
    pool.meta_put(&importing_key(name), Some(b"1"))?;
    let extents = data_extents(&f, size);
    let data_total: u64 = extents.iter().map(|e| e.1).sum();
    let started = Instant::now();
    let progress = bar(data_total, &format!("importing {name}"));
    if let Err(e) = copy_extents(pool, &f, name, extents, data_total, &progress) {
        progress.finish_and_clear();
        // Leave nothing half-made behind (a kill -9 cannot get here: then the volume stays,
        // marked as an incomplete import).
        let cleanup = pool
            .delete_volume(name)
            .and_then(|_| pool.meta_put(&importing_key(name), None));
        if let Err(c) = cleanup {
            eprintln!("condense: could not delete the half-imported volume {name:?}: {c}");
        }
        return Err(e.context(format!(
            "import of {} failed; nothing was kept",
            path.display()
        )));
    }
    pool.meta_put(&importing_key(name), None)?;
    pool.flush().context("making the import durable")?;
    progress.finish_and_clear();
    let secs = started.elapsed().as_secs_f64();
    let after = pool.stats()?;
    let added = after.physical_bytes.saturating_sub(before);
    let v = after.volumes.iter().find(|v| v.name == name);
    let written_bytes = v.map_or(0, |v| v.written_bytes);
    println!(
        "imported {} into volume {name}: {} logical, {} of data read, {} non-zero; pool grew by {} ({:.1} % saved on this image); {:.1} s, {:.0} MB/s",
        path.display(),
        human(size),
        human(data_total),
        human(written_bytes),
        human(added),
        if written_bytes > 0 { 100.0 * (1.0 - added as f64 / written_bytes as f64) } else { 0.0 },
        secs,
        data_total as f64 / 1e6 / secs.max(1e-9)
    );
    Ok(())
}

/// Copy the data extents of `f` into volume `name` (reader thread + engine writes).
fn copy_extents(
    pool: &Pool,
    f: &File,
    name: &str,
    extents: Vec<(u64, u64)>,
    data_total: u64,
    progress: &indicatif::ProgressBar,
) -> Result<()> {
    let vol = pool.volume(name)?;
    let bs = u64::from(pool.block_size());

    // Reader thread: fill buffers ahead of the engine; buffers come back for reuse.
    let (full_tx, full_rx) = mpsc::sync_channel::<(u64, Vec<u8>)>(3);
    let (empty_tx, empty_rx) = mpsc::channel::<Vec<u8>>();
    for _ in 0..4 {
        let _ = empty_tx.send(Vec::with_capacity(PIECE as usize));
    }
    let reader_file = f.try_clone()?;
    let reader = std::thread::spawn(move || -> std::io::Result<()> {
        for (start, len) in extents {
            // Align to blocks: a data extent may start or end inside a block.
            let s = start / bs * bs;
            let e = (start + len).div_ceil(bs) * bs;
            let mut pos = s;
            while pos < e {
                let n = PIECE.min(e - pos);
                let Ok(mut buf) = empty_rx.recv() else {
                    return Ok(());
                };
                buf.resize(n as usize, 0);
                reader_file.read_exact_at(&mut buf, pos)?;
                if full_tx.send((pos, buf)).is_err() {
                    return Ok(());
                }
                pos += n;
            }
        }
        Ok(())
    });
    let mut written = 0u64;
    for (pos, buf) in full_rx {
        vol.write_at(pos, &buf, false)
            .with_context(|| format!("writing volume {name:?} at offset {pos}"))?;
        written += buf.len() as u64;
        progress.set_position(written.min(data_total));
        let _ = empty_tx.send(buf);
    }
    match reader.join() {
        Ok(r) => r.with_context(|| "reading the image".to_string())?,
        Err(_) => bail!("the image reader thread failed"),
    }
    Ok(())
}

pub fn export_raw(pool: &Pool, name: &str, path: &Path, force: bool) -> Result<()> {
    let vol = pool
        .volume(name)
        .with_context(|| format!("cannot export volume {name:?}"))?;
    let size = vol.size()?;
    if path.exists() && !force {
        bail!("{} exists; pass --force to overwrite it", path.display());
    }
    let out = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .with_context(|| format!("cannot create {}", path.display()))?;
    out.set_len(size)
        .with_context(|| format!("cannot size {} to {size} bytes", path.display()))?;
    let extents = vol.extents(0, size)?;
    let data_total: u64 = extents
        .iter()
        .filter(|e| e.kind == ExtentKind::Data)
        .map(|e| e.len)
        .sum();
    let progress = bar(data_total, &format!("exporting {name}"));
    let mut buf = Vec::new();
    let mut done = 0u64;
    for e in extents.iter().filter(|e| e.kind == ExtentKind::Data) {
        let mut pos = e.offset;
        while pos < e.offset + e.len {
            let n = PIECE.min(e.offset + e.len - pos);
            buf.resize(n as usize, 0);
            vol.read_at(pos, &mut buf)
                .with_context(|| format!("reading volume {name:?} at offset {pos}"))?;
            out.write_all_at(&buf, pos)
                .with_context(|| format!("writing {} at offset {pos}", path.display()))?;
            pos += n;
            done += n;
            progress.set_position(done);
        }
    }
    out.sync_all()
        .with_context(|| format!("syncing {}", path.display()))?;
    progress.finish_and_clear();
    println!(
        "exported volume {name} to {}: {} logical, {} of data",
        path.display(),
        human(size),
        human(data_total)
    );
    Ok(())
}

//! Raw imports and exports on a pool in a temporary directory: round trips that keep holes,
//! streams that are too long or empty, and failures that keep nothing.

use condense_engine::{InitOptions, OpenOptions, Pool};
use condense_image::{export_raw, import_raw, import_stdin, Error, Silent};
use std::io::Cursor;
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::sync::Arc;

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn pool(dir: &std::path::Path) -> Result<Arc<Pool>, Box<dyn std::error::Error>> {
    let path = dir.join("pool");
    Pool::init_path(&path, &InitOptions::default())?;
    Ok(Pool::open_path(&path, OpenOptions::default())?)
}

/// `path` opened and checked as a raw image, as `condense import` does.
fn checked(
    path: &std::path::Path,
) -> Result<condense_estimate::image::CheckedImage, Box<dyn std::error::Error>> {
    let opts = condense_estimate::image::ImageOptions {
        format: Some(condense_estimate::probe::Format::Raw),
        allow_backing_file: false,
    };
    Ok(condense_estimate::image::open(path, &opts)?)
}

/// 4 MiB with data at the start, in the middle (not block-aligned) and a hole elsewhere.
fn sparse_image(path: &std::path::Path) -> Result<Vec<u8>, Box<dyn std::error::Error>> {
    let mut content = vec![0u8; 4 << 20];
    for (i, b) in content[..100_000].iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    content[2_000_001..2_010_000].fill(0xab);
    let f = std::fs::File::create(path)?;
    f.set_len(content.len() as u64)?;
    f.write_all_at(&content[..100_000], 0)?;
    f.write_all_at(&content[2_000_001..2_010_000], 2_000_001)?;
    Ok(content)
}

#[test]
fn a_raw_image_comes_back_byte_identical_with_its_holes() -> TestResult {
    let dir = tempfile::tempdir()?;
    let pool = pool(dir.path())?;
    let image = dir.path().join("vm.raw");
    let content = sparse_image(&image)?;

    let report = import_raw(&pool, &checked(&image)?, "vm", &Silent)?;
    assert_eq!((report.size, report.volume.as_str()), (4 << 20, "vm"));
    assert!(
        report.read < 1 << 20,
        "only data extents are read: {report:?}"
    );
    assert!(!pool.is_importing("vm"));
    assert!(report.to_string().starts_with("imported "), "{report}");

    let out = dir.path().join("out.raw");
    let exported = export_raw(&pool, "vm", &out, false, &Silent)?;
    assert_eq!(std::fs::read(&out)?, content);
    assert_eq!(exported.size, 4 << 20);
    let meta = std::fs::metadata(&out)?;
    assert!(meta.blocks() * 512 < 1 << 20, "holes stay holes");
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    Ok(())
}

#[test]
fn an_export_never_overwrites_without_force() -> TestResult {
    let dir = tempfile::tempdir()?;
    let pool = pool(dir.path())?;
    let image = dir.path().join("vm.raw");
    let content = sparse_image(&image)?;
    import_raw(&pool, &checked(&image)?, "vm", &Silent)?;
    let out = dir.path().join("out.raw");
    std::fs::write(&out, b"old")?;
    let e = export_raw(&pool, "vm", &out, false, &Silent).err();
    assert!(matches!(e, Some(Error::Exists { .. })), "{e:?}");
    assert_eq!(std::fs::read(&out)?, b"old");
    export_raw(&pool, "vm", &out, true, &Silent)?;
    assert_eq!(std::fs::read(&out)?, content);
    Ok(())
}

#[test]
fn a_stream_imports_skipping_zero_blocks_and_may_end_early() -> TestResult {
    let dir = tempfile::tempdir()?;
    let pool = pool(dir.path())?;
    let mut input = vec![0u8; 3 * 4096];
    input[4096..8192].fill(9);
    input.extend_from_slice(&[5; 100]);
    let report = import_stdin(
        &pool,
        "s",
        1 << 20,
        false,
        Cursor::new(input.clone()),
        &Silent,
    )?;
    assert!(
        report.ended_early && report.read == input.len() as u64,
        "{report:?}"
    );
    assert!(report.to_string().contains("read as zeros"), "{report}");
    let stats = pool.volume_stats("s")?;
    assert_eq!(stats.written_bytes, 2 * 4096, "two non-zero blocks");
    let mut back = vec![0u8; 1 << 20];
    pool.volume("s")?.read_at(0, &mut back)?;
    assert_eq!(&back[..input.len()], &input[..]);
    assert!(back[input.len()..].iter().all(|&b| b == 0));
    Ok(())
}

#[test]
fn a_stream_longer_than_its_size_is_refused_and_nothing_is_kept() -> TestResult {
    let dir = tempfile::tempdir()?;
    let pool = pool(dir.path())?;
    let total = (1 << 20) + 5000;
    let input = Cursor::new(vec![1u8; total]);
    let e = import_stdin(&pool, "long", 1 << 20, false, input, &Silent).err();
    let Some(Error::InputLongerThanSize {
        total: t,
        size,
        fits,
    }) = e
    else {
        panic!("{e:?}");
    };
    assert_eq!((t, size, fits), (total as u64, 1 << 20, (1 << 20) + 8192));
    assert!(pool.volume("long").is_err(), "the volume was deleted");
    Ok(())
}

#[test]
fn an_empty_stream_or_a_bad_size_is_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    let pool = pool(dir.path())?;
    let e = import_stdin(&pool, "e", 1 << 20, false, Cursor::new(vec![]), &Silent).err();
    let text = e.map(|e| error_chain(&e)).unwrap_or_default();
    assert!(
        text.contains(
            "import of standard input failed; nothing was kept: standard input was empty"
        ),
        "{text}"
    );
    assert!(pool.volume("e").is_err());
    let e = import_stdin(&pool, "e", 5000, false, Cursor::new(vec![1; 10]), &Silent).err();
    assert!(matches!(e, Some(Error::SizeNotWholeBlocks { .. })), "{e:?}");
    Ok(())
}

/// The error and its causes as anyhow's `{:#}` shows them.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(&format!(": {c}"));
        cause = c.source();
    }
    text
}

//! The text form of a [`Report`], as `condense estimate` prints it without `--json`: a header
//! line, then per chunking the totals, one line per codec, the dedup index (sparse: what it
//! finds inline), delta compression (`--delta`), the per-image table and (for more than one image) the sharing matrix. Only
//! formats figures the report already holds; the layout is documented in docs/ESTIMATE.md.

use super::figures::{ChunkingFigures, DeltaFigures, Figures, ImageFigures, IndexFigures, Sharing};
use super::Report;
use condense_api::size::human;
use std::fmt::Write as _;

impl Report {
    /// The report as `condense estimate` prints it without `--json`.
    pub fn text(&self) -> String {
        let mut o = header(self);
        for c in &self.chunkings {
            chunking(&mut o, c);
        }
        o
    }
}

/// The first line: what was read, how fast, and the projected codec.
fn header(r: &Report) -> String {
    format!(
        "read {} of data from {} image(s) in {:.1} s ({}/s); projected pool: {} compression\n",
        human(r.read_bytes),
        r.images.len(),
        r.elapsed_seconds,
        human(r.read_bytes_per_second as u64),
        r.compression
    )
}

/// One chunking's section: totals, codecs, projection, image table, sharing matrix.
fn chunking(o: &mut String, c: &ChunkingFigures) {
    let t = &c.total;
    let _ = writeln!(o, "\n== chunking {} ==", c.chunking);
    totals(o, t);
    codecs(o, t);
    projection(o, t);
    index(o, &c.index);
    if let Some(d) = &c.delta {
        delta(o, d);
    }
    image_table(o, &c.images);
    if c.images.len() > 1 {
        sharing_matrix(o, &c.images, &c.sharing);
    }
}

/// Sizes, zeros, non-zero data, unique chunks, dedup saving.
fn totals(o: &mut String, t: &Figures) {
    let rows: Vec<(&str, String)> = vec![
        ("logical size", human(t.logical_bytes)),
        ("allocated (read)", human(t.allocated_bytes)),
        (
            "zero chunks",
            format!("{} ({})", t.zero_chunks, human(t.zero_bytes)),
        ),
        (
            "non-zero data",
            format!("{} in {} chunks", human(t.nonzero_bytes), t.nonzero_chunks),
        ),
        (
            "unique / duplicate chunks",
            format!(
                "{} ({}) / {}",
                t.unique_chunks,
                human(t.unique_bytes),
                t.duplicate_chunks
            ),
        ),
        ("dedup saving", format!("{:.1} %", t.dedup_saving_percent)),
    ];
    for (k, v) in rows {
        let _ = writeln!(o, "  {k:<28} {v}");
    }
}

/// One line per codec: its compression saving and what the pool would hold with it.
fn codecs(o: &mut String, t: &Figures) {
    for cf in &t.codecs {
        let _ = writeln!(
            o,
            "  {:<28} {:.1} % compression -> {} physical, {:.1} % saved{}",
            format!("with {}", cf.codec),
            cf.compression_saving_percent,
            human(cf.projected_physical_bytes),
            cf.projected_saving_percent,
            if cf.sampled_percent < 100.0 {
                format!(" (sampled {:.0} %)", cf.sampled_percent)
            } else {
                String::new()
            }
        );
    }
}

/// The projected pool with the chosen codec: bytes on disk and RAM.
fn projection(o: &mut String, t: &Figures) {
    let _ = writeln!(
        o,
        "  {:<28} {} ({} data + {} metadata), {:.1} % saved",
        "projected physical",
        human(t.projected_physical_bytes),
        human(t.projected_data_bytes),
        human(t.projected_metadata_bytes),
        t.projected_saving_percent
    );
    let _ = writeln!(
        o,
        "  {:<28} {} ({:.1} bytes per unique chunk)",
        "RAM for index and maps",
        human(t.index_ram_bytes),
        t.ram_bytes_per_unique_chunk
    );
}

/// The dedup index: dense's RAM; sparse's RAM and what it would store inline.
fn index(o: &mut String, x: &IndexFigures) {
    if x.mode == "dense" {
        let _ = writeln!(
            o,
            "  {:<28} dense: {} of RAM (sparse: --index sparse)",
            "dedup index",
            human(x.ram_bytes)
        );
        return;
    }
    let _ = writeln!(
        o,
        "  {:<28} sparse, budget {}: {} of RAM (dense: {})",
        "dedup index",
        human(x.budget_bytes),
        human(x.ram_bytes),
        human(x.dense_ram_bytes)
    );
    let _ = writeln!(
        o,
        "  {:<28} {:.1} % of duplicates found, {} missed -> {} physical, {:.1} % saved{}",
        "sparse inline",
        x.inline_dedup_percent,
        x.missed_duplicate_chunks,
        human(x.projected_physical_bytes),
        x.projected_saving_percent,
        if x.hooks_dropped > 0 {
            format!(" ({} hooks dropped for the budget)", x.hooks_dropped)
        } else {
            String::new()
        }
    );
}

/// Delta compression (`--delta`): what it saves, the pool with it, the sketch index's RAM.
fn delta(o: &mut String, d: &DeltaFigures) {
    let _ = writeln!(
        o,
        "  {:<28} {} deltas save {} of {} stored with {} ({:.1} %): {} payload",
        "delta compression",
        d.delta_chunks,
        human(d.saved_bytes),
        human(d.stored_bytes_without),
        d.codec,
        d.delta_saving_percent,
        human(d.stored_bytes)
    );
    let _ = writeln!(
        o,
        "  {:<28} {} physical ({} without deltas), {:.1} % saved",
        "with deltas",
        human(d.projected_physical_bytes),
        human(d.projected_physical_bytes_without),
        d.projected_saving_percent
    );
    let _ = writeln!(
        o,
        "  {:<28} {} ({:.1} bytes per unique chunk; {} with index and maps); {} of {} lookups found a candidate",
        "sketch index RAM",
        human(d.sketch_index_bytes),
        d.sketch_index_bytes_per_unique_chunk,
        human(d.index_ram_bytes),
        d.sketch_hits,
        d.sketch_lookups
    );
}

/// One row per image: sizes, dedup within itself, alone vs in the set.
fn image_table(o: &mut String, images: &[ImageFigures]) {
    let w = images
        .iter()
        .map(|i| i.name.len())
        .max()
        .unwrap_or(5)
        .max(5);
    let _ = writeln!(
        o,
        "\n  {:<w$} {:>10} {:>10} {:>10} {:>10} {:>7} {:>10} {:>7} {:>10}",
        "image", "logical", "allocated", "non-zero", "unique", "dedup", "alone", "saved", "in set"
    );
    for i in images {
        let f = &i.figures;
        let _ = writeln!(
            o,
            "  {:<w$} {:>10} {:>10} {:>10} {:>10} {:>6.1}% {:>10} {:>6.1}% {:>10}",
            i.name,
            human(f.logical_bytes),
            human(f.allocated_bytes),
            human(f.nonzero_bytes),
            human(f.unique_bytes),
            f.dedup_saving_percent,
            human(f.projected_physical_bytes),
            f.projected_saving_percent,
            human(i.shared_physical_bytes)
        );
    }
}

/// Row image × column image: the share of the row's non-zero data found in the column.
fn sharing_matrix(o: &mut String, images: &[ImageFigures], sharing: &Sharing) {
    let _ = writeln!(
        o,
        "\n  sharing: % of the row image's non-zero data also found in the column image (diagonal: within itself)"
    );
    let cw = 7;
    let labels: Vec<String> = images
        .iter()
        .enumerate()
        .map(|(i, img)| format!("[{}] {}", i + 1, img.name))
        .collect();
    let w = labels.iter().map(String::len).max().unwrap_or(0);
    let mut head = format!("  {:<w$}", "");
    for j in 0..images.len() {
        let _ = write!(head, " {:>cw$}", format!("[{}]", j + 1));
    }
    let _ = writeln!(o, "{head}");
    for (a, row) in sharing.percent.iter().enumerate() {
        let mut line = format!("  {:<w$}", labels[a]);
        for p in row {
            let _ = write!(line, " {:>cw$.1}", p);
        }
        let _ = writeln!(o, "{line}");
    }
}

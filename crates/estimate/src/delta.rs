//! `condense estimate --delta`: the images' writes replayed through delta compression
//! (`condense_engine::delta_replay`, the write path's own search), each image as its own
//! import (docs/ESTIMATE.md "Delta compression").
//!
//! Owns: the replay of one fixed chunking, where the current import stored each chunk (its
//! offset in the image, 8 bytes per chunk of the import: bases are read back from the image,
//! as only chunks of the same import can be bases, the sketch index starting empty at each
//! open), and the payload bytes each import stores with and without deltas.
//!
//! Invariants: a piece is one write of the import (`condense import` writes a raw image's
//! data ranges in pieces of 8 MiB, as the estimate reads them); its misses are the analysis's
//! first occurrences, in order, whole blocks only (a partial block at an unaligned disk end
//! is no pool's); each miss is sized alone in the write path's compressor runs
//! (`reduction::compressor_run`, spread: an import is the only write in flight).

use condense_engine::delta_replay::{alone_sizes, DeltaReplay};
use condense_engine::reduction::compressor_run;
use condense_engine::Compression;
use rayon::prelude::*;
use std::collections::HashMap;

/// Reads `buf.len()` bytes of image `image` at `offset` (a base's block), or says why not.
pub type ReadBlock<'a> = dyn FnMut(usize, u64, &mut [u8]) -> Result<(), String> + Send + 'a;

/// The delta replay of one fixed chunking over every image.
pub struct DeltaRun {
    pub replay: DeltaReplay,
    compression: Compression,
    /// The image being imported (a new one opens the pool again).
    image: Option<usize>,
    /// The first chunk id of the current import, and the image offset of each of its chunks.
    first_id: u64,
    offsets: Vec<u64>,
    /// Per image: payload bytes its import stores with deltas, and stored alone.
    pub stored: Vec<(u64, u64)>,
    /// The first base that could not be read back (the estimate fails with it).
    pub read_error: Option<String>,
}

impl DeltaRun {
    /// A run over `images` images into a pool compressing with `compression`.
    pub fn new(images: usize, compression: Compression) -> DeltaRun {
        DeltaRun {
            replay: DeltaReplay::default(),
            compression,
            image: None,
            first_id: 0,
            offsets: Vec::new(),
            stored: vec![(0, 0); images],
            read_error: None,
        }
    }

    /// One write of `image`: `data`, at `offset` of the image, in `bs`-byte blocks; `misses`
    /// the blocks that are new chunks, in order.
    pub fn write(
        &mut self,
        (image, offset): (usize, u64),
        data: &[u8],
        bs: usize,
        misses: &[usize],
        read: &mut ReadBlock<'_>,
    ) {
        if self.image != Some(image) {
            self.replay.reopen();
            self.image = Some(image);
            self.first_id = self.replay.totals().chunks;
            self.offsets.clear();
        }
        let per = compressor_run(misses.len(), rayon::current_num_threads(), true);
        let compression = self.compression;
        let sizes: Vec<usize> = misses
            .par_chunks(per)
            .flat_map_iter(|run| alone_sizes(data, bs, run, compression))
            .collect();
        let alone: HashMap<usize, usize> = misses.iter().copied().zip(sizes).collect();
        let (first_id, offsets, error) = (self.first_id, &self.offsets, &mut self.read_error);
        let stored = self.replay.write(
            data,
            bs,
            misses,
            &|i| alone.get(&i).copied().unwrap_or(bs),
            &mut |id| {
                let at = *offsets.get(usize::try_from(id.checked_sub(first_id)?).ok()?)?;
                let mut block = vec![0u8; bs];
                match read(image, at, &mut block) {
                    Ok(()) => Some(block),
                    Err(e) => {
                        error.get_or_insert(e);
                        None
                    }
                }
            },
        );
        let totals = &mut self.stored[image];
        for s in stored {
            self.offsets.push(offset + (s.block * bs) as u64);
            totals.0 += s.bytes;
            totals.1 += alone.get(&s.block).copied().unwrap_or(bs) as u64;
        }
    }
}

//! A `journal-G.wal` file replayed as an open would (read-only, salvage or writable mode): header, batches, records.
//! See `condense_engine_fuzz::journal` for what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = condense_engine_fuzz::journal(data);
});

//! `dedup.idx`, the dedup index saved at a clean close.
//! See `condense_engine_fuzz::dedup_index` for what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = condense_engine_fuzz::dedup_index(data);
});

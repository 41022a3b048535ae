//! The cache tier's `cache.idx` log, parsed and then opened as a cache.
//! See `condense_engine_fuzz::cache_index` for what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = condense_engine_fuzz::cache_index(data);
});

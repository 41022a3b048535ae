//! The `lease` object of an S3 pool's bucket.
//! See `condense_engine_fuzz::lease` for what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = condense_engine_fuzz::lease(data);
});

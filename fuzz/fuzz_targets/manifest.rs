//! The manifest of a checkpoint root in an S3 pool's bucket, and object names.
//! See `condense_engine_fuzz::manifest` for what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = condense_engine_fuzz::manifest(data);
});

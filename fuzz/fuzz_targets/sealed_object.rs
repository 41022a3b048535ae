//! A hostile sealed object opened with the pool's data key (AES-256-GCM with its context).
//! See `condense_engine_fuzz::sealed_object` for what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = condense_engine_fuzz::sealed_object(data);
});

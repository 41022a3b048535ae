//! The contents of a `--key-file`.
//! See `condense_engine_fuzz::key_file` for what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = condense_engine_fuzz::key_file(data);
});

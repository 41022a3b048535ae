//! A whole NBD connection fed arbitrary client bytes, against an in-memory volume.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = condense_nbd::fuzz::session(data);
});

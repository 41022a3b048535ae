//! The pool's `cache.conf`.
//! See `condense_engine_fuzz::cache_conf` for what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = condense_engine_fuzz::cache_conf(data);
});

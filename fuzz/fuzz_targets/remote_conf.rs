//! An S3 pool's local `remote.conf`.
//! See `condense_engine_fuzz::remote_conf` for what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = condense_engine_fuzz::remote_conf(data);
});

//! The payload of a delta chunk record (its bases and the block compressed against them).
//! See `condense_engine_fuzz::delta_record` for what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = condense_engine_fuzz::delta_record(data);
});

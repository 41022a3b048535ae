//! A `seg-N.dat` file: its header and every chunk record the repair scan finds, read back through the chunk read path.
//! See `condense_engine_fuzz::segment` for what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = condense_engine_fuzz::segment(data);
});

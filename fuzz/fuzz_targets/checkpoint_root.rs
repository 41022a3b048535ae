//! The `checkpoint` file: the root that names every tree, volume and counter (plain or sealed).
//! See `condense_engine_fuzz::checkpoint_root` for what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = condense_engine_fuzz::checkpoint_root(data);
});

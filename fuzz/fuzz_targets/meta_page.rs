//! A stored page of `meta.dat` (block map or chunk table, leaf or interior, plain or sealed) and its pointers, entries and slots.
//! See `condense_engine_fuzz::meta_page` for what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = condense_engine_fuzz::meta_page(data);
});

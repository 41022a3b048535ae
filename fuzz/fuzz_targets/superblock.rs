//! The pool's `superblock` file (plain, or an encrypted pool's with its key section).
//! See `condense_engine_fuzz::superblock` for what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = condense_engine_fuzz::superblock(data);
});

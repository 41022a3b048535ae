//! The first bytes of an image given to `import` or `estimate` (the format probe).
//! See `condense_estimate::fuzz::image_header`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = condense_estimate::fuzz::image_header(data);
});

//! What `qemu-img info` and `qemu-img map` print about an untrusted image, and the ranges
//! `estimate` derives from it. See `condense_estimate::fuzz::qemu_img_json`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = condense_estimate::fuzz::qemu_img_json(data);
});

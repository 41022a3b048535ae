//! The NBD option parser, request header parser and request check, and the extent
//! conversions, on arbitrary bytes (see `condense_nbd::fuzz::parsers` for the properties).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    condense_nbd::fuzz::parsers(data);
});

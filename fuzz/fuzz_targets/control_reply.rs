//! The control socket's reply as the CLI reads it (crates/service/src/control/reply.rs): the
//! line read from whatever listens on `POOL/control.sock`, then decoded into the text the CLI
//! prints and the exit status it returns.
//!
//! The limit is small here (the target's `-max_len` goes past it) so that the reply that never
//! ends is exercised too. Whatever the bytes, the text that comes out has no control character
//! but newline and tab, and the exit status is one a process can have.
#![no_main]

use condense_service::control::reply;

/// The limit of the line read here (the CLI's is `reply::MAX_REPLY`).
const LIMIT: u64 = 4096;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Ok(line) = reply::read(data, LIMIT) else {
        assert!(data.len() as u64 >= LIMIT);
        return;
    };
    assert!(line.len() as u64 <= LIMIT && data.starts_with(&line));
    if let Ok(r) = reply::decode(line) {
        for text in [&r.stdout, &r.stderr] {
            assert!(
                !text.chars().any(|c| c.is_control() && c != '\n' && c != '\t'),
                "{text:?}"
            );
        }
        assert!((0..=255).contains(&r.code), "{}", r.code);
    }
});

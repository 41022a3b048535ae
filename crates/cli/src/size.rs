//! Sizes as people write and read them (shared with the library crates: `condense_api::size`).

pub use condense_api::size::{human, parse_size};

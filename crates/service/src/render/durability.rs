//! `durability show`: what a flush promises in a pool in an object store (docs/S3.md).

use super::Report;
use condense_engine::remote::Durability;
use serde::{Serialize, Serializer};
use std::path::Path;

/// The durability of the pool at `pool` (`None`: a local pool).
pub struct DurabilityReport<'a> {
    pub pool: &'a Path,
    pub durability: Option<Durability>,
}

#[derive(Serialize)]
struct Wire {
    durability: Option<&'static str>,
}

impl Serialize for DurabilityReport<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        Wire {
            durability: self.durability.map(Durability::as_str),
        }
        .serialize(s)
    }
}

impl Report for DurabilityReport<'_> {
    fn text(&self) -> String {
        match self.durability {
            Some(d) => format!("{}: {}\n", d.as_str(), meaning(d)),
            None => format!(
                "{} is a local pool: a flush returns once its own disk has it\n",
                self.pool.display()
            ),
        }
    }
}

/// What a durability means, in an administrator's terms.
pub fn meaning(d: Durability) -> &'static str {
    match d {
        Durability::Remote => "a flush returns once the object store has it; a host lost with its disk loses nothing flushed",
        Durability::Local => "a flush returns once this host's local journal has it; uploads run in the background (at least every 60 s), so a host lost with its disk loses what was written since the last upload",
    }
}

//! `cache stats`, and the cache's part of `stats`.

use super::{human, Report};
use condense_engine::CacheStats;
use serde::{Serialize, Serializer};

/// The cache tier's figures, under the keys `cache stats --json` and `stats --json` share.
pub struct CacheReport<'a>(pub &'a CacheStats);

#[derive(Serialize)]
pub(crate) struct Wire<'a> {
    cache_dir: &'a str,
    cache_mode: &'a str,
    cache_size_bytes: u64,
    cache_used_bytes: u64,
    cache_dirty_bytes: u64,
    cache_hits: u64,
    cache_misses: u64,
    cache_hit_bytes: u64,
    cache_miss_bytes: u64,
    cache_promotions: u64,
    cache_demotions: u64,
    cache_corrupt_entries: u64,
    cache_destaged_segments: u64,
    cache_destaged_bytes: u64,
    cache_meta_hits: u64,
    cache_meta_misses: u64,
}

impl<'a> Wire<'a> {
    pub(crate) fn of(s: &'a CacheStats) -> Wire<'a> {
        Wire {
            cache_dir: &s.dir,
            cache_mode: &s.mode,
            cache_size_bytes: s.size_bytes,
            cache_used_bytes: s.used_bytes,
            cache_dirty_bytes: s.dirty_bytes,
            cache_hits: s.hits,
            cache_misses: s.misses,
            cache_hit_bytes: s.hit_bytes,
            cache_miss_bytes: s.miss_bytes,
            cache_promotions: s.promotions,
            cache_demotions: s.demotions,
            cache_corrupt_entries: s.corrupt,
            cache_destaged_segments: s.destaged_segments,
            cache_destaged_bytes: s.destaged_bytes,
            cache_meta_hits: s.meta_hits,
            cache_meta_misses: s.meta_misses,
        }
    }
}

impl Serialize for CacheReport<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        Wire::of(self.0).serialize(s)
    }
}

impl Report for CacheReport<'_> {
    fn text(&self) -> String {
        let s = self.0;
        let reads = s.hits + s.misses;
        let ratio = if reads > 0 {
            format!("{:.1} %", 100.0 * s.hits as f64 / reads as f64)
        } else {
            "-".into()
        };
        format!(
            "cache\n  dir         {}\n  mode        {}\n  size        {}\n  used        {}\n  dirty       {}\n  \
             hits        {} ({}), hit ratio {ratio}\n  misses      {} ({})\n  promotions  {}\n  \
             demotions   {}\n  corrupt     {} entries detected (dropped, read from the pool)\n  \
             destaged    {} segments ({}) copied to the pool since it was opened\n  \
             metadata    {} page faults served from the cache, {} read from the pool since it was opened\n",
            s.dir,
            s.mode,
            human(s.size_bytes),
            human(s.used_bytes),
            human(s.dirty_bytes),
            s.hits,
            human(s.hit_bytes),
            s.misses,
            human(s.miss_bytes),
            s.promotions,
            s.demotions,
            s.corrupt,
            s.destaged_segments,
            human(s.destaged_bytes),
            s.meta_hits,
            s.meta_misses
        )
    }
}

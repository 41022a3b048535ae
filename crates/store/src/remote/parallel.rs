//! Requests to the store a few at a time ([`in_parallel`]): uploads and downloads of extents,
//! deletions of what no root needs.

/// Uploads and downloads of extents run this many at a time.
const PARALLEL_REQUESTS: usize = 8;

/// `f` on every item, [`PARALLEL_REQUESTS`] at a time (one request each); the results in
/// the items' order.
pub(super) fn in_parallel<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let mut out = Vec::with_capacity(items.len());
    for batch in items.chunks(PARALLEL_REQUESTS) {
        std::thread::scope(|s| {
            let handles: Vec<_> = batch.iter().map(|item| s.spawn(|| f(item))).collect();
            for h in handles {
                match h.join() {
                    Ok(r) => out.push(r),
                    Err(panic) => std::panic::resume_unwind(panic),
                }
            }
        });
    }
    out
}

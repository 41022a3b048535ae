//! How the engine takes a mutex: [`lock`], which ignores poisoning. A thread that panicked
//! while holding a lock leaves state whose consistency the pool's own checks decide (a write
//! that failed half-way poisons the pool through [`crate::error::Error::Poisoned`], not
//! through the mutex), so the next holder goes on instead of panicking in turn.
//!
//! On the ground floor: every module may use it, and it imports nothing of the engine. The
//! order in which the engine's locks are taken (and the peer rule: one pool's state per
//! thread) is the pool core's, written and asserted in condense-engine `pool/mod.rs`.

use std::sync::{Mutex, MutexGuard};

/// Lock `m`, whatever a panicking holder left.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

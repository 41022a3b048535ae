//! This crate's errors: the same kind as `condense-estimate`'s (what failed and where, the
//! cause as `source()`, so `{:#}` in anyhow prints `what: cause`), shared rather than copied.

pub use condense_estimate::error::{Context, Error, Result};

/// Return early with [`Error::Invalid`] and a formatted message.
macro_rules! bail {
    ($($arg:tt)*) => {
        return Err($crate::error::Error::Invalid(format!($($arg)*)))
    };
}
pub(crate) use bail;

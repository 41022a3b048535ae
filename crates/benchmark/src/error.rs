//! This crate's errors. Every error says what failed and where (file, tool, image), and what
//! to do where there is something to do; the underlying cause (an I/O error, a tool's
//! message) is its `source()`, so `{:#}` in anyhow prints `what: cause`.

/// An error of this crate.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An operation failed because of an underlying error (I/O, JSON, another `Error`).
    #[error("{what}")]
    Failed {
        what: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
    /// A condition the input or the environment does not meet, with no underlying error.
    #[error("{0}")]
    Invalid(String),
    /// An I/O error inside a step that its caller describes (e.g. one NBD message of a
    /// handshake that fails as a whole with a [`Error::Failed`] naming it).
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Give an error or a missing value the description of what failed.
pub trait Context<T> {
    fn context(self, what: impl Into<String>) -> Result<T>;
    fn with_context(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T, E: std::error::Error + Send + Sync + 'static> Context<T> for std::result::Result<T, E> {
    fn context(self, what: impl Into<String>) -> Result<T> {
        self.map_err(|e| Error::Failed {
            what: what.into(),
            source: Box::new(e),
        })
    }
    fn with_context(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| Error::Failed {
            what: what(),
            source: Box::new(e),
        })
    }
}

impl<T> Context<T> for Option<T> {
    fn context(self, what: impl Into<String>) -> Result<T> {
        self.ok_or_else(|| Error::Invalid(what.into()))
    }
    fn with_context(self, what: impl FnOnce() -> String) -> Result<T> {
        self.ok_or_else(|| Error::Invalid(what()))
    }
}

/// Return early with [`Error::Invalid`] and a formatted message.
macro_rules! bail {
    ($($arg:tt)*) => {
        return Err($crate::error::Error::Invalid(format!($($arg)*)))
    };
}
pub(crate) use bail;

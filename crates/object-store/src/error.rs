//! The backend's errors: one enum, semantic kinds, each naming the operation, the object and
//! (where a person can act) what to do. Callers match on the kind (`NotFound` is routine for a
//! probe, `Unreachable` is a health state), people read the message.

use std::fmt;

/// What the backend was doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Open,
    Put,
    Get,
    GetRange,
    Head,
    List,
    Delete,
    PutIfAbsent,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::Open => "open",
            Op::Put => "put",
            Op::Get => "get",
            Op::GetRange => "get range of",
            Op::Head => "head",
            Op::List => "list",
            Op::Delete => "delete",
            Op::PutIfAbsent => "put-if-absent",
        })
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No object of that name.
    #[error("{op} {name} in {store}: no such object")]
    NotFound { op: Op, name: String, store: String },

    /// A byte range not wholly inside the object.
    #[error("{op} {name} in {store}: bytes {start}..{end} are past the object's end ({size})")]
    RangePastEnd {
        op: Op,
        name: String,
        store: String,
        start: u64,
        end: u64,
        /// The object's size, if it was learnt.
        size: SizeText,
    },

    /// A name or prefix the backends do not accept.
    #[error("invalid object name {name:?}: {why}")]
    InvalidName { name: String, why: String },

    /// A configuration value that cannot work; `fix` says what to change.
    #[error("invalid object store configuration: {what}: {fix}")]
    Config { what: String, fix: String },

    /// The store did not answer (connection refused, reset, timed out), after retries.
    #[error(
        "{op} {name}: store unreachable at {endpoint} ({detail}): check the endpoint and that \
         the store is running"
    )]
    Unreachable {
        op: Op,
        name: String,
        endpoint: String,
        detail: String,
    },

    /// The store refused the credentials or their permissions.
    #[error(
        "{op} {name} at {endpoint}: access denied ({detail}): check AWS_ACCESS_KEY_ID / \
         AWS_SECRET_ACCESS_KEY and the key's permissions on the bucket"
    )]
    Denied {
        op: Op,
        name: String,
        endpoint: String,
        detail: String,
    },

    /// Any other answer from the store (a 5xx after retries, a missing bucket, ...).
    #[error("{op} {name} at {endpoint} failed: {detail}")]
    Store {
        op: Op,
        name: String,
        endpoint: String,
        detail: String,
    },

    /// A local file system error (LocalBackend).
    #[error("{op} {name} in {dir}: {what}: {source}")]
    Io {
        op: Op,
        name: String,
        dir: String,
        what: &'static str,
        source: std::io::Error,
    },

    /// The backend's own runtime failed (a task panicked, the runtime could not start).
    #[error("{op} {name}: the object store client's runtime failed: {detail}")]
    Runtime {
        op: Op,
        name: String,
        detail: String,
    },
}

/// An optional size shown in a message ("12 bytes" or "size unknown").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SizeText(pub Option<u64>);

impl fmt::Display for SizeText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(n) => write!(f, "{n} bytes"),
            None => f.write_str("size unknown"),
        }
    }
}

impl Error {
    /// Whether this is [`Error::NotFound`].
    pub fn is_not_found(&self) -> bool {
        matches!(self, Error::NotFound { .. })
    }
}

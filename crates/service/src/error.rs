//! The crate's error type: what failed, by kind, each carrying the words an administrator reads.
//!
//! Owns: [`ServiceError`], [`Result`], and [`Context`], which names the step that failed over
//! another error (as `cannot open pool DIR` over the engine's reason).
//!
//! Invariant: an error's `Display` is its own message only; the reason under it is its
//! `source()`, so the CLI prints the whole chain joined by ": " (crates/cli, `error_text`) and
//! [`chain`] does the same here. The messages say what failed, where and what to do.

use std::error::Error as StdError;

/// An error of the daemon, the control socket, or a report.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// The pool engine failed; its message says what and where.
    #[error(transparent)]
    Engine(#[from] condense_engine::Error),
    /// A file, socket, thread or terminal call failed: `what` names the call and its path.
    #[error("{what}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// A bad option, config file, key file or passphrase: the message says what to change.
    #[error("{0}")]
    Invalid(String),
    /// The control socket: a daemon that cannot be trusted, or whose reply makes no sense.
    #[error("{0}")]
    Control(String),
    /// A step failed because of the error under it (another library's, or this crate's own):
    /// `what` names the step.
    #[error("{what}")]
    Context {
        what: String,
        #[source]
        source: Box<dyn StdError + Send + Sync + 'static>,
    },
}

/// A result of this crate.
pub type Result<T> = std::result::Result<T, ServiceError>;

impl ServiceError {
    /// The engine error at the bottom of this one, if it is one (under any steps named over it).
    pub fn engine(&self) -> Option<&condense_engine::Error> {
        match self {
            ServiceError::Engine(e) => Some(e),
            ServiceError::Context { source, .. } => {
                source.downcast_ref::<condense_engine::Error>().or_else(|| {
                    source
                        .downcast_ref::<ServiceError>()
                        .and_then(ServiceError::engine)
                })
            }
            _ => None,
        }
    }
}

/// `e` and its causes joined by ": ", as the CLI shows them (`condense: error: ...`).
pub fn chain(e: &(dyn StdError + 'static)) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text = format!("{text}: {c}");
        cause = c.source();
    }
    text
}

/// Name the step that failed over an error: `r.context("cannot start the server runtime")`.
pub trait Context<T> {
    /// The error, if any, under `what`.
    fn context(self, what: impl Into<String>) -> Result<T>;
    /// The error, if any, under what `what()` says (built only on failure).
    fn with_context<S: Into<String>>(self, what: impl FnOnce() -> S) -> Result<T>;
}

impl<T, E: StdError + Send + Sync + 'static> Context<T> for std::result::Result<T, E> {
    fn context(self, what: impl Into<String>) -> Result<T> {
        self.map_err(|source| ServiceError::Context {
            what: what.into(),
            source: Box::new(source),
        })
    }

    fn with_context<S: Into<String>>(self, what: impl FnOnce() -> S) -> Result<T> {
        self.map_err(|source| ServiceError::Context {
            what: what().into(),
            source: Box::new(source),
        })
    }
}

/// An I/O error under what failed: `.map_err(io("cannot read the config file F"))`.
pub fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ServiceError {
    let what = what.into();
    move |source| ServiceError::Io { what, source }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chain_is_each_message_once_joined_by_colons() {
        let inner: Result<()> = Err(std::io::Error::other("disk full")).map_err(io("writing x"));
        let e = inner.context("cannot save").err();
        let e = e.as_ref().map(|e| chain(e));
        assert_eq!(e.as_deref(), Some("cannot save: writing x: disk full"));
    }

    #[test]
    fn the_engine_error_is_found_under_steps() {
        let e: Result<()> = Err(ServiceError::from(condense_engine::Error::Locked(
            "held".into(),
        )));
        let e = e.context("cannot open pool p").err();
        assert!(matches!(
            e.as_ref().and_then(ServiceError::engine),
            Some(condense_engine::Error::Locked(_))
        ));
    }
}

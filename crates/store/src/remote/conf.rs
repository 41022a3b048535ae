//! How to reach the store `remote.conf` names ([`backend`]: the pool's URL, the
//! endpoint, the region, the credentials file), and the errors of the store. The bytes of
//! `remote.conf` are encoded in [`condense_format::remote`].
//!
//! Invariants:
//! - Credentials never come from a command line: an endpoint or pool URL with a user name or
//!   password is refused without showing it ([`check_endpoint`], [`parse_s3_url`]); a
//!   credentials file is read only if its owner alone can access it ([`crate::secret_file`]).
//! - `remote.conf` holds no secret.
//! - A request the store did not answer is a [`StoreUnavailable`]: it changed nothing, and
//!   the caller may retry it.

use crate::io::StoreUnavailable;
use condense_format::error::{Error, Result};
pub use condense_format::remote::{RemoteConf, REMOTE_CONF_NAME};
use condense_object_store::ObjectBackend;
use std::collections::HashMap;
use std::io;
use std::path::Path;
use std::sync::Arc;

/// Connect to the store `conf` names; `writer`: this open may write the bucket (a read-only
/// open writes nothing, not even the conditional-put probe).
pub fn backend(conf: &RemoteConf, writer: bool) -> Result<Arc<dyn ObjectBackend>> {
    if let Some(path) = conf.url.strip_prefix("file://") {
        return condense_object_store::LocalBackend::open(path)
            .map(|b| Arc::new(b) as Arc<dyn ObjectBackend>)
            .map_err(|e| remote_error(&conf.url, e));
    }
    let (bucket, prefix) = parse_s3_url(&conf.url)?;
    let vars = match &conf.credentials {
        Some(f) => read_credentials(f)?,
        None => HashMap::new(),
    };
    let var = |k: &str| {
        vars.get(k)
            .cloned()
            .or_else(|| std::env::var(k).ok())
            .filter(|v| !v.is_empty())
    };
    let required = |k: &str| {
        var(k).ok_or_else(|| {
            Error::Invalid(format!(
                "{k} is not set: export AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or give \
                 --credentials FILE (lines of KEY=VALUE); never put them on the command line"
            ))
        })
    };
    let endpoint = match &conf.endpoint {
        Some(e) => Some(e.clone()),
        None => var("AWS_ENDPOINT_URL"),
    };
    if let Some(e) = &endpoint {
        check_endpoint(e).map_err(|e| match (e, &conf.endpoint) {
            (Error::Invalid(m), None) => Error::Invalid(format!("$AWS_ENDPOINT_URL: {m}")),
            (e, _) => e,
        })?;
    }
    let config = condense_object_store::S3Config {
        bucket,
        prefix,
        endpoint,
        region: conf
            .region
            .clone()
            .or_else(|| var("AWS_REGION"))
            .unwrap_or_else(|| "us-east-1".into()),
        access_key_id: required("AWS_ACCESS_KEY_ID")?,
        secret_access_key: required("AWS_SECRET_ACCESS_KEY")?,
        allow_http: var("AWS_ALLOW_HTTP")
            .is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1"),
        timeouts: Default::default(),
        probe_conditional_put: writer && !conf.read_only,
    };
    condense_object_store::S3Backend::open(&config)
        .map(|b| Arc::new(b) as Arc<dyn ObjectBackend>)
        .map_err(|e| remote_error(&conf.url, e))
}

/// True if `spec` names a pool in an object store (`s3://...`, or `file://...` for tests).
pub fn is_remote_url(spec: &str) -> bool {
    spec.starts_with("s3://") || spec.starts_with("file://")
}

/// `s3://BUCKET[/PREFIX]` → (bucket, prefix).
pub fn parse_s3_url(url: &str) -> Result<(String, String)> {
    let rest = url.strip_prefix("s3://").ok_or_else(|| {
        Error::Invalid(format!("{url:?} is not an S3 URL: give s3://BUCKET/PREFIX"))
    })?;
    if url.contains(['?', '#']) {
        return Err(Error::Invalid(format!(
            "{} has a query or fragment in it (not shown: it may hold a secret): give \
             s3://BUCKET/PREFIX, and the credentials with --credentials FILE or in the \
             environment, never on the command line",
            condense_object_store::redacted(url)
        )));
    }
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    if let Some(shown) = without_userinfo(url).filter(|_| bucket.contains('@')) {
        return Err(Error::Invalid(format!(
            "{shown} has a user name or password in it: give s3://BUCKET/PREFIX, and the \
             credentials with --credentials FILE or in the environment, never on the command line"
        )));
    }
    if bucket.is_empty() {
        return Err(Error::Invalid(format!(
            "{url:?} names no bucket: give s3://BUCKET/PREFIX"
        )));
    }
    Ok((bucket.to_string(), prefix.trim_end_matches('/').to_string()))
}

/// `url` with everything between its scheme and its last `@` (a user name, a password)
/// replaced by `***`; `None` if it has no `@`.
fn without_userinfo(url: &str) -> Option<String> {
    let at = url.rfind('@')?;
    let start = url
        .find("://")
        .map(|i| i + 3)
        .filter(|&s| s <= at)
        .unwrap_or(0);
    Some(format!("{}***{}", &url[..start], &url[at..]))
}

/// Refuse an S3 endpoint URL that carries credentials (`https://USER:PASSWORD@HOST`) or a
/// query (`?X-Amz-Credential=...&password=...`): they would sit in the process list, the shell
/// history and `remote.conf`. The error shows the URL without them.
pub fn check_endpoint(endpoint: &str) -> Result<()> {
    if endpoint.contains(['?', '#']) {
        return Err(Error::Invalid(format!(
            "the S3 endpoint {} has a query or fragment in it (not shown: it may hold a \
             secret): give the endpoint as http(s)://HOST[:PORT], and the credentials with \
             --credentials FILE (lines AWS_ACCESS_KEY_ID=... and AWS_SECRET_ACCESS_KEY=..., \
             mode 0600) or in the environment, never on the command line",
            condense_object_store::redacted(endpoint)
        )));
    }
    match without_userinfo(endpoint) {
        None => Ok(()),
        Some(shown) => Err(Error::Invalid(format!(
            "the S3 endpoint {shown} has a user name or password in it: give the endpoint as \
             http(s)://HOST[:PORT], and the credentials with --credentials FILE (lines \
             AWS_ACCESS_KEY_ID=... and AWS_SECRET_ACCESS_KEY=..., mode 0600) or in the \
             environment, never on the command line"
        ))),
    }
}

/// `KEY=VALUE` lines (`export ` and quotes allowed, `#` comments), as `credentials.env` files
/// are written. The file must be its owner's only ([`crate::secret_file`]).
fn read_credentials(path: &Path) -> Result<HashMap<String, String>> {
    const WHAT: &str = "credentials file";
    let bytes = crate::secret_file::read(path, WHAT)?;
    let text = std::str::from_utf8(&bytes)
        .map_err(|_| Error::Invalid(format!("{WHAT} {} is not UTF-8 text", path.display())))?;
    let mut vars = HashMap::new();
    for line in text.lines() {
        let line = line.trim();
        let line = line.strip_prefix("export ").unwrap_or(line);
        if line.starts_with('#') {
            continue;
        }
        if let Some((k, v)) = line.split_once('=') {
            let v = v.trim().trim_matches('"').trim_matches('\'');
            vars.insert(k.trim().to_string(), v.to_string());
        }
    }
    Ok(vars)
}

pub(super) fn remote_error(store: &str, e: condense_object_store::Error) -> Error {
    Error::io(
        format!("object store {store}"),
        io::Error::other(e.to_string()),
    )
}

pub(super) fn to_io(e: condense_object_store::Error) -> io::Error {
    if e.is_not_found() {
        return io::Error::new(io::ErrorKind::NotFound, e.to_string());
    }
    io::Error::other(StoreUnavailable(e.to_string()))
}

//! [`S3Backend`]: objects in an S3-compatible bucket (AWS S3, Ceph RGW, MinIO, Garage, R2)
//! through `object_store`'s `AmazonS3`, path-style requests.
//!
//! The engine is synchronous; `object_store` is async. The backend owns a small tokio runtime
//! (2 worker threads) and every call spawns its request there and waits on a channel, so it
//! works from any thread — including a thread of another tokio runtime, where `block_on`
//! would panic.
//!
//! Faults are bounded (tests/s3/README.md measured the defaults hanging 180 s on a frozen
//! store): each attempt has a request timeout ([`Timeouts::request`], default 10 s) and a
//! connect timeout (5 s); retries back off from 100 ms up to 5 s and stop starting after
//! [`Timeouts::retry_total`] (30 s). So a call fails within about `retry_total + request`
//! (40 s) with [`Error::Unreachable`] naming the endpoint. The endpoint is validated with the
//! `url` crate before the client is built (an invalid URI otherwise panics inside signing).
//!
//! `put_if_absent`: at open the backend writes a scratch object `PREFIX/.probe-NONCE` twice
//! with `PutMode::Create`. If the second write is refused, the store honours
//! `If-None-Match: *` and every `put_if_absent` is a real conditional put. If it succeeds
//! (Garage 2.5.0 ignores the header and overwrites), `put_if_absent` falls back to a
//! best-effort check: HEAD the name (present → `false`); else PUT it with a nonce in the
//! object's metadata (`x-amz-meta-condense-nonce`), wait 500 ms plus the PUT's own time, read
//! the metadata back: our nonce → `true`, another → `false`. This refuses a caller that comes
//! after another's object is visible, but two callers within one PUT round trip of each other
//! can both see "absent", and the later PUT overwrites the earlier's bytes (the earlier then
//! reads back a foreign nonce and returns `false`; only the last writer wins). The pool lease
//! is built on that (docs/S3.md "Lease").

use crate::error::{Error, Op, Result, SizeText};
use crate::{under, validate_name, validate_prefix, BackendStats, Counters, ObjectBackend};
use futures_util::TryStreamExt;
use object_store::aws::{AmazonS3Builder, S3ConditionalPut};
use object_store::client::{HttpError, HttpErrorKind};
use object_store::path::Path;
use object_store::{
    Attribute, AttributeValue, Attributes, BackoffConfig, ClientOptions, GetOptions, GetRange,
    ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, RetryConfig,
};
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The metadata key that carries a best-effort `put_if_absent`'s nonce.
const NONCE_KEY: &str = "condense-nonce";

/// How long a best-effort `put_if_absent` waits, beyond its PUT's own time, before it reads
/// the object back.
const SETTLE: Duration = Duration::from_millis(500);

/// Timeouts and retries of every request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    /// One attempt, from sending to the end of the body (size it to the largest object:
    /// 64 MiB at 10 MB/s is 6.4 s).
    pub request: Duration,
    /// Establishing a connection.
    pub connect: Duration,
    /// No retry starts after this long since the first attempt.
    pub retry_total: Duration,
    /// At most this many retries.
    pub max_retries: usize,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            request: Duration::from_secs(10),
            connect: Duration::from_secs(5),
            retry_total: Duration::from_secs(30),
            max_retries: 10,
        }
    }
}

/// Where and how to reach a bucket. The secret is never printed (`Debug` redacts it).
#[derive(Clone)]
pub struct S3Config {
    pub bucket: String,
    /// Every object's name is `PREFIX/NAME` (empty: names at the bucket's root).
    pub prefix: String,
    /// `http(s)://host[:port]`; `None` for AWS S3 (the region picks the endpoint).
    pub endpoint: Option<String>,
    pub region: String,
    pub access_key_id: String,
    pub secret_access_key: String,
    /// Allow an `http://` endpoint (test clusters, a store on localhost).
    pub allow_http: bool,
    pub timeouts: Timeouts,
    /// Probe at open whether the store honours conditional PUT (writes a scratch object).
    /// Off for a read-only user of the bucket: `put_if_absent` is then taken as best effort.
    pub probe_conditional_put: bool,
}

impl fmt::Debug for S3Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Config")
            .field("bucket", &self.bucket)
            .field("prefix", &self.prefix)
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"<redacted>")
            .field("allow_http", &self.allow_http)
            .field("timeouts", &self.timeouts)
            .finish()
    }
}

impl S3Config {
    /// The configuration from the environment: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`
    /// (required), `AWS_ENDPOINT_URL` (optional), `AWS_REGION` (default `us-east-1`),
    /// `AWS_ALLOW_HTTP` (`true`/`1` to allow `http://`).
    pub fn from_env(bucket: &str, prefix: &str) -> Result<S3Config> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let required = |k: &str| {
            var(k).ok_or_else(|| Error::Config {
                what: format!("{k} is not set"),
                fix: "export AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (never on the \
                      command line)"
                    .into(),
            })
        };
        Ok(S3Config {
            bucket: bucket.to_string(),
            prefix: prefix.to_string(),
            endpoint: var("AWS_ENDPOINT_URL"),
            region: var("AWS_REGION").unwrap_or_else(|| "us-east-1".into()),
            access_key_id: required("AWS_ACCESS_KEY_ID")?,
            secret_access_key: required("AWS_SECRET_ACCESS_KEY")?,
            allow_http: var("AWS_ALLOW_HTTP")
                .is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1"),
            timeouts: Timeouts::default(),
            probe_conditional_put: true,
        })
    }

    /// `s3://bucket/prefix`
    pub fn url(&self) -> String {
        if self.prefix.is_empty() {
            format!("s3://{}", self.bucket)
        } else {
            format!("s3://{}/{}", self.bucket, self.prefix)
        }
    }

    /// The endpoint as `scheme://host[:port]`, checked (no panic later inside signing). Its
    /// errors show it without what may be a secret ([`redacted`]).
    fn checked_endpoint(&self) -> Result<Option<String>> {
        let Some(raw) = &self.endpoint else {
            return Ok(None);
        };
        let shown = redacted(raw);
        let bad = |why: String| Error::Config {
            what: format!("endpoint {shown:?} {why}"),
            fix: "give it as http(s)://HOST[:PORT], e.g. http://127.0.0.1:3900 (AWS_ENDPOINT_URL \
                  or --endpoint)"
                .into(),
        };
        let url = url::Url::parse(raw).map_err(|e| bad(format!("is not a URL ({e})")))?;
        let host = match url.host_str() {
            Some(h) if !h.is_empty() => h,
            _ => return Err(bad("has no host".into())),
        };
        match url.scheme() {
            "https" => {}
            "http" if self.allow_http => {}
            "http" => {
                return Err(Error::Config {
                    what: format!("endpoint {raw:?} is plain http"),
                    fix: "set AWS_ALLOW_HTTP=true to allow an unencrypted endpoint, or use https"
                        .into(),
                })
            }
            s => return Err(bad(format!("has scheme {s:?}, not http or https"))),
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(bad("carries credentials (use the AWS_* variables)".into()));
        }
        if url.path() != "/" || url.query().is_some() || url.fragment().is_some() {
            return Err(bad("has a path or query (the bucket is given apart)".into()));
        }
        Ok(Some(match url.port() {
            Some(p) => format!("{}://{host}:{p}", url.scheme()),
            None => format!("{}://{host}", url.scheme()),
        }))
    }

    fn validate(&self) -> Result<()> {
        let bad = |what: String, fix: &str| Error::Config {
            what,
            fix: fix.into(),
        };
        let b = &self.bucket;
        if b.len() < 3
            || b.len() > 63
            || !b
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
        {
            return Err(bad(
                format!("bucket name {b:?}"),
                "S3 bucket names are 3-63 characters of a-z 0-9 . -",
            ));
        }
        validate_prefix(&self.prefix)?;
        if self.region.is_empty() {
            return Err(bad("empty region".into(), "set AWS_REGION or --region"));
        }
        if self.timeouts.request.is_zero() || self.timeouts.connect.is_zero() {
            return Err(bad("a zero timeout".into(), "give timeouts above zero"));
        }
        Ok(())
    }
}

/// A bucket (and prefix) of an S3-compatible store. See the module docs.
pub struct S3Backend {
    store: Arc<dyn ObjectStore>,
    /// `Some` until dropped (a runtime is shut down in the background, never dropped inside
    /// another runtime's thread).
    rt: Option<tokio::runtime::Runtime>,
    prefix: String,
    url: String,
    endpoint: String,
    conditional: bool,
    stats: Arc<Counters>,
}

impl fmt::Debug for S3Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Backend")
            .field("url", &self.url)
            .field("endpoint", &self.endpoint)
            .field("conditional_put_honoured", &self.conditional)
            .finish()
    }
}

impl S3Backend {
    /// Check the configuration, build the client, and probe the store (which also checks that
    /// the bucket is reachable and writable with these credentials).
    pub fn open(config: &S3Config) -> Result<S3Backend> {
        config.validate()?;
        let endpoint = config.checked_endpoint()?;
        let t = config.timeouts;
        let options = ClientOptions::new()
            .with_timeout(t.request)
            .with_connect_timeout(t.connect)
            .with_allow_http(config.allow_http);
        let retry = RetryConfig {
            backoff: BackoffConfig {
                init_backoff: Duration::from_millis(100),
                max_backoff: Duration::from_secs(5),
                base: 2.0,
            },
            max_retries: t.max_retries,
            retry_timeout: t.retry_total,
        };
        let mut builder = AmazonS3Builder::new()
            .with_bucket_name(&config.bucket)
            .with_region(&config.region)
            .with_access_key_id(&config.access_key_id)
            .with_secret_access_key(&config.secret_access_key)
            .with_allow_http(config.allow_http)
            .with_virtual_hosted_style_request(false)
            .with_conditional_put(S3ConditionalPut::ETagMatch)
            .with_client_options(options)
            .with_retry(retry);
        if let Some(e) = &endpoint {
            builder = builder.with_endpoint(e);
        }
        let shown_endpoint = endpoint
            .clone()
            .unwrap_or_else(|| format!("AWS S3 ({})", config.region));
        let store = builder.build().map_err(|e| Error::Config {
            what: format!("building the S3 client for {}: {e}", config.url()),
            fix: "check the bucket, region and endpoint".into(),
        })?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("condense-s3")
            .enable_all()
            .build()
            .map_err(|e| Error::Runtime {
                op: Op::Open,
                name: config.url(),
                detail: e.to_string(),
            })?;
        let mut backend = S3Backend {
            store: Arc::new(store),
            rt: Some(rt),
            prefix: config.prefix.clone(),
            url: config.url(),
            endpoint: shown_endpoint,
            conditional: false,
            stats: Arc::new(Counters::default()),
        };
        if config.probe_conditional_put {
            backend.conditional = backend.probe_conditional_put()?;
        }
        Ok(backend)
    }

    /// Two `PutMode::Create` of one scratch object: does the second fail? (See module docs.)
    fn probe_conditional_put(&self) -> Result<bool> {
        let name = format!(".probe-{}", crate::nonce());
        let path = self.path_unchecked(&name);
        let first = self.create(Op::Open, &name, &path, b"probe 1".to_vec())?;
        let second = self.create(Op::Open, &name, &path, b"probe 2".to_vec());
        let store = self.store.clone();
        let p = path.clone();
        self.stats.delete();
        // Best effort: a leftover probe is never listed (its name starts with '.').
        let _ = self.run(Op::Delete, &name, async move { store.delete(&p).await });
        match (first, second?) {
            (true, false) => Ok(true),
            (true, true) => Ok(false),
            (false, _) => Err(Error::Store {
                op: Op::Open,
                name: name.clone(),
                endpoint: self.endpoint.clone(),
                detail: "a fresh probe object was reported as existing".into(),
            }),
        }
    }

    /// A `PutMode::Create`: `Ok(true)` created, `Ok(false)` the store refused (exists).
    fn create(&self, op: Op, name: &str, path: &Path, bytes: Vec<u8>) -> Result<bool> {
        let store = self.store.clone();
        let p = path.clone();
        let n = bytes.len();
        let opts = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        self.stats.put(n);
        let r = self.run(op, name, async move {
            store.put_opts(&p, PutPayload::from(bytes), opts).await
        })?;
        match r {
            Ok(_) => Ok(true),
            Err(object_store::Error::AlreadyExists { .. })
            | Err(object_store::Error::Precondition { .. }) => Ok(false),
            Err(e) => Err(self.error(op, name, e)),
        }
    }

    /// The object's key: `PREFIX/NAME`.
    fn path(&self, name: &str) -> Result<Path> {
        validate_name(name)?;
        Ok(self.path_unchecked(name))
    }

    fn path_unchecked(&self, name: &str) -> Path {
        if self.prefix.is_empty() {
            Path::from_iter(name.split('/'))
        } else {
            Path::from_iter(self.prefix.split('/').chain(name.split('/')))
        }
    }

    /// Run `fut` on the backend's runtime and wait for it, from any thread.
    fn run<T: Send + 'static>(
        &self,
        op: Op,
        name: &str,
        fut: impl Future<Output = T> + Send + 'static,
    ) -> Result<T> {
        let runtime_error = |detail: &str| Error::Runtime {
            op,
            name: name.to_string(),
            detail: detail.to_string(),
        };
        let rt = self.rt.as_ref().ok_or_else(|| runtime_error("shut down"))?;
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        rt.spawn(async move {
            let _ = tx.send(fut.await);
        });
        rx.recv()
            .map_err(|_| runtime_error("the request's task ended without an answer"))
    }

    /// An `object_store` error as ours: unreachable, denied, not found, or the store's words.
    fn error(&self, op: Op, name: &str, e: object_store::Error) -> Error {
        let name = name.to_string();
        let endpoint = self.endpoint.clone();
        match e {
            object_store::Error::NotFound { .. } => Error::NotFound {
                op,
                name,
                store: self.url.clone(),
            },
            object_store::Error::PermissionDenied { source, .. }
            | object_store::Error::Unauthenticated { source, .. } => Error::Denied {
                op,
                name,
                endpoint,
                detail: source.to_string(),
            },
            e => {
                let detail = e.to_string();
                if unreachable(&e) {
                    Error::Unreachable {
                        op,
                        name,
                        endpoint,
                        detail,
                    }
                } else {
                    Error::Store {
                        op,
                        name,
                        endpoint,
                        detail,
                    }
                }
            }
        }
    }

    fn past_end(&self, name: &str, start: u64, len: u64, size: Option<u64>) -> Error {
        Error::RangePastEnd {
            op: Op::GetRange,
            name: name.to_string(),
            store: self.url.clone(),
            start,
            end: start.saturating_add(len),
            size: SizeText(size),
        }
    }

    /// HEAD with the object's metadata (for the nonce), or `None`.
    fn head_attributes(&self, op: Op, name: &str, path: &Path) -> Result<Option<Attributes>> {
        let store = self.store.clone();
        let p = path.clone();
        self.stats.head();
        let r = self.run(op, name, async move {
            let opts = GetOptions {
                head: true,
                ..Default::default()
            };
            store.get_opts(&p, opts).await.map(|r| r.attributes)
        })?;
        match r {
            Ok(a) => Ok(Some(a)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.error(op, name, e)),
        }
    }

    /// The best-effort `put_if_absent` of a store that ignores `If-None-Match` (module docs).
    fn put_if_absent_best_effort(&self, name: &str, path: &Path, bytes: &[u8]) -> Result<bool> {
        let op = Op::PutIfAbsent;
        if self.head_attributes(op, name, path)?.is_some() {
            return Ok(false);
        }
        let nonce = crate::nonce();
        let mut attributes = Attributes::new();
        attributes.insert(
            Attribute::Metadata(NONCE_KEY.into()),
            AttributeValue::from(nonce.clone()),
        );
        let opts = PutOptions {
            attributes,
            ..Default::default()
        };
        let store = self.store.clone();
        let p = path.clone();
        let payload = PutPayload::from(bytes.to_vec());
        self.stats.put(bytes.len());
        let began = Instant::now();
        self.run(
            op,
            name,
            async move { store.put_opts(&p, payload, opts).await },
        )?
        .map_err(|e| self.error(op, name, e))?;
        std::thread::sleep(SETTLE + began.elapsed());
        let Some(attributes) = self.head_attributes(op, name, path)? else {
            return Ok(false); // deleted meanwhile: not ours to claim
        };
        let theirs = attributes.get(&Attribute::Metadata(NONCE_KEY.into()));
        Ok(theirs.is_some_and(|v| v.as_ref() == nonce.as_str()))
    }
}

/// Whether the error chain holds a connection failure or a timeout.
fn unreachable(e: &object_store::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if let Some(h) = s.downcast_ref::<HttpError>() {
            return matches!(
                h.kind(),
                HttpErrorKind::Connect
                    | HttpErrorKind::Timeout
                    | HttpErrorKind::Request
                    | HttpErrorKind::Interrupted
            );
        }
        source = s.source();
    }
    false
}

impl Drop for S3Backend {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

impl ObjectBackend for S3Backend {
    fn put(&self, name: &str, bytes: &[u8]) -> Result<()> {
        let path = self.path(name)?;
        let store = self.store.clone();
        let payload = PutPayload::from(bytes.to_vec());
        self.stats.put(bytes.len());
        self.run(
            Op::Put,
            name,
            async move { store.put(&path, payload).await },
        )?
        .map_err(|e| self.error(Op::Put, name, e))?;
        Ok(())
    }

    fn get(&self, name: &str) -> Result<Vec<u8>> {
        let path = self.path(name)?;
        let store = self.store.clone();
        let bytes = self
            .run(Op::Get, name, async move {
                store.get(&path).await?.bytes().await
            })?
            .map_err(|e| self.error(Op::Get, name, e))?;
        self.stats.get(bytes.len());
        Ok(Vec::from(bytes))
    }

    fn get_range(&self, name: &str, start: u64, len: u64) -> Result<Vec<u8>> {
        let path = self.path(name)?;
        let Some(end) = start.checked_add(len) else {
            return Err(self.past_end(name, start, len, None));
        };
        if len == 0 {
            // No request can ask for zero bytes; the range is valid if it starts inside.
            return match self.head(name)? {
                Some(size) if start <= size => Ok(Vec::new()),
                Some(size) => Err(self.past_end(name, start, len, Some(size))),
                None => Err(Error::NotFound {
                    op: Op::GetRange,
                    name: name.to_string(),
                    store: self.url.clone(),
                }),
            };
        }
        let store = self.store.clone();
        let p = path.clone();
        let r = self.run(Op::GetRange, name, async move {
            let opts = GetOptions {
                range: Some(GetRange::Bounded(start..end)),
                ..Default::default()
            };
            store.get_opts(&p, opts).await?.bytes().await
        })?;
        self.stats.get(r.as_ref().map_or(0, |b| b.len()));
        match r {
            Ok(bytes) if bytes.len() as u64 == len => Ok(Vec::from(bytes)),
            Ok(bytes) => Err(self.past_end(name, start, len, Some(start + bytes.len() as u64))),
            Err(e) => {
                let e = self.error(Op::GetRange, name, e);
                if e.is_not_found() {
                    return Err(e);
                }
                // S3 answers a range starting past the end with 416: say which it was.
                match self.head(name) {
                    Ok(Some(size)) if end > size => {
                        Err(self.past_end(name, start, len, Some(size)))
                    }
                    _ => Err(e),
                }
            }
        }
    }

    fn head(&self, name: &str) -> Result<Option<u64>> {
        let path = self.path(name)?;
        let store = self.store.clone();
        self.stats.head();
        match self.run(Op::Head, name, async move { store.head(&path).await })? {
            Ok(meta) => Ok(Some(meta.size)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.error(Op::Head, name, e)),
        }
    }

    fn list(&self, prefix: &str) -> Result<Vec<(String, u64)>> {
        validate_prefix(prefix)?;
        let root = if prefix.is_empty() {
            if self.prefix.is_empty() {
                None
            } else {
                Some(Path::from_iter(self.prefix.split('/')))
            }
        } else {
            Some(self.path_unchecked(prefix))
        };
        let store = self.store.clone();
        let metas = self
            .run(Op::List, prefix, async move {
                store
                    .list(root.as_ref())
                    .try_collect::<Vec<object_store::ObjectMeta>>()
                    .await
            })?
            .map_err(|e| self.error(Op::List, prefix, e))?;
        self.stats.list(metas.len());
        let strip = if self.prefix.is_empty() {
            String::new()
        } else {
            format!("{}/", self.prefix)
        };
        let mut out: Vec<(String, u64)> = metas
            .into_iter()
            .filter_map(|m| {
                let name = m.location.as_ref().strip_prefix(&strip)?.to_string();
                (validate_name(&name).is_ok() && under(&name, prefix)).then_some((name, m.size))
            })
            .collect();
        out.sort();
        Ok(out)
    }

    fn delete(&self, name: &str) -> Result<()> {
        let path = self.path(name)?;
        let store = self.store.clone();
        self.stats.delete();
        match self.run(Op::Delete, name, async move { store.delete(&path).await })? {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.error(Op::Delete, name, e)),
        }
    }

    fn put_if_absent(&self, name: &str, bytes: &[u8]) -> Result<bool> {
        let path = self.path(name)?;
        if self.conditional {
            self.create(Op::PutIfAbsent, name, &path, bytes.to_vec())
        } else {
            self.put_if_absent_best_effort(name, &path, bytes)
        }
    }

    fn conditional_put_honoured(&self) -> bool {
        self.conditional
    }

    fn stats(&self) -> BackendStats {
        self.stats.snapshot()
    }

    fn describe(&self) -> String {
        format!("{} at {}", self.url, self.endpoint)
    }
}

/// `url` as an error may show it: a user name or password (between `://` and the last `@`
/// before the path) and a query or fragment (`?...`, `#...`) replaced by `***`, since any of
/// them may hold a secret.
pub fn redacted(url: &str) -> String {
    let (head, tail) = match url.find(['?', '#']) {
        Some(cut) => (&url[..cut], "?***"),
        None => (url, ""),
    };
    let start = head.find("://").map_or(0, |i| i + 3);
    let authority_end = head[start..].find('/').map_or(head.len(), |i| start + i);
    match head[start..authority_end].rfind('@') {
        Some(at) => format!("{}***{}{tail}", &head[..start], &head[start + at..]),
        None => format!("{head}{tail}"),
    }
}

#[cfg(test)]
mod redaction_tests {
    use super::redacted;

    #[test]
    fn secrets_in_an_endpoint_are_not_shown() {
        for (url, shown) in [
            ("https://h:9000", "https://h:9000"),
            ("https://u:hunter2@h:9000/", "https://***@h:9000/"),
            ("https://h/?password=hunter2", "https://h/?***"),
            ("https://h#hunter2", "https://h?***"),
            ("u:hunter2@h", "***@h"),
        ] {
            assert_eq!(redacted(url), shown);
        }
    }
}

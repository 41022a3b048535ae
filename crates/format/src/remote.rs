//! The files of a pool in an object store that are not the pool's own: `remote.conf` in the
//! local directory ([`RemoteConf`], text), the `lease` object ([`LeaseBody`], text) and the
//! write-ahead objects `wal/SEQ` of `--durability remote` ([`encode_wal`]);
//! docs/FORMAT.md "Files of a pool directory" and docs/S3.md.
//!
//! Invariants: every decoder refuses, never panics on, bytes it does not read (a wrong first
//! line, a bad number, a truncated or changed write-ahead object); a write-ahead object
//! names only a journal or segment file of the local directory (no path, no hidden name).

use super::common::{JOURNAL_PREFIX, SEGMENT_PREFIX};
use super::superblock::Durability;
use crate::error::{Error, Result};
use std::path::PathBuf;

/// The local directory's description of its pool in the bucket.
pub const REMOTE_CONF_NAME: &str = "remote.conf";
const CONF_FIRST_LINE: &str = "condense-remote 1";
const LEASE_FIRST_LINE: &str = "condense-lease 1";
const WAL_MAGIC: [u8; 8] = *b"CNDSWAL1";

/// `remote.conf`: where the pool is and how this host reaches it. Holds no secret.
///
/// The durability is the pool's, stored in its superblock, not here. A `remote.conf` written
/// by a Condense that kept it here (before issue 23) holds a `durability=` line: for a pool
/// that stores none yet it is taken once (the first writable open stores it in the pool and
/// drops the line); for a pool that stores one, the pool's wins.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteConf {
    /// `s3://BUCKET[/PREFIX]`, or `file:///DIR` (a directory as the object store: tests).
    pub url: String,
    /// S3 endpoint (`None`: `$AWS_ENDPOINT_URL`, else AWS).
    pub endpoint: Option<String>,
    /// S3 region (`None`: `$AWS_REGION`, else us-east-1).
    pub region: Option<String>,
    /// A file of `KEY=VALUE` lines with the credentials (`None`: the environment).
    pub credentials: Option<PathBuf>,
    /// A durability for a pool that stores none yet (made before issue 23): the old
    /// `durability=` line, or `connect --durability` to such a pool. `None` otherwise.
    pub durability_to_store: Option<Durability>,
    /// This host only reads the pool (no lease; never writes to the bucket).
    pub read_only: bool,
}

impl RemoteConf {
    pub fn encode(&self) -> String {
        let mut s = format!("{CONF_FIRST_LINE}\nurl={}\n", self.url);
        if let Some(e) = &self.endpoint {
            s += &format!("endpoint={e}\n");
        }
        if let Some(r) = &self.region {
            s += &format!("region={r}\n");
        }
        if let Some(c) = &self.credentials {
            s += &format!("credentials={}\n", c.display());
        }
        if let Some(d) = self.durability_to_store {
            s += &format!("durability={}\n", d.as_str());
        }
        s += &format!("read_only={}\n", self.read_only);
        s
    }

    pub fn decode(bytes: &[u8]) -> Result<RemoteConf> {
        let bad = |d: String| Error::corrupt(REMOTE_CONF_NAME, d);
        let text = std::str::from_utf8(bytes).map_err(|_| bad("not UTF-8 text".into()))?;
        let mut lines = text.lines();
        if lines.next() != Some(CONF_FIRST_LINE) {
            return Err(bad(format!("first line is not {CONF_FIRST_LINE:?}")));
        }
        let mut conf = RemoteConf {
            url: String::new(),
            endpoint: None,
            region: None,
            credentials: None,
            durability_to_store: None,
            read_only: false,
        };
        for l in lines {
            match l.split_once('=') {
                Some(("url", v)) => conf.url = v.to_string(),
                Some(("endpoint", v)) => conf.endpoint = Some(v.to_string()),
                Some(("region", v)) => conf.region = Some(v.to_string()),
                Some(("credentials", v)) => conf.credentials = Some(PathBuf::from(v)),
                Some(("durability", v)) => {
                    conf.durability_to_store =
                        Some(Durability::parse(v).ok_or_else(|| {
                            bad(format!("durability {v:?} is not local or remote"))
                        })?)
                }
                Some(("read_only", v)) => conf.read_only = v == "true",
                _ => {}
            }
        }
        if conf.url.is_empty() {
            return Err(bad("no url= line".into()));
        }
        Ok(conf)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseBody {
    pub host: String,
    pub pid: u32,
    pub nonce: String,
    /// Seconds since the Unix epoch.
    pub expires: u64,
    pub renewed: u64,
}

impl LeaseBody {
    /// A release: the last renewal of a claim, marked by expiry 0.
    pub fn released(&self) -> bool {
        self.expires == 0
    }

    pub fn encode(&self) -> Vec<u8> {
        format!(
            "{LEASE_FIRST_LINE}\nhost={}\npid={}\nnonce={}\nexpires_unix={}\nrenewed_unix={}\n",
            self.host, self.pid, self.nonce, self.expires, self.renewed
        )
        .into_bytes()
    }

    pub fn decode(b: &[u8]) -> Option<LeaseBody> {
        let text = std::str::from_utf8(b).ok()?;
        let mut lines = text.lines();
        if lines.next()? != LEASE_FIRST_LINE {
            return None;
        }
        let mut l = LeaseBody {
            host: String::new(),
            pid: 0,
            nonce: String::new(),
            expires: 0,
            renewed: 0,
        };
        for line in lines {
            match line.split_once('=') {
                Some(("host", v)) => l.host = v.to_string(),
                Some(("pid", v)) => l.pid = v.parse().ok()?,
                Some(("nonce", v)) => l.nonce = v.to_string(),
                Some(("expires_unix", v)) => l.expires = v.parse().ok()?,
                Some(("renewed_unix", v)) => l.renewed = v.parse().ok()?,
                _ => {}
            }
        }
        Some(l)
    }
}

/// Files whose syncs are logged as write-ahead objects: journals and segments.
pub fn is_logged(name: &str) -> bool {
    name.starts_with(SEGMENT_PREFIX) || name.starts_with(JOURNAL_PREFIX)
}

pub fn encode_wal(name: &str, offset: u64, data: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(32 + name.len() + data.len());
    v.extend_from_slice(&WAL_MAGIC);
    v.extend_from_slice(&(name.len() as u16).to_le_bytes());
    v.extend_from_slice(name.as_bytes());
    v.extend_from_slice(&offset.to_le_bytes());
    v.extend_from_slice(&(data.len() as u64).to_le_bytes());
    v.extend_from_slice(&crc32c::crc32c(data).to_le_bytes());
    v.extend_from_slice(data);
    v
}

pub fn decode_wal(b: &[u8]) -> Option<(String, u64, &[u8])> {
    if b.get(..8)? != WAL_MAGIC {
        return None;
    }
    let nlen = u16::from_le_bytes(b.get(8..10)?.try_into().ok()?) as usize;
    let name = std::str::from_utf8(b.get(10..10 + nlen)?).ok()?.to_string();
    let at = 10 + nlen;
    let offset = u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?);
    let len = usize::try_from(u64::from_le_bytes(b.get(at + 8..at + 16)?.try_into().ok()?)).ok()?;
    let crc = u32::from_le_bytes(b.get(at + 16..at + 20)?.try_into().ok()?);
    let data = b.get(at + 20..at.checked_add(20)?.checked_add(len)?)?;
    let safe = !name.is_empty() && !name.contains('/') && !name.starts_with('.');
    (crc32c::crc32c(data) == crc && safe && is_logged(&name)).then_some((name, offset, data))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_conf_round_trips() -> Result<()> {
        let c = RemoteConf {
            url: "s3://bucket/prefix".into(),
            endpoint: Some("http://127.0.0.1:3900".into()),
            region: Some("garage".into()),
            credentials: Some(PathBuf::from("/etc/condense/creds.env")),
            durability_to_store: Some(Durability::Remote),
            read_only: true,
        };
        assert_eq!(RemoteConf::decode(c.encode().as_bytes())?, c);
        assert!(RemoteConf::decode(b"condense-remote 2\nurl=s3://b\n").is_err());
        assert!(
            RemoteConf::decode(b"condense-remote 1\nendpoint=x\n").is_err(),
            "no url"
        );
        assert!(RemoteConf::decode(b"condense-remote 1\nurl=s3://b\ndurability=x\n").is_err());
        assert!(RemoteConf::decode(&[0xff]).is_err());
        Ok(())
    }

    #[test]
    fn lease_body_round_trips() {
        let l = LeaseBody {
            host: "host-1".into(),
            pid: 42,
            nonce: "abc".into(),
            expires: 1_700_000_030,
            renewed: 1_700_000_000,
        };
        let back = LeaseBody::decode(&l.encode()).expect("decodes");
        assert_eq!(
            (back.host, back.pid, back.nonce, back.expires, back.renewed),
            (l.host, l.pid, l.nonce, l.expires, l.renewed)
        );
        assert!(LeaseBody::decode(b"condense-lease 1\npid=x\n").is_none());
        assert!(LeaseBody::decode(b"something else\n").is_none());
    }

    #[test]
    fn wal_objects_round_trip_and_refuse_damage() {
        let name = crate::journal_name(3);
        let b = encode_wal(&name, 4096, b"some bytes");
        assert_eq!(
            decode_wal(&b),
            Some((name.clone(), 4096, &b"some bytes"[..]))
        );
        for cut in 0..b.len() {
            assert!(decode_wal(&b[..cut]).is_none(), "truncated to {cut}");
        }
        let mut bad = b.clone();
        *bad.last_mut().expect("bytes") ^= 1;
        assert!(decode_wal(&bad).is_none(), "CRC");
        assert!(decode_wal(&encode_wal("../etc/passwd", 0, b"x")).is_none());
        assert!(decode_wal(&encode_wal("lock", 0, b"x")).is_none());
    }
}

//! A small, strict NBD client for protocol tests, written from the specification. It checks
//! every magic and length it receives, so a server that sends a malformed reply fails the test.

#![allow(dead_code)]

use condense_api::mem::MemCatalog;
use condense_api::Catalog;
use condense_nbd::proto::*;
use condense_nbd::{Endpoint, Server, ServerConfig, ServerHandle};
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

pub type TestResult = Result<(), Box<dyn std::error::Error>>;

pub const MIB: u64 = 1 << 20;

/// A MemCatalog with volumes "vm1" (8 MiB), "vm2" (1 MiB) and the hidden ".internal".
pub fn catalog() -> Arc<MemCatalog> {
    let c = Arc::new(MemCatalog::new(4096));
    for (name, size) in [("vm1", 8 * MIB), ("vm2", MIB), (".internal", MIB)] {
        c.create(name, size).expect("create volume");
    }
    c
}

pub fn start(catalog: Arc<dyn Catalog>, config: ServerConfig) -> ServerHandle {
    let server = Server::bind(
        catalog,
        config,
        &[Endpoint::Tcp("127.0.0.1:0".parse().expect("addr"))],
    )
    .expect("bind");
    server.spawn().expect("spawn")
}

pub fn addr(h: &ServerHandle) -> std::net::SocketAddr {
    match &h.endpoints()[0] {
        Endpoint::Tcp(a) => *a,
        Endpoint::Unix(_) => panic!("not tcp"),
    }
}

/// One option reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OptReply {
    pub option: u32,
    pub kind: u32,
    pub data: Vec<u8>,
}

/// One reply (simple, or one structured chunk).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Simple {
        cookie: u64,
        error: u32,
        data: Vec<u8>,
    },
    Chunk {
        cookie: u64,
        flags: u16,
        kind: u16,
        payload: Vec<u8>,
    },
}

impl Reply {
    pub fn cookie(&self) -> u64 {
        match self {
            Reply::Simple { cookie, .. } | Reply::Chunk { cookie, .. } => *cookie,
        }
    }
    pub fn done(&self) -> bool {
        match self {
            Reply::Simple { .. } => true,
            Reply::Chunk { flags, .. } => flags & REPLY_FLAG_DONE != 0,
        }
    }
    /// The NBD error of this reply (0 when it is not an error).
    pub fn error(&self) -> u32 {
        match self {
            Reply::Simple { error, .. } => *error,
            Reply::Chunk { kind, payload, .. } if kind & 0x8000 != 0 => be32(&payload[..4]),
            Reply::Chunk { .. } => 0,
        }
    }
}

pub fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}
pub fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}
pub fn be64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

pub struct Client {
    pub s: TcpStream,
    pub structured: bool,
    /// Cookies of reads sent with simple replies, so their data can be framed.
    pending_simple_reads: std::collections::HashMap<u64, u32>,
    pub size: u64,
    pub flags: u16,
}

impl Client {
    /// Connect and do the greeting; options come next.
    pub fn connect(addr: std::net::SocketAddr) -> io::Result<Client> {
        Self::connect_with_flags(addr, FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES)
    }

    pub fn connect_with_flags(addr: std::net::SocketAddr, client_flags: u32) -> io::Result<Client> {
        let s = TcpStream::connect(addr)?;
        s.set_read_timeout(Some(Duration::from_secs(20)))?;
        s.set_nodelay(true)?;
        let mut c = Client {
            s,
            structured: false,
            pending_simple_reads: Default::default(),
            size: 0,
            flags: 0,
        };
        let g = c.read_n(18)?;
        assert_eq!(be64(&g[..8]), INIT_MAGIC);
        assert_eq!(be64(&g[8..16]), OPTS_MAGIC);
        assert_eq!(be16(&g[16..]), FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
        c.s.write_all(&client_flags.to_be_bytes())?;
        Ok(c)
    }

    pub fn read_n(&mut self, n: usize) -> io::Result<Vec<u8>> {
        read_exact_vec(&mut self.s, n)
    }

    pub fn send_option(&mut self, option: u32, data: &[u8]) -> io::Result<()> {
        send_option_to(&mut self.s, option, data)
    }

    /// Send an option and read replies up to the final one (ACK or an error).
    pub fn option(&mut self, kind: u32, data: &[u8]) -> io::Result<Vec<OptReply>> {
        option(&mut self.s, kind, data)
    }

    pub fn structured_reply(&mut self) -> io::Result<()> {
        let r = self.option(OPT_STRUCTURED_REPLY, &[])?;
        assert_eq!(r.last().map(|r| r.kind), Some(REP_ACK));
        self.structured = true;
        Ok(())
    }

    /// SET_META_CONTEXT; returns the replies.
    pub fn set_meta(&mut self, export: &str, queries: &[&str]) -> io::Result<Vec<OptReply>> {
        self.option(OPT_SET_META_CONTEXT, &meta_data(export, queries))
    }

    /// NBD_OPT_GO; on ACK the client is in transmission.
    pub fn go(&mut self, name: &str, info: &[u16]) -> io::Result<Vec<OptReply>> {
        let r = self.option(OPT_GO, &go_data(name, info))?;
        if r.last().map(|r| r.kind) == Some(REP_ACK) {
            for i in &r {
                if i.kind == REP_INFO && be16(&i.data) == INFO_EXPORT {
                    assert_eq!(i.data.len(), 12);
                    self.size = be64(&i.data[2..10]);
                    self.flags = be16(&i.data[10..12]);
                }
            }
        }
        Ok(r)
    }

    /// Connect, negotiate structured replies and base:allocation, and GO.
    pub fn open(addr: std::net::SocketAddr, name: &str) -> io::Result<Client> {
        let mut c = Client::connect(addr)?;
        c.structured_reply()?;
        let m = c.set_meta(name, &["base:allocation"])?;
        assert_eq!(m.len(), 2, "one context then ACK: {m:?}");
        let r = c.go(name, &[INFO_BLOCK_SIZE])?;
        assert_eq!(r.last().map(|r| r.kind), Some(REP_ACK), "GO {name}: {r:?}");
        Ok(c)
    }

    pub fn send_request(
        &mut self,
        kind: u16,
        flags: u16,
        cookie: u64,
        offset: u64,
        len: u32,
        payload: &[u8],
    ) -> io::Result<()> {
        let m = encode_request(kind, flags, cookie, offset, len, payload);
        if kind == CMD_READ && !self.structured {
            self.pending_simple_reads.insert(cookie, len);
        }
        self.s.write_all(&m)
    }

    /// Read one reply message (a simple reply, or one structured chunk).
    pub fn read_reply(&mut self) -> io::Result<Reply> {
        let pending = &mut self.pending_simple_reads;
        let r = read_reply_from(&mut self.s, |cookie| {
            pending.remove(&cookie).unwrap_or(0) as usize
        })?;
        assert!(
            self.structured || matches!(r, Reply::Simple { .. }),
            "structured chunk without negotiation"
        );
        Ok(r)
    }

    /// Read all chunks of the reply to one request (no other requests in flight).
    pub fn read_full_reply(&mut self) -> io::Result<Vec<Reply>> {
        let mut out = Vec::new();
        loop {
            let r = self.read_reply()?;
            let done = r.done();
            out.push(r);
            if done {
                return Ok(out);
            }
        }
    }

    /// Send a request and collect its complete reply.
    pub fn request(
        &mut self,
        kind: u16,
        flags: u16,
        offset: u64,
        len: u32,
        payload: &[u8],
    ) -> io::Result<Vec<Reply>> {
        let cookie = 0x1234_5678_9abc_def0 ^ offset ^ u64::from(len);
        self.send_request(kind, flags, cookie, offset, len, payload)?;
        let r = self.read_full_reply()?;
        for c in &r {
            assert_eq!(c.cookie(), cookie);
        }
        Ok(r)
    }

    /// The error of a request's reply (0 on success).
    pub fn status(
        &mut self,
        kind: u16,
        flags: u16,
        offset: u64,
        len: u32,
        payload: &[u8],
    ) -> io::Result<u32> {
        let r = self.request(kind, flags, offset, len, payload)?;
        Ok(r.iter().map(Reply::error).find(|&e| e != 0).unwrap_or(0))
    }

    pub fn write(&mut self, offset: u64, data: &[u8], flags: u16) -> io::Result<u32> {
        self.status(CMD_WRITE, flags, offset, data.len() as u32, data)
    }

    /// Read through structured or simple replies, reassembling data and holes.
    pub fn read(&mut self, offset: u64, len: u32) -> io::Result<Result<Vec<u8>, u32>> {
        let r = self.request(CMD_READ, 0, offset, len, &[])?;
        Ok(assemble_read(&r, offset, len))
    }

    /// Block status descriptors (length, flags) for a range.
    pub fn block_status(
        &mut self,
        offset: u64,
        len: u32,
        flags: u16,
    ) -> io::Result<Result<Vec<(u32, u32)>, u32>> {
        let r = self.request(CMD_BLOCK_STATUS, flags, offset, len, &[])?;
        let mut out = Vec::new();
        for c in &r {
            match c {
                Reply::Chunk { kind, payload, .. } if *kind == REPLY_TYPE_BLOCK_STATUS => {
                    assert_eq!(be32(payload), META_ID_BASE_ALLOCATION);
                    for d in payload[4..].chunks(8) {
                        out.push((be32(&d[..4]), be32(&d[4..])));
                    }
                }
                other if other.error() != 0 => return Ok(Err(other.error())),
                other => panic!("unexpected block status reply {other:?}"),
            }
        }
        Ok(Ok(out))
    }

    /// Expect the server to close the connection (EOF or reset) within the read timeout.
    pub fn expect_closed(&mut self) {
        let mut b = [0u8; 1];
        match self.s.read(&mut b) {
            Ok(0) => {}
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {}
            other => panic!("expected the server to close the connection, got {other:?}"),
        }
    }
}

/// One transmission request: header, then `payload` (a write's data).
pub fn encode_request(
    kind: u16,
    flags: u16,
    cookie: u64,
    offset: u64,
    len: u32,
    payload: &[u8],
) -> Vec<u8> {
    let mut m = Vec::with_capacity(28 + payload.len());
    m.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
    m.extend_from_slice(&flags.to_be_bytes());
    m.extend_from_slice(&kind.to_be_bytes());
    m.extend_from_slice(&cookie.to_be_bytes());
    m.extend_from_slice(&offset.to_be_bytes());
    m.extend_from_slice(&len.to_be_bytes());
    m.extend_from_slice(payload);
    m
}

/// Write an option request to any stream (plain TCP or TLS).
pub fn send_option_to<S: Write>(s: &mut S, option: u32, data: &[u8]) -> io::Result<()> {
    let mut m = Vec::new();
    m.extend_from_slice(&OPTS_MAGIC.to_be_bytes());
    m.extend_from_slice(&option.to_be_bytes());
    m.extend_from_slice(&(data.len() as u32).to_be_bytes());
    m.extend_from_slice(data);
    s.write_all(&m)?;
    s.flush()
}

/// Read one option reply from any stream.
pub fn read_opt_reply_from<S: Read>(s: &mut S) -> io::Result<OptReply> {
    let h = read_exact_vec(s, 20)?;
    assert_eq!(be64(&h[..8]), REP_MAGIC, "option reply magic");
    let len = be32(&h[16..20]) as usize;
    assert!(len < 1 << 20, "option reply of {len} bytes");
    Ok(OptReply {
        option: be32(&h[8..12]),
        kind: be32(&h[12..16]),
        data: read_exact_vec(s, len)?,
    })
}

/// Send an option over any stream and read its replies up to the final one (ACK or an
/// error).
pub fn option<S: Read + Write>(s: &mut S, option: u32, data: &[u8]) -> io::Result<Vec<OptReply>> {
    send_option_to(s, option, data)?;
    let mut out = Vec::new();
    loop {
        let r = read_opt_reply_from(s)?;
        assert_eq!(r.option, option, "reply names the option");
        let last = r.kind == REP_ACK || r.kind & (1 << 31) != 0;
        out.push(r);
        if last {
            return Ok(out);
        }
    }
}

/// The export names NBD_OPT_LIST gives over any stream.
pub fn listed<S: Read + Write>(s: &mut S) -> io::Result<Vec<String>> {
    let r = option(s, OPT_LIST, &[])?;
    assert_eq!(r.last().map(|r| r.kind), Some(REP_ACK), "{r:?}");
    Ok(r.iter()
        .filter(|r| r.kind == REP_SERVER)
        .map(|r| String::from_utf8_lossy(&r.data[4..4 + be32(&r.data) as usize]).into_owned())
        .collect())
}

/// The kind of an option's final reply.
pub fn final_kind(r: &[OptReply]) -> Option<u32> {
    r.last().map(|r| r.kind)
}

pub fn read_exact_vec<S: Read>(s: &mut S, n: usize) -> io::Result<Vec<u8>> {
    let mut b = vec![0u8; n];
    s.read_exact(&mut b)?;
    Ok(b)
}

/// Read one reply message over any stream: a simple reply (its data `simple_len(cookie)` bytes
/// when it is not an error) or one structured chunk, checked by [`check_chunk`].
pub fn read_reply_from<S: Read>(
    s: &mut S,
    mut simple_len: impl FnMut(u64) -> usize,
) -> io::Result<Reply> {
    let m = read_exact_vec(s, 4)?;
    match be32(&m) {
        SIMPLE_REPLY_MAGIC => {
            let h = read_exact_vec(s, 12)?;
            let (error, cookie) = (be32(&h), be64(&h[4..]));
            // The read's length is taken even for an error, which carries no data.
            let len = simple_len(cookie);
            let data = read_exact_vec(s, if error == 0 { len } else { 0 })?;
            Ok(Reply::Simple {
                cookie,
                error,
                data,
            })
        }
        STRUCTURED_REPLY_MAGIC => {
            let h = read_exact_vec(s, 16)?;
            let len = be32(&h[12..16]) as usize;
            assert!(len <= (32 << 20) + 8, "chunk of {len} bytes");
            let r = Reply::Chunk {
                cookie: be64(&h[4..12]),
                flags: be16(&h[..2]),
                kind: be16(&h[2..4]),
                payload: read_exact_vec(s, len)?,
            };
            check_chunk(&r);
            Ok(r)
        }
        other => panic!("reply magic {other:#x}"),
    }
}

/// Check the internal consistency of a structured chunk.
fn check_chunk(r: &Reply) {
    let Reply::Chunk {
        kind,
        payload,
        flags,
        ..
    } = r
    else {
        return;
    };
    match *kind {
        REPLY_TYPE_NONE => {
            assert!(payload.is_empty());
            assert!(flags & REPLY_FLAG_DONE != 0);
        }
        REPLY_TYPE_OFFSET_DATA => assert!(payload.len() >= 9),
        REPLY_TYPE_OFFSET_HOLE => {
            assert_eq!(payload.len(), 12);
            assert_ne!(be32(&payload[8..]), 0, "empty hole");
        }
        REPLY_TYPE_BLOCK_STATUS => {
            assert!(payload.len() >= 12 && (payload.len() - 4) % 8 == 0);
            for d in payload[4..].chunks(8) {
                assert_ne!(be32(d), 0, "empty extent");
            }
        }
        REPLY_TYPE_ERROR => {
            assert!(payload.len() >= 6);
            assert_ne!(be32(payload), 0);
            let msg = be16(&payload[4..]) as usize;
            assert_eq!(payload.len(), 6 + msg);
            assert!(std::str::from_utf8(&payload[6..]).is_ok());
        }
        other => panic!("unexpected chunk type {other}"),
    }
}

/// Rebuild the bytes of a read from its reply, checking coverage without overlap.
pub fn assemble_read(r: &[Reply], offset: u64, len: u32) -> Result<Vec<u8>, u32> {
    let mut out = vec![0u8; len as usize];
    let mut covered = vec![false; len as usize];
    for c in r {
        if c.error() != 0 {
            return Err(c.error());
        }
        match c {
            Reply::Simple { data, .. } => {
                assert_eq!(data.len(), len as usize);
                return Ok(data.clone());
            }
            Reply::Chunk { kind, payload, .. } => {
                let (start, n, data) = match *kind {
                    REPLY_TYPE_OFFSET_DATA => {
                        (be64(payload), payload.len() - 8, Some(&payload[8..]))
                    }
                    REPLY_TYPE_OFFSET_HOLE => (be64(payload), be32(&payload[8..]) as usize, None),
                    REPLY_TYPE_NONE => continue,
                    other => panic!("chunk type {other} in a read reply"),
                };
                assert!(
                    start >= offset && start + n as u64 <= offset + u64::from(len),
                    "chunk outside the request"
                );
                let at = (start - offset) as usize;
                for c in &mut covered[at..at + n] {
                    assert!(!*c, "overlapping chunks");
                    *c = true;
                }
                if let Some(d) = data {
                    out[at..at + n].copy_from_slice(d);
                }
            }
        }
    }
    assert!(
        covered.iter().all(|&c| c),
        "read reply does not cover the request"
    );
    Ok(out)
}

pub fn go_data(name: &str, info: &[u16]) -> Vec<u8> {
    let mut d = Vec::new();
    d.extend_from_slice(&(name.len() as u32).to_be_bytes());
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&(info.len() as u16).to_be_bytes());
    for i in info {
        d.extend_from_slice(&i.to_be_bytes());
    }
    d
}

pub fn meta_data(export: &str, queries: &[&str]) -> Vec<u8> {
    let mut d = Vec::new();
    d.extend_from_slice(&(export.len() as u32).to_be_bytes());
    d.extend_from_slice(export.as_bytes());
    d.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for q in queries {
        d.extend_from_slice(&(q.len() as u32).to_be_bytes());
        d.extend_from_slice(q.as_bytes());
    }
    d
}

/// A deterministic, non-repeating pattern.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// After a bad client: a fresh client can still open an export and read and write.
pub fn still_serving(addr: std::net::SocketAddr) -> TestResult {
    let mut c = Client::open(addr, "vm2")?;
    let data = pattern(99, 5000);
    assert_eq!(c.write(777, &data, 0)?, 0);
    assert_eq!(c.read(777, 5000)?, Ok(data));
    Ok(())
}

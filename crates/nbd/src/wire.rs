//! Pure functions from bytes to protocol messages and back.
//!
//! Nothing here does I/O or keeps state: the option parser, the request header parser and the
//! request check take bytes (and the facts of the negotiated export) and return a verdict, so
//! they can be fuzzed directly (`fuzz/fuzz_targets/nbd_parse.rs`) and tested exhaustively.
//! The async code in `handshake` and `transmission` only moves bytes to and from here.

use crate::proto::*;
use condense_api::{Change, Extent, ExtentKind};

/// An option the client sent during the handshake, parsed from its number and data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClientOption {
    ExportName(String),
    Abort,
    List,
    StartTls,
    Info(GoRequest),
    Go(GoRequest),
    StructuredReply,
    ListMetaContext(MetaRequest),
    SetMetaContext(MetaRequest),
    /// An option this server does not know: answered with `NBD_REP_ERR_UNSUP`.
    Unknown(u32),
}

/// The data of `NBD_OPT_INFO` and `NBD_OPT_GO`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GoRequest {
    pub name: String,
    /// The `NBD_INFO_*` items the client asked for.
    pub info: Vec<u16>,
}

/// The data of `NBD_OPT_LIST_META_CONTEXT` and `NBD_OPT_SET_META_CONTEXT`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetaRequest {
    pub export: String,
    pub queries: Vec<String>,
}

/// Why an option's data was refused; answered with `NBD_REP_ERR_INVALID` and the message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct OptionInvalid(pub String);

/// A bounds-checked big-endian reader over a byte slice.
struct Cursor<'a> {
    buf: &'a [u8],
    what: &'static str,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], OptionInvalid> {
        if n > self.buf.len() {
            return Err(OptionInvalid(format!(
                "{} is truncated: {} more bytes needed, {} left",
                self.what,
                n,
                self.buf.len()
            )));
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }
    fn u16(&mut self) -> Result<u16, OptionInvalid> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, OptionInvalid> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn string(&mut self, len: u32, field: &str) -> Result<String, OptionInvalid> {
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        if len > STRING_BYTES_MAX {
            return Err(OptionInvalid(format!(
                "{field} is {len} bytes, more than the protocol's {STRING_BYTES_MAX}"
            )));
        }
        parse_string(self.take(len)?, field)
    }
    fn finish(&self) -> Result<(), OptionInvalid> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(OptionInvalid(format!(
                "{} has {} unexpected trailing bytes",
                self.what,
                self.buf.len()
            )))
        }
    }
}

/// A protocol string: UTF-8, no NUL, at most 4096 bytes.
pub fn parse_string(bytes: &[u8], field: &str) -> Result<String, OptionInvalid> {
    if bytes.len() > STRING_BYTES_MAX {
        return Err(OptionInvalid(format!(
            "{field} is {} bytes, more than the protocol's {STRING_BYTES_MAX}",
            bytes.len()
        )));
    }
    if bytes.contains(&0) {
        return Err(OptionInvalid(format!("{field} contains a NUL byte")));
    }
    match std::str::from_utf8(bytes) {
        Ok(s) => Ok(s.to_string()),
        Err(e) => Err(OptionInvalid(format!("{field} is not UTF-8: {e}"))),
    }
}

fn no_data(option: &'static str, data: &[u8]) -> Result<(), OptionInvalid> {
    if data.is_empty() {
        Ok(())
    } else {
        Err(OptionInvalid(format!(
            "{option} takes no data, {} bytes were sent",
            data.len()
        )))
    }
}

/// Parse one option from its number and data (the 16-byte option header already read).
pub fn parse_option(option: u32, data: &[u8]) -> Result<ClientOption, OptionInvalid> {
    match option {
        OPT_EXPORT_NAME => Ok(ClientOption::ExportName(parse_string(data, "export name")?)),
        // The client should send no data with ABORT; the server should ignore any.
        OPT_ABORT => Ok(ClientOption::Abort),
        OPT_LIST => no_data("NBD_OPT_LIST", data).map(|()| ClientOption::List),
        OPT_STARTTLS => no_data("NBD_OPT_STARTTLS", data).map(|()| ClientOption::StartTls),
        OPT_STRUCTURED_REPLY => {
            no_data("NBD_OPT_STRUCTURED_REPLY", data).map(|()| ClientOption::StructuredReply)
        }
        OPT_INFO => parse_go(data, "NBD_OPT_INFO").map(ClientOption::Info),
        OPT_GO => parse_go(data, "NBD_OPT_GO").map(ClientOption::Go),
        OPT_LIST_META_CONTEXT => {
            parse_meta(data, "NBD_OPT_LIST_META_CONTEXT").map(ClientOption::ListMetaContext)
        }
        OPT_SET_META_CONTEXT => {
            parse_meta(data, "NBD_OPT_SET_META_CONTEXT").map(ClientOption::SetMetaContext)
        }
        other => Ok(ClientOption::Unknown(other)),
    }
}

fn parse_go(data: &[u8], what: &'static str) -> Result<GoRequest, OptionInvalid> {
    let mut c = Cursor { buf: data, what };
    let name_len = c.u32()?;
    let name = c.string(name_len, "export name")?;
    let n = c.u16()?;
    let mut info = Vec::new();
    for _ in 0..n {
        info.push(c.u16()?);
    }
    c.finish()?;
    Ok(GoRequest { name, info })
}

fn parse_meta(data: &[u8], what: &'static str) -> Result<MetaRequest, OptionInvalid> {
    let mut c = Cursor { buf: data, what };
    let name_len = c.u32()?;
    let export = c.string(name_len, "export name")?;
    let n = c.u32()?;
    let mut queries = Vec::new();
    for _ in 0..n {
        let len = c.u32()?;
        queries.push(c.string(len, "metadata context query")?);
    }
    c.finish()?;
    Ok(MetaRequest { export, queries })
}

/// A metadata context this server offers on an export.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum MetaContext {
    /// `base:allocation`: holes and zeros.
    BaseAllocation,
    /// `qemu:dirty-bitmap:SNAP`: the blocks whose content differs from snapshot `SNAP` of the
    /// export's volume (bit 0, [`STATE_DIRTY`], set for them).
    DirtyBitmap(String),
}

impl MetaContext {
    /// The context's name on the wire.
    pub fn name(&self) -> String {
        match self {
            MetaContext::BaseAllocation => META_BASE_ALLOCATION.to_string(),
            MetaContext::DirtyBitmap(snapshot) => format!("{META_DIRTY_BITMAP_PREFIX}{snapshot}"),
        }
    }
}

/// Whether snapshot `snapshot` may be offered as `qemu:dirty-bitmap:SNAP`: its name is not
/// hidden (leading '.') and the context name fits in a protocol string.
pub fn dirty_bitmap_offerable(snapshot: &str) -> bool {
    !snapshot.is_empty()
        && !snapshot.starts_with('.')
        && META_DIRTY_BITMAP_PREFIX.len() + snapshot.len() <= STRING_BYTES_MAX
}

/// Which metadata contexts a query names, given the snapshots the export offers dirty
/// bitmaps for (already filtered by [`dirty_bitmap_offerable`]).
///
/// Contexts: `base:allocation`, and `qemu:dirty-bitmap:SNAP` per snapshot. `for_list` allows
/// the wildcards `base:`, `qemu:` and `qemu:dirty-bitmap:` (LIST_META_CONTEXT); SET ignores
/// them, as the protocol and qemu do. Queries of unknown namespaces, unknown leaves and
/// unknown snapshots select nothing; a query without a colon is invalid.
pub fn match_meta_query(
    query: &str,
    for_list: bool,
    snapshots: &[String],
) -> Result<Vec<MetaContext>, OptionInvalid> {
    let Some((namespace, leaf)) = query.split_once(':') else {
        return Err(OptionInvalid(format!(
            "metadata context query {query:?} has no namespace (no colon)"
        )));
    };
    let all_bitmaps = || {
        snapshots
            .iter()
            .map(|s| MetaContext::DirtyBitmap(s.clone()))
            .collect::<Vec<_>>()
    };
    match namespace {
        "base" if leaf == "allocation" || (for_list && leaf.is_empty()) => {
            Ok(vec![MetaContext::BaseAllocation])
        }
        "qemu" if for_list && leaf.is_empty() => Ok(all_bitmaps()),
        "qemu" => match leaf.strip_prefix("dirty-bitmap:") {
            Some("") if for_list => Ok(all_bitmaps()),
            Some(name) if !name.is_empty() && snapshots.iter().any(|s| s == name) => {
                Ok(vec![MetaContext::DirtyBitmap(name.to_string())])
            }
            _ => Ok(Vec::new()),
        },
        _ => Ok(Vec::new()),
    }
}

/// The contexts a whole LIST or SET request names, each once, in the order first named.
/// LIST with no query names every context.
pub fn select_meta_contexts(
    queries: &[String],
    for_list: bool,
    snapshots: &[String],
) -> Result<Vec<MetaContext>, OptionInvalid> {
    let mut out: Vec<MetaContext> = Vec::new();
    if queries.is_empty() {
        if for_list {
            out.push(MetaContext::BaseAllocation);
            out.extend(
                snapshots
                    .iter()
                    .map(|s| MetaContext::DirtyBitmap(s.clone())),
            );
        }
        return Ok(out);
    }
    // A set, not a scan of `out`: a client may repeat a wildcard thousands of times.
    let mut seen = std::collections::HashSet::new();
    for q in queries {
        for c in match_meta_query(q, for_list, snapshots)? {
            if seen.insert(c.clone()) {
                out.push(c);
            }
        }
    }
    Ok(out)
}

/// Whether answering `queries` needs the export's snapshot names (a query in the `qemu:`
/// namespace, or a LIST of everything).
pub fn meta_queries_need_snapshots(queries: &[String], for_list: bool) -> bool {
    (for_list && queries.is_empty()) || queries.iter().any(|q| q.starts_with("qemu:"))
}

/// A request header as it came off the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestHeader {
    pub flags: u16,
    pub kind: u16,
    pub cookie: u64,
    pub offset: u64,
    pub len: u32,
}

/// Parse the 28-byte request header; `Err` carries a wrong magic, after which the stream
/// cannot be trusted and the connection must be dropped.
pub fn parse_request_header(b: &[u8; REQUEST_HEADER_BYTES]) -> Result<RequestHeader, u32> {
    let magic = u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    if magic != REQUEST_MAGIC {
        return Err(magic);
    }
    let mut cookie = [0u8; 8];
    cookie.copy_from_slice(&b[8..16]);
    let mut offset = [0u8; 8];
    offset.copy_from_slice(&b[16..24]);
    Ok(RequestHeader {
        flags: u16::from_be_bytes([b[4], b[5]]),
        kind: u16::from_be_bytes([b[6], b[7]]),
        cookie: u64::from_be_bytes(cookie),
        offset: u64::from_be_bytes(offset),
        len: u32::from_be_bytes([b[24], b[25], b[26], b[27]]),
    })
}

/// What a connection negotiated: the facts a request is checked against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Negotiated {
    pub size: u64,
    pub read_only: bool,
    pub structured: bool,
    /// At least one metadata context was selected for this export (BLOCK_STATUS is allowed).
    pub block_status: bool,
    /// Largest READ or WRITE payload accepted.
    pub payload_bytes_max: u32,
}

/// A request that passed every check, ready to run against the volume.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    Read {
        offset: u64,
        len: u32,
        df: bool,
    },
    /// The payload of `len` bytes follows the header on the wire.
    Write {
        offset: u64,
        len: u32,
        fua: bool,
    },
    Disc,
    Flush,
    Trim {
        offset: u64,
        len: u32,
        fua: bool,
    },
    Cache {
        offset: u64,
        len: u32,
    },
    WriteZeroes {
        offset: u64,
        len: u32,
        fua: bool,
        may_unmap: bool,
        fast: bool,
    },
    BlockStatus {
        offset: u64,
        len: u32,
        req_one: bool,
    },
}

/// What to do with a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Run(Command),
    /// Answer with this NBD error after reading and discarding `skip` payload bytes.
    Reject {
        error: u32,
        skip: u32,
        message: String,
    },
    /// The request cannot be answered without losing track of the stream: hard disconnect.
    Disconnect(String),
}

/// Check a request header against what was negotiated. Pure: the fuzz target calls it.
pub fn check_request(h: &RequestHeader, n: &Negotiated) -> Verdict {
    let has_payload = h.kind == CMD_WRITE;
    if has_payload && h.len > n.payload_bytes_max {
        return Verdict::Disconnect(format!(
            "write payload of {} bytes exceeds the maximum of {}",
            h.len, n.payload_bytes_max
        ));
    }
    let skip = if has_payload { h.len } else { 0 };
    match checked_command(h, n) {
        Ok(command) => Verdict::Run(command),
        Err((error, message)) => Verdict::Reject {
            error,
            skip,
            message,
        },
    }
}

/// Why a request is refused: the NBD error and a message for the client.
type Refusal = (u32, String);

/// The flags a request may carry: FUA, and its own command's flags.
fn check_flags(h: &RequestHeader, n: &Negotiated) -> Result<(), Refusal> {
    let allowed_flags = CMD_FLAG_FUA
        | match h.kind {
            CMD_WRITE_ZEROES => CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
            CMD_READ if n.structured => CMD_FLAG_DF,
            CMD_BLOCK_STATUS => CMD_FLAG_REQ_ONE,
            _ => 0,
        };
    if h.flags & !allowed_flags != 0 {
        return Err((
            EINVAL,
            format!(
                "command flags {:#x} are not valid for command {}",
                h.flags & !allowed_flags,
                h.kind
            ),
        ));
    }
    Ok(())
}

/// The command a request asks for, once its flags, the export's mode and its range allow it.
fn checked_command(h: &RequestHeader, n: &Negotiated) -> Result<Command, Refusal> {
    check_flags(h, n)?;
    let fua = h.flags & CMD_FLAG_FUA != 0;
    let (offset, len) = (h.offset, h.len);
    let in_range = offset
        .checked_add(u64::from(len))
        .is_some_and(|end| end <= n.size);
    let out_of_range = |error: u32| -> Refusal {
        (
            error,
            format!(
                "{len} bytes at offset {offset} are past the end of the export ({} bytes)",
                n.size
            ),
        )
    };
    let writes = matches!(h.kind, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
    if writes && n.read_only {
        return Err((EPERM, "the export is read-only".to_string()));
    }
    match h.kind {
        CMD_READ => {
            if len > n.payload_bytes_max {
                return Err((
                    EINVAL,
                    format!(
                        "read of {len} bytes exceeds the maximum payload of {}",
                        n.payload_bytes_max
                    ),
                ));
            }
            if !in_range {
                return Err(out_of_range(EINVAL));
            }
            Ok(Command::Read {
                offset,
                len,
                df: h.flags & CMD_FLAG_DF != 0,
            })
        }
        CMD_WRITE if !in_range => Err(out_of_range(ENOSPC)),
        CMD_WRITE => Ok(Command::Write { offset, len, fua }),
        CMD_DISC => Ok(Command::Disc),
        CMD_FLUSH if offset != 0 || len != 0 => {
            Err((EINVAL, "flush must have offset and length 0".to_string()))
        }
        CMD_FLUSH => Ok(Command::Flush),
        CMD_TRIM if !in_range => Err(out_of_range(EINVAL)),
        CMD_TRIM => Ok(Command::Trim { offset, len, fua }),
        CMD_CACHE if !in_range => Err(out_of_range(EINVAL)),
        CMD_CACHE => Ok(Command::Cache { offset, len }),
        CMD_WRITE_ZEROES if !in_range => Err(out_of_range(ENOSPC)),
        CMD_WRITE_ZEROES => Ok(Command::WriteZeroes {
            offset,
            len,
            fua,
            may_unmap: h.flags & CMD_FLAG_NO_HOLE == 0,
            fast: h.flags & CMD_FLAG_FAST_ZERO != 0,
        }),
        CMD_BLOCK_STATUS => {
            if !n.block_status {
                return Err((
                    EINVAL,
                    "block status needs a metadata context selected with NBD_OPT_SET_META_CONTEXT"
                        .to_string(),
                ));
            }
            if len == 0 {
                return Err((EINVAL, "block status of 0 bytes".to_string()));
            }
            if !in_range {
                return Err(out_of_range(EINVAL));
            }
            Ok(Command::BlockStatus {
                offset,
                len,
                req_one: h.flags & CMD_FLAG_REQ_ONE != 0,
            })
        }
        other => Err((EINVAL, format!("unknown command {other}"))),
    }
}

/// The `base:allocation` flags of an extent kind.
pub fn allocation_flags(kind: ExtentKind) -> u32 {
    match kind {
        ExtentKind::Data => 0,
        ExtentKind::Zero => STATE_ZERO,
        ExtentKind::Unmapped => STATE_HOLE | STATE_ZERO,
    }
}

/// Longest extent descriptor sent (a 4 KiB multiple below 2^32).
pub const DESCRIPTOR_BYTES_MAX: u64 = 0xFFFF_F000;
/// Most descriptors in one block status chunk, as the protocol recommends.
pub const DESCRIPTORS_MAX: usize = 1 << 20;

/// Walk `[offset, offset+len)` through runs `(offset, len, value)` sorted by offset, calling
/// `f(start, len, value)` for consecutive pieces that cover the range exactly. Gaps or overlaps
/// in `runs` (an engine that broke its contract) are covered with `gap`, which must be the
/// safe answer (data for allocation, dirty for a dirty bitmap).
fn cover<T: Copy>(
    runs: impl IntoIterator<Item = (u64, u64, T)>,
    offset: u64,
    len: u64,
    gap: T,
    mut f: impl FnMut(u64, u64, T),
) {
    let end = offset.saturating_add(len);
    let mut pos = offset;
    for (r_offset, r_len, value) in runs {
        if pos >= end {
            break;
        }
        let r_end = r_offset.saturating_add(r_len).min(end);
        if r_end <= pos {
            continue;
        }
        if r_offset > pos {
            let gap_end = r_offset.min(end);
            f(pos, gap_end - pos, gap);
            pos = gap_end;
            if pos >= end {
                break;
            }
        }
        f(pos, r_end - pos, value);
        pos = r_end;
    }
    if pos < end {
        f(pos, end - pos, gap);
    }
}

fn extent_runs(extents: &[Extent]) -> impl Iterator<Item = (u64, u64, ExtentKind)> + '_ {
    extents.iter().map(|e| (e.offset, e.len, e.kind))
}

/// Merge equal neighbours of a covering, split below 2^32, keep at most
/// [`DESCRIPTORS_MAX`]; with `req_one` exactly one.
fn descriptors(runs: impl FnOnce(&mut dyn FnMut(u64, u32)), req_one: bool) -> Vec<(u32, u32)> {
    let mut merged: Vec<(u64, u32)> = Vec::new();
    runs(&mut |n, flags| match merged.last_mut() {
        Some(last) if last.1 == flags => last.0 += n,
        _ => merged.push((n, flags)),
    });
    let mut out = Vec::new();
    'outer: for (mut n, flags) in merged {
        while n > 0 {
            let piece = n.min(DESCRIPTOR_BYTES_MAX);
            // piece <= DESCRIPTOR_BYTES_MAX < 2^32.
            out.push((piece as u32, flags));
            n -= piece;
            if req_one || out.len() >= DESCRIPTORS_MAX {
                break 'outer;
            }
        }
    }
    out
}

/// The `base:allocation` descriptors `(length, flags)` for a request, clipped to it, merged
/// where equal, split below 2^32, at most [`DESCRIPTORS_MAX`]; with `req_one` exactly one.
pub fn block_status_descriptors(
    extents: &[Extent],
    offset: u64,
    len: u64,
    req_one: bool,
) -> Vec<(u32, u32)> {
    descriptors(
        |push| {
            cover(
                extent_runs(extents),
                offset,
                len,
                ExtentKind::Data,
                |_, n, kind| push(n, allocation_flags(kind)),
            )
        },
        req_one,
    )
}

/// The `qemu:dirty-bitmap:` descriptors for a request from the volume's changed runs:
/// [`STATE_DIRTY`] where changed, 0 where clean; gaps in `changes` count as dirty (a backup
/// then copies too much, never too little). Same clipping and limits as
/// [`block_status_descriptors`].
pub fn dirty_bitmap_descriptors(
    changes: &[Change],
    offset: u64,
    len: u64,
    req_one: bool,
) -> Vec<(u32, u32)> {
    let runs = changes.iter().map(|c| (c.offset, c.len, c.changed));
    descriptors(
        |push| {
            cover(runs, offset, len, true, |_, n, changed| {
                push(n, if changed { STATE_DIRTY } else { 0 })
            })
        },
        req_one,
    )
}

/// One piece of a structured READ reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadPiece {
    pub offset: u64,
    pub len: u32,
    /// Reads as zeros: sent as `NBD_REPLY_TYPE_OFFSET_HOLE`, without touching the volume.
    pub hole: bool,
}

/// Whether `extents` (in order) cover all of `[offset, offset+len)`, with no gap; they may
/// reach past either end.
pub fn covers(extents: &[Extent], offset: u64, len: u64) -> bool {
    let Some(end) = offset.checked_add(len) else {
        return false;
    };
    let mut pos = offset;
    for e in extents {
        if pos >= end {
            break;
        }
        if e.offset > pos {
            return false;
        }
        pos = pos.max(e.offset.saturating_add(e.len));
    }
    pos >= end
}

/// Split a read of `[offset, offset+len)` into data and hole pieces by the volume's extents.
pub fn plan_read(extents: &[Extent], offset: u64, len: u32) -> Vec<ReadPiece> {
    let mut out: Vec<ReadPiece> = Vec::new();
    cover(
        extent_runs(extents),
        offset,
        u64::from(len),
        ExtentKind::Data,
        |start, n, kind| {
            let hole = kind != ExtentKind::Data;
            // n <= len, which fits in u32.
            let n = n as u32;
            match out.last_mut() {
                Some(last) if last.hole == hole => last.len += n,
                _ => out.push(ReadPiece {
                    offset: start,
                    len: n,
                    hole,
                }),
            }
        },
    );
    out
}

// Encoders. Each appends to `out` so replies can be batched into one write.

/// An option reply header and its data.
pub fn put_option_reply(out: &mut Vec<u8>, option: u32, reply: u32, data: &[u8]) {
    out.extend_from_slice(&REP_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&reply.to_be_bytes());
    // Option reply data is built by this server and is far below 4 GiB.
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
}

/// A simple reply header (the data of a successful READ follows it).
pub fn put_simple_reply(out: &mut Vec<u8>, cookie: u64, error: u32) {
    out.extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&error.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
}

/// A structured reply chunk header announcing `len` payload bytes.
pub fn put_chunk_header(out: &mut Vec<u8>, cookie: u64, flags: u16, kind: u16, len: u32) {
    out.extend_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(&kind.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
    out.extend_from_slice(&len.to_be_bytes());
}

/// A final `NBD_REPLY_TYPE_ERROR` chunk with a message for people.
pub fn put_error_chunk(out: &mut Vec<u8>, cookie: u64, error: u32, message: &str) {
    let mut msg = message.as_bytes();
    if msg.len() > STRING_BYTES_MAX {
        msg = &msg[..STRING_BYTES_MAX];
    }
    // msg.len() <= 4096.
    let len = msg.len() as u16;
    put_chunk_header(
        out,
        cookie,
        REPLY_FLAG_DONE,
        REPLY_TYPE_ERROR,
        6 + u32::from(len),
    );
    out.extend_from_slice(&error.to_be_bytes());
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(msg);
}

/// An `NBD_REPLY_TYPE_OFFSET_HOLE` chunk.
pub fn put_hole_chunk(out: &mut Vec<u8>, cookie: u64, done: bool, offset: u64, len: u32) {
    let flags = if done { REPLY_FLAG_DONE } else { 0 };
    put_chunk_header(out, cookie, flags, REPLY_TYPE_OFFSET_HOLE, 12);
    out.extend_from_slice(&offset.to_be_bytes());
    out.extend_from_slice(&len.to_be_bytes());
}

/// The header of an `NBD_REPLY_TYPE_OFFSET_DATA` chunk; `len` data bytes follow it.
pub fn put_data_chunk_header(out: &mut Vec<u8>, cookie: u64, done: bool, offset: u64, len: u32) {
    let flags = if done { REPLY_FLAG_DONE } else { 0 };
    put_chunk_header(
        out,
        cookie,
        flags,
        REPLY_TYPE_OFFSET_DATA,
        len.saturating_add(8),
    );
    out.extend_from_slice(&offset.to_be_bytes());
}

/// An `NBD_REPLY_TYPE_BLOCK_STATUS` chunk for one context; `done` on the last one of a reply.
pub fn put_block_status_chunk(
    out: &mut Vec<u8>,
    cookie: u64,
    done: bool,
    context_id: u32,
    descriptors: &[(u32, u32)],
) {
    // At most DESCRIPTORS_MAX descriptors: 4 + 8 * 2^20 bytes.
    let len = 4 + 8 * descriptors.len() as u32;
    let flags = if done { REPLY_FLAG_DONE } else { 0 };
    put_chunk_header(out, cookie, flags, REPLY_TYPE_BLOCK_STATUS, len);
    out.extend_from_slice(&context_id.to_be_bytes());
    for (n, flags) in descriptors {
        out.extend_from_slice(&n.to_be_bytes());
        out.extend_from_slice(&flags.to_be_bytes());
    }
}

/// The data of an `NBD_REP_INFO` reply of type `NBD_INFO_EXPORT`.
pub fn info_export(size: u64, transmission_flags: u16) -> Vec<u8> {
    let mut d = Vec::with_capacity(12);
    d.extend_from_slice(&INFO_EXPORT.to_be_bytes());
    d.extend_from_slice(&size.to_be_bytes());
    d.extend_from_slice(&transmission_flags.to_be_bytes());
    d
}

/// The data of an `NBD_REP_INFO` reply of type `NBD_INFO_BLOCK_SIZE`.
pub fn info_block_size(minimum: u32, preferred: u32, maximum: u32) -> Vec<u8> {
    let mut d = Vec::with_capacity(14);
    d.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    d.extend_from_slice(&minimum.to_be_bytes());
    d.extend_from_slice(&preferred.to_be_bytes());
    d.extend_from_slice(&maximum.to_be_bytes());
    d
}

/// The data of an `NBD_REP_INFO` reply carrying a string (`NBD_INFO_NAME`, `_DESCRIPTION`).
pub fn info_string(kind: u16, s: &str) -> Vec<u8> {
    let mut d = Vec::with_capacity(2 + s.len());
    d.extend_from_slice(&kind.to_be_bytes());
    d.extend_from_slice(s.as_bytes());
    d
}

/// The data of an `NBD_REP_SERVER` reply.
pub fn rep_server(name: &str) -> Vec<u8> {
    let mut d = Vec::with_capacity(4 + name.len());
    // Export names come from the catalog; the handshake refuses ones over 4096 bytes.
    d.extend_from_slice(&(name.len() as u32).to_be_bytes());
    d.extend_from_slice(name.as_bytes());
    d
}

/// The data of an `NBD_REP_META_CONTEXT` reply.
pub fn rep_meta_context(id: u32, name: &str) -> Vec<u8> {
    let mut d = Vec::with_capacity(4 + name.len());
    d.extend_from_slice(&id.to_be_bytes());
    d.extend_from_slice(name.as_bytes());
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    fn go_data(name: &str, info: &[u16]) -> Vec<u8> {
        let mut d = Vec::new();
        d.extend_from_slice(&(name.len() as u32).to_be_bytes());
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&(info.len() as u16).to_be_bytes());
        for i in info {
            d.extend_from_slice(&i.to_be_bytes());
        }
        d
    }

    #[test]
    fn go_parses_and_rejects_bad_lengths() {
        let d = go_data("vm1", &[INFO_BLOCK_SIZE, INFO_NAME]);
        assert_eq!(
            parse_option(OPT_GO, &d),
            Ok(ClientOption::Go(GoRequest {
                name: "vm1".into(),
                info: vec![INFO_BLOCK_SIZE, INFO_NAME]
            }))
        );
        // Every truncation is invalid, never a panic.
        for cut in 0..d.len() {
            assert!(parse_option(OPT_GO, &d[..cut]).is_err(), "cut at {cut}");
        }
        // Trailing bytes are invalid too.
        let mut long = d.clone();
        long.push(0);
        assert!(parse_option(OPT_INFO, &long).is_err());
        // A name length that points past the data.
        let mut lie = d.clone();
        lie[..4].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(parse_option(OPT_GO, &lie).is_err());
    }

    #[test]
    fn strings_must_be_utf8_without_nul() {
        assert!(parse_option(OPT_EXPORT_NAME, b"a\0b").is_err());
        assert!(parse_option(OPT_EXPORT_NAME, &[0xff, 0xfe]).is_err());
        assert!(parse_option(OPT_EXPORT_NAME, &vec![b'a'; 4097]).is_err());
        assert_eq!(
            parse_option(OPT_EXPORT_NAME, b""),
            Ok(ClientOption::ExportName(String::new()))
        );
    }

    #[test]
    fn options_without_data_refuse_data() {
        assert!(parse_option(OPT_LIST, b"x").is_err());
        assert!(parse_option(OPT_STRUCTURED_REPLY, b"x").is_err());
        assert_eq!(parse_option(OPT_ABORT, b"junk"), Ok(ClientOption::Abort));
        assert_eq!(parse_option(99, b"junk"), Ok(ClientOption::Unknown(99)));
    }

    #[test]
    fn meta_queries() {
        let mut d = Vec::new();
        d.extend_from_slice(&2u32.to_be_bytes());
        d.extend_from_slice(b"vm");
        d.extend_from_slice(&2u32.to_be_bytes());
        for q in ["base:allocation", "qemu:dirty-bitmap:x"] {
            d.extend_from_slice(&(q.len() as u32).to_be_bytes());
            d.extend_from_slice(q.as_bytes());
        }
        let parsed = parse_option(OPT_SET_META_CONTEXT, &d);
        assert_eq!(
            parsed,
            Ok(ClientOption::SetMetaContext(MetaRequest {
                export: "vm".into(),
                queries: vec!["base:allocation".into(), "qemu:dirty-bitmap:x".into()]
            }))
        );
        for cut in 0..d.len() {
            assert!(parse_option(OPT_LIST_META_CONTEXT, &d[..cut]).is_err());
        }
        use MetaContext::*;
        let none: &[String] = &[];
        let base = Ok(vec![BaseAllocation]);
        assert_eq!(match_meta_query("base:allocation", false, none), base);
        assert_eq!(match_meta_query("base:", false, none), Ok(vec![]));
        assert_eq!(match_meta_query("base:", true, none), base);
        assert_eq!(match_meta_query("base:other", true, none), Ok(vec![]));
        assert_eq!(
            match_meta_query("qemu:dirty-bitmap:x", true, none),
            Ok(vec![])
        );
        assert!(match_meta_query("nocolon", true, none).is_err());
        let snaps = vec!["s1".to_string(), "s2".to_string()];
        let both = Ok(vec![DirtyBitmap("s1".into()), DirtyBitmap("s2".into())]);
        for q in ["qemu:", "qemu:dirty-bitmap:"] {
            assert_eq!(match_meta_query(q, true, &snaps), both, "{q}");
            assert_eq!(match_meta_query(q, false, &snaps), Ok(vec![]), "{q}");
        }
        for list in [true, false] {
            assert_eq!(
                match_meta_query("qemu:dirty-bitmap:s2", list, &snaps),
                Ok(vec![DirtyBitmap("s2".into())])
            );
            assert_eq!(
                match_meta_query("qemu:dirty-bitmap:s3", list, &snaps),
                Ok(vec![])
            );
            assert_eq!(
                match_meta_query("qemu:allocation-depth", list, &snaps),
                Ok(vec![])
            );
            assert_eq!(
                match_meta_query("qemu:dirty-bitmap", list, &snaps),
                Ok(vec![])
            );
        }
        // Whole requests: LIST of nothing is everything; duplicates are named once.
        assert_eq!(
            select_meta_contexts(&[], true, &snaps),
            Ok(vec![
                BaseAllocation,
                DirtyBitmap("s1".into()),
                DirtyBitmap("s2".into())
            ])
        );
        assert_eq!(select_meta_contexts(&[], false, &snaps), Ok(vec![]));
        let qs: Vec<String> = [
            "qemu:dirty-bitmap:s2",
            "base:allocation",
            "qemu:dirty-bitmap:s2",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        assert_eq!(
            select_meta_contexts(&qs, false, &snaps),
            Ok(vec![DirtyBitmap("s2".into()), BaseAllocation])
        );
        assert!(meta_queries_need_snapshots(&[], true));
        assert!(!meta_queries_need_snapshots(&[], false));
        assert!(meta_queries_need_snapshots(&qs, false));
        assert!(!meta_queries_need_snapshots(&qs[1..2], true));
        assert!(dirty_bitmap_offerable("daily"));
        assert!(!dirty_bitmap_offerable(".internal"));
        assert!(!dirty_bitmap_offerable(&"x".repeat(STRING_BYTES_MAX)));
    }

    fn negotiated() -> Negotiated {
        Negotiated {
            size: 1 << 20,
            read_only: false,
            structured: true,
            block_status: true,
            payload_bytes_max: 1 << 25,
        }
    }

    fn header(kind: u16, flags: u16, offset: u64, len: u32) -> RequestHeader {
        RequestHeader {
            flags,
            kind,
            cookie: 7,
            offset,
            len,
        }
    }

    #[test]
    fn request_checks() {
        let n = negotiated();
        let run = |h| matches!(check_request(&h, &n), Verdict::Run(_));
        let error = |h| match check_request(&h, &n) {
            Verdict::Reject { error, .. } => Some(error),
            _ => None,
        };
        assert!(run(header(CMD_READ, 0, 0, 4096)));
        assert!(run(header(CMD_READ, CMD_FLAG_DF, 1, 4095)));
        assert_eq!(error(header(CMD_READ, 0, (1 << 20) - 1, 2)), Some(EINVAL));
        assert_eq!(error(header(CMD_READ, 0, u64::MAX, 2)), Some(EINVAL));
        assert_eq!(error(header(CMD_WRITE, 0, 1 << 20, 1)), Some(ENOSPC));
        assert_eq!(error(header(CMD_WRITE_ZEROES, 0, 1 << 20, 1)), Some(ENOSPC));
        assert_eq!(error(header(CMD_TRIM, 0, 1 << 20, 1)), Some(EINVAL));
        assert_eq!(error(header(CMD_FLUSH, 0, 1, 0)), Some(EINVAL));
        assert_eq!(
            error(header(CMD_READ, CMD_FLAG_NO_HOLE, 0, 1)),
            Some(EINVAL)
        );
        assert_eq!(error(header(CMD_WRITE, 1 << 9, 0, 1)), Some(EINVAL));
        assert_eq!(error(header(42, 0, 0, 0)), Some(EINVAL));
        assert_eq!(error(header(CMD_BLOCK_STATUS, 0, 0, 0)), Some(EINVAL));
        // A rejected write still has its payload to skip.
        assert_eq!(
            check_request(&header(CMD_WRITE, 1 << 9, 0, 100), &n),
            Verdict::Reject {
                error: EINVAL,
                skip: 100,
                message: "command flags 0x200 are not valid for command 1".into()
            }
        );
        // Too large a write payload cannot be skipped cheaply: disconnect.
        assert!(matches!(
            check_request(&header(CMD_WRITE, 0, 0, (1 << 25) + 1), &n),
            Verdict::Disconnect(_)
        ));
        assert_eq!(
            check_request(&header(CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE, 0, 8), &n),
            Verdict::Run(Command::WriteZeroes {
                offset: 0,
                len: 8,
                fua: false,
                may_unmap: false,
                fast: false
            })
        );
        let ro = Negotiated {
            read_only: true,
            ..n
        };
        assert!(matches!(
            check_request(&header(CMD_TRIM, 0, 0, 1), &ro),
            Verdict::Reject { error: EPERM, .. }
        ));
        let simple = Negotiated {
            structured: false,
            block_status: false,
            ..n
        };
        assert!(matches!(
            check_request(&header(CMD_READ, CMD_FLAG_DF, 0, 1), &simple),
            Verdict::Reject { error: EINVAL, .. }
        ));
        assert!(matches!(
            check_request(&header(CMD_BLOCK_STATUS, 0, 0, 1), &simple),
            Verdict::Reject { error: EINVAL, .. }
        ));
    }

    #[test]
    fn request_header_round_trip() {
        let mut b = [0u8; REQUEST_HEADER_BYTES];
        b[..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&1u16.to_be_bytes());
        b[6..8].copy_from_slice(&CMD_WRITE.to_be_bytes());
        b[8..16].copy_from_slice(&0xdead_beefu64.to_be_bytes());
        b[16..24].copy_from_slice(&512u64.to_be_bytes());
        b[24..28].copy_from_slice(&4096u32.to_be_bytes());
        assert_eq!(
            parse_request_header(&b),
            Ok(RequestHeader {
                flags: 1,
                kind: CMD_WRITE,
                cookie: 0xdead_beef,
                offset: 512,
                len: 4096
            })
        );
        b[0] = 0;
        assert!(parse_request_header(&b).is_err());
    }

    fn ext(offset: u64, len: u64, kind: ExtentKind) -> Extent {
        Extent { offset, len, kind }
    }

    #[test]
    fn descriptors_clip_merge_and_fill_gaps() {
        use ExtentKind::*;
        let e = [
            ext(0, 4096, Data),
            ext(4096, 4096, Zero),
            ext(8192, 8192, Unmapped),
        ];
        assert_eq!(
            block_status_descriptors(&e, 100, 10000, false),
            vec![
                (3996, 0),
                (4096, STATE_ZERO),
                (1908, STATE_HOLE | STATE_ZERO)
            ]
        );
        assert_eq!(
            block_status_descriptors(&e, 100, 10000, true),
            vec![(3996, 0)]
        );
        // A gap in the engine's answer reads as data; a short answer is filled up.
        let gappy = [ext(4096, 4096, Unmapped)];
        assert_eq!(
            block_status_descriptors(&gappy, 0, 12288, false),
            vec![(4096, 0), (4096, STATE_HOLE | STATE_ZERO), (4096, 0)]
        );
        assert_eq!(block_status_descriptors(&[], 0, 10, false), vec![(10, 0)]);
        // Huge extents are split below 2^32.
        let big = [ext(0, 1 << 33, Unmapped)];
        let d = block_status_descriptors(&big, 0, 1 << 33, false);
        assert_eq!(d.iter().map(|x| u64::from(x.0)).sum::<u64>(), 1 << 33);
        assert!(d.len() == 3);
    }

    #[test]
    fn dirty_descriptors_cover_clip_and_treat_gaps_as_dirty() {
        let ch = |offset, len, changed| Change {
            offset,
            len,
            changed,
        };
        let c = [
            ch(0, 8192, false),
            ch(8192, 4096, true),
            ch(12288, 4096, false),
        ];
        assert_eq!(
            dirty_bitmap_descriptors(&c, 100, 12288, false),
            vec![(8092, 0), (4096, STATE_DIRTY), (100, 0)]
        );
        assert_eq!(
            dirty_bitmap_descriptors(&c, 8192, 8192, true),
            vec![(4096, STATE_DIRTY)]
        );
        // A short or gappy answer is filled with dirty, the safe side for a backup.
        let gappy = [ch(4096, 4096, false)];
        assert_eq!(
            dirty_bitmap_descriptors(&gappy, 0, 12288, false),
            vec![(4096, STATE_DIRTY), (4096, 0), (4096, STATE_DIRTY)]
        );
        assert_eq!(
            dirty_bitmap_descriptors(&[], 0, 10, false),
            vec![(10, STATE_DIRTY)]
        );
        let big = [ch(0, 1 << 33, true)];
        let d = dirty_bitmap_descriptors(&big, 0, 1 << 33, false);
        assert_eq!(d.iter().map(|x| u64::from(x.0)).sum::<u64>(), 1 << 33);
    }

    #[test]
    fn extents_cover_a_read_only_without_gaps() {
        use ExtentKind::*;
        let e = [ext(0, 4096, Unmapped), ext(4096, 4096, Data)];
        assert!(covers(&e, 0, 8192));
        assert!(covers(&e, 10, 5000), "extents may reach past both ends");
        assert!(!covers(&e, 0, 8193), "the end is not covered");
        assert!(!covers(&e[1..], 0, 8192), "the start is not covered");
        let gap = [ext(0, 4096, Data), ext(8192, 4096, Data)];
        assert!(!covers(&gap, 0, 12288));
        assert!(covers(&gap, 8192, 10));
        assert!(!covers(&[], 0, 1));
        assert!(covers(&[], 0, 0));
        assert!(!covers(&e, u64::MAX, 2));
    }

    #[test]
    fn read_plan_covers_exactly() {
        use ExtentKind::*;
        let e = [
            ext(0, 4096, Unmapped),
            ext(4096, 4096, Data),
            ext(8192, 4096, Zero),
            ext(12288, 4096, Unmapped),
        ];
        assert_eq!(
            plan_read(&e, 10, 12000),
            vec![
                ReadPiece {
                    offset: 10,
                    len: 4086,
                    hole: true
                },
                ReadPiece {
                    offset: 4096,
                    len: 4096,
                    hole: false
                },
                ReadPiece {
                    offset: 8192,
                    len: 3818,
                    hole: true
                },
            ]
        );
    }
}

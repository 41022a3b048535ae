//! The transmission phase: read requests, run them on the blocking pool (the Volume API is
//! blocking), and send replies as they complete, out of order.
//!
//! One reader loop per connection parses requests and hands them to the server's worker
//! threads ([`Workers`]); one writer task owns the socket's write half and sends whole replies.
//! Memory is bounded by the in-flight budget ([`crate::budget`]): every request — run,
//! refused, or failed — holds a permit sized for its buffers and its reply from the moment its
//! header is read until its reply is written, and the reader stops reading while the budget is
//! spent. A client that never reads its replies therefore stops being read, and what the
//! server holds for it stays within the budget.

use crate::budget::{ConnBudget, Permit};
use crate::buffers::{Buf, BufPool};
use crate::export::Export;
use crate::metrics::NbdMetrics;
use crate::proto::*;
use crate::wire::{self, Command, MetaContext, RequestHeader, Verdict};
use crate::workers::Workers;
use condense_api::Volume;
use std::cell::Cell;
use std::io::IoSlice;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::sync::{mpsc, watch};

/// A block status query asks the volume about at most this many bytes at a time (the protocol
/// lets the server answer less than asked; clients continue where the answer stops).
const BLOCK_STATUS_QUERY_BYTES_MAX: u64 = 1 << 30;
/// Descriptors one block status chunk carries at most (128 KiB); the answer then covers less
/// than asked, and the client continues where it stops.
const BLOCK_STATUS_DESCRIPTORS_MAX: usize = 16 * 1024;
/// Bytes of an error message sent to the client at most: every reply of a request that costs
/// one budget unit fits in it.
const ERROR_MESSAGE_BYTES_MAX: usize = 1024;

/// A reply ready to be written, with the budget it holds until then.
struct Reply {
    answer: Answer,
    _permit: Permit,
}

/// A reply's bytes in wire order: headers built here (all in `head`) and data read from the
/// volume (one buffer, `data`).
struct Answer {
    head: Vec<u8>,
    data: Option<Buf>,
    parts: Vec<Part>,
}

/// A piece of an [`Answer`] on the wire.
enum Part {
    Head(Range<usize>),
    Data(Range<usize>),
}

impl Answer {
    /// A reply of headers only.
    fn head(head: Vec<u8>) -> Answer {
        let parts = vec![Part::Head(0..head.len())];
        Answer {
            head,
            data: None,
            parts,
        }
    }

    fn bytes(&self, part: &Part) -> &[u8] {
        match part {
            Part::Head(r) => &self.head[r.clone()],
            Part::Data(r) => self
                .data
                .as_ref()
                .map_or(&[][..], |d| &d.as_slice()[r.clone()]),
        }
    }
}

/// How the transmission phase ended.
#[derive(Debug, PartialEq, Eq)]
pub enum End {
    /// NBD_CMD_DISC: every outstanding request was answered.
    Disconnect,
    /// The client closed the socket.
    Closed,
    /// The server is shutting down: requests in flight were answered, then the socket closed.
    Shutdown,
    /// The client broke the protocol beyond recovery (bad magic, absurd payload).
    ProtocolViolation(String),
    /// The socket failed.
    Io(String),
}

/// What a request needs to run on the blocking pool.
struct Job {
    volume: Arc<dyn Volume>,
    cookie: u64,
    structured: bool,
    command: Command,
    payload: Option<Buf>,
    buffers: Arc<BufPool>,
    /// The selected metadata contexts, for BLOCK_STATUS.
    contexts: Arc<[(u32, MetaContext)]>,
    metrics: Arc<NbdMetrics>,
    /// When the request's header was read.
    started: Instant,
}

/// Run the transmission phase until the client disconnects or shutdown is signalled.
#[allow(clippy::too_many_arguments)] // each is a separate piece of the server's shared state
pub async fn serve<R, W>(
    reader: R,
    writer: W,
    export: Export,
    workers: &Workers,
    buffers: &Arc<BufPool>,
    metrics: &Arc<NbdMetrics>,
    budget: ConnBudget,
    shutdown: watch::Receiver<bool>,
) -> End
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin + Send + 'static,
{
    // Unbounded as a channel, bounded by the budget: every reply on it holds a permit.
    let (tx, rx) = mpsc::unbounded_channel::<Reply>();
    // Aborted if this connection is dropped (shutdown past its drain timeout): the socket then
    // closes even while a client that never reads keeps the writer waiting.
    let mut writer_task = AbortOnDrop(tokio::spawn(write_replies(writer, rx)));
    let block_size = export.volume.block_size().max(1) as usize;
    let mut conn = Conn {
        // Pipelined clients send many requests per segment: read them from a buffer, not with
        // two system calls each. Small (64 KiB, 15 small writes): the part of a large write's
        // payload that arrives through the buffer is copied twice, the rest goes straight into
        // the payload buffer (256 KiB cost 2 % of serve's CPU in copies under 1 MiB writes).
        reader: BufReader::with_capacity(64 * 1024, reader),
        tx,
        export,
        block_size,
        workers,
        buffers,
        metrics,
        budget,
        shutdown,
    };

    let end = loop {
        if let Err(end) = conn.next_request().await {
            break end;
        }
    };
    // Every request already read gets its reply before the socket closes (at shutdown the
    // server's drain timeout bounds this for a client that does not read).
    conn.budget.drained().await;
    drop(conn.tx);
    match (&mut writer_task.0).await {
        Ok(Ok(())) => end,
        Ok(Err(e)) if end == End::Disconnect || end == End::Shutdown => End::Io(e.to_string()),
        _ => end,
    }
}

/// A task aborted when its handle is dropped.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// One connection in the transmission phase: the socket's buffered read half, the channel to
/// its reply writer, and the server's state its requests use.
struct Conn<'a, R> {
    reader: BufReader<R>,
    tx: mpsc::UnboundedSender<Reply>,
    export: Export,
    block_size: usize,
    workers: &'a Workers,
    buffers: &'a Arc<BufPool>,
    metrics: &'a Arc<NbdMetrics>,
    budget: ConnBudget,
    shutdown: watch::Receiver<bool>,
}

/// A request the checks refused: the NBD error, the payload bytes to skip and a message.
type Refused = (u32, u32, String);

impl<R: AsyncRead + Unpin> Conn<'_, R> {
    /// Read one request and answer it, or hand it to a worker; `Err` ends the phase.
    async fn next_request(&mut self) -> Result<(), End> {
        let header = self.read_header().await?;
        let n = self.export.negotiated;
        let request = match wire::check_request(&header, &n) {
            Verdict::Disconnect(why) => return Err(End::ProtocolViolation(why)),
            Verdict::Run(Command::Disc) => return Err(End::Disconnect),
            Verdict::Run(command) => Ok(command),
            Verdict::Reject {
                error,
                skip,
                message,
            } => Err((error, skip, message)),
        };
        // Wait for room before anything is read or built for this request.
        let cost = request.as_ref().map_or(0, |c| {
            request_bytes(c, n.structured, self.block_size, self.export.contexts.len())
        });
        let permit = self.reserve(cost).await?;
        let command = match request {
            Ok(command) => command,
            Err(refused) => return self.refuse(&header, refused, permit).await,
        };
        let started = Instant::now();
        let payload = self.read_payload(&command).await?;
        let job = Job {
            volume: self.export.volume.clone(),
            cookie: header.cookie,
            structured: n.structured,
            command,
            payload,
            buffers: self.buffers.clone(),
            contexts: self.export.contexts.clone(),
            metrics: self.metrics.clone(),
            started,
        };
        self.dispatch(job, permit)
    }

    /// The next request's header, unless shutdown comes first or the socket ends.
    async fn read_header(&mut self) -> Result<RequestHeader, End> {
        let mut raw = [0u8; REQUEST_HEADER_BYTES];
        if *self.shutdown.borrow() {
            return Err(End::Shutdown);
        }
        let read = if self.reader.buffer().len() >= REQUEST_HEADER_BYTES {
            self.reader.read_exact(&mut raw).await
        } else {
            tokio::select! {
                r = self.reader.read_exact(&mut raw) => r,
                _ = self.shutdown.changed() => return Err(End::Shutdown),
            }
        };
        if let Err(e) = read {
            return Err(if e.kind() == std::io::ErrorKind::UnexpectedEof {
                End::Closed
            } else {
                End::Io(e.to_string())
            });
        }
        match wire::parse_request_header(&raw) {
            Ok(h) => Ok(h),
            Err(magic) => Err(End::ProtocolViolation(format!("request magic {magic:#x}"))),
        }
    }

    /// A permit for `cost` bytes of the in-flight budget, waiting for room if it is spent.
    async fn reserve(&mut self, cost: usize) -> Result<Permit, End> {
        match self.budget.try_acquire(cost) {
            Some(p) => Ok(p),
            None => tokio::select! {
                p = self.budget.acquire(cost) => match p {
                    Ok(p) => Ok(p),
                    Err(_) => Err(End::Io("in-flight budget closed".to_string())),
                },
                // A client that stopped reading while its budget is spent: end on shutdown too.
                _ = self.shutdown.changed() => Err(End::Shutdown),
            },
        }
    }

    /// Answer a refused request with its error, after skipping its payload.
    async fn refuse(
        &mut self,
        header: &RequestHeader,
        (error, skip, message): Refused,
        permit: Permit,
    ) -> Result<(), End> {
        tracing::debug!(?header, error, message, "request refused");
        self.metrics.request_refused();
        if let Err(e) = discard(&mut self.reader, skip).await {
            return Err(End::Io(e.to_string()));
        }
        let structured = self.export.negotiated.structured;
        let answer = Answer::head(error_reply(header, structured, error, &message));
        let reply = Reply {
            answer,
            _permit: permit,
        };
        if self.tx.send(reply).is_err() {
            return Err(End::Io("reply writer stopped".to_string()));
        }
        Ok(())
    }

    /// A write's payload, read into a buffer from the pool; `None` for other commands.
    async fn read_payload(&mut self, command: &Command) -> Result<Option<Buf>, End> {
        let mut payload = None;
        if let Command::Write { len, .. } = *command {
            // check_request hung up on larger payloads.
            debug_assert!(len <= self.export.negotiated.payload_bytes_max);
            let mut buf = self.buffers.take(len as usize);
            if let Err(e) = self.reader.read_exact(buf.as_mut_slice()).await {
                return Err(End::Io(format!("reading a write payload: {e}")));
            }
            payload = Some(buf);
        }
        Ok(payload)
    }

    /// Run a small job on this task and queue its reply, or hand it to a worker thread.
    fn dispatch(&self, job: Job, permit: Permit) -> Result<(), End> {
        // Small reads are answered on this task: a cached block costs a few
        // microseconds, less than waking a worker thread and back.
        let inline = match job.command {
            Command::Read { len, .. } => len as usize <= INLINE_READ_BYTES_MAX,
            Command::Write { len, fua, .. } => !fua && len as usize <= INLINE_WRITE_BYTES_MAX,
            _ => false,
        };
        if inline {
            let reply = Reply {
                answer: run_job(job),
                _permit: permit,
            };
            if self.tx.send(reply).is_err() {
                return Err(End::Io("reply writer stopped".to_string()));
            }
            return Ok(());
        }
        let tx = self.tx.clone();
        self.workers.submit(Box::new(move || {
            let reply = Reply {
                answer: run_job(job),
                _permit: permit,
            };
            // The writer is gone only when the connection already failed; dropping
            // the reply then releases its budget all the same.
            let _ = tx.send(reply);
        }));
        Ok(())
    }
}

/// Bytes a request holds until its reply is written: its payload or data buffer as allocated,
/// and its reply's headers (a reply of headers only fits in the one unit every request costs).
fn request_bytes(c: &Command, structured: bool, block_size: usize, contexts: usize) -> usize {
    match *c {
        Command::Read { len, .. } => {
            let len = len as usize;
            // A structured read sends a chunk per run of data or holes: at most one per block
            // touched and one more, each a header of at most 32 bytes and a part of 24.
            let chunks = if structured { len / block_size + 2 } else { 1 };
            BufPool::alloc_bytes(len) + chunks * 64
        }
        Command::Write { len, .. } => BufPool::alloc_bytes(len as usize),
        Command::BlockStatus { .. } => contexts.max(1) * (24 + 8 * BLOCK_STATUS_DESCRIPTORS_MAX),
        _ => 0,
    }
}

/// Reads up to this size run on the connection's task instead of a worker thread.
const INLINE_READ_BYTES_MAX: usize = 16 * 1024;

/// Writes up to this size (without FUA) run on the connection's task too: hashing and
/// staging 4 KiB costs a few microseconds, less than the two thread hand-offs of a worker.
const INLINE_WRITE_BYTES_MAX: usize = 16 * 1024;

/// Run one request's volume call and count it; a panic becomes an EIO reply instead of a
/// lost request.
fn run_job(job: Job) -> Answer {
    let cookie = job.cookie;
    let structured = job.structured;
    let (metrics, command, started) = (job.metrics.clone(), job.command, job.started);
    let failed = Cell::new(false);
    let answer = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| execute(job, &failed)));
    metrics.request_done(&command, started.elapsed(), failed.get() || answer.is_err());
    answer.unwrap_or_else(|_| {
        tracing::error!(cookie, "volume call panicked");
        let h = RequestHeader {
            flags: 0,
            kind: CMD_WRITE,
            cookie,
            offset: 0,
            len: 0,
        };
        Answer::head(error_reply(&h, structured, EIO, "internal error"))
    })
}

async fn discard<R: AsyncRead + Unpin>(reader: &mut R, mut n: u32) -> std::io::Result<()> {
    let mut scratch = [0u8; 8192];
    while n > 0 {
        let want = (n as usize).min(scratch.len());
        reader.read_exact(&mut scratch[..want]).await?;
        n -= want as u32;
    }
    Ok(())
}

async fn write_replies<W: AsyncWrite + Unpin>(
    writer: W,
    mut rx: mpsc::UnboundedReceiver<Reply>,
) -> std::io::Result<()> {
    let mut w = BufWriter::with_capacity(256 * 1024, writer);
    while let Some(reply) = rx.recv().await {
        let mut next = Some(reply);
        // Write everything that is ready, then flush once.
        while let Some(r) = next.take() {
            write_answer(&mut w, &r.answer).await?;
            // Written (into the buffer, flushed below): its budget goes back.
            drop(r);
            next = rx.try_recv().ok();
        }
        w.flush().await?;
    }
    w.flush().await?;
    w.shutdown().await
}

/// Write a reply's parts with vectored writes: rustls then puts the reply's header into the
/// same TLS record as the first data (not a 16-byte record and system call of its own ahead of
/// 1 MiB), and a plaintext socket gets the whole reply in one `writev`. `w` is a `BufWriter`:
/// small replies are still gathered in its buffer, large ones pass straight through; a stream
/// without vectored writes (OpenSSL's, for TLS-PSK) is written part by part as before.
async fn write_answer<W: AsyncWrite + Unpin>(w: &mut W, answer: &Answer) -> std::io::Result<()> {
    let mut slices: Vec<IoSlice<'_>> = answer
        .parts
        .iter()
        .map(|p| IoSlice::new(answer.bytes(p)))
        .collect();
    let mut rest = &mut slices[..];
    IoSlice::advance_slices(&mut rest, 0);
    while !rest.is_empty() {
        let n = w.write_vectored(rest).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut rest, n);
    }
    Ok(())
}

/// The error reply for a request: a structured error chunk when structured replies were
/// negotiated (required for READ, and it carries the message), else a simple reply.
fn error_reply(h: &RequestHeader, structured: bool, error: u32, message: &str) -> Vec<u8> {
    let mut message = message;
    if message.len() > ERROR_MESSAGE_BYTES_MAX {
        let mut end = ERROR_MESSAGE_BYTES_MAX;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message = &message[..end];
    }
    let mut out = Vec::with_capacity(32 + message.len());
    if structured {
        wire::put_error_chunk(&mut out, h.cookie, error, message);
    } else {
        wire::put_simple_reply(&mut out, h.cookie, error);
    }
    out
}

fn ok_reply(cookie: u64) -> Answer {
    let mut out = Vec::with_capacity(16);
    wire::put_simple_reply(&mut out, cookie, 0);
    Answer::head(out)
}

/// Run one request against the volume and build its reply; `failed` is set when the reply
/// is an error. Blocking.
fn execute(job: Job, failed: &Cell<bool>) -> Answer {
    let Job {
        volume,
        cookie,
        structured,
        command,
        payload,
        buffers,
        contexts,
        ..
    } = job;
    let v = volume.as_ref();
    let header = RequestHeader {
        flags: 0,
        kind: 0,
        cookie,
        offset: 0,
        len: 0,
    };
    let fail = |e: condense_api::VolumeError| {
        tracing::debug!(cookie, error = %e, "request failed");
        failed.set(true);
        Answer::head(error_reply(
            &header,
            structured,
            nbd_error_from_errno(e.errno()),
            &e.to_string(),
        ))
    };
    let done = |r: condense_api::Result<()>| match r {
        Ok(()) => ok_reply(cookie),
        Err(e) => fail(e),
    };
    match command {
        Command::Read { offset, len, df } => {
            let r = if structured {
                read_structured(v, &buffers, cookie, offset, len, df)
            } else {
                read_simple(v, &buffers, cookie, offset, len)
            };
            r.unwrap_or_else(fail)
        }
        Command::Write { offset, fua, .. } => {
            let data = payload.as_ref().map(Buf::as_slice).unwrap_or_default();
            done(v.write(offset, data, fua))
        }
        Command::Flush => done(v.flush()),
        Command::Trim { offset, len, fua } => {
            if len == 0 {
                ok_reply(cookie)
            } else {
                done(v.trim(offset, u64::from(len), fua))
            }
        }
        // Every volume zeroes by changing its block map, never by writing data: always fast.
        Command::WriteZeroes {
            offset,
            len,
            fua,
            may_unmap,
            fast: _,
        } => {
            if len == 0 {
                ok_reply(cookie)
            } else {
                done(v.write_zeroes(offset, u64::from(len), may_unmap, fua))
            }
        }
        Command::Cache { .. } => ok_reply(cookie),
        Command::BlockStatus {
            offset,
            len,
            req_one,
        } => block_status(v, cookie, &contexts, offset, len, req_one).unwrap_or_else(fail),
        // Handled by the reader loop; never dispatched.
        Command::Disc => Answer::head(Vec::new()),
    }
}

/// One `NBD_REPLY_TYPE_BLOCK_STATUS` chunk per selected context, in id order, the last one
/// final. Each answers for at most [`BLOCK_STATUS_QUERY_BYTES_MAX`] bytes from `offset` in at
/// most [`BLOCK_STATUS_DESCRIPTORS_MAX`] descriptors. If any context cannot be answered the
/// reply is that error alone.
fn block_status(
    v: &dyn Volume,
    cookie: u64,
    contexts: &[(u32, MetaContext)],
    offset: u64,
    len: u32,
    req_one: bool,
) -> condense_api::Result<Answer> {
    if contexts.is_empty() {
        // check_request refuses this earlier; never send a reply without a final chunk.
        return Err(condense_api::VolumeError::Invalid(
            "no metadata context selected".to_string(),
        ));
    }
    let query = u64::from(len).min(BLOCK_STATUS_QUERY_BYTES_MAX);
    let mut chunks = Vec::with_capacity(contexts.len());
    for (id, context) in contexts {
        let mut d = match context {
            MetaContext::BaseAllocation => {
                let extents = v.block_status(offset, query)?;
                wire::block_status_descriptors(&extents, offset, query, req_one)
            }
            MetaContext::DirtyBitmap(snapshot) => {
                let changes = v.changed_since(snapshot, offset, query)?;
                wire::dirty_bitmap_descriptors(&changes, offset, query, req_one)
            }
        };
        d.truncate(BLOCK_STATUS_DESCRIPTORS_MAX);
        chunks.push((*id, d));
    }
    let last = chunks.len().saturating_sub(1);
    let bytes: usize = chunks.iter().map(|(_, d)| 24 + 8 * d.len()).sum();
    let mut out = Vec::with_capacity(bytes);
    for (i, (id, d)) in chunks.iter().enumerate() {
        wire::put_block_status_chunk(&mut out, cookie, i == last, *id, d);
    }
    Ok(Answer::head(out))
}

fn read_simple(
    v: &dyn Volume,
    buffers: &Arc<BufPool>,
    cookie: u64,
    offset: u64,
    len: u32,
) -> condense_api::Result<Answer> {
    let mut data = buffers.take(len as usize);
    if len > 0 {
        v.read(offset, data.as_mut_slice())?;
    }
    let mut head = Vec::with_capacity(16);
    wire::put_simple_reply(&mut head, cookie, 0);
    Ok(Answer {
        parts: vec![Part::Head(0..head.len()), Part::Data(0..len as usize)],
        head,
        data: Some(data),
    })
}

/// A structured read: data chunks for the data runs, hole chunks for the rest, all data read
/// into one buffer of the request's length (the budget charged for it).
fn read_structured(
    v: &dyn Volume,
    buffers: &Arc<BufPool>,
    cookie: u64,
    offset: u64,
    len: u32,
    df: bool,
) -> condense_api::Result<Answer> {
    if len == 0 {
        let mut out = Vec::with_capacity(20);
        wire::put_chunk_header(&mut out, cookie, REPLY_FLAG_DONE, REPLY_TYPE_NONE, 0);
        return Ok(Answer::head(out));
    }
    let mut data = buffers.take(len as usize);
    // One call reads the data and says where the holes are (counted by the volume as one
    // read). Extents that do not cover the request exactly (a volume's bug) would leave bytes
    // of the buffer unread: then the whole range is read and sent as data.
    let pieces = if df {
        None
    } else {
        let extents = v.read_sparse(offset, data.as_mut_slice())?;
        wire::covers(&extents, offset, u64::from(len))
            .then(|| wire::plan_read(&extents, offset, len))
    };
    let pieces = match pieces {
        Some(p) => p,
        None => {
            v.read(offset, data.as_mut_slice())?;
            vec![wire::ReadPiece {
                offset,
                len,
                hole: false,
            }]
        }
    };
    let mut data = pieces.iter().any(|p| !p.hole).then_some(data);
    let last = pieces.len().saturating_sub(1);
    let mut parts = Vec::with_capacity(pieces.len() * 2);
    let mut head = Vec::new();
    // Start of the headers not yet in a part.
    let mut mark = 0;
    for (i, p) in pieces.iter().enumerate() {
        let final_chunk = i == last;
        if p.hole {
            wire::put_hole_chunk(&mut head, cookie, final_chunk, p.offset, p.len);
            continue;
        }
        // Pieces lie inside [offset, offset + len) (plan_read clips them).
        let at = p.offset.saturating_sub(offset) as usize;
        let range = at..at + p.len as usize;
        if data
            .as_ref()
            .is_none_or(|b| b.as_slice().get(range.clone()).is_none())
        {
            return Err(condense_api::VolumeError::Io(format!(
                "read plan piece {}+{} outside the request {offset}+{len}",
                p.offset, p.len
            )));
        }
        wire::put_data_chunk_header(&mut head, cookie, final_chunk, p.offset, p.len);
        parts.push(Part::Head(mark..head.len()));
        parts.push(Part::Data(range));
        mark = head.len();
    }
    if mark < head.len() {
        parts.push(Part::Head(mark..head.len()));
    }
    Ok(Answer {
        head,
        data: data.take(),
        parts,
    })
}

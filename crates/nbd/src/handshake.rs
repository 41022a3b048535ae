//! The fixed newstyle handshake: greeting, client flags, and option haggling up to
//! `NBD_OPT_GO` / `NBD_OPT_EXPORT_NAME` (transmission), `NBD_OPT_STARTTLS` (the caller runs
//! the TLS handshake, then haggles again over TLS) or `NBD_OPT_ABORT` (end).
//!
//! TLS rules ([`Security`]): without TLS settings STARTTLS is `NBD_REP_ERR_UNSUP`. Under
//! `require`, before TLS every option but STARTTLS and ABORT is answered
//! `NBD_REP_ERR_TLS_REQD` (its data read and ignored) and `NBD_OPT_EXPORT_NAME` closes the
//! connection. Once TLS is active, STARTTLS is `NBD_REP_ERR_INVALID`, and nothing negotiated
//! before it carries over. Exports a connection's [`Access`] does not allow are neither listed
//! nor opened: they are answered exactly like exports that do not exist.

use crate::export::{self, blocking, Export};
use crate::proto::*;
use crate::state::ServerState;
use crate::tls::{Access, TlsMode};
use crate::wire::{self, ClientOption, GoRequest, MetaContext, MetaRequest, Negotiated};
use condense_api::Volume;
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::watch;

/// Option data accepted in one option; larger data is skipped and answered `ERR_TOO_BIG`.
pub const OPTION_DATA_BYTES_MAX: u32 = 64 * 1024;
/// Option data larger than this is not even skipped: hard disconnect.
const OPTION_SKIP_BYTES_MAX: u32 = 16 * 1024 * 1024;
/// Options one connection may send before it is considered abusive and dropped.
const OPTIONS_PER_CONNECTION_MAX: u32 = 4096;

/// How the handshake ended.
pub enum Outcome {
    Transmission(Export),
    /// STARTTLS was acknowledged: the next bytes on the connection are a TLS handshake.
    StartTls,
    /// The client aborted, sent something unanswerable, went away, or the server is shutting
    /// down: close the connection.
    Close(&'static str),
}

/// A failure that ends the connection during the handshake.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("socket: {0}")]
    Io(#[from] std::io::Error),
}

/// Where a connection stands with TLS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Security {
    /// The server has no TLS settings.
    NoTls,
    /// TLS is offered in this mode and not started yet.
    Plain(TlsMode),
    /// TLS is active.
    Tls,
}

/// What the option haggling of one connection starts from.
pub struct Session {
    pub security: Security,
    /// The exports this connection may list and open.
    pub access: Access,
    /// The client asked for no zero padding after NBD_OPT_EXPORT_NAME (greeting flag).
    pub no_zeroes: bool,
}

/// State carried across options.
struct Haggle<'a> {
    session: &'a Session,
    structured: bool,
    /// What the last successful NBD_OPT_SET_META_CONTEXT selected, if anything.
    meta: Option<MetaSelection>,
}

/// Metadata contexts selected for one export.
struct MetaSelection {
    /// The canonical name of the export they were selected for.
    export: String,
    contexts: Arc<[(u32, MetaContext)]>,
}

/// Read exactly `buf.len()` bytes unless shutdown is signalled first (then `Ok(false)`).
async fn read_or_shutdown<S: AsyncRead + Unpin>(
    stream: &mut S,
    buf: &mut [u8],
    shutdown: &mut watch::Receiver<bool>,
) -> std::io::Result<bool> {
    if *shutdown.borrow() {
        return Ok(false);
    }
    tokio::select! {
        r = stream.read_exact(buf) => r.map(|_| true),
        _ = shutdown.changed() => Ok(false),
    }
}

async fn skip<S: AsyncRead + Unpin>(stream: &mut S, mut n: u64) -> std::io::Result<()> {
    let mut scratch = vec![0u8; 64 * 1024];
    while n > 0 {
        let want = n.min(scratch.len() as u64) as usize;
        stream.read_exact(&mut scratch[..want]).await?;
        n -= want as u64;
    }
    Ok(())
}

async fn reply<S: AsyncWrite + Unpin>(
    stream: &mut S,
    option: u32,
    reply: u32,
    data: &[u8],
) -> std::io::Result<()> {
    let mut out = Vec::with_capacity(20 + data.len());
    wire::put_option_reply(&mut out, option, reply, data);
    stream.write_all(&out).await
}

async fn error_reply<S: AsyncWrite + Unpin>(
    stream: &mut S,
    option: u32,
    error: u32,
    message: &str,
) -> std::io::Result<()> {
    tracing::debug!(option, error, message, "option refused");
    reply(stream, option, error, message.as_bytes()).await
}

/// Send the greeting and read the client flags on a fresh connection. `Ok(None)`: close
/// (shutdown, or flags this server does not know); `Ok(Some(no_zeroes))`: options come next.
pub async fn greet<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<Option<bool>, HandshakeError> {
    let mut greeting = Vec::with_capacity(18);
    greeting.extend_from_slice(&INIT_MAGIC.to_be_bytes());
    greeting.extend_from_slice(&OPTS_MAGIC.to_be_bytes());
    greeting.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    stream.write_all(&greeting).await?;
    stream.flush().await?;

    let mut flags = [0u8; 4];
    if !read_or_shutdown(stream, &mut flags, shutdown).await? {
        return Ok(None);
    }
    let client_flags = u32::from_be_bytes(flags);
    if client_flags & !CLIENT_FLAGS_KNOWN != 0 {
        tracing::debug!(client_flags, "client sent unknown client flags");
        return Ok(None);
    }
    Ok(Some(client_flags & FLAG_C_NO_ZEROES != 0))
}

/// Haggle options until the client picks an export, starts TLS, or leaves.
pub async fn negotiate<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    server: &Arc<ServerState>,
    shutdown: &mut watch::Receiver<bool>,
    session: &Session,
) -> Result<Outcome, HandshakeError> {
    let mut state = Haggle {
        session,
        structured: false,
        meta: None,
    };

    for _ in 0..OPTIONS_PER_CONNECTION_MAX {
        let mut header = [0u8; 16];
        if !read_or_shutdown(stream, &mut header, shutdown).await? {
            return Ok(Outcome::Close("shutdown"));
        }
        let mut magic = [0u8; 8];
        magic.copy_from_slice(&header[..8]);
        if u64::from_be_bytes(magic) != OPTS_MAGIC {
            return Ok(Outcome::Close("option without the IHAVEOPT magic"));
        }
        let option = u32::from_be_bytes([header[8], header[9], header[10], header[11]]);
        let len = u32::from_be_bytes([header[12], header[13], header[14], header[15]]);
        if len > OPTION_DATA_BYTES_MAX {
            if len > OPTION_SKIP_BYTES_MAX || option == OPT_EXPORT_NAME {
                return Ok(Outcome::Close("option data too large"));
            }
            skip(stream, u64::from(len)).await?;
            error_reply(
                stream,
                option,
                REP_ERR_TOO_BIG,
                &format!("option data of {len} bytes is larger than {OPTION_DATA_BYTES_MAX}"),
            )
            .await?;
            continue;
        }
        let mut data = vec![0u8; len as usize];
        stream.read_exact(&mut data).await?;
        if *shutdown.borrow() {
            if option != OPT_ABORT {
                error_reply(
                    stream,
                    option,
                    REP_ERR_SHUTDOWN,
                    "the server is shutting down",
                )
                .await?;
            }
            return Ok(Outcome::Close("shutdown"));
        }
        if session.security == Security::Plain(TlsMode::Require)
            && option != OPT_STARTTLS
            && option != OPT_ABORT
        {
            if option == OPT_EXPORT_NAME {
                // EXPORT_NAME cannot be refused: FORCEDTLS hangs up.
                return Ok(Outcome::Close("NBD_OPT_EXPORT_NAME before STARTTLS"));
            }
            error_reply(
                stream,
                option,
                REP_ERR_TLS_REQD,
                "this server requires TLS: send NBD_OPT_STARTTLS first \
                 (nbds:// URIs, qemu tls-creds-x509 or tls-creds-psk)",
            )
            .await?;
            stream.flush().await?;
            continue;
        }
        let parsed = match wire::parse_option(option, &data) {
            Ok(p) => p,
            Err(e) => {
                if option == OPT_EXPORT_NAME {
                    // EXPORT_NAME has no error reply: the only answer is to hang up.
                    return Ok(Outcome::Close("invalid NBD_OPT_EXPORT_NAME"));
                }
                if option == OPT_SET_META_CONTEXT {
                    // SET replaces the selection even when it fails.
                    state.meta = None;
                }
                error_reply(stream, option, REP_ERR_INVALID, &e.0).await?;
                continue;
            }
        };
        if let Some(outcome) = handle_option(stream, server, &mut state, option, parsed).await? {
            stream.flush().await?;
            return Ok(outcome);
        }
        stream.flush().await?;
    }
    Ok(Outcome::Close("too many options"))
}

/// Answer one option. `Some` ends the handshake.
async fn handle_option<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    server: &Arc<ServerState>,
    state: &mut Haggle<'_>,
    option: u32,
    parsed: ClientOption,
) -> Result<Option<Outcome>, HandshakeError> {
    match parsed {
        ClientOption::Abort => {
            // The client may already be gone; that is fine.
            let _ = reply(stream, option, REP_ACK, &[]).await;
            Ok(Some(Outcome::Close("client aborted")))
        }
        ClientOption::List => {
            list_exports(stream, server, state, option).await?;
            Ok(None)
        }
        ClientOption::StartTls => start_tls(stream, state, option).await,
        ClientOption::StructuredReply => {
            if state.structured {
                error_reply(
                    stream,
                    option,
                    REP_ERR_INVALID,
                    "structured replies already negotiated",
                )
                .await?;
            } else {
                state.structured = true;
                reply(stream, option, REP_ACK, &[]).await?;
            }
            Ok(None)
        }
        ClientOption::ListMetaContext(req) => {
            meta_context(stream, server, state, option, req, true).await?;
            Ok(None)
        }
        ClientOption::SetMetaContext(req) => {
            meta_context(stream, server, state, option, req, false).await?;
            Ok(None)
        }
        ClientOption::Info(req) => {
            info_or_go(stream, server, state, option, req, false).await?;
            Ok(None)
        }
        ClientOption::Go(req) => info_or_go(stream, server, state, option, req, true).await,
        ClientOption::ExportName(name) => export_name(stream, server, state, &name).await,
        ClientOption::Unknown(code) => {
            error_reply(
                stream,
                option,
                REP_ERR_UNSUP,
                &format!("option {code} is not supported"),
            )
            .await?;
            Ok(None)
        }
    }
}

/// NBD_OPT_LIST: one reply per export this connection may see, then the ack.
async fn list_exports<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    server: &Arc<ServerState>,
    state: &Haggle<'_>,
    option: u32,
) -> Result<(), HandshakeError> {
    match export::visible_exports(&server.catalog).await {
        Ok(names) => {
            for name in names.iter().filter(|n| state.session.access.allows(n)) {
                reply(stream, option, REP_SERVER, &wire::rep_server(name)).await?;
            }
            reply(stream, option, REP_ACK, &[]).await?;
        }
        Err(e) => error_reply(stream, option, REP_ERR_UNSUP, &format!("cannot list: {e}")).await?,
    }
    Ok(())
}

/// NBD_OPT_STARTTLS: start TLS if it is configured and not yet active.
async fn start_tls<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    state: &Haggle<'_>,
    option: u32,
) -> Result<Option<Outcome>, HandshakeError> {
    match state.session.security {
        Security::NoTls => {
            error_reply(
                stream,
                option,
                REP_ERR_UNSUP,
                "TLS is not configured on this server \
             (serve with --tls-cert and --tls-key, or --tls-psk)",
            )
            .await?;
            Ok(None)
        }
        Security::Plain(_) => {
            reply(stream, option, REP_ACK, &[]).await?;
            Ok(Some(Outcome::StartTls))
        }
        Security::Tls => {
            error_reply(stream, option, REP_ERR_INVALID, "TLS is already active").await?;
            Ok(None)
        }
    }
}

/// NBD_OPT_EXPORT_NAME: open the export and answer in the old style, or hang up (this option
/// has no error reply).
async fn export_name<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    server: &Arc<ServerState>,
    state: &Haggle<'_>,
    name: &str,
) -> Result<Option<Outcome>, HandshakeError> {
    let Ok(volume) = open_export(server, state, name).await else {
        return Ok(Some(Outcome::Close(
            "NBD_OPT_EXPORT_NAME of an unknown export",
        )));
    };
    // NBD_OPT_EXPORT_NAME has no error reply: without a slot the only answer is to hang up.
    let Some(slot) = server.transmission_slot() else {
        return Ok(Some(Outcome::Close(
            "NBD_OPT_EXPORT_NAME with every transmission slot taken",
        )));
    };
    let mut export = make_export(server, state, volume);
    export.slot = Some(slot);
    let mut out = Vec::with_capacity(134);
    out.extend_from_slice(&export.negotiated.size.to_be_bytes());
    out.extend_from_slice(&export.transmission_flags.to_be_bytes());
    if !state.session.no_zeroes {
        out.extend_from_slice(&[0u8; 124]);
    }
    stream.write_all(&out).await?;
    Ok(Some(Outcome::Transmission(export)))
}

/// Open an export this connection may see; one it may not is as unknown as a missing one.
async fn open_export(
    server: &Arc<ServerState>,
    state: &Haggle<'_>,
    name: &str,
) -> Result<Arc<dyn Volume>, condense_api::VolumeError> {
    let access = &state.session.access;
    let not_found = || condense_api::VolumeError::NotFound(name.to_string());
    if !name.is_empty() && !access.allows(name) {
        return Err(not_found());
    }
    let volume = export::open(&server.catalog, name).await?;
    if !access.allows(volume.name()) {
        return Err(not_found());
    }
    Ok(volume)
}

fn make_export(server: &ServerState, state: &Haggle<'_>, volume: Arc<dyn Volume>) -> Export {
    let read_only = server.config.read_only || volume.is_read_only();
    let mut flags = TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH | TFLAG_SEND_FUA | TFLAG_SEND_CACHE;
    if read_only {
        flags |= TFLAG_READ_ONLY;
    } else {
        flags |= TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES | TFLAG_SEND_FAST_ZERO;
    }
    if state.structured {
        flags |= TFLAG_SEND_DF;
    }
    if volume.flush_is_pool_wide() {
        flags |= TFLAG_CAN_MULTI_CONN;
    }
    let contexts = match &state.meta {
        Some(m) if state.structured && m.export == volume.name() => m.contexts.clone(),
        _ => Arc::from(Vec::new()),
    };
    Export {
        negotiated: Negotiated {
            size: volume.size(),
            read_only,
            structured: state.structured,
            block_status: !contexts.is_empty(),
            payload_bytes_max: server.config.payload_bytes_max,
        },
        transmission_flags: flags,
        volume,
        contexts,
        slot: None,
    }
}

/// The preferred block size advertised: the volume's block size when the protocol allows it.
fn preferred_block_size(volume: &dyn Volume) -> u32 {
    let bs = volume.block_size();
    if bs.is_power_of_two() && (512..=(1 << 16)).contains(&bs) {
        bs
    } else {
        4096
    }
}

async fn info_or_go<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    server: &Arc<ServerState>,
    state: &mut Haggle<'_>,
    option: u32,
    req: GoRequest,
    go: bool,
) -> Result<Option<Outcome>, HandshakeError> {
    let volume = match open_export(server, state, &req.name).await {
        Ok(v) => v,
        Err(e) => {
            error_reply(stream, option, REP_ERR_UNKNOWN, &e.to_string()).await?;
            return Ok(None);
        }
    };
    let mut export = make_export(server, state, volume);
    if go {
        let Some(slot) = server.transmission_slot() else {
            error_reply(
                stream,
                option,
                REP_ERR_POLICY,
                &format!(
                    "the server serves its maximum of {} connections (serve \
                     --max-connections); try again later",
                    server.config.max_connections
                ),
            )
            .await?;
            return Ok(None);
        };
        export.slot = Some(slot);
    }
    let mut out = Vec::new();
    wire::put_option_reply(
        &mut out,
        option,
        REP_INFO,
        &wire::info_export(export.negotiated.size, export.transmission_flags),
    );
    let preferred = preferred_block_size(export.volume.as_ref());
    let maximum = server.config.payload_bytes_max.max(preferred);
    wire::put_option_reply(
        &mut out,
        option,
        REP_INFO,
        &wire::info_block_size(1, preferred, maximum),
    );
    if req.info.contains(&INFO_NAME) {
        wire::put_option_reply(
            &mut out,
            option,
            REP_INFO,
            &wire::info_string(INFO_NAME, export.volume.name()),
        );
    }
    wire::put_option_reply(&mut out, option, REP_ACK, &[]);
    stream.write_all(&out).await?;
    if go {
        Ok(Some(Outcome::Transmission(export)))
    } else {
        Ok(None)
    }
}

async fn meta_context<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    server: &Arc<ServerState>,
    state: &mut Haggle<'_>,
    option: u32,
    req: MetaRequest,
    list: bool,
) -> Result<(), HandshakeError> {
    if !list {
        // SET replaces the selection even when it fails.
        state.meta = None;
    }
    if !state.structured {
        error_reply(
            stream,
            option,
            REP_ERR_INVALID,
            "negotiate NBD_OPT_STRUCTURED_REPLY first",
        )
        .await?;
        return Ok(());
    }
    let volume = match open_export(server, state, &req.export).await {
        Ok(v) => v,
        Err(e) => {
            error_reply(stream, option, REP_ERR_UNKNOWN, &e.to_string()).await?;
            return Ok(());
        }
    };
    let snapshots = if wire::meta_queries_need_snapshots(&req.queries, list) {
        dirty_bitmap_snapshots(&volume).await
    } else {
        Vec::new()
    };
    let contexts = match wire::select_meta_contexts(&req.queries, list, &snapshots) {
        Ok(c) => c,
        Err(e) => {
            error_reply(stream, option, REP_ERR_INVALID, &e.0).await?;
            return Ok(());
        }
    };
    // LIST replies carry id 0 (reserved); SET gives every selected context its own id.
    let mut next_bitmap_id = META_ID_DIRTY_BITMAP_FIRST;
    let mut selected = Vec::with_capacity(contexts.len());
    for c in contexts {
        let id = match (&c, list) {
            (_, true) => 0,
            (MetaContext::BaseAllocation, false) => META_ID_BASE_ALLOCATION,
            (MetaContext::DirtyBitmap(_), false) => {
                let id = next_bitmap_id;
                next_bitmap_id += 1;
                id
            }
        };
        selected.push((id, c));
    }
    let mut out = Vec::new();
    for (id, c) in &selected {
        wire::put_option_reply(
            &mut out,
            option,
            REP_META_CONTEXT,
            &wire::rep_meta_context(*id, &c.name()),
        );
    }
    wire::put_option_reply(&mut out, option, REP_ACK, &[]);
    if !list && !selected.is_empty() {
        // Block status answers context by context in id order.
        selected.sort_by_key(|(id, _)| *id);
        state.meta = Some(MetaSelection {
            export: volume.name().to_string(),
            contexts: Arc::from(selected),
        });
    }
    stream.write_all(&out).await?;
    Ok(())
}

/// The snapshots of a volume export offered as `qemu:dirty-bitmap:SNAP` (none on a snapshot
/// export). A volume that cannot list its snapshots offers none; the handshake goes on.
async fn dirty_bitmap_snapshots(volume: &Arc<dyn Volume>) -> Vec<String> {
    if condense_api::split_snapshot_name(volume.name()).is_some() {
        return Vec::new();
    }
    let v = volume.clone();
    match blocking(move || v.snapshot_names()).await {
        Ok(names) => names
            .into_iter()
            .filter(|n| wire::dirty_bitmap_offerable(n))
            .collect(),
        Err(e) => {
            tracing::warn!(volume = volume.name(), "cannot list snapshots: {e}");
            Vec::new()
        }
    }
}

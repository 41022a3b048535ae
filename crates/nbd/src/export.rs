//! Exports: which names of the catalog are served, listing and opening them, and [`Export`],
//! the one a connection chose with what its handshake negotiated for it.
//!
//! Owns: the rule of which names are exportable ([`is_exportable`]: names whose volume or
//! snapshot part begins with '.' are internal, never listed nor opened), the default export
//! (the empty name, when the pool has exactly one visible volume), and [`blocking`], how every
//! catalog and volume call leaves the async threads. The handshake builds an [`Export`]; the
//! transmission phase serves it and drops it (and the transmission slot it holds) at the end.
use crate::wire::{MetaContext, Negotiated};
use condense_api::{Catalog, Volume, VolumeError};
use std::sync::Arc;
use tokio::sync::OwnedSemaphorePermit;

/// The export a client chose, and what was negotiated for it.
pub struct Export {
    pub volume: Arc<dyn Volume>,
    pub negotiated: Negotiated,
    pub transmission_flags: u16,
    /// The metadata contexts selected for this export, with their ids, in id order.
    pub contexts: Arc<[(u32, MetaContext)]>,
    /// The transmission slot the connection holds while it serves this export (taken when
    /// the client chooses it; none for NBD_OPT_INFO).
    pub slot: Option<OwnedSemaphorePermit>,
}

/// Whether a volume or snapshot name may be served: names (of the volume, or of the snapshot
/// in `VOLUME@SNAPSHOT`) beginning with '.' are internal, and so are empty ones.
pub fn is_exportable(name: &str) -> bool {
    let visible = |part: &str| !part.is_empty() && !part.starts_with('.');
    let parts_visible = match condense_api::split_snapshot_name(name) {
        Some((volume, snapshot)) => visible(volume) && visible(snapshot),
        None => visible(name),
    };
    parts_visible && name.len() <= crate::proto::STRING_BYTES_MAX
}

/// Run a blocking catalog or volume call off the async threads.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, VolumeError> + Send + 'static,
) -> Result<T, VolumeError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| VolumeError::Io(format!("catalog task failed: {e}")))?
}

/// Volumes clients may see: the catalog's volumes except internal ones (leading '.').
async fn visible_volumes(catalog: &Arc<dyn Catalog>) -> Result<Vec<String>, VolumeError> {
    let catalog = catalog.clone();
    let list = blocking(move || catalog.list()).await?;
    Ok(list
        .into_iter()
        .map(|v| v.name)
        .filter(|n| is_exportable(n))
        .collect())
}

/// Exports clients may see (NBD_OPT_LIST): each visible volume followed by its visible
/// snapshots as `VOLUME@SNAPSHOT`, oldest first. A catalog that cannot list its
/// snapshots still lists its volumes.
pub async fn visible_exports(catalog: &Arc<dyn Catalog>) -> Result<Vec<String>, VolumeError> {
    let volumes = visible_volumes(catalog).await?;
    let catalog = catalog.clone();
    let snapshots = match blocking(move || catalog.snapshots()).await {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!("cannot list snapshots: {e}");
            Vec::new()
        }
    };
    let mut out = Vec::with_capacity(volumes.len() + snapshots.len());
    for v in &volumes {
        out.push(v.clone());
        out.extend(
            snapshots
                .iter()
                .filter(|s| &s.volume == v)
                .map(|s| s.full_name())
                .filter(|n| is_exportable(n)),
        );
    }
    Ok(out)
}

/// Open the export a client named (a volume, or `VOLUME@SNAPSHOT` read-only); the empty
/// name is the default export, which exists when the pool has exactly one visible volume.
pub async fn open(catalog: &Arc<dyn Catalog>, name: &str) -> Result<Arc<dyn Volume>, VolumeError> {
    let name = if name.is_empty() {
        let names = visible_volumes(catalog).await?;
        match names.as_slice() {
            [only] => only.clone(),
            _ => {
                return Err(VolumeError::NotFound(
                    "(default export: name one, the pool has several or none)".to_string(),
                ))
            }
        }
    } else {
        name.to_string()
    };
    if !is_exportable(&name) {
        return Err(VolumeError::NotFound(name));
    }
    let catalog = catalog.clone();
    blocking(move || catalog.open(&name)).await
}

//! The workspace endpoints of the gateway (docs/protocol.md, "Workspaces"):
//!
//! - `POST /workspaces`: a manifest (JSON, optionally gzip) → the workspace id and the
//!   contents the caller has to upload;
//! - `POST /workspaces/{id}/blobs`: several contents as a tar stream (optionally gzip), each
//!   entry named by its hash;
//! - `PUT /workspaces/{id}/blobs/{hash}`: one content (optionally gzip);
//! - `GET /workspaces/blobs/{hash}`: a content the caller has (sync-back downloads).
//!
//! Uploads are streamed to disk and hashed on the way; only contents the workspace's manifest
//! declares are accepted, each at its declared size.

use std::io::Read;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use futures_util::TryStreamExt as _;

use crate::auth::Caller;
use crate::contract::{ErrorBody, ErrorCode};
use crate::workspace::manifest::{PostResponse, UploadResponse};
use crate::workspace::store::{Owner, Workspace, WorkspaceStore};

/// What the handlers share.
#[derive(Clone)]
struct WsState {
    store: Arc<WorkspaceStore>,
    metrics: crate::metrics::Metrics,
}

/// The workspace routes; `store` is the gateway's, refusals are counted in `metrics`.
pub(super) fn routes<S: Clone + Send + Sync + 'static>(
    store: Arc<WorkspaceStore>,
    metrics: crate::metrics::Metrics,
) -> Router<S> {
    Router::new()
        .route("/workspaces", post(post_manifest))
        .route("/workspaces/{id}/blobs", post(post_bundle))
        .route("/workspaces/{id}/blobs/{hash}", put(put_blob))
        .route("/workspaces/blobs/{hash}", get(get_blob))
        .with_state(WsState { store, metrics })
}

fn owner(caller: Option<axum::Extension<Caller>>) -> Owner {
    caller.and_then(|c| c.0.identity)
}

fn refuse(metrics: &crate::metrics::Metrics, e: ErrorBody) -> Response {
    metrics.rejected(e.code);
    e.into_response()
}

/// Whether the body is gzip (`Content-Encoding: gzip`); other encodings are refused.
fn gzip(headers: &HeaderMap) -> Result<bool, ErrorBody> {
    match headers
        .get(header::CONTENT_ENCODING)
        .map(|v| v.to_str().unwrap_or("?").trim().to_ascii_lowercase())
    {
        None => Ok(false),
        Some(e) if e == "gzip" => Ok(true),
        Some(e) if e == "identity" => Ok(false),
        Some(e) => Err(ErrorBody::new(
            ErrorCode::UnsupportedMediaType,
            format!("unsupported Content-Encoding {e:?}: use gzip or none"),
        )),
    }
}

/// The request body as a blocking reader (decompressed when gzip). Call on a blocking
/// thread: the bridge (and the gzip header read) block on the runtime.
fn body_reader(body: Body, gz: bool) -> Box<dyn Read + Send> {
    let stream = body.into_data_stream().map_err(std::io::Error::other);
    let bridge = tokio_util::io::SyncIoBridge::new(tokio_util::io::StreamReader::new(stream));
    if gz {
        Box::new(flate2::read::GzDecoder::new(bridge))
    } else {
        Box::new(bridge)
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ErrorBody> + Send + 'static,
) -> Result<T, ErrorBody> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ErrorBody::new(ErrorCode::Internal, format!("upload task failed: {e}")))?
}

async fn post_manifest(
    State(WsState { store, metrics }): State<WsState>,
    caller: Option<axum::Extension<Caller>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let owner = owner(caller);
    let gz = match gzip(&headers) {
        Ok(g) => g,
        Err(e) => return refuse(&metrics, e),
    };
    let max = store.config().max_manifest_bytes;
    // A declared length over the bound is refused before the body is read.
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if let Some(n) = declared.filter(|n| *n > max as u64) {
        return refuse(
            &metrics,
            ErrorBody::new(
                ErrorCode::PayloadTooLarge,
                format!(
                    "the manifest is {n} bytes, larger than {max} bytes (workspaces.max_manifest_bytes)"
                ),
            ),
        );
    }
    let store2 = store.clone();
    let posted = blocking(move || {
        use crate::workspace::jsoncap::{BodyCap, Hashing, JsonStringCap};
        // Parsed as it arrives, never held as text: the body's size, each string's length
        // and the number of entries are bounded before anything grows with them.
        let mut hashing = Hashing {
            inner: BodyCap::new(body_reader(body, gz), max as u64),
            hasher: WorkspaceStore::body_hasher(&owner),
        };
        let reader = std::io::BufReader::with_capacity(64 * 1024, JsonStringCap::new(&mut hashing));
        let cfg = store2.config();
        let manifest =
            crate::workspace::manifest::parse(reader, cfg.max_files, cfg.max_registry_bytes)?;
        // A rerun posts the same body again: no need to validate and register it again.
        let key = WorkspaceStore::key_of(hashing.hasher);
        if let Some(posted) = store2.post_again(&key, &owner) {
            return Ok(posted);
        }
        Ok(store2.post_body(manifest, &owner, Some(key))?)
    })
    .await;
    match posted {
        Ok(p) => axum::Json(PostResponse {
            workspace: p.workspace.id.clone(),
            version: p.workspace.digest.clone(),
            files: p.workspace.files,
            bytes: p.workspace.bytes,
            missing: p.missing,
            missing_bytes: p.missing_bytes,
        })
        .into_response(),
        Err(e) => refuse(&metrics, e),
    }
}

/// The declared size of `hash` in `ws`.
fn declared(ws: &Workspace, hash: &str) -> Result<u64, ErrorBody> {
    ws.contents.get(hash).copied().ok_or_else(|| {
        ErrorBody::new(
            ErrorCode::InvalidRequest,
            format!("{hash:?} is not a content of workspace {}", ws.id),
        )
    })
}

async fn post_bundle(
    State(WsState { store, metrics }): State<WsState>,
    caller: Option<axum::Extension<Caller>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let owner = owner(caller);
    let ws = match store.get(&id, &owner) {
        Ok(ws) => ws,
        Err(e) => return refuse(&metrics, e.into()),
    };
    let gz = match gzip(&headers) {
        Ok(g) => g,
        Err(e) => return refuse(&metrics, e),
    };
    let done = blocking(move || {
        let reader = body_reader(body, gz);
        let bad = |m: String| ErrorBody::new(ErrorCode::InvalidRequest, m);
        // Extended headers are capped before the tar crate reads them into memory.
        let mut archive = tar::Archive::new(crate::workspace::tarcap::CappedHeaders::new(reader));
        let entries = archive
            .entries()
            .map_err(|e| bad(format!("invalid upload (a tar stream of contents): {e}")))?;
        let mut seen = std::collections::HashSet::new();
        let mut bytes = 0;
        for entry in entries {
            let mut entry = entry.map_err(|e| {
                bad(format!(
                    "the upload broke off or is not a valid tar stream: {e}"
                ))
            })?;
            let name = entry
                .path()
                .ok()
                .and_then(|p| p.to_str().map(str::to_owned))
                .unwrap_or_default();
            if entry.header().entry_type() != tar::EntryType::Regular {
                return Err(bad(format!("upload entry {name:?} is not a regular file")));
            }
            let size = declared(&ws, &name)?;
            if entry.header().size().ok() != Some(size) {
                return Err(bad(format!(
                    "upload entry {name} does not have the manifest's size {size}"
                )));
            }
            if !seen.insert(name.clone()) {
                return Err(bad(format!("content {name} is uploaded twice")));
            }
            store.receive(&mut entry, &name, size, &owner)?;
            bytes += size;
        }
        Ok(UploadResponse {
            stored: seen.len(),
            bytes,
        })
    })
    .await;
    match done {
        Ok(r) => axum::Json(r).into_response(),
        Err(e) => refuse(&metrics, e),
    }
}

async fn put_blob(
    State(WsState { store, metrics }): State<WsState>,
    caller: Option<axum::Extension<Caller>>,
    Path((id, hash)): Path<(String, String)>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let owner = owner(caller);
    let checked = store
        .get(&id, &owner)
        .map_err(ErrorBody::from)
        .and_then(|ws| declared(&ws, &hash))
        .and_then(|size| gzip(&headers).map(|gz| (size, gz)));
    let (size, gz) = match checked {
        Ok(v) => v,
        Err(e) => return refuse(&metrics, e),
    };
    let done = blocking(move || {
        let mut reader = body_reader(body, gz);
        Ok(store.receive(&mut reader, &hash, size, &owner)?)
    })
    .await;
    match done {
        Ok(()) => axum::Json(UploadResponse {
            stored: 1,
            bytes: size,
        })
        .into_response(),
        Err(e) => refuse(&metrics, e),
    }
}

async fn get_blob(
    State(WsState { store, metrics }): State<WsState>,
    caller: Option<axum::Extension<Caller>>,
    Path(hash): Path<String>,
) -> Response {
    match store.open_blob(&hash, &owner(caller)) {
        Ok((file, size)) => {
            let stream = tokio_util::io::ReaderStream::new(tokio::fs::File::from_std(file));
            let mut resp = Response::new(Body::from_stream(stream));
            let h = resp.headers_mut();
            h.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/octet-stream"),
            );
            h.insert(header::CONTENT_LENGTH, HeaderValue::from(size));
            *resp.status_mut() = StatusCode::OK;
            resp
        }
        Err(e) => refuse(&metrics, e.into()),
    }
}

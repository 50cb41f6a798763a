//! `/peer/v1/...`: what the other replicas of this gateway ask (`crate::peers`). Every path
//! takes only the peer secret as its bearer token (not a user's token), and answers 404 on a
//! gateway without peers.

use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use crate::contract::{ErrorBody, ErrorCode};
use crate::mcp::McpService;
use crate::peers::Peers;

/// The peer routes (none without peers).
pub(super) fn routes<S: Clone + Send + Sync + 'static>(
    peers: Option<Arc<Peers>>,
    service: McpService,
    mcp: Arc<crate::server::mcp_http::McpGuard>,
) -> Router<S> {
    let Some(peers) = peers else {
        return Router::new();
    };
    let p = peers.clone();
    let c = peers.clone();
    let l = peers.clone();
    let listing = service.clone();
    Router::new()
        .route(
            crate::mcp::LIST_OUTPUTS_PATH,
            post(
                move |conn: Conn, headers: HeaderMap, body: Bytes| async move {
                    if let Some(refused) = refused(&l, conn, &headers) {
                        return refused;
                    }
                    match serde_json::from_slice(&body) {
                        Ok(req) => {
                            axum::Json(crate::mcp::answer_peer_list(&listing, req)).into_response()
                        }
                        Err(e) => ErrorBody::new(
                            ErrorCode::InvalidRequest,
                            format!("invalid peer list request: {e}"),
                        )
                        .into_response(),
                    }
                },
            ),
        )
        .route(
            crate::server::mcp_http::CANCEL_PATH,
            post(
                move |conn: Conn, headers: HeaderMap, body: Bytes| async move {
                    if let Some(refused) = refused(&c, conn, &headers) {
                        return refused;
                    }
                    match serde_json::from_slice(&body) {
                        Ok(req) => {
                            let cancelled = mcp.cancel_here(&req);
                            axum::Json(serde_json::json!({"cancelled": cancelled})).into_response()
                        }
                        Err(e) => ErrorBody::new(
                            ErrorCode::InvalidRequest,
                            format!("invalid peer cancel request: {e}"),
                        )
                        .into_response(),
                    }
                },
            ),
        )
        .route(
            crate::peers::REPLICA_PATH,
            get(move |conn: Conn, headers: HeaderMap| async move {
                if let Some(refused) = refused(&p, conn, &headers) {
                    return refused;
                }
                axum::Json(serde_json::json!({"replica": p.tag()})).into_response()
            }),
        )
        .route(
            crate::mcp::READ_OUTPUT_PATH,
            post(
                move |conn: Conn, headers: HeaderMap, body: Bytes| async move {
                    if let Some(refused) = refused(&peers, conn, &headers) {
                        return refused;
                    }
                    let req = match serde_json::from_slice(&body) {
                        Ok(r) => r,
                        Err(e) => {
                            return ErrorBody::new(
                                ErrorCode::InvalidRequest,
                                format!("invalid peer read request: {e}"),
                            )
                            .into_response();
                        }
                    };
                    let (status, json) = crate::mcp::answer_peer_read(&service, peers.tag(), req);
                    let status = axum::http::StatusCode::from_u16(status)
                        .unwrap_or(axum::http::StatusCode::INTERNAL_SERVER_ERROR);
                    (status, axum::Json(json)).into_response()
                },
            ),
        )
}

/// The connection's hold on the unauthenticated-connections cap.
type Conn = Option<axum::Extension<crate::server::connections::Unauthenticated>>;

/// Refuses a request without the peer secret (the same answer whatever was wrong with it);
/// a peer that proved it frees its connection from the cap on unauthenticated ones.
fn refused(peers: &Peers, conn: Conn, headers: &HeaderMap) -> Option<Response> {
    if peers.authorized(headers) {
        if let Some(axum::Extension(c)) = conn {
            c.release();
        }
        return None;
    }
    crate::audit::unauthorized("/peer/v1/", "a peer request", "without the peer secret");
    Some(
        ErrorBody::new(
            ErrorCode::Unauthorized,
            "peer requests need the replicas' shared peer secret (MCP_RUN_PEER_SECRET)",
        )
        .into_response(),
    )
}

/// Around the users' endpoints that need the caller's state (`/workspaces...`, and
/// `/sessions...` unless the backend's sessions are shared): a request whose caller's home is another replica is relayed there
/// (`crate::peers`, "homes"); the rest go on here.
pub(super) async fn to_home(
    axum::extract::State((peers, shared_sessions)): axum::extract::State<(Arc<Peers>, bool)>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if !crate::peers::path_needs_home(req.uri().path(), shared_sessions)
        || req.extensions().get::<crate::peers::Forwarded>().is_some()
    {
        return next.run(req).await;
    }
    let caller = req
        .extensions()
        .get::<crate::auth::Caller>()
        .cloned()
        .unwrap_or_default();
    let (parts, body) = req.into_parts();
    let declared = parts
        .headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let bodiless = matches!(
        parts.method,
        axum::http::Method::GET | axum::http::Method::DELETE | axum::http::Method::HEAD
    );
    let mut body = match declared {
        _ if bodiless => crate::peers::Relayed::Buffered(Bytes::new()),
        Some(n) if n <= crate::peers::REPLAYABLE_BYTES => {
            match axum::body::to_bytes(body, crate::peers::REPLAYABLE_BYTES as usize).await {
                Ok(b) => crate::peers::Relayed::Buffered(b),
                Err(e) => {
                    return ErrorBody::new(
                        ErrorCode::InvalidRequest,
                        format!("cannot read the request body: {e}"),
                    )
                    .into_response();
                }
            }
        }
        _ => crate::peers::Relayed::Streamed(body),
    };
    // A home found gone is left out, and the request goes to the next one (once more).
    for _ in 0..2 {
        match peers.home(&caller).await {
            crate::peers::Home::Here => break,
            crate::peers::Home::There(tag) => {
                match peers.proxy(&tag, &caller, &parts, body).await {
                    Ok(answer) => return answer,
                    Err(again) => body = again,
                }
            }
        }
    }
    let body = match body {
        crate::peers::Relayed::Buffered(b) => axum::body::Body::from(b),
        crate::peers::Relayed::Streamed(b) => b,
    };
    next.run(axum::extract::Request::from_parts(parts, body))
        .await
}

/// Around the users' endpoints under [`crate::peers::HTTP_PREFIX`]: a request another
/// replica forwarded, with the peer secret, acts for the caller its header names and is
/// served here.
pub(super) async fn from_peer(
    axum::extract::State(peers): axum::extract::State<Arc<Peers>>,
    conn: Conn,
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if let Some(refused) = refused(&peers, conn, req.headers()) {
        return refused;
    }
    let caller = match crate::peers::decode_caller(req.headers()) {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    // The peer secret is no token of the caller's: it goes no further.
    req.headers_mut().remove(axum::http::header::AUTHORIZATION);
    req.extensions_mut().insert(caller);
    req.extensions_mut().insert(crate::peers::Forwarded);
    next.run(req).await
}

/// Around `/mcp` with peers: a POST's handlers learn when the client's connection reaches EOF
/// ([`crate::mcp::ConnectionClosed`]), watched as long as the answer streams.
pub(super) async fn watch_mcp_close(
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if req.method() != axum::http::Method::POST {
        return next.run(req).await;
    }
    let until = tokio_util::sync::CancellationToken::new();
    let closed = req
        .extensions()
        .get::<crate::server::connections::PeerClosed>()
        .and_then(|p| p.watch(until.clone()));
    if let Some(c) = closed {
        req.extensions_mut().insert(crate::mcp::ConnectionClosed(c));
    }
    let guard = until.drop_guard();
    next.run(req).await.map(move |body| {
        use futures_util::StreamExt as _;
        axum::body::Body::from_stream(body.into_data_stream().map(move |chunk| {
            let _watching = &guard;
            chunk
        }))
    })
}

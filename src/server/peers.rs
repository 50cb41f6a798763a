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
) -> Router<S> {
    let Some(peers) = peers else {
        return Router::new();
    };
    let p = peers.clone();
    Router::new()
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

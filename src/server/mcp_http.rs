//! What `/mcp` needs around rmcp's streamable-HTTP service, whatever the client does:
//! - a body that is not JSON gets a JSON-RPC parse error (-32700), a JSON value that is not
//!   a request object or batch an invalid-request error (-32600), not rmcp's plain text;
//! - a request that reuses the id of one still running in the same session is refused
//!   (409, JSON-RPC -32600) instead of leaving both waiting;
//! - sessions are bounded: in total and per client (address, or token name), so that a
//!   flood of `initialize` cannot take the gateway's memory;
//! - every other error rmcp answers in plain text becomes the gateway's JSON error body;
//! - with replicas (peers), where rmcp serves MCP statelessly: `initialize` still hands out
//!   an `Mcp-Session-Id` (random, kept nowhere), so that a `notifications/cancelled` of
//!   protocol versions up to 2025-11-25 names its call as (session, request id) wherever it
//!   lands: the replica that gets it cancels the call if it runs here, else asks every peer
//!   to (`/peer/v1/mcp/cancel`, [`McpGuard::cancel_here`]). rmcp's stateless transport would
//!   drop the notification.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use tokio_util::sync::CancellationToken;

use crate::contract::{ErrorBody, ErrorCode};
use crate::peers::Peers;

/// A request being answered.
struct Running {
    identity: Option<String>,
    cancel: CancellationToken,
}

/// What a replica asks its peers when a call's `notifications/cancelled` reached it but the
/// call does not run there (`/peer/v1/mcp/cancel`).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct CancelRequest {
    /// The `Mcp-Session-Id` the call and the notification carry.
    pub session: String,
    /// The call's JSON-RPC id, as JSON text (`1` and `"1"` are different ids).
    pub request_id: String,
    /// The caller's identity (its token's name; none when auth is off).
    pub identity: Option<String>,
}

/// The peer path of [`CancelRequest`].
pub(crate) const CANCEL_PATH: &str = "/peer/v1/mcp/cancel";

/// The header that names an MCP session.
const SESSION_HEADER: &str = "mcp-session-id";

/// The state of the `/mcp` guard.
pub(crate) struct McpGuard {
    sessions: Arc<LocalSessionManager>,
    max_sessions: usize,
    max_per_client: usize,
    max_body_bytes: usize,
    /// `(session, id)` of requests being answered: the caller's identity and what cancels
    /// the call.
    in_flight: Mutex<HashMap<(String, String), Running>>,
    /// With replicas: session ids are handed out here, and cancellations go to the peers.
    peers: Option<Arc<Peers>>,
    /// Cancellations that found no call here, for a while: the call may arrive after its
    /// cancellation (its POST went through a slower path than the notification's).
    early: Mutex<Early>,
    /// Session ids by client, pruned of ended sessions when the client opens another.
    by_client: tokio::sync::Mutex<HashMap<String, Vec<String>>>,
}

impl McpGuard {
    pub(crate) fn new(
        sessions: Arc<LocalSessionManager>,
        max_sessions: usize,
        max_per_client: usize,
        max_body_bytes: usize,
    ) -> Self {
        Self {
            sessions,
            max_sessions,
            max_per_client,
            max_body_bytes,
            in_flight: Mutex::default(),
            by_client: tokio::sync::Mutex::default(),
            peers: None,
            early: Mutex::default(),
        }
    }

    /// With replicas (rmcp serves MCP statelessly): hands out session ids and routes
    /// cancellations (see the module's doc).
    pub(crate) fn with_peers(mut self, peers: Option<Arc<Peers>>) -> Self {
        self.peers = peers;
        self
    }

    /// Cancels the call `request_id` of `session` if it runs here for `identity`; whether it
    /// did.
    /// Not found, it is remembered for [`EARLY_TTL`]: a call that arrives then is cancelled
    /// at once.
    pub(crate) fn cancel_here(&self, req: &CancelRequest) -> bool {
        let key = (req.session.clone(), req.request_id.clone());
        let found = self.in_flight.lock().ok().and_then(|set| {
            set.get(&key)
                .filter(|r| r.identity == req.identity)
                .map(|r| r.cancel.clone())
        });
        match found {
            Some(cancel) => {
                cancel.cancel();
                true
            }
            None => {
                if let Ok(mut early) = self.early.lock() {
                    early.remember(key, req.identity.clone());
                }
                false
            }
        }
    }

    /// A `notifications/cancelled` of `session`: cancels its call here, else on the replica
    /// that runs it. Every live replica has been asked when this returns (each for at most a
    /// few seconds), so the call is stopped, or will be when it arrives, once the
    /// notification is answered.
    async fn cancelled(
        &self,
        session: &str,
        message: &serde_json::Value,
        identity: Option<String>,
    ) {
        let Some(id) = message.pointer("/params/requestId") else {
            return;
        };
        let req = CancelRequest {
            session: session.to_owned(),
            request_id: id.to_string(),
            identity,
        };
        if self.cancel_here(&req) {
            return;
        }
        let Some(peers) = &self.peers else {
            return;
        };
        let body = serde_json::to_value(&req).unwrap_or_default();
        let found = peers.post_all(CANCEL_PATH, &body).await;
        let cancelled = found
            .iter()
            .any(|(_, r)| matches!(r, Ok((200, v)) if v["cancelled"] == true));
        if !cancelled {
            // Already over, not arrived yet, or on a replica that did not answer.
            tracing::debug!(request = %req.request_id, "a cancelled MCP call runs on no replica now");
        }
    }
}

/// A JSON-RPC error answer (no result), with an HTTP status.
fn rpc_error(status: StatusCode, id: serde_json::Value, code: i64, message: &str) -> Response {
    let body = serde_json::json!({
        "jsonrpc": "2.0",
        "id": id,
        "error": {"code": code, "message": message},
    });
    (status, axum::Json(body)).into_response()
}

/// How long a cancellation that found no call is remembered.
const EARLY_TTL: Duration = Duration::from_secs(10);
/// How many such cancellations are remembered at most (the oldest are forgotten first).
const EARLY_MAX: usize = 4096;

/// Cancellations that found no call, oldest first.
#[derive(Default)]
struct Early(VecDeque<(Instant, (String, String), Option<String>)>);

impl Early {
    fn prune(&mut self) {
        while self
            .0
            .front()
            .is_some_and(|(at, ..)| at.elapsed() > EARLY_TTL || self.0.len() > EARLY_MAX)
        {
            self.0.pop_front();
        }
    }

    fn remember(&mut self, key: (String, String), identity: Option<String>) {
        self.0.push_back((Instant::now(), key, identity));
        self.prune();
    }

    /// Whether the call `key` of `identity` was cancelled before it arrived (forgotten then).
    fn take(&mut self, key: &(String, String), identity: &Option<String>) -> bool {
        self.prune();
        match self
            .0
            .iter()
            .position(|(_, k, i)| k == key && i == identity)
        {
            Some(at) => {
                self.0.remove(at);
                true
            }
            None => false,
        }
    }
}

/// Removes `(session, id)` from the in-flight map when the answer is over (or dropped).
struct InFlight(Arc<McpGuard>, (String, String));

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Ok(mut set) = self.0.in_flight.lock() {
            set.remove(&self.1);
        }
    }
}

/// The middleware in front of rmcp's service.
pub(crate) async fn middleware(
    State(guard): State<Arc<McpGuard>>,
    req: Request,
    next: Next,
) -> Response {
    if req.method() != axum::http::Method::POST {
        let delete = req.method() == axum::http::Method::DELETE;
        if delete && guard.peers.is_some() && req.headers().contains_key(SESSION_HEADER) {
            // A session handed out statelessly holds nothing: ending it is done.
            return StatusCode::NO_CONTENT.into_response();
        }
        let mut resp = json_errors(next.run(req).await).await;
        // rmcp ends a session's DELETE with 202; the official Python SDK takes only 200 and
        // 204 as a closed session (it warns "Session termination failed: 202").
        if delete && resp.status() == StatusCode::ACCEPTED {
            *resp.status_mut() = StatusCode::NO_CONTENT;
        }
        return resp;
    }
    let (parts, body) = req.into_parts();
    let bytes = match axum::body::to_bytes(body, guard.max_body_bytes).await {
        Ok(b) => b,
        Err(_) => {
            return ErrorBody::new(
                ErrorCode::PayloadTooLarge,
                "the request body is larger than the server accepts, or did not arrive",
            )
            .into_response();
        }
    };
    let message: serde_json::Value = match serde_json::from_slice(&bytes) {
        Ok(v) => v,
        Err(e) => {
            return rpc_error(
                StatusCode::BAD_REQUEST,
                serde_json::Value::Null,
                -32700,
                &format!("Parse error: the body is not JSON ({e})"),
            );
        }
    };
    if !(message.is_object() || message.is_array()) {
        return rpc_error(
            StatusCode::BAD_REQUEST,
            serde_json::Value::Null,
            -32600,
            "Invalid Request: a JSON-RPC message is an object",
        );
    }
    let session = parts
        .headers
        .get(SESSION_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let method = message.get("method").and_then(|m| m.as_str());
    let is_request = method.is_some();
    let identity = parts
        .extensions
        .get::<crate::auth::Caller>()
        .and_then(|c| c.identity.clone());
    let mut hold = None;
    let mut parts = parts;
    match (&session, message.get("id")) {
        (Some(session), Some(id)) if is_request => {
            let key = (session.clone(), id.to_string());
            // With replicas the handler also stops when the call's connection closes: the
            // same token (`mcp::ConnectionClosed`).
            let cancel = match parts.extensions.get::<crate::mcp::ConnectionClosed>() {
                Some(c) => c.0.clone(),
                None => {
                    let c = CancellationToken::new();
                    parts
                        .extensions
                        .insert(crate::mcp::ConnectionClosed(c.clone()));
                    c
                }
            };
            let fresh = guard
                .in_flight
                .lock()
                .map(|mut set| match set.entry(key.clone()) {
                    std::collections::hash_map::Entry::Occupied(_) => false,
                    std::collections::hash_map::Entry::Vacant(v) => {
                        v.insert(Running {
                            identity: identity.clone(),
                            cancel: cancel.clone(),
                        });
                        true
                    }
                })
                .unwrap_or(true);
            if fresh
                && guard.peers.is_some()
                && guard
                    .early
                    .lock()
                    .is_ok_and(|mut early| early.take(&key, &identity))
            {
                // Its cancellation came first: the handler stops before it starts anything.
                cancel.cancel();
            }
            if !fresh {
                return rpc_error(
                    StatusCode::CONFLICT,
                    id.clone(),
                    -32600,
                    "Invalid Request: a request with this id is still being answered in this session; use a new id",
                );
            }
            hold = Some(InFlight(guard.clone(), key));
        }
        (None, _) if method == Some("initialize") => {
            if let Some(refusal) = admit_session(&guard, &parts).await {
                return refusal;
            }
        }
        (Some(session), None)
            if method == Some("notifications/cancelled") && guard.peers.is_some() =>
        {
            guard.cancelled(session, &message, identity.clone()).await;
        }
        _ => {}
    }
    let client = client_key(&parts);
    let mut resp = next
        .run(Request::from_parts(parts, Body::from(bytes)))
        .await;
    if guard.peers.is_some()
        && session.is_none()
        && method == Some("initialize")
        && resp.status().is_success()
        && !resp.headers().contains_key(SESSION_HEADER)
    {
        // Visible ASCII, unguessable: it names the client's calls, nothing else.
        let id = format!("{:032x}", rand::random::<u128>());
        if let Ok(v) = HeaderValue::from_str(&id) {
            resp.headers_mut().insert(SESSION_HEADER, v);
        }
        return json_errors(resp).await;
    }
    if session.is_none()
        && let Some(id) = resp
            .headers()
            .get(SESSION_HEADER)
            .and_then(|v| v.to_str().ok())
    {
        guard
            .by_client
            .lock()
            .await
            .entry(client)
            .or_default()
            .push(id.to_owned());
    }
    let resp = json_errors(resp).await;
    match hold {
        None => resp,
        Some(hold) => {
            let (parts, body) = resp.into_parts();
            let stream = body.into_data_stream().map(move |chunk| {
                let _ = &hold;
                chunk
            });
            Response::from_parts(parts, Body::from_stream(stream))
        }
    }
}

/// The rate-limit style key of a client: its token name, else its address.
fn client_key(parts: &axum::http::request::Parts) -> String {
    parts
        .extensions
        .get::<crate::auth::Caller>()
        .map(|c| c.describe())
        .unwrap_or_default()
}

/// Refuses a new session over the total or the client's cap.
async fn admit_session(guard: &McpGuard, parts: &axum::http::request::Parts) -> Option<Response> {
    let live = guard.sessions.sessions.read().await;
    if live.len() >= guard.max_sessions {
        return Some(
            ErrorBody::new(
                ErrorCode::TooManyRequests,
                format!(
                    "{} MCP sessions are open, the gateway's maximum (mcp.max_sessions); retry later",
                    live.len()
                ),
            )
            .retry_after(5)
            .into_response(),
        );
    }
    let mut by_client = guard.by_client.lock().await;
    let mine = by_client.entry(client_key(parts)).or_default();
    mine.retain(|id| live.keys().any(|k| k.as_ref() == id.as_str()));
    if mine.len() >= guard.max_per_client {
        return Some(
            ErrorBody::new(
                ErrorCode::TooManyRequests,
                format!(
                    "this client has {} MCP sessions open, the maximum per client (mcp.max_sessions_per_client); close one (DELETE /mcp) or retry later",
                    mine.len()
                ),
            )
            .retry_after(5)
            .into_response(),
        );
    }
    by_client.retain(|_, ids| !ids.is_empty());
    None
}

/// rmcp answers some errors in plain text: those become the gateway's JSON error body.
async fn json_errors(resp: Response) -> Response {
    let status = resp.status();
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("json"));
    if status.as_u16() < 400 || is_json {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let text = axum::body::to_bytes(body, 64 * 1024)
        .await
        .unwrap_or_else(|_| Bytes::new());
    let code = match status.as_u16() {
        401 => ErrorCode::Unauthorized,
        403 => ErrorCode::ForbiddenHost,
        404 => ErrorCode::NotFound,
        405 => ErrorCode::MethodNotAllowed,
        413 => ErrorCode::PayloadTooLarge,
        415 => ErrorCode::UnsupportedMediaType,
        429 => ErrorCode::TooManyRequests,
        s if s < 500 => ErrorCode::InvalidRequest,
        _ => ErrorCode::Internal,
    };
    let message = String::from_utf8_lossy(&text).trim().to_owned();
    let message = if message.is_empty() {
        status.canonical_reason().unwrap_or("error").to_owned()
    } else {
        message
    };
    let body = crate::contract::ErrorResponse {
        error: ErrorBody::new(code, message),
    };
    let mut out = (status, axum::Json(body)).into_response();
    for (name, value) in parts.headers.iter() {
        if name != header::CONTENT_TYPE && name != header::CONTENT_LENGTH {
            out.headers_mut().insert(name.clone(), value.clone());
        }
    }
    out.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guard() -> McpGuard {
        McpGuard::new(Arc::new(LocalSessionManager::default()), 4, 4, 1024)
    }

    fn req(session: &str, id: &str, identity: Option<&str>) -> CancelRequest {
        CancelRequest {
            session: session.into(),
            request_id: id.into(),
            identity: identity.map(Into::into),
        }
    }

    #[test]
    fn a_cancellation_stops_only_the_call_of_its_session_id_and_identity() {
        let g = guard();
        let cancel = CancellationToken::new();
        g.in_flight.lock().unwrap().insert(
            ("s1".into(), "7".into()),
            Running {
                identity: Some("alice".into()),
                cancel: cancel.clone(),
            },
        );
        for other in [
            req("s2", "7", Some("alice")),
            req("s1", "\"7\"", Some("alice")),
            req("s1", "7", Some("bob")),
            req("s1", "7", None),
        ] {
            assert!(!g.cancel_here(&other), "{other:?}");
            assert!(!cancel.is_cancelled());
        }
        assert!(g.cancel_here(&req("s1", "7", Some("alice"))));
        assert!(cancel.is_cancelled());
    }

    #[test]
    fn a_cancellation_that_came_first_is_remembered_for_a_while() {
        let g = guard();
        assert!(!g.cancel_here(&req("s1", "8", None)));
        let mut early = g.early.lock().unwrap();
        assert!(!early.take(&("s1".into(), "8".into()), &Some("alice".into())));
        assert!(early.take(&("s1".into(), "8".into()), &None));
        // Once.
        assert!(!early.take(&("s1".into(), "8".into()), &None));
        // Bounded in number.
        for i in 0..EARLY_MAX + 10 {
            early.remember(("s".into(), i.to_string()), None);
        }
        assert_eq!(early.0.len(), EARLY_MAX);
        assert!(!early.take(&("s".into(), "0".into()), &None));
    }
}

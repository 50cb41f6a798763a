//! The gateway's HTTP surface: `POST /raw` (NDJSON streaming), MCP over streamable HTTP at
//! `/mcp`, `GET /capabilities`, `GET /healthz`, `GET /readyz`, `GET /metrics` (Prometheus;
//! unauthenticated, like the probes).
//! Every error is a JSON body `{"error":{"code","message"}}` with a matching status.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use tokio::net::TcpListener;

use crate::contract::{ErrorBody, ErrorCode, ErrorResponse, RunRequest};
use crate::runner::Runner;

pub(crate) mod connections;
pub(crate) mod guard;
pub(crate) mod mcp_http;
mod peer_port;
mod peers;
mod raw;
mod sessions;
mod workspace;
pub(crate) use raw::HeadLimit;

/// Shared state of the HTTP handlers.
#[derive(Clone)]
pub(crate) struct AppState {
    pub runner: Arc<Runner>,
    pub keepalive: Duration,
    pub capabilities: Arc<crate::capabilities::Capabilities>,
    pub mcp: McpSettings,
    /// Bearer tokens for every path but the probes and metrics; `None`: auth off.
    pub auth: Option<Arc<crate::auth::Auth>>,
    /// Host/Origin and declared-length checks in front of everything.
    pub guard: Arc<crate::server::guard::Guard>,
    /// The other replicas of this gateway (`server.peers`); `None`: a gateway alone.
    pub peers: Option<Arc<crate::peers::Peers>>,
}

/// How `/mcp` is served.
#[derive(Clone)]
pub(crate) struct McpSettings {
    /// The `mcp:` section (result budget, output store, session limits, ...).
    pub config: crate::mcp::McpConfig,
    /// Ends every MCP session (at shutdown, once running commands were drained).
    pub stop: tokio_util::sync::CancellationToken,
    /// Operator-declared CLI tools served next to `run_network_tool`.
    pub tools: Arc<Vec<crate::mcp::tools::ToolConfig>>,
    /// Output templates for `run_network_tool` (the built-ins plus the config's).
    pub templates: Arc<crate::templates::TemplateStore>,
}

impl IntoResponse for ErrorBody {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.code.http_status())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        // Always for these two; for any other error only when its maker said a retry may
        // succeed (a caller's home replica that did not answer: run-remote retries those).
        let retry = match self.code {
            ErrorCode::TooManyRequests | ErrorCode::ShuttingDown => {
                Some(self.retry_after_secs.unwrap_or(1))
            }
            _ => self.retry_after_secs,
        };
        let unauthorized = self.code == ErrorCode::Unauthorized;
        let mut resp = (status, axum::Json(ErrorResponse { error: self })).into_response();
        if let Some(secs) = retry {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if unauthorized {
            resp.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"mcp-run\""),
            );
        }
        resp
    }
}

/// The router with every endpoint (`max_body_bytes` bounds request bodies) and, with
/// `peer_port` (`server.peer_listen`), the peer port's router: the peer channel is then
/// served there only.
pub(crate) fn routers(
    state: AppState,
    max_body_bytes: usize,
    peer_port: bool,
) -> (Router, Option<Router>) {
    let peer_routes;
    let mcp = {
        use rmcp::transport::streamable_http_server::{
            StreamableHttpServerConfig, StreamableHttpService, session::local::LocalSessionManager,
        };
        let service = crate::mcp::McpService::new(
            state.runner.clone(),
            state.capabilities.clone(),
            &state.mcp.config,
        )
        .with_tools(state.mcp.tools.clone())
        .with_templates(state.mcp.templates.clone(), "/".into())
        .with_peers(state.peers.clone());
        // Host and Origin are checked for every endpoint by `guard`, with JSON errors.
        let mut config = StreamableHttpServerConfig::default().disable_allowed_hosts();
        config.cancellation_token = state.mcp.stop.clone();
        config.max_request_body_bytes = max_body_bytes;
        // With replicas, any of them may get any request: no MCP session lives in one
        // process's memory (docs/deployment.md "Scaling" says why not rmcp's session store).
        config.legacy_session_mode = state.peers.is_none();
        if state.peers.is_some() {
            // Without sessions a closed stream is how a client cancels a call; the replica
            // learns of it when a write fails, so write a keep-alive more often than the 15 s
            // default (the first write after a close may still succeed).
            config.sse_keep_alive = Some(Duration::from_secs(5));
        }
        let mut sessions = LocalSessionManager::default();
        sessions.session_config.keep_alive =
            Some(Duration::from_secs(state.mcp.config.session_idle_secs));
        let sessions = Arc::new(sessions);
        let guard = Arc::new(
            crate::server::mcp_http::McpGuard::new(
                sessions.clone(),
                state.mcp.config.max_sessions,
                state.mcp.config.max_sessions_per_client,
                max_body_bytes,
            )
            .with_peers(state.peers.clone()),
        );
        peer_routes = peers::routes(state.peers.clone(), service.clone(), guard.clone());
        let watch = state.peers.is_some();
        tower::ServiceBuilder::new()
            .option_layer(watch.then(|| axum::middleware::from_fn(peers::watch_mcp_close)))
            .layer(axum::middleware::from_fn_with_state(
                guard,
                crate::server::mcp_http::middleware,
            ))
            .service(StreamableHttpService::new(
                move || Ok(service.clone()),
                sessions,
                config,
            ))
    };
    let workspaces = match state.runner.workspaces() {
        Some(store) => workspace::routes(store.clone(), state.runner.metrics().clone()),
        None => Router::new(),
    };
    // The endpoints that may need the caller's state. With peers, the caller's home replica
    // serves them (`crate::peers`, "homes"): relayed there, or forwarded here by a peer.
    let homed = Router::new()
        .merge(workspaces)
        .route("/raw", post(raw::raw))
        .route("/sessions", get(sessions::list))
        .route("/sessions/{name}", axum::routing::delete(sessions::end));
    let (homed, forwarded) = match &state.peers {
        Some(p) => (
            homed.clone().layer(axum::middleware::from_fn_with_state(
                (p.clone(), state.runner.sessions_shared()),
                peers::to_home,
            )),
            Router::new().nest(
                crate::peers::HTTP_PREFIX,
                homed.layer(axum::middleware::from_fn_with_state(
                    p.clone(),
                    peers::from_peer,
                )),
            ),
        ),
        None => (homed, Router::new()),
    };
    // With a peer port, everything under /peer/ (the peer routes and the forwarded users'
    // requests) is served there only.
    let (peer_routes, forwarded, peer_app) = if peer_port {
        let routes = peer_routes.merge(forwarded);
        let app = peer_port::app(routes, state.clone(), max_body_bytes);
        (peer_port::refused_here(), Router::new(), Some(app))
    } else {
        (peer_routes, forwarded, None)
    };
    let app = Router::new()
        .merge(homed)
        .merge(forwarded)
        .merge(peer_routes)
        .route("/capabilities", get(capabilities))
        .nest_service("/mcp", mcp)
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .fallback(|| async { ErrorBody::new(ErrorCode::NotFound, "no such endpoint") })
        .method_not_allowed_fallback(|| async {
            ErrorBody::new(
                ErrorCode::MethodNotAllowed,
                "method not allowed on this endpoint",
            )
        })
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .layer(axum::Extension(HeadLimit(max_body_bytes)))
        // Inside auth: a request that gets here frees its connection from the cap on
        // unauthenticated connections.
        .layer(axum::middleware::from_fn(
            crate::server::connections::mark_authenticated,
        ))
        .layer(axum::middleware::from_fn_with_state(
            crate::auth::Gate {
                auth: state.auth.clone(),
                metrics: state.runner.metrics().clone(),
            },
            crate::auth::middleware,
        ))
        // Outermost: a request for a foreign host or with an oversized body goes no further.
        .layer(axum::middleware::from_fn_with_state(
            state.guard.clone(),
            crate::server::guard::middleware,
        ))
        .with_state(state);
    // Around the whole router: a route's `Allow` header is set outside its own layers.
    let app = Router::new()
        .fallback_service(app)
        .layer(axum::middleware::map_response(name_allowed_methods));
    (app, peer_app)
}

/// How a served gateway stops.
pub(crate) struct Shutdown<F> {
    /// Starts the drain when it completes.
    pub(crate) signal: F,
    /// How long running commands get to finish before they are killed.
    pub(crate) grace: Duration,
    /// Cancelled when they are done: long-lived connections (MCP sessions) end then.
    pub(crate) drained: tokio_util::sync::CancellationToken,
}

/// Serves `router` on `listener` until the shutdown signal fires, then drains: the listener
/// stays open (new executions get `503 shutting_down`), running commands get the grace to
/// finish, then they are killed, and connections are closed (see [`connections`]).
pub(crate) async fn serve(
    listener: TcpListener,
    router: Router,
    runner: Arc<Runner>,
    limits: crate::server::connections::ConnectionLimits,
    shutdown: Shutdown<impl std::future::Future<Output = ()> + Send + 'static>,
) -> std::io::Result<()> {
    let metrics = runner.metrics().clone();
    let Shutdown {
        signal,
        grace,
        drained,
    } = shutdown;
    let drain = async move {
        signal.await;
        tracing::info!(running = runner.in_flight(), "shutting down");
        runner.shutdown(grace).await;
        // Long-lived connections (MCP sessions) end now, so that the server can stop.
        drained.cancel();
    };
    crate::server::connections::run(listener, router, limits, metrics, drain).await
}

/// A 405 names the methods the endpoint takes (axum puts them in `Allow`), so that e.g.
/// `curl -T` (a PUT) on `/raw` says to POST instead of only refusing.
async fn name_allowed_methods(res: Response) -> Response {
    if res.status() != StatusCode::METHOD_NOT_ALLOWED {
        return res;
    }
    let Some(allow) = res.headers().get(header::ALLOW).cloned() else {
        return res;
    };
    let methods = allow.to_str().unwrap_or_default().replace(',', ", ");
    let mut named = ErrorBody::new(
        ErrorCode::MethodNotAllowed,
        format!("method not allowed on this endpoint; it takes {methods}"),
    )
    .into_response();
    named.headers_mut().insert(header::ALLOW, allow);
    named
}

async fn capabilities(State(state): State<AppState>) -> Response {
    axum::Json(state.capabilities.as_ref().clone()).into_response()
}

async fn healthz() -> impl IntoResponse {
    axum::Json(serde_json::json!({"status": "ok"}))
}

async fn readyz(State(state): State<AppState>) -> Response {
    if state.runner.is_shutting_down() {
        return ErrorBody::new(ErrorCode::ShuttingDown, "the gateway is shutting down")
            .into_response();
    }
    match state.runner.executor().ready().await {
        Ok(()) => axum::Json(serde_json::json!({
            "status": "ready",
            "backend": state.runner.executor().name(),
        }))
        .into_response(),
        Err(e) => ErrorBody::new(ErrorCode::BackendUnavailable, e.message).into_response(),
    }
}

async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)],
        state.runner.metrics().render(),
    )
}

/// Parses a `/raw` request body, mapping every failure to its status and code.
pub(crate) fn parse_request(
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<RunRequest, ErrorBody> {
    let is_json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .map(|mime| mime.trim().eq_ignore_ascii_case("application/json"))
        .unwrap_or(false);
    if !is_json {
        return Err(ErrorBody::new(
            ErrorCode::UnsupportedMediaType,
            "the request body must be JSON with `Content-Type: application/json` (or, with stdin, `Content-Type: application/vnd.mcp-run.stdin`)",
        ));
    }
    let body = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ErrorBody::new(
                ErrorCode::PayloadTooLarge,
                "the request body is larger than the server accepts",
            )
        } else {
            ErrorBody::new(
                ErrorCode::InvalidRequest,
                format!("cannot read the request body: {rejection}"),
            )
        }
    })?;
    // serde would also take an array for a struct (`["echo",["x"]]`): only the documented
    // object is a request.
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(ErrorBody::new(
            ErrorCode::InvalidRequest,
            "the request body must be a JSON object such as {\"executable\": \"echo\", \"args\": [\"hi\"]}",
        ));
    }
    serde_json::from_slice::<RunRequest>(&body)
        .map_err(|e| ErrorBody::new(ErrorCode::InvalidRequest, format!("invalid request: {e}")))
}

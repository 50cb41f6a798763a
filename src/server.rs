//! The gateway's HTTP surface: `POST /raw` (NDJSON streaming), MCP over streamable HTTP at
//! `/mcp`, `GET /capabilities`, `GET /healthz`, `GET /readyz`, `GET /metrics` (Prometheus;
//! unauthenticated, like the probes).
//! Every error is a JSON body `{"error":{"code","message"}}` with a matching status.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::StreamExt;
use futures_util::stream::{self, Stream};
use tokio::net::TcpListener;

use crate::contract::{ErrorBody, ErrorCode, ErrorResponse, Event, RunRequest};
use crate::exec::Execution;
use crate::runner::Runner;

/// Shared state of the HTTP handlers.
#[derive(Clone)]
pub struct AppState {
    pub runner: Arc<Runner>,
    pub keepalive: Duration,
    pub capabilities: Arc<crate::capabilities::Capabilities>,
    pub mcp: McpSettings,
    /// Bearer tokens for every path but the probes and metrics; `None`: auth off.
    pub auth: Option<Arc<crate::auth::Auth>>,
}

/// How `/mcp` is served.
#[derive(Clone)]
pub struct McpSettings {
    /// The `mcp:` section (result budget, output store, ...).
    pub config: crate::mcp::McpConfig,
    /// Accepted `Host` headers (DNS-rebinding protection); empty accepts any.
    pub allowed_hosts: Vec<String>,
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
        let retry = matches!(
            self.code,
            ErrorCode::TooManyRequests | ErrorCode::ShuttingDown
        )
        .then(|| self.retry_after_secs.unwrap_or(1));
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

/// The router with every endpoint; `max_body_bytes` bounds request bodies.
pub fn router(state: AppState, max_body_bytes: usize) -> Router {
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
        .with_templates(state.mcp.templates.clone(), "/".into());
        let mut config = StreamableHttpServerConfig::default()
            .with_allowed_hosts(state.mcp.allowed_hosts.clone());
        if state.mcp.allowed_hosts.is_empty() {
            config = config.disable_allowed_hosts();
        }
        config.cancellation_token = state.mcp.stop.clone();
        config.max_request_body_bytes = max_body_bytes;
        StreamableHttpService::new(
            move || Ok(service.clone()),
            Arc::new(LocalSessionManager::default()),
            config,
        )
    };
    Router::new()
        .route("/raw", post(raw))
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
        .layer(axum::middleware::from_fn_with_state(
            crate::auth::Gate {
                auth: state.auth.clone(),
                metrics: state.runner.metrics().clone(),
            },
            crate::auth::middleware,
        ))
        .with_state(state)
}

/// Serves `router` on `listener` until `shutdown` fires, then drains: new connections are
/// refused, running commands get `grace` to finish, then they are killed.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    runner: Arc<Runner>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    grace: Duration,
    drained: tokio_util::sync::CancellationToken,
) -> std::io::Result<()> {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    // The client address is the rate-limit key of callers without a token.
    let app = router.into_make_service_with_connect_info::<std::net::SocketAddr>();
    let server = axum::serve(listener, app).with_graceful_shutdown(async move {
        shutdown.await;
        let _ = tx.send(());
    });
    let drain = async move {
        if rx.await.is_ok() {
            tracing::info!(running = runner.in_flight(), "shutting down");
            runner.shutdown(grace).await;
        }
        // Long-lived connections (MCP sessions) end now, so that the server can stop.
        drained.cancel();
    };
    // The server future ends when every connection has closed, which is after the runner
    // ended the streams; both must finish.
    let (served, ()) = tokio::join!(server.into_future(), drain);
    served
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
pub fn parse_request(
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
            "the request body must be JSON with `Content-Type: application/json`",
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
    serde_json::from_slice::<RunRequest>(&body)
        .map_err(|e| ErrorBody::new(ErrorCode::InvalidRequest, format!("invalid request: {e}")))
}

async fn raw(
    State(state): State<AppState>,
    caller: Option<axum::Extension<crate::auth::Caller>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let req = match parse_request(&headers, body) {
        Ok(r) => r,
        Err(e) => {
            state.runner.metrics().rejected(e.code);
            return e.into_response();
        }
    };
    // Logged below: secrets in the command line are redacted like the output.
    let command = match state.runner.redactor() {
        Some(r) => r.redact_str(&req.command_line()),
        None => req.command_line(),
    };
    let caller = caller.map(|c| c.0).unwrap_or_default();
    match state.runner.start_as(req, &caller).await {
        Ok(execution) => {
            tracing::debug!(%command, context = ?execution.context(), "started");
            let mut resp = Response::new(Body::from_stream(ndjson(execution, state.keepalive)));
            let h = resp.headers_mut();
            h.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/x-ndjson"),
            );
            h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
            // Tells nginx-style proxies not to buffer the stream.
            h.insert("x-accel-buffering", HeaderValue::from_static("no"));
            resp
        }
        Err(e) => {
            tracing::info!(%command, code = %e.code, message = %e.message, "rejected");
            e.into_response()
        }
    }
}

/// The NDJSON body of a run: `started`, output, keep-alives while silent, one terminal
/// event. The execution lives inside the stream, so a client that goes away drops it, and
/// dropping it kills the command.
pub fn ndjson(
    execution: Execution,
    keepalive: Duration,
) -> impl Stream<Item = Result<Bytes, Infallible>> + Send {
    let first = Event::Started {
        context: execution.context().clone(),
    }
    .to_line();
    let rest = stream::unfold(Some(execution), move |state| async move {
        let mut execution = state?;
        let event = match tokio::time::timeout(keepalive, execution.next()).await {
            Ok(Some(event)) => event,
            Ok(None) => return None,
            Err(_) => Event::Keepalive,
        };
        Some((Ok(event.to_line()), Some(execution)))
    });
    stream::once(async move { Ok(first) }).chain(rest)
}

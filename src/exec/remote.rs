//! The remote backend: runs commands on a gateway through its `/raw` endpoint. `run-remote`
//! and `mcp-run stdio --backend remote` use it, so that a machine without cluster
//! credentials runs its commands where the gateway runs them.

pub(crate) mod workspace;

use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::future::BoxFuture;
use futures_util::stream::BoxStream;
use futures_util::{StreamExt, TryStreamExt};
use tokio::sync::mpsc;
use tokio_util::codec::FramedRead;
use tokio_util::io::StreamReader;
use tokio_util::sync::CancellationToken;

use super::{EVENT_BUFFER, ExecSpec, Execution, Executor, StartOptions};
use crate::contract::{
    ErrorBody, ErrorCode, Event, ExitInfo, LineDecoder, LineError, PROGRESS_HEADER, RunRequest,
    STDIN_CONTENT_TYPE,
};

/// The remote backend's section of the configuration (`remote:`).
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RemoteConfig {
    /// The gateway's `/raw` URL [default: `RUN_REMOTE_SERVER`].
    pub server: Option<String>,
    /// A directory synced to the gateway as a workspace before every command, which then
    /// runs in it (`mcp-run stdio --workspace DIR`; docs/workspaces.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace: Option<std::path::PathBuf>,
}

impl RemoteConfig {
    /// `(field, message)` on failure.
    pub fn validate(&self) -> Result<(), (String, String)> {
        if let Some(server) = &self.server {
            parse_server_url(server).map_err(|e| ("remote.server".to_owned(), e.to_string()))?;
        }
        Ok(())
    }
}

/// The longest NDJSON line accepted from a gateway (a 256 KiB chunk is about 350 KB).
const MAX_LINE: usize = 16 * 1024 * 1024;

/// How much longer than the request's timeout to wait for the gateway's own timeout.
const TIMEOUT_SLACK: Duration = Duration::from_secs(15);

/// Runs commands on a remote gateway.
pub struct RemoteExecutor {
    client: reqwest::Client,
    url: reqwest::Url,
    token: Option<String>,
    /// Sent with every run (a replica forwarding a run names the caller it acts for).
    headers: reqwest::header::HeaderMap,
}

/// Why the remote backend cannot be set up.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("invalid gateway URL {url:?} ({reason}): {}", URL_HINT)]
    Unparsable { url: String, reason: String },
    #[error("invalid gateway URL {url:?}: {}", URL_HINT)]
    NotHttp { url: String },
    #[error("cannot build the HTTP client: {0}")]
    Client(reqwest::Error),
    #[error("--workspace {}: {source}", path.display())]
    Workspace {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("--workspace {}: not a directory", .0.display())]
    NotADirectory(std::path::PathBuf),
}

const URL_HINT: &str = "it must be a full URL such as http://127.0.0.1:8080/raw";

/// Why a call to the upstream gateway failed on this side. What the upstream itself
/// answers (its error body, an `error` event) is relayed as the `ErrorBody` it is.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RemoteError {
    /// `chain`: the error and its causes; `retry`: nothing was sent (no connection), so a
    /// retry cannot run the command twice.
    #[error("cannot reach the gateway at {url}: {chain}")]
    Unreachable {
        url: String,
        chain: String,
        retry: bool,
    },
    #[error("the gateway's answer from {url} is not what was expected: {source}")]
    BadAnswer {
        url: String,
        source: serde_json::Error,
    },
    #[error("cannot encode the request: {0}")]
    Encode(serde_json::Error),
    #[error("cancelled")]
    Cancelled,
    /// The first event (Debug).
    #[error("the gateway's stream did not begin with `started` but with {0}")]
    NotStarted(String),
    #[error("an event line from the gateway is too long")]
    LineTooLong,
    #[error("the gateway's stream ended mid-line")]
    MidLine,
    #[error("the connection to the gateway broke: {0}")]
    Broke(String),
    #[error("malformed event from the gateway: {0}")]
    Malformed(String),
}

impl From<RemoteError> for ErrorBody {
    fn from(e: RemoteError) -> Self {
        let code = match e {
            RemoteError::Unreachable { retry, .. } => {
                let err = ErrorBody::new(ErrorCode::GatewayUnreachable, e.to_string());
                return if retry { err.retry_after(1) } else { err };
            }
            RemoteError::Encode(_) => ErrorCode::InvalidRequest,
            RemoteError::Cancelled => ErrorCode::ShuttingDown,
            RemoteError::BadAnswer { .. }
            | RemoteError::NotStarted(_)
            | RemoteError::LineTooLong
            | RemoteError::MidLine
            | RemoteError::Broke(_)
            | RemoteError::Malformed(_) => ErrorCode::ProtocolError,
        };
        ErrorBody::new(code, e.to_string())
    }
}

/// Checks that `server` is a full `http(s)://host[:port]/path` URL.
pub(crate) fn parse_server_url(server: &str) -> Result<reqwest::Url, SetupError> {
    let url = reqwest::Url::parse(server).map_err(|e| SetupError::Unparsable {
        url: server.to_owned(),
        reason: e.to_string(),
    })?;
    if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none_or(str::is_empty) {
        return Err(SetupError::NotHttp {
            url: server.to_owned(),
        });
    }
    Ok(url)
}

/// A reqwest client builder for the gateway's own HTTP clients (the remote backend, the
/// peer channel). reqwest is built without a default crypto provider: the first caller
/// installs ring. `plain_http`: every URL is `http`, so no trust store is loaded (loading
/// the system's certificates is most of a client's start-up time).
pub(crate) fn client_builder(plain_http: bool) -> reqwest::ClientBuilder {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let builder = reqwest::Client::builder();
    if !plain_http {
        return builder;
    }
    let config = rustls::ClientConfig::builder()
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    builder.tls_backend_preconfigured(config)
}

impl RemoteExecutor {
    /// `url` is the gateway's `/raw` URL; `token`, when set, is sent as a bearer token.
    pub fn new(url: &str, token: Option<String>) -> Result<Self, SetupError> {
        let url = parse_server_url(url)?;
        let client = client_builder(url.scheme() == "http")
            // A POST with a body is not replayed elsewhere; a redirect is reported instead.
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(Duration::from_secs(10))
            .tcp_keepalive(Duration::from_secs(30))
            .user_agent(concat!("mcp-run/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(SetupError::Client)?;
        Ok(Self {
            client,
            url,
            token,
            headers: reqwest::header::HeaderMap::new(),
        })
    }

    /// Another replica of this gateway (`crate::peers`): `url` is its forwarded-run path,
    /// `secret` the peer secret, `headers` go with every run; `client` is shared.
    pub(crate) fn for_peer(
        client: reqwest::Client,
        url: reqwest::Url,
        secret: String,
        headers: reqwest::header::HeaderMap,
    ) -> Self {
        Self {
            client,
            url,
            token: Some(secret),
            headers,
        }
    }

    pub fn url(&self) -> &reqwest::Url {
        &self.url
    }

    /// The gateway's workspace endpoints, over the same connection pool and token.
    pub fn workspace_client(&self) -> crate::workspace::client::WorkspaceClient {
        crate::workspace::client::WorkspaceClient::new(
            self.client.clone(),
            &self.url,
            self.token.clone(),
        )
    }

    /// The gateway's URL for `tail` (`/sessions`), beside its `/raw`.
    fn beside(&self, tail: &str) -> reqwest::Url {
        let mut u = self.url.clone();
        let path = format!(
            "{}{tail}",
            u.path().trim_end_matches('/').trim_end_matches("/raw")
        );
        u.set_path(&path);
        u
    }

    /// Sends `builder` (with the token) and reads a JSON answer, or the gateway's error.
    async fn call_json<T: serde::de::DeserializeOwned>(
        &self,
        mut builder: reqwest::RequestBuilder,
        url: &reqwest::Url,
    ) -> Result<Option<T>, ErrorBody> {
        if let Some(token) = &self.token {
            builder = builder.bearer_auth(token);
        }
        let resp = builder.send().await.map_err(|e| RemoteError::Unreachable {
            url: url.to_string(),
            chain: error_chain(&e),
            retry: false,
        })?;
        let status = resp.status();
        let body = resp.text().await.unwrap_or_default();
        if !status.is_success() {
            return Err(ErrorBody::from_answer(status, &body));
        }
        if status == reqwest::StatusCode::NO_CONTENT {
            return Ok(None);
        }
        serde_json::from_str(&body).map(Some).map_err(|source| {
            RemoteError::BadAnswer {
                url: url.to_string(),
                source,
            }
            .into()
        })
    }

    /// `GET /sessions`: the caller's open sessions.
    pub async fn sessions(&self) -> Result<crate::contract::SessionList, ErrorBody> {
        let url = self.beside("/sessions");
        let list = self.call_json(self.client.get(url.clone()), &url).await?;
        Ok(list.unwrap_or_default())
    }

    /// `DELETE /sessions/{name}`: ends one of the caller's sessions.
    pub async fn end_session(&self, name: &str) -> Result<(), ErrorBody> {
        crate::contract::check_session_name(name)?;
        let url = self.beside(&format!("/sessions/{name}"));
        self.call_json::<serde_json::Value>(self.client.delete(url.clone()), &url)
            .await?;
        Ok(())
    }

    /// Sends a request and returns once the gateway reported `started`.
    pub async fn run(
        &self,
        req: &RunRequest,
        cancel: CancellationToken,
    ) -> Result<Execution, ErrorBody> {
        self.run_with(req, StartOptions::new(cancel)).await
    }

    /// [`RemoteExecutor::run`] with stdin (streamed in the request body as it comes) and the
    /// gateway's start-up phases, asked for when `opts.progress` has a listener.
    pub async fn run_with(
        &self,
        req: &RunRequest,
        opts: StartOptions,
    ) -> Result<Execution, ErrorBody> {
        let StartOptions {
            cancel,
            progress,
            stdin,
        } = opts;
        let mut head = serde_json::to_vec(req).map_err(RemoteError::Encode)?;
        let mut builder = self
            .client
            .post(self.url.clone())
            .headers(self.headers.clone())
            .header(reqwest::header::ACCEPT, "application/x-ndjson");
        builder = match stdin {
            None => builder
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(head),
            Some(input) => {
                // The request line, then stdin verbatim: the body ends when `input` does.
                head.push(b'\n');
                let first = futures_util::stream::once(async move {
                    Ok::<_, std::convert::Infallible>(Bytes::from(head))
                });
                let rest = futures_util::stream::unfold(input, |mut input| async move {
                    let chunk = input.recv().await?;
                    Some((Ok(chunk), input))
                });
                builder
                    .header(reqwest::header::CONTENT_TYPE, STDIN_CONTENT_TYPE)
                    .body(reqwest::Body::wrap_stream(first.chain(rest)))
            }
        };
        if progress.is_active() {
            builder = builder.header(PROGRESS_HEADER, "1");
        }
        if let Some(token) = &self.token {
            builder = builder.bearer_auth(token);
        }
        let resp = tokio::select! {
            r = builder.send() => r.map_err(|e| RemoteError::Unreachable {
                url: self.url.to_string(),
                chain: error_chain(&e),
                // No connection, so nothing was sent (one that timed out already waited
                // long enough).
                retry: e.is_connect() && !e.is_timeout(),
            })?,
            _ = cancel.cancelled() => return Err(RemoteError::Cancelled.into()),
        };
        let status = resp.status();
        if !status.is_success() {
            let retry_after = resp
                .headers()
                .get(reqwest::header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<u64>().ok());
            let mut err = ErrorBody::from_answer(status, &resp.text().await.unwrap_or_default());
            // A proxy's own page (no error body) for an upstream that is down or busy.
            let proxy_down =
                err.code == ErrorCode::ProtocolError && matches!(status.as_u16(), 502..=504);
            if let Some(secs) = retry_after.or(proxy_down.then_some(1)) {
                err = err.retry_after(secs);
            }
            return Err(err);
        }
        let mut lines = Lines::new(resp);
        // Phases (and keep-alives) may come first when they were asked for.
        let context = loop {
            let next = tokio::select! {
                n = lines.next() => n,
                _ = cancel.cancelled() => return Err(RemoteError::Cancelled.into()),
            };
            match next {
                Ok(Some(Event::Started { context })) => break context,
                Ok(Some(Event::Phase { phase, message })) => progress.report(phase, message),
                Ok(Some(Event::Keepalive | Event::Unknown)) => {}
                // The upstream's own error: relayed as it is.
                Ok(Some(Event::Error { code, message })) => {
                    return Err(ErrorBody::new(code, message));
                }
                Ok(other) => {
                    return Err(RemoteError::NotStarted(format!("{other:?}")).into());
                }
                Err(e) => return Err(e),
            }
        };
        let (tx, rx) = mpsc::channel(EVENT_BUFFER);
        let own = cancel.child_token();
        tokio::spawn(pump(lines, tx, own.clone()));
        Ok(Execution::new(context, rx, own))
    }
}

/// Forwards the gateway's events until the terminal one. Dropping the response (consumer
/// gone, or cancelled) closes the connection, and the gateway kills the command.
async fn pump(mut lines: Lines, tx: mpsc::Sender<Event>, cancel: CancellationToken) {
    let started = Instant::now();
    loop {
        let next = tokio::select! {
            n = lines.next() => n,
            _ = cancel.cancelled() => {
                drop(lines);
                let _ = tx.send(Event::Exit(ExitInfo {
                    code: None,
                    signal: Some(nix::libc::SIGKILL),
                    duration_ms: started.elapsed().as_millis() as u64,
                    timed_out: false,
                })).await;
                return;
            }
        };
        let event = match next {
            Ok(Some(
                Event::Keepalive | Event::Unknown | Event::Started { .. } | Event::Phase { .. },
            )) => continue,
            Ok(Some(event)) => event,
            Ok(None) => Event::Error {
                code: ErrorCode::ProtocolError,
                message: "the gateway's stream ended before the command's exit was reported".into(),
            },
            Err(e) => Event::Error {
                code: e.code,
                message: e.message,
            },
        };
        let terminal = event.is_terminal();
        if tx.send(event).await.is_err() || terminal {
            return;
        }
    }
}

/// The gateway's response body, split into NDJSON events.
struct Lines(
    FramedRead<StreamReader<BoxStream<'static, std::io::Result<Bytes>>, Bytes>, LineDecoder>,
);

impl Lines {
    fn new(resp: reqwest::Response) -> Self {
        let body = resp.bytes_stream().map_err(std::io::Error::other).boxed();
        Self(FramedRead::new(
            StreamReader::new(body),
            LineDecoder::new(MAX_LINE),
        ))
    }

    async fn next(&mut self) -> Result<Option<Event>, ErrorBody> {
        loop {
            let line = match self.0.next().await {
                Some(Ok(line)) => line,
                None => return Ok(None),
                Some(Err(LineError::TooLong(_))) => {
                    return Err(RemoteError::LineTooLong.into());
                }
                Some(Err(LineError::Unterminated(_))) => {
                    return Err(RemoteError::MidLine.into());
                }
                Some(Err(LineError::Io(e))) => {
                    // The reqwest error inside: its message and causes, as before the wrapping.
                    let chain = match e.get_ref() {
                        Some(inner) => error_chain(inner),
                        None => error_chain(&e),
                    };
                    return Err(RemoteError::Broke(chain).into());
                }
            };
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            return Event::from_line_mut(line)
                .map(Some)
                .map_err(|e| RemoteError::Malformed(e.to_string()).into());
        }
    }
}

/// An error with its causes, which reqwest keeps in the source chain.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        source = cause.source();
    }
    s
}

/// The upstream request's `timeout_secs`: the spec's, or with steps (each with its own
/// timeout) the longest step's, which the upstream's limits accept as they accepted ours.
pub(crate) fn request_timeout(spec: &ExecSpec) -> u64 {
    match spec.steps.iter().filter_map(|s| s.timeout_secs).max() {
        Some(t) => t,
        None => spec.timeout.as_secs().max(1),
    }
}

impl Executor for RemoteExecutor {
    fn name(&self) -> &'static str {
        "remote"
    }

    fn start(
        &self,
        spec: ExecSpec,
        opts: StartOptions,
    ) -> BoxFuture<'_, Result<Execution, ErrorBody>> {
        Box::pin(async move {
            if let Some(run) = spec.workspace.clone() {
                return workspace::forward(self, spec, run, opts).await;
            }
            let timeout = request_timeout(&spec);
            let req = RunRequest {
                executable: spec.executable,
                args: spec.args,
                cwd: spec.cwd,
                env: spec.env,
                timeout_secs: Some(timeout),
                profile: spec.profile,
                cache_scope: spec.cache_scope,
                session: spec.session,
                session_busy: spec.session_busy,
                steps: spec.steps,
                continue_on_error: spec.continue_on_error,
                ..RunRequest::default()
            };
            self.run_with(&req, opts).await
        })
    }

    fn timeout_slack(&self) -> Duration {
        TIMEOUT_SLACK
    }

    /// Workspaces are forwarded: uploaded from this gateway's cache to the upstream one.
    /// The remote gateway keeps the sessions (see [`crate::session`]).
    fn forwards_sessions(&self) -> bool {
        true
    }

    fn supports_workspaces(&self) -> bool {
        true
    }

    /// The gateway's own report (`GET /capabilities` beside `/raw`), naming the gateway.
    fn capabilities(&self) -> BoxFuture<'_, crate::capabilities::BackendCapabilities> {
        Box::pin(async move {
            let gateway = self.url.to_string();
            let mut url = self.url.clone();
            let base = url
                .path()
                .trim_end_matches('/')
                .trim_end_matches("/raw")
                .to_string();
            url.set_path(&format!("{base}/capabilities"));
            let mut req = self.client.get(url).timeout(Duration::from_secs(10));
            if let Some(token) = &self.token {
                req = req.bearer_auth(token);
            }
            let fetched = match req.send().await {
                Ok(r) if r.status().is_success() => match r.bytes().await {
                    Ok(b) => serde_json::from_slice::<crate::capabilities::Capabilities>(&b)
                        .map_err(|e| format!("invalid capabilities document: {e}")),
                    Err(e) => Err(error_chain(&e)),
                },
                Ok(r) => Err(format!("the gateway answered {}", r.status())),
                Err(e) => Err(error_chain(&e)),
            };
            match fetched {
                Ok(c) => crate::capabilities::BackendCapabilities {
                    gateway: Some(gateway),
                    ..c.backend
                },
                Err(e) => {
                    tracing::warn!("cannot read the gateway's capabilities: {e}");
                    crate::capabilities::BackendCapabilities {
                        backend: "remote".into(),
                        safety_level: "unknown".into(),
                        description: format!(
                            "Commands run on the mcp-run gateway at {gateway} (its capabilities could not be read: {e})."
                        ),
                        gateway: Some(gateway),
                        ..Default::default()
                    }
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_url_must_be_full() {
        assert!(parse_server_url("http://127.0.0.1:8080/raw").is_ok());
        assert!(parse_server_url("https://gw.example/raw").is_ok());
        for bad in [
            "127.0.0.1:8080",
            "localhost:8080/raw",
            "ftp://x/raw",
            "",
            "http://",
        ] {
            assert!(parse_server_url(bad).is_err(), "{bad}");
        }
    }
}

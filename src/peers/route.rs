//! Requests that need a caller's state (its workspaces, its sessions) go to the replica that
//! holds it: the caller's *home*. The home is picked by rendezvous hashing of the caller's
//! key (its identity, else its address: the key sessions and rate limits use) over the tags
//! of the replicas that answer, so every replica picks the same one without asking, and when
//! a replica goes only its callers move. Stateless runs are served where they land.
//!
//! A request that lands elsewhere is forwarded over the peer channel with the caller it acts
//! for (the header [`CALLER_HEADER`], only believed with the peer secret), and the home
//! serves it as if the caller had sent it there: same limits, policy, rate limit, audit and
//! owner checks. A forwarded request is served where it arrives, never forwarded again.
//!
//! - runs (`/raw`, MCP tool calls) that name a workspace, or a session of a backend whose
//!   sessions live in one process (`Runner::sessions_shared` is false): the
//!   runner forwards them with [`Peers::start_at`] to `/peer/v1/http/raw`, streaming stdin
//!   and events both ways;
//! - `/workspaces/...` and `/sessions...`: [`Peers::proxy`] relays the HTTP request and its
//!   answer, bodies streamed.

use std::collections::hash_map::Entry;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use sha2::Digest as _;

use super::Peers;
use crate::caller::Caller;
use crate::contract::{ErrorBody, ErrorCode, RunRequest};
use crate::exec::{Execution, StartOptions};

/// Where forwarded requests of users' endpoints go: the endpoint's path follows.
pub(crate) const HTTP_PREFIX: &str = "/peer/v1/http";
/// The header naming the caller a forwarded request acts for (hex of a small JSON object).
pub(crate) const CALLER_HEADER: &str = "x-mcp-run-peer-caller";
/// How long a view of which replicas answer is used before it is asked again (in the
/// background: requests never wait for it once there is one).
const VIEW_TTL: Duration = Duration::from_secs(5);

/// Marks a request forwarded by a peer (a request extension): it is served here.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Forwarded;

/// Which replica serves a caller's stateful requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Home {
    Here,
    /// The tag of another replica.
    There(String),
}

/// When the view of live replicas was last asked for, and whether it is being asked now.
#[derive(Debug, Default)]
pub(super) struct View {
    at: Option<Instant>,
    asking: bool,
}

/// The caller as a forwarded request carries it.
#[derive(serde::Serialize, serde::Deserialize)]
struct WireCaller {
    identity: Option<String>,
    addr: Option<std::net::IpAddr>,
}

/// Whether a run needs its caller's home: it names a workspace (kept by the home), or a
/// session that only the home's process holds.
pub(crate) fn needs_home(req: &RunRequest, shared_sessions: bool) -> bool {
    req.workspace.is_some() || (req.session.is_some() && !shared_sessions)
}

/// Whether a request to one of the users' endpoints needs its caller's home: the
/// workspace endpoints, and the session endpoints unless sessions are shared.
pub(crate) fn path_needs_home(path: &str, shared_sessions: bool) -> bool {
    let sessions = path == "/sessions" || path.starts_with("/sessions/");
    path == "/workspaces" || path.starts_with("/workspaces/") || (sessions && !shared_sessions)
}

/// The caller header's value for `caller`.
fn encode_caller(caller: &Caller) -> HeaderValue {
    let wire = WireCaller {
        identity: caller.identity.clone(),
        addr: caller.addr,
    };
    let json = serde_json::to_vec(&wire).unwrap_or_default();
    // Hex: an identity may hold bytes a header value may not.
    HeaderValue::from_str(&crate::workspace::hex(&json)).unwrap_or(HeaderValue::from_static(""))
}

/// Why a request could not be routed to the caller's home replica.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RouteError {
    #[error("a forwarded request needs a valid {CALLER_HEADER} header")]
    BadCallerHeader,
    #[error(
        "replica {tag} of this gateway, which holds this caller's workspaces and sessions, did not answer ({why}); retry: the next replica takes over (its workspaces are posted again, its sessions start afresh)"
    )]
    HomeGone { tag: String, why: String },
    #[error("cannot relay the answer: {0}")]
    Relay(axum::http::Error),
}

impl From<RouteError> for ErrorBody {
    fn from(e: RouteError) -> Self {
        let code = match e {
            RouteError::BadCallerHeader => ErrorCode::InvalidRequest,
            RouteError::HomeGone { .. } => {
                return ErrorBody::new(ErrorCode::BackendUnavailable, e.to_string()).retry_after(1);
            }
            RouteError::Relay(_) => ErrorCode::Internal,
        };
        ErrorBody::new(code, e.to_string())
    }
}

/// The caller a forwarded request acts for, from its headers.
pub(crate) fn decode_caller(headers: &HeaderMap) -> Result<Caller, ErrorBody> {
    let bad = || ErrorBody::from(RouteError::BadCallerHeader);
    let text = headers
        .get(CALLER_HEADER)
        .and_then(|v| v.to_str().ok())
        .ok_or_else(bad)?;
    if text.len() % 2 != 0 || text.len() > 8192 {
        return Err(bad());
    }
    let bytes = (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16))
        .collect::<Result<Vec<u8>, _>>()
        .map_err(|_| bad())?;
    let wire: WireCaller = serde_json::from_slice(&bytes).map_err(|_| bad())?;
    Ok(Caller {
        identity: wire.identity,
        addr: wire.addr,
        ..Caller::default()
    })
}

/// The rendezvous score of replica `tag` for `key`: the highest score is the home.
fn score(tag: &str, key: &str) -> [u8; 8] {
    let mut h = sha2::Sha256::new();
    h.update(tag.as_bytes());
    h.update([0u8]);
    h.update(key.as_bytes());
    let d = h.finalize();
    let mut s = [0u8; 8];
    s.copy_from_slice(&d[..8]);
    s
}

/// The home among `tags` for `key`.
fn pick<'a>(tags: impl IntoIterator<Item = &'a str>, key: &str) -> Option<&'a str> {
    tags.into_iter().max_by_key(|t| (score(t, key), *t))
}

impl Peers {
    /// The home of `caller`'s stateful requests among the replicas that answer.
    pub(crate) async fn home(self: &std::sync::Arc<Self>, caller: &Caller) -> Home {
        self.fresh_view().await;
        let key = caller.key();
        let known = self.known.lock().map(|k| k.clone()).unwrap_or_default();
        let tags = known.keys().map(String::as_str).chain([self.tag()]);
        match pick(tags, &key) {
            Some(t) if t != self.tag() => Home::There(t.to_owned()),
            _ => Home::Here,
        }
    }

    /// The tags of the other replicas that answered when last asked (asked first if never).
    pub(crate) async fn live(self: &std::sync::Arc<Self>) -> Vec<String> {
        self.fresh_view().await;
        self.known
            .lock()
            .map(|k| k.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// Makes sure there is a view of the live replicas: the first one is awaited, a stale
    /// one is refreshed in the background.
    async fn fresh_view(self: &std::sync::Arc<Self>) {
        let (first, stale) = {
            let mut v = self.view.lock().unwrap_or_else(|e| e.into_inner());
            let first = v.at.is_none();
            let stale = v.at.is_none_or(|at| at.elapsed() > VIEW_TTL) && !v.asking;
            if stale {
                v.asking = true;
            }
            (first, stale)
        };
        if !stale {
            return;
        }
        let me = self.clone();
        let ask = async move {
            me.refresh().await;
            let mut v = me.view.lock().unwrap_or_else(|e| e.into_inner());
            v.at = Some(Instant::now());
            v.asking = false;
        };
        if first {
            ask.await;
        } else {
            tokio::spawn(ask);
        }
    }

    /// Drops `tag` from the view (it did not answer) and asks again at the next request.
    pub(super) fn lost(&self, tag: &str) {
        self.forget(tag);
        if let Ok(mut v) = self.view.lock()
            && !v.asking
            && let Some(at) = v.at.as_mut()
        {
            *at = Instant::now() - VIEW_TTL * 2;
        }
    }

    /// The base URL of the replica tagged `tag`, when it is known.
    fn url_of(&self, tag: &str) -> Option<reqwest::Url> {
        self.known.lock().ok()?.get(tag).cloned()
    }

    /// A client for forwarded requests: unlike the peer channel's, no overall timeout (a
    /// forwarded run lasts as long as its command; an upload as long as its body).
    fn stream_client(&self) -> &reqwest::Client {
        self.streams.get_or_init(|| {
            crate::exec::remote::client_builder(self.urls.iter().all(|u| u.scheme() == "http"))
                .redirect(reqwest::redirect::Policy::none())
                .connect_timeout(Duration::from_secs(2))
                .tcp_keepalive(Duration::from_secs(30))
                .user_agent(concat!("mcp-run-peer/", env!("CARGO_PKG_VERSION")))
                .build()
                .unwrap_or_default()
        })
    }

    /// The error of a home that does not answer.
    fn home_gone(tag: &str, why: &str) -> ErrorBody {
        RouteError::HomeGone {
            tag: tag.to_owned(),
            why: why.to_owned(),
        }
        .into()
    }

    /// Starts `req` on the replica tagged `tag` as `caller`: its events stream back as the
    /// returned execution's (phases to `opts.progress`, `opts.stdin` streamed there).
    pub(crate) async fn start_at(
        &self,
        tag: &str,
        req: &RunRequest,
        caller: &Caller,
        opts: StartOptions,
    ) -> Result<Execution, ErrorBody> {
        let Some(base) = self.url_of(tag) else {
            return Err(Self::home_gone(tag, "it is no longer among the peers"));
        };
        let url = base
            .join(&format!("{HTTP_PREFIX}/raw"))
            .map_err(|e| Self::home_gone(tag, &e.to_string()))?;
        let mut headers = HeaderMap::new();
        headers.insert(CALLER_HEADER, encode_caller(caller));
        let remote = crate::exec::remote::RemoteExecutor::for_peer(
            self.stream_client().clone(),
            url,
            self.secret.clone(),
            headers,
        );
        let started = remote.run_with(req, opts).await;
        match started {
            Err(e) if e.code == ErrorCode::GatewayUnreachable => {
                self.lost(tag);
                tracing::warn!(replica = tag, error = %e.message, "a run's home replica did not answer");
                Err(Self::home_gone(tag, "connection failed"))
            }
            // The relay's own client-side codes never reach the caller as such.
            Err(e) if e.code == ErrorCode::ProtocolError => Err(Self::home_gone(tag, &e.message)),
            Err(e) => Err(e),
            Ok(execution) => Ok(execution.filtered(HomeLost(tag.to_owned()))),
        }
    }

    /// Relays a request for one of the users' endpoints (`/workspaces...`, `/sessions...`)
    /// to the replica tagged `tag`, as `caller`; its answer as it comes. `Err(body)`: that
    /// replica could not be reached and the body can be sent again (it was buffered), to the
    /// caller's next home.
    pub(crate) async fn proxy(
        &self,
        tag: &str,
        caller: &Caller,
        parts: &axum::http::request::Parts,
        body: Relayed,
    ) -> Result<Response, Relayed> {
        let Some(base) = self.url_of(tag) else {
            return Err(body);
        };
        let path = parts
            .uri
            .path_and_query()
            .map(|p| p.as_str())
            .unwrap_or("/");
        let Ok(url) = base.join(&format!("{HTTP_PREFIX}{path}")) else {
            return Ok(Self::home_gone(tag, "bad path").into_response());
        };
        let mut out = self
            .stream_client()
            .request(parts.method.clone(), url)
            .bearer_auth(&self.secret)
            .header(CALLER_HEADER, encode_caller(caller));
        // What describes the body and what the caller accepts; never its credentials.
        for name in [
            header::CONTENT_TYPE,
            header::CONTENT_ENCODING,
            header::CONTENT_LENGTH,
            header::ACCEPT,
        ] {
            if let Some(v) = parts.headers.get(&name) {
                out = out.header(name, v);
            }
        }
        let (out, kept) = match body {
            Relayed::Buffered(b) => (out.body(b.clone()), Some(b)),
            Relayed::Streamed(b) => (
                out.body(reqwest::Body::wrap_stream(b.into_data_stream())),
                None,
            ),
        };
        let resp = match out.send().await {
            Ok(r) => r,
            Err(e) => {
                self.lost(tag);
                tracing::warn!(replica = tag, error = %super::without_url(e), "a caller's home replica did not answer");
                return match kept {
                    Some(b) => Err(Relayed::Buffered(b)),
                    None => Ok(Self::home_gone(tag, "connection failed").into_response()),
                };
            }
        };
        let mut answer = Response::builder().status(resp.status().as_u16());
        for (name, v) in resp.headers() {
            let keep: [HeaderName; 5] = [
                header::CONTENT_TYPE,
                header::CONTENT_LENGTH,
                header::CONTENT_ENCODING,
                header::RETRY_AFTER,
                header::CACHE_CONTROL,
            ];
            if keep.contains(name) {
                answer = answer.header(name, v);
            }
        }
        Ok(answer
            .body(Body::from_stream(resp.bytes_stream()))
            .unwrap_or_else(|e| ErrorBody::from(RouteError::Relay(e)).into_response()))
    }

    /// A bodiless request (`GET /sessions`, `DELETE /sessions/{name}`) for `caller`'s state,
    /// answered by its home: `None` when that is this replica, else the status and body of
    /// the home's answer (a home found gone is replaced by the next, once).
    pub(crate) async fn call_home(
        self: &std::sync::Arc<Self>,
        caller: &Caller,
        method: axum::http::Method,
        path: &str,
    ) -> Option<Result<(u16, bytes::Bytes), ErrorBody>> {
        for _ in 0..2 {
            let Home::There(tag) = self.home(caller).await else {
                return None;
            };
            let Some(base) = self.url_of(&tag) else {
                continue;
            };
            let Ok(url) = base.join(&format!("{HTTP_PREFIX}{path}")) else {
                return Some(Err(Self::home_gone(&tag, "bad path")));
            };
            let sent = self
                .client
                .request(method.clone(), url)
                .bearer_auth(&self.secret)
                .header(CALLER_HEADER, encode_caller(caller))
                .send()
                .await;
            match sent {
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    return Some(
                        resp.bytes()
                            .await
                            .map(|b| (status, b))
                            .map_err(|e| Self::home_gone(&tag, &super::without_url(e))),
                    );
                }
                Err(e) => {
                    self.lost(&tag);
                    tracing::warn!(replica = %tag, error = %super::without_url(e), "a caller's home replica did not answer");
                }
            }
        }
        None
    }

    /// Adds the tags of live replicas to the view (asking every peer), keeping the rest.
    pub(super) fn merge_view(&self, found: Vec<(String, reqwest::Url)>) {
        if let Ok(mut known) = self.known.lock() {
            known.clear();
            for (tag, url) in found {
                if let Entry::Vacant(e) = known.entry(tag) {
                    e.insert(url);
                }
            }
        }
    }
}

/// The body of a relayed request: small ones are buffered, so that a home found gone is
/// replaced by the next one without the caller noticing; large ones (content uploads) are
/// streamed, and the caller retries.
pub(crate) enum Relayed {
    Buffered(bytes::Bytes),
    Streamed(Body),
}

/// Bodies up to this size are buffered for a retry at the next home (a manifest is usually
/// far smaller; `GET` and `DELETE` have none).
pub(crate) const REPLAYABLE_BYTES: u64 = 4 << 20;

/// Says which replica a forwarded run was lost with when the connection to it breaks.
struct HomeLost(String);

impl crate::exec::EventFilter for HomeLost {
    fn filter(
        &mut self,
        event: crate::contract::Event,
        out: &mut std::collections::VecDeque<crate::contract::Event>,
    ) {
        use crate::contract::Event;
        out.push_back(match event {
            Event::Error {
                code: ErrorCode::ProtocolError,
                message,
            } => Event::Error {
                code: ErrorCode::BackendUnavailable,
                message: format!(
                    "replica {} of this gateway, which ran this command for this caller's workspace or session, stopped answering ({message}); its outcome is unknown: run it again",
                    self.0
                ),
            },
            e => e,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_home_is_the_same_from_every_view_and_moves_only_for_the_lost_replica() {
        let tags = ["0a0a0a0a", "1b1b1b1b", "2c2c2c2c"];
        let keys: Vec<String> = (0..300).map(|i| format!("id:user{i}")).collect();
        let mut per = std::collections::HashMap::new();
        for k in &keys {
            let home = pick(tags, k).unwrap();
            // The order of the view does not matter.
            assert_eq!(pick(tags.iter().rev().copied(), k), Some(home));
            *per.entry(home).or_insert(0) += 1;
            // Without another replica, a caller keeps its home.
            for gone in tags.iter().filter(|t| **t != home) {
                let rest = tags.iter().copied().filter(|t| t != gone);
                assert_eq!(pick(rest, k), Some(home));
            }
        }
        // Callers spread over the replicas.
        assert!(per.values().all(|n| *n > 60), "{per:?}");
    }

    #[test]
    fn the_caller_travels_in_a_header() {
        let c = Caller {
            identity: Some("ci bot \u{e9}".into()),
            addr: Some("10.1.2.3".parse().unwrap()),
            ..Caller::default()
        };
        let mut h = HeaderMap::new();
        h.insert(CALLER_HEADER, encode_caller(&c));
        let back = decode_caller(&h).unwrap();
        assert_eq!(back.identity, c.identity);
        assert_eq!(back.addr, c.addr);
        h.insert(CALLER_HEADER, HeaderValue::from_static("zz"));
        assert!(decode_caller(&h).is_err());
        assert!(decode_caller(&HeaderMap::new()).is_err());
    }

    #[test]
    fn which_requests_need_a_home() {
        let ws = RunRequest {
            workspace: Some("ws_x".into()),
            ..RunRequest::default()
        };
        let session = RunRequest {
            session: Some("build".into()),
            ..RunRequest::default()
        };
        assert!(needs_home(&ws, true));
        assert!(needs_home(&session, false));
        assert!(!needs_home(&session, true));
        assert!(!needs_home(&RunRequest::default(), false));
        assert!(path_needs_home("/workspaces/ws_1/blobs", true));
        assert!(path_needs_home("/sessions", false));
        assert!(!path_needs_home("/sessions/build", true));
        assert!(!path_needs_home("/workspacesx", false));
    }
}

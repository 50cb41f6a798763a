//! Kept outputs across replicas: a `resources/read` of a run kept by another replica of the
//! gateway is forwarded to it over the peer channel (`crate::peers`), with the caller's
//! identity, and its answer (the page, or why there is none) returned as is. Both ends of
//! that request are here: [`read_output`] asks, [`answer`] answers.
//!
//! The owner applies today's bounds and expiry and the owner check; the forwarding replica
//! only says so when the owner is gone (its outputs went with it).
//!
//! The caller's sessions (the tool `end_session`, the resource `mcp-run://sessions`) are its
//! home replica's when they live in one process: [`end_session_at_home`] and
//! [`sessions_at_home`] ask it (`crate::peers`, "homes").

use rmcp::ErrorData as McpError;
use rmcp::model::{ErrorCode, ReadResourceResult};
use serde::{Deserialize, Serialize};

use super::McpService;
use crate::auth::Caller;
use crate::peers::{PeerError, Peers};

/// The peer path of a kept-output read.
pub(crate) const READ_PATH: &str = "/peer/v1/outputs/read";

/// What a replica asks the owner.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ReadRequest {
    /// The tag of the replica meant: a replica restarted at the same address is another.
    pub replica: String,
    /// The `mcp-run://runs/...` URI, with its page parameters.
    pub uri: String,
    /// The caller's identity (its token's name; none when auth is off).
    pub identity: Option<String>,
}

/// The peer path of a listing of a caller's kept outputs.
pub(crate) const LIST_PATH: &str = "/peer/v1/outputs/list";

/// What a replica asks every other for `resources/list`.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ListRequest {
    /// The caller's identity (its token's name; none when auth is off).
    pub identity: Option<String>,
    /// At most this many runs, the most recent first.
    pub max: usize,
}

/// One kept run in a listing: enough to name its streams and order runs of all replicas.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct KeptRun {
    pub id: String,
    /// Milliseconds since it finished, on the replica that keeps it (no clock is compared).
    pub age_ms: u64,
    /// Bytes kept of stdout and stderr.
    pub kept: [u64; 2],
}

/// A replica's answer to [`ListRequest`].
#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct ListAnswer {
    pub runs: Vec<KeptRun>,
}

/// The caller's most recent kept runs of every live replica, this one's (`here`) included:
/// at most `max`, the most recent first. A replica that does not answer is left out, with a
/// log line: its runs are missing from the list, not an error.
pub(super) async fn list_outputs(
    peers: &std::sync::Arc<Peers>,
    caller: &Caller,
    mut here: Vec<KeptRun>,
    max: usize,
) -> Vec<KeptRun> {
    let req = ListRequest {
        identity: caller.identity.clone(),
        max,
    };
    let body = serde_json::to_value(&req).unwrap_or_default();
    for (tag, answer) in peers.post_all(LIST_PATH, &body).await {
        let parsed = match answer {
            Ok((200, json)) => {
                serde_json::from_value::<ListAnswer>(json).map_err(|e| e.to_string())
            }
            Ok((status, _)) => Err(format!("status {status}")),
            Err(e) => Err(e.to_string()),
        };
        match parsed {
            Ok(list) => here.extend(list.runs.into_iter().take(max)),
            Err(error) => tracing::warn!(
                replica = %tag,
                error = %error,
                "resources/list: a replica did not list its kept outputs; they are left out"
            ),
        }
    }
    here.sort_by_key(|r| r.age_ms);
    here.truncate(max);
    here
}

/// Answers a peer's [`ListRequest`].
pub(crate) fn answer_list(service: &McpService, req: ListRequest) -> ListAnswer {
    let caller = Caller {
        identity: req.identity,
        ..Caller::default()
    };
    ListAnswer {
        runs: service.kept_runs(&caller, req.max.min(super::LISTED_RUNS)),
    }
}

/// Why there is no page (an MCP error's code and message).
#[derive(Debug, Serialize, Deserialize)]
struct Refusal {
    code: i32,
    message: String,
}

/// Reads `uri` (run `id`) on the replica tagged `replica`, as `caller`.
pub(super) async fn read_output(
    peers: &Peers,
    replica: &str,
    id: &str,
    uri: &str,
    caller: &Caller,
) -> Result<ReadResourceResult, McpError> {
    let req = ReadRequest {
        replica: replica.to_owned(),
        uri: uri.to_owned(),
        identity: caller.identity.clone(),
    };
    let body = serde_json::to_value(&req).unwrap_or_default();
    let gone = |why: &str| {
        McpError::resource_not_found(
            format!(
                "run {id} was kept by replica {replica} of this gateway, which {why}: its outputs went with it; run the command again"
            ),
            None,
        )
    };
    match peers.post(replica, READ_PATH, &body).await {
        Ok((200, page)) => serde_json::from_value(page).map_err(|e| {
            McpError::internal_error(
                format!("replica {replica} answered a page that does not parse: {e}"),
                None,
            )
        }),
        Ok((_, refusal)) => match serde_json::from_value::<Refusal>(refusal) {
            Ok(r) => Err(McpError::new(ErrorCode(r.code), r.message, None)),
            Err(_) => Err(McpError::internal_error(
                format!("replica {replica} refused the read without saying why"),
                None,
            )),
        },
        Err(PeerError::Unknown(_)) => Err(gone(
            "no longer answers (it restarted, stopped or was scaled away)",
        )),
        Err(e @ PeerError::Failed { .. }) => {
            tracing::warn!(error = %e, "a kept output could not be read from its replica");
            Err(gone("did not answer"))
        }
    }
}

/// Answers a peer's [`ReadRequest`] on the replica tagged `tag`: the status and JSON body.
pub(crate) fn answer(
    service: &McpService,
    tag: &str,
    req: ReadRequest,
) -> (u16, serde_json::Value) {
    let refusal = |status: u16, code: ErrorCode, message: String| {
        let r = Refusal {
            code: code.0,
            message,
        };
        (status, serde_json::to_value(r).unwrap_or_default())
    };
    if req.replica != tag {
        return refusal(
            404,
            ErrorCode::RESOURCE_NOT_FOUND,
            format!(
                "replica {} of this gateway restarted since it kept this run: its outputs went with it; run the command again",
                req.replica
            ),
        );
    }
    let caller = Caller {
        identity: req.identity,
        ..Caller::default()
    };
    match service.read_output_as(&req.uri, &caller) {
        Ok(page) => (200, serde_json::to_value(page).unwrap_or_default()),
        Err(e) => {
            let status = if e.code == ErrorCode::RESOURCE_NOT_FOUND {
                404
            } else {
                400
            };
            refusal(status, e.code, e.message.into_owned())
        }
    }
}

/// The home's peers when `caller`'s sessions live on one replica (a backend whose sessions
/// are not shared, with peers).
fn session_peers(service: &McpService) -> Option<&std::sync::Arc<Peers>> {
    service
        .peers
        .as_ref()
        .filter(|_| !service.runner.sessions_shared())
}

/// Ends `caller`'s session `name` on its home replica: `None` when that is this one.
pub(crate) async fn end_session_at_home(
    service: &McpService,
    caller: &Caller,
    name: &str,
) -> Option<Result<(), crate::contract::ErrorBody>> {
    let peers = session_peers(service)?;
    let path = format!("/sessions/{name}");
    match peers
        .call_home(caller, axum::http::Method::DELETE, &path)
        .await?
    {
        Ok((204, _)) => Some(Ok(())),
        Ok((status, body)) => Some(Err(crate::contract::ErrorBody::from_answer(
            status,
            &String::from_utf8_lossy(&body),
        ))),
        Err(e) => Some(Err(e)),
    }
}

/// `caller`'s open sessions, from its home replica: `None` when that is this one.
pub(crate) async fn sessions_at_home(
    service: &McpService,
    caller: &Caller,
) -> Option<Result<crate::contract::SessionList, crate::contract::ErrorBody>> {
    let peers = session_peers(service)?;
    match peers
        .call_home(caller, axum::http::Method::GET, "/sessions")
        .await?
    {
        Ok((200, body)) => Some(serde_json::from_slice(&body).map_err(|e| {
            crate::contract::ErrorBody::new(
                crate::contract::ErrorCode::ProtocolError,
                format!("the home replica's session list does not parse: {e}"),
            )
        })),
        Ok((status, body)) => Some(Err(crate::contract::ErrorBody::from_answer(
            status,
            &String::from_utf8_lossy(&body),
        ))),
        Err(e) => Some(Err(e)),
    }
}

/// In an MCP request's HTTP extensions, with peers: cancelled when the client's connection
/// reaches EOF, or when a `notifications/cancelled` names the call, whichever replica it
/// reached (`server::mcp_http`). Without rmcp's sessions, closing the call's connection is
/// how a 2026-07-28 client cancels it (it aborts the call's POST), and a write that fails
/// comes late, or never before a call's first message; older clients send the notification,
/// which rmcp's stateless transport drops.
#[derive(Clone)]
pub(crate) struct ConnectionClosed(pub(crate) tokio_util::sync::CancellationToken);

/// The token of [`ConnectionClosed`] for the call in `context`; one that never fires without.
pub(crate) fn connection_closed(
    context: &rmcp::service::RequestContext<rmcp::RoleServer>,
) -> tokio_util::sync::CancellationToken {
    context
        .extensions
        .get::<axum::http::request::Parts>()
        .and_then(|p| p.extensions.get::<ConnectionClosed>())
        .map(|c| c.0.clone())
        .unwrap_or_default()
}

//! The other replicas of this gateway (`server.peers`, `mcp-run serve --peer URL`) and the
//! channel between them.
//!
//! Each replica has a tag, 8 random hex digits drawn at start (a restarted replica is a new
//! replica: what the old process kept in memory and its temporary directory is gone with it).
//! State that one replica keeps and another may be asked for (today: MCP runs' kept outputs)
//! carries the tag of the replica that holds it; a replica asked for another's state finds
//! the peer with that tag (`GET /peer/v1/replica`, cached) and forwards the request there.
//!
//! Every peer request carries the shared peer secret (`MCP_RUN_PEER_SECRET`, or the file
//! `server.peer_secret_file`) as its bearer token, checked in constant time; the secret is
//! never put in a URL or a log line. Peer requests carry the identity of the caller they act
//! for, so a peer serves only what that caller could read on the replica itself: whoever
//! holds the secret can act as any identity, which is why runner pods must not reach the peer
//! port (a NetworkPolicy; see docs/deployment.md "Scaling").

use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use subtle::ConstantTimeEq as _;

pub(crate) mod discovery;
mod route;
pub(crate) use route::{
    Forwarded, HTTP_PREFIX, Home, REPLAYABLE_BYTES, Relayed, decode_caller, needs_home,
    path_needs_home,
};

/// The environment variable holding the peer secret (wins over `server.peer_secret_file`).
pub(crate) const SECRET_ENV: &str = "MCP_RUN_PEER_SECRET";
/// The shortest secret accepted: 32 characters (e.g. `openssl rand -hex 16`).
pub(crate) const MIN_SECRET_LEN: usize = 32;
/// Where peer requests go, under a peer's base URL.
pub(crate) const PATH_PREFIX: &str = "/peer/v1/";
/// The path that answers a replica's tag.
pub(crate) const REPLICA_PATH: &str = "/peer/v1/replica";

/// How long [`Peers::post_all`] waits for each replica.
const PEER_ALL_TIMEOUT: Duration = Duration::from_secs(5);

/// Characters of a replica tag (hex digits).
pub(crate) const TAG_LEN: usize = 8;

/// Why a peer could not answer.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PeerError {
    /// No configured peer has the tag (it restarted, or was removed, or is down).
    #[error(
        "no replica {0} answers among this gateway's peers (it restarted, stopped or was scaled away)"
    )]
    Unknown(String),
    /// The peer was found but the request failed.
    #[error("replica {replica} did not answer: {message}")]
    Failed { replica: String, message: String },
}

const URL_HINT: &str = "expected a replica's base URL such as http://10.0.0.12:8080";

/// Why the peers cannot be set up (the gateway does not start). Never contains a secret.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PeerSetupError {
    /// `reason`: the URL parser's (reqwest does not export its error type).
    #[error("invalid peer URL {url:?}: {reason}; {URL_HINT}")]
    Unparsable { url: String, reason: String },
    #[error("invalid peer URL {0:?}: {URL_HINT}")]
    NotHttp(String),
    /// The URL is not repeated: it holds a credential.
    #[error(
        "a peer URL must not carry credentials: the peer secret comes from MCP_RUN_PEER_SECRET or server.peer_secret_file"
    )]
    Credentials,
    #[error("invalid peer URL {0:?}: no query or fragment; {URL_HINT}")]
    QueryOrFragment(String),
    #[error("cannot read the peer secret file {} (server.peer_secret_file): {source}", path.display())]
    SecretFile {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error(
        "the peer secret is too short: at least {MIN_SECRET_LEN} characters (e.g. `openssl rand -hex 16`)"
    )]
    ShortSecret,
    #[error("cannot build the peer HTTP client: {0}")]
    Client(reqwest::Error),
}

/// Checks one `server.peers` entry: an `http` or `https` base URL without credentials,
/// query or fragment.
pub(crate) fn parse_url(s: &str) -> Result<reqwest::Url, PeerSetupError> {
    let url = reqwest::Url::parse(s).map_err(|e| PeerSetupError::Unparsable {
        url: s.to_owned(),
        reason: e.to_string(),
    })?;
    if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none_or(str::is_empty) {
        return Err(PeerSetupError::NotHttp(s.to_owned()));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(PeerSetupError::Credentials);
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(PeerSetupError::QueryOrFragment(s.to_owned()));
    }
    Ok(url)
}

/// Reads the peer secret: `MCP_RUN_PEER_SECRET` (via `env`), else the file. Errors never
/// contain the secret.
pub(crate) fn load_secret(
    file: Option<&Path>,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Option<String>, PeerSetupError> {
    let secret = match env(SECRET_ENV).filter(|s| !s.trim().is_empty()) {
        Some(s) => Some(s.trim().to_owned()),
        None => match file {
            Some(p) => Some(
                std::fs::read_to_string(p)
                    .map_err(|source| PeerSetupError::SecretFile {
                        path: p.to_owned(),
                        source,
                    })?
                    .trim()
                    .to_owned(),
            ),
            None => None,
        },
    };
    if let Some(s) = &secret
        && s.chars().count() < MIN_SECRET_LEN
    {
        return Err(PeerSetupError::ShortSecret);
    }
    Ok(secret)
}

/// This replica and its peers.
pub(crate) struct Peers {
    tag: String,
    /// `server.peers`.
    urls: Vec<reqwest::Url>,
    /// `server.peer_service`: the replicas listed by the Kubernetes API, added to `urls`.
    discovery: Option<discovery::Discovery>,
    secret: String,
    client: reqwest::Client,
    /// Replica tag → its base URL, learnt from the peers' answers.
    known: Mutex<HashMap<String, reqwest::Url>>,
    /// When `known` was last asked for ([`route`]: callers' homes).
    view: Mutex<route::View>,
    /// The client of forwarded requests (made on first use).
    streams: std::sync::OnceLock<reqwest::Client>,
}

impl std::fmt::Debug for Peers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peers")
            .field("tag", &self.tag)
            .field("urls", &self.urls)
            .field("discovery", &self.discovery)
            .finish_non_exhaustive()
    }
}

impl Peers {
    /// The peers at `urls` (already checked by [`parse_url`]), with the shared secret.
    pub(crate) fn new(urls: &[String], secret: String) -> Result<Self, PeerSetupError> {
        let urls = urls
            .iter()
            .map(|u| parse_url(u))
            .collect::<Result<Vec<_>, _>>()?;
        let client = crate::exec::remote::client_builder(urls.iter().all(|u| u.scheme() == "http"))
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(Duration::from_secs(2))
            // A peer answers from its own memory and disk: anything longer is a broken peer.
            .timeout(Duration::from_secs(30))
            .user_agent(concat!("mcp-run-peer/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(PeerSetupError::Client)?;
        let tag = format!("{:08x}", rand::random::<u32>());
        Ok(Self {
            tag,
            urls,
            discovery: None,
            secret,
            client,
            known: Mutex::default(),
            view: Mutex::default(),
            streams: std::sync::OnceLock::new(),
        })
    }

    /// This replica's tag.
    pub(crate) fn tag(&self) -> &str {
        &self.tag
    }

    /// Also the replicas that the Kubernetes API lists (`server.peer_service`).
    pub(crate) fn with_discovery(mut self, discovery: discovery::Discovery) -> Self {
        self.discovery = Some(discovery);
        self
    }

    /// Whether the replicas are found from the Kubernetes API (their number changes).
    pub(crate) fn discovers(&self) -> bool {
        self.discovery.is_some()
    }

    /// The base URLs of the other replicas now: `server.peers` and the discovered ones.
    pub(crate) async fn urls(&self) -> Vec<reqwest::Url> {
        let mut urls = self.urls.clone();
        if let Some(d) = &self.discovery {
            for u in d.urls().await {
                if !urls.contains(&u) {
                    urls.push(u);
                }
            }
        }
        urls
    }

    /// How many peers are configured (`server.peers`).
    pub(crate) fn len(&self) -> usize {
        self.urls.len()
    }

    /// Whether a request carries the peer secret as its bearer token (constant time).
    pub(crate) fn authorized(&self, headers: &axum::http::HeaderMap) -> bool {
        let Some(token) = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
        else {
            return false;
        };
        token.as_bytes().ct_eq(self.secret.as_bytes()).into()
    }

    /// POSTs `body` as JSON to `path` (under [`PATH_PREFIX`]) on the replica tagged `replica`;
    /// the answer's status and JSON body.
    pub(crate) async fn post(
        &self,
        replica: &str,
        path: &str,
        body: &serde_json::Value,
    ) -> Result<(u16, serde_json::Value), PeerError> {
        let base = self.locate(replica).await?;
        let failed = |message: String| PeerError::Failed {
            replica: replica.to_owned(),
            message,
        };
        let url = base.join(path).map_err(|e| failed(e.to_string()))?;
        let resp = self
            .client
            .post(url)
            .bearer_auth(&self.secret)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(serde_json::to_vec(body).unwrap_or_default())
            .send()
            .await
            .map_err(|e| {
                // The replica may have been replaced at the same address: ask again next time.
                self.forget(replica);
                failed(without_url(e))
            })?;
        let status = resp.status().as_u16();
        // A peer's answer is one page, bounded by its `mcp.result_chars`.
        let bytes = resp.bytes().await.map_err(|e| failed(without_url(e)))?;
        let json = serde_json::from_slice(&bytes)
            .map_err(|e| failed(format!("an answer that is not JSON: {e}")))?;
        Ok((status, json))
    }

    /// POSTs `body` to `path` on every live replica but this one, at once, each bounded by
    /// `PEER_ALL_TIMEOUT`: each one's tag and answer. A replica that does not answer is left
    /// out of the next view of the live ones.
    pub(crate) async fn post_all(
        self: &std::sync::Arc<Self>,
        path: &str,
        body: &serde_json::Value,
    ) -> Vec<(String, Result<(u16, serde_json::Value), PeerError>)> {
        let tags = self.live().await;
        let asks = tags.into_iter().map(|tag| async move {
            let answer =
                match tokio::time::timeout(PEER_ALL_TIMEOUT, self.post(&tag, path, body)).await {
                    Ok(a) => a,
                    Err(_) => Err(PeerError::Failed {
                        replica: tag.clone(),
                        message: format!("no answer within {PEER_ALL_TIMEOUT:?}"),
                    }),
                };
            if answer.is_err() {
                self.lost(&tag);
            }
            (tag, answer)
        });
        futures_util::future::join_all(asks).await
    }

    /// The base URL of the peer tagged `replica`: from the cache, else by asking every peer.
    async fn locate(&self, replica: &str) -> Result<reqwest::Url, PeerError> {
        if let Some(url) = self.known.lock().ok().and_then(|k| k.get(replica).cloned()) {
            return Ok(url);
        }
        self.refresh().await;
        self.known
            .lock()
            .ok()
            .and_then(|k| k.get(replica).cloned())
            .ok_or_else(|| PeerError::Unknown(replica.into()))
    }

    /// Asks every peer (`server.peers` and the discovered ones) for its tag; the answers
    /// replace what was known.
    async fn refresh(&self) {
        let urls = self.urls().await;
        let asks = urls.iter().map(|base| async move {
            let url = base.join(REPLICA_PATH).ok()?;
            let resp = self
                .client
                .get(url)
                .bearer_auth(&self.secret)
                .timeout(Duration::from_secs(5))
                .send()
                .await
                .ok()?;
            if !resp.status().is_success() {
                tracing::warn!(
                    peer = %base,
                    status = resp.status().as_u16(),
                    "a peer refused the replica question (is the peer secret the same on every replica?)"
                );
                return None;
            }
            let v: serde_json::Value = serde_json::from_slice(&resp.bytes().await.ok()?).ok()?;
            Some((v["replica"].as_str()?.to_owned(), base.clone()))
        });
        let found = futures_util::future::join_all(asks).await;
        self.merge_view(found.into_iter().flatten().collect());
    }

    fn forget(&self, replica: &str) {
        if let Ok(mut k) = self.known.lock() {
            k.remove(replica);
        }
    }
}

/// A reqwest error's text with its causes, without its URL (the path is ours; the host is
/// in the configuration).
fn without_url(e: reqwest::Error) -> String {
    let e = e.without_url();
    let mut text = e.to_string();
    let mut cur = std::error::Error::source(&e);
    while let Some(c) = cur {
        text = format!("{text}: {c}");
        cur = c.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_secrets_are_checked_without_echoing_secrets() {
        assert!(parse_url("http://10.0.0.1:8080").is_ok());
        assert!(parse_url("https://gw-1.gw.ns.svc:8443/").is_ok());
        for bad in ["10.0.0.1:8080", "ftp://x", "http://x?a=1", "http://x#f"] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
        let e = parse_url("http://u:hunter2hunter2@x:1").unwrap_err();
        assert!(!e.to_string().contains("hunter2"), "{e}");

        let long = "s".repeat(MIN_SECRET_LEN);
        assert_eq!(
            load_secret(None, |_| Some(format!(" {long}\n"))).unwrap(),
            Some(long.clone())
        );
        assert_eq!(load_secret(None, |_| None).unwrap(), None);
        let e = load_secret(None, |_| Some("shortsecret".into())).unwrap_err();
        assert!(!e.to_string().contains("shortsecret"), "{e}");
    }

    #[test]
    fn only_the_secret_authorizes() {
        let p = Peers::new(&["http://127.0.0.1:1".into()], "k".repeat(40)).unwrap();
        assert_eq!(p.tag().len(), TAG_LEN);
        let mut h = axum::http::HeaderMap::new();
        assert!(!p.authorized(&h));
        h.insert(
            "authorization",
            format!("Bearer {}", "k".repeat(39)).parse().unwrap(),
        );
        assert!(!p.authorized(&h));
        h.insert(
            "authorization",
            format!("Bearer {}", "k".repeat(40)).parse().unwrap(),
        );
        assert!(p.authorized(&h));
    }
}

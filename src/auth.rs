//! Who calls the gateway: optional bearer-token auth (config `auth:`, tokens from
//! `MCP_RUN_AUTH_TOKENS_FILE` or `MCP_RUN_AUTH_TOKENS`) and the caller's identity for audit
//! and rate limiting ([`crate::rate_limit`]). `docs/policy.md` describes the behaviour.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderMap, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

pub(crate) use crate::caller::Caller;
use crate::contract::{ErrorBody, ErrorCode};

/// The environment variable naming the tokens file (the Helm chart sets it).
pub(crate) const TOKENS_FILE_ENV: &str = "MCP_RUN_AUTH_TOKENS_FILE";
/// The environment variable holding tokens directly (comma- or whitespace-separated).
pub(crate) const TOKENS_ENV: &str = "MCP_RUN_AUTH_TOKENS";

/// Why tokens could not be loaded: the gateway does not start, or a reload keeps the
/// previous tokens. Messages name the file or variable and the entry, never a token.
#[derive(Debug, thiserror::Error)]
pub(crate) enum AuthError {
    #[error("{origin}: entry {entry}: the name before `:` must be letters, digits, `-_.@`")]
    BadName { origin: String, entry: usize },
    #[error("{origin}: entry {entry}: the token is empty")]
    EmptyToken { origin: String, entry: usize },
    #[error(
        "`auth.required` is set but no token is configured (set {TOKENS_FILE_ENV}, {TOKENS_ENV} or auth.tokens_file)"
    )]
    NoToken,
    #[error("cannot read the auth tokens file {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "the auth tokens file {} names more than {max} identity: the local backend runs every command as the gateway's user, so several identities need local.allow_multiple_identities (docs/policy.md)",
        path.display()
    )]
    TooManyIdentities { path: PathBuf, max: usize },
}

/// Paths that stay open when auth is on: probes and metrics.
pub(crate) const OPEN_PATHS: &[&str] = &["/healthz", "/readyz", "/metrics"];

/// The `auth:` section of the configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// A tokens file (one `token` or `name:token` a line, `#` comments). The environment
    /// variable `MCP_RUN_AUTH_TOKENS_FILE` overrides it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_file: Option<PathBuf>,
    /// Refuse to start when no token is configured (so that a missing Secret cannot open the
    /// gateway).
    pub required: bool,
    /// How often the tokens file is read again (a rotated Kubernetes Secret is picked up
    /// without a restart); 0: read once at start.
    pub reload_secs: u64,
}

impl Default for AuthConfig {
    fn default() -> Self {
        Self {
            tokens_file: None,
            required: false,
            reload_secs: 10,
        }
    }
}

/// One configured token, kept as its SHA-256 digest.
#[derive(Clone)]
struct Token {
    name: String,
    digest: [u8; 32],
}

/// The bearer tokens the gateway accepts.
pub(crate) struct Auth {
    /// What is checked: the file's tokens, then the environment's.
    tokens: std::sync::RwLock<Arc<Vec<Token>>>,
    /// The tokens file, re-read by [`Auth::reload`].
    file: Option<PathBuf>,
    /// The digest of the file's last accepted content.
    file_digest: Mutex<[u8; 32]>,
    /// Tokens from `MCP_RUN_AUTH_TOKENS` (fixed for the process).
    env_tokens: Vec<Token>,
    /// The most distinct identities a reloaded file may bring (the local backend is
    /// single-tenant unless told otherwise).
    identity_limit: std::sync::OnceLock<usize>,
}

/// `(name, token)` pairs as parsed.
type Entries = Vec<(String, String)>;

fn tokens_of(entries: Entries) -> Vec<Token> {
    entries
        .into_iter()
        .map(|(name, token)| Token {
            name,
            digest: digest(token.as_bytes()),
        })
        .collect()
}

fn distinct_names(tokens: &[Token]) -> usize {
    tokens
        .iter()
        .map(|t| t.name.as_str())
        .collect::<std::collections::BTreeSet<_>>()
        .len()
}

fn digest(token: &[u8]) -> [u8; 32] {
    Sha256::digest(token).into()
}

impl Auth {
    /// Parses token entries: `token` or `name:token`, one per line (or separated by commas
    /// and whitespace for the environment variable); `#` starts a comment line. An unnamed
    /// token is named `token-` and the first 8 hex digits of its SHA-256 (safe to log).
    pub(crate) fn parse(
        text: &str,
        source: &str,
        split_words: bool,
    ) -> Result<Vec<(String, String)>, AuthError> {
        let mut out = Vec::new();
        let entries: Vec<(usize, &str)> = if split_words {
            text.split(|c: char| c == ',' || c.is_whitespace())
                .enumerate()
                .map(|(i, e)| (i + 1, e.trim()))
                .filter(|(_, e)| !e.is_empty())
                .collect()
        } else {
            text.lines()
                .enumerate()
                .map(|(i, l)| (i + 1, l.trim()))
                .filter(|(_, l)| !l.is_empty() && !l.starts_with('#'))
                .collect()
        };
        for (n, entry) in entries {
            let (name, token) = match entry.split_once(':') {
                Some((name, token)) => {
                    let name = name.trim();
                    if name.is_empty()
                        || !name
                            .bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b"-_.@".contains(&b))
                    {
                        return Err(AuthError::BadName {
                            origin: source.to_owned(),
                            entry: n,
                        });
                    }
                    (name.to_owned(), token.trim())
                }
                None => {
                    let d = digest(entry.as_bytes());
                    let hex: String = d[..4].iter().map(|b| format!("{b:02x}")).collect();
                    (format!("token-{hex}"), entry)
                }
            };
            if token.is_empty() {
                return Err(AuthError::EmptyToken {
                    origin: source.to_owned(),
                    entry: n,
                });
            }
            if token.len() < 16 {
                tracing::warn!(%source, entry = n, name = %name, "auth token shorter than 16 characters");
            }
            out.push((name, token.to_owned()));
        }
        Ok(out)
    }

    /// Loads the tokens from `MCP_RUN_AUTH_TOKENS_FILE` (else `auth.tokens_file`) and
    /// `MCP_RUN_AUTH_TOKENS`. `None`: no token anywhere, auth is off (an error instead when
    /// `auth.required`).
    pub(crate) fn load(
        config: &AuthConfig,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<Auth>, AuthError> {
        let file = env(TOKENS_FILE_ENV)
            .filter(|f| !f.is_empty())
            .map(PathBuf::from)
            .or_else(|| config.tokens_file.clone());
        let (file_tokens, file_digest) = match &file {
            Some(path) => {
                let (entries, d) = Self::read_file(path)?;
                (tokens_of(entries), d)
            }
            None => (Vec::new(), [0; 32]),
        };
        let env_tokens = match env(TOKENS_ENV) {
            Some(text) => tokens_of(Self::parse(&text, TOKENS_ENV, true)?),
            None => Vec::new(),
        };
        if file_tokens.is_empty() && env_tokens.is_empty() {
            return if config.required {
                Err(AuthError::NoToken)
            } else {
                Ok(None)
            };
        }
        let mut all = file_tokens;
        all.extend(env_tokens.iter().cloned());
        Ok(Some(Auth {
            tokens: std::sync::RwLock::new(Arc::new(all)),
            file,
            file_digest: Mutex::new(file_digest),
            env_tokens,
            identity_limit: Default::default(),
        }))
    }

    /// The file's `(name, token)` entries and the digest of its content.
    fn read_file(path: &std::path::Path) -> Result<(Entries, [u8; 32]), AuthError> {
        let text = std::fs::read_to_string(path).map_err(|source| AuthError::Read {
            path: path.to_owned(),
            source,
        })?;
        let entries = Self::parse(&text, &path.display().to_string(), false)?;
        Ok((entries, digest(text.as_bytes())))
    }

    /// Fixed tokens, no file.
    #[cfg(test)]
    pub(crate) fn new(entries: Vec<(String, String)>) -> Self {
        let env_tokens = tokens_of(entries);
        Self {
            tokens: std::sync::RwLock::new(Arc::new(env_tokens.clone())),
            file: None,
            file_digest: Mutex::new([0; 32]),
            env_tokens,
            identity_limit: Default::default(),
        }
    }

    /// How many distinct identities (token names) are configured.
    pub(crate) fn identities(&self) -> usize {
        distinct_names(&self.current())
    }

    /// From now on, a reloaded tokens file that brings more than `n` identities is refused
    /// (the previous tokens stay).
    pub(crate) fn limit_identities(&self, n: usize) {
        let _ = self.identity_limit.set(n);
    }

    fn current(&self) -> Arc<Vec<Token>> {
        self.tokens
            .read()
            .map(|t| t.clone())
            .unwrap_or_else(|p| p.into_inner().clone())
    }

    pub(crate) fn len(&self) -> usize {
        self.current().len()
    }

    /// Reads the tokens file again. `Ok(true)`: its content changed and its tokens replace
    /// the previous ones; `Err`: unreadable or invalid, the previous tokens stay. An emptied
    /// file leaves only the environment's tokens (none: every request is refused).
    pub(crate) fn reload(&self) -> Result<bool, AuthError> {
        let Some(path) = &self.file else {
            return Ok(false);
        };
        let (entries, d) = Self::read_file(path)?;
        let mut last = self.file_digest.lock().unwrap_or_else(|p| p.into_inner());
        if *last == d {
            return Ok(false);
        }
        let mut all = tokens_of(entries);
        all.extend(self.env_tokens.iter().cloned());
        if let Some(&max) = self.identity_limit.get()
            && distinct_names(&all) > max
        {
            return Err(AuthError::TooManyIdentities {
                path: path.clone(),
                max,
            });
        }
        *self.tokens.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(all);
        *last = d;
        Ok(true)
    }

    /// Re-reads the tokens file every `every` in a background task (nothing without a file).
    pub(crate) fn watch(self: &Arc<Self>, every: std::time::Duration) {
        if self.file.is_none() || every.is_zero() {
            return;
        }
        let auth = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.tick().await;
            loop {
                tick.tick().await;
                let Some(auth) = auth.upgrade() else { return };
                match auth.reload() {
                    Ok(true) => tracing::info!(
                        tokens = auth.len(),
                        "auth tokens file changed: tokens reloaded"
                    ),
                    Ok(false) => {}
                    Err(e) => tracing::warn!("{e}; keeping the previous tokens"),
                }
            }
        });
    }

    /// The name of the token presented, compared in constant time: digests of equal length
    /// are compared with `subtle`, and every configured token is compared, match or not.
    pub(crate) fn verify(&self, presented: &str) -> Option<String> {
        let d = digest(presented.as_bytes());
        let mut found = None;
        for t in self.current().iter() {
            if bool::from(t.digest.ct_eq(&d)) && found.is_none() {
                found = Some(t.name.clone());
            }
        }
        found
    }

    /// Checks a request's `Authorization` header.
    pub(crate) fn check(&self, headers: &HeaderMap) -> Result<String, ErrorBody> {
        let unauthorized = |m: &str| ErrorBody::new(ErrorCode::Unauthorized, m);
        let value = headers
            .get(header::AUTHORIZATION)
            .ok_or_else(|| unauthorized("this gateway requires a bearer token (`Authorization: Bearer TOKEN`; run-remote sends RUN_REMOTE_TOKEN)"))?;
        let value = value
            .to_str()
            .map_err(|_| unauthorized("the Authorization header is not valid text"))?;
        let token = value
            .split_once(' ')
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, t)| t.trim())
            .ok_or_else(|| unauthorized("the Authorization header must be `Bearer TOKEN`"))?;
        self.verify(token)
            .ok_or_else(|| unauthorized("the bearer token is not valid"))
    }
}

/// What the HTTP middleware needs: the tokens (`None`: auth off) and where to count refusals.
#[derive(Clone)]
pub(crate) struct Gate {
    pub auth: Option<Arc<Auth>>,
    pub metrics: crate::metrics::Metrics,
}

/// The HTTP middleware: finds the caller's address and, when auth is on, checks the bearer
/// token of every path but the open ones. The [`Caller`] goes into the request's extensions
/// for the handlers (and, through rmcp, the MCP tools).
pub(crate) async fn middleware(
    State(Gate { auth, metrics }): State<Gate>,
    mut req: Request,
    next: Next,
) -> Response {
    let addr = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.ip());
    let mut caller = Caller {
        addr,
        ..Caller::default()
    };
    if let Some(auth) = &auth
        && !OPEN_PATHS.contains(&req.uri().path())
        // Replicas authenticate each other with the peer secret (`server::peers`).
        && !req.uri().path().starts_with(crate::peers::PATH_PREFIX)
    {
        match auth.check(req.headers()) {
            Ok(name) => caller.identity = Some(name),
            Err(e) => {
                crate::audit::unauthorized(req.uri().path(), &caller.describe(), &e.message);
                metrics.rejected(e.code);
                return e.into_response();
            }
        }
    }
    req.extensions_mut().insert(caller);
    next.run(req).await
}

/// The caller of an MCP request, from the HTTP request rmcp passes along (none over stdio).
pub(crate) fn mcp_caller(extensions: &rmcp::model::Extensions) -> Option<Caller> {
    extensions
        .get::<axum::http::request::Parts>()
        .and_then(|p| p.extensions.get::<Caller>())
        .cloned()
}

#[cfg(test)]
mod tests {

    use super::*;

    #[test]
    fn token_files_and_names() {
        let e = Auth::parse(
            "# comment\n\nci:abcdefghijklmnopq\n  rawtoken-0123456789  \nx:y:z\n",
            "f",
            false,
        )
        .unwrap();
        assert_eq!(e[0], ("ci".into(), "abcdefghijklmnopq".into()));
        assert!(
            e[1].0.starts_with("token-") && e[1].0.len() == 14,
            "{:?}",
            e[1]
        );
        assert_eq!(e[1].1, "rawtoken-0123456789");
        // Split at the first colon: the token may contain more.
        assert_eq!(e[2], ("x".into(), "y:z".into()));
        let env = Auth::parse("a:1111, b:2222\nc:3333", "env", true).unwrap();
        assert_eq!(env.len(), 3);
        assert!(
            Auth::parse("bad name:x", "f", false)
                .unwrap_err()
                .to_string()
                .contains("entry 1")
        );
        assert!(
            Auth::parse("n:", "f", false)
                .unwrap_err()
                .to_string()
                .contains("empty")
        );
    }

    #[test]
    fn verify_and_check_headers() {
        let auth = Auth::new(vec![
            ("a".into(), "secret-a-0123456789".into()),
            ("b".into(), "secret-b-0123456789".into()),
        ]);
        assert_eq!(auth.verify("secret-b-0123456789").as_deref(), Some("b"));
        assert_eq!(auth.verify("secret-b-012345678"), None);
        assert_eq!(auth.verify(""), None);
        let mut h = HeaderMap::new();
        assert_eq!(auth.check(&h).unwrap_err().code, ErrorCode::Unauthorized);
        h.insert(header::AUTHORIZATION, "Basic x".parse().unwrap());
        assert!(auth.check(&h).unwrap_err().message.contains("Bearer"));
        h.insert(
            header::AUTHORIZATION,
            "bearer secret-a-0123456789".parse().unwrap(),
        );
        assert_eq!(auth.check(&h).unwrap(), "a");
    }

    #[test]
    fn load_from_env_and_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("tokens");
        std::fs::write(&file, "f:file-token-0123456789\n").unwrap();
        let f = file.to_str().unwrap().to_owned();
        let env = |k: &str| match k {
            TOKENS_FILE_ENV => Some(f.clone()),
            TOKENS_ENV => Some("e:env-token-0123456789".into()),
            _ => None,
        };
        let auth = Auth::load(&AuthConfig::default(), env).unwrap().unwrap();
        assert_eq!(auth.len(), 2);
        assert_eq!(auth.verify("env-token-0123456789").as_deref(), Some("e"));
        assert!(
            Auth::load(&AuthConfig::default(), |_| None)
                .unwrap()
                .is_none()
        );
        let required = AuthConfig {
            required: true,
            ..Default::default()
        };
        assert!(
            Auth::load(&required, |_| None)
                .err()
                .unwrap()
                .to_string()
                .contains("auth.required")
        );
        let missing = |k: &str| (k == TOKENS_FILE_ENV).then(|| "/nonexistent/tokens".to_owned());
        assert!(
            Auth::load(&AuthConfig::default(), missing)
                .err()
                .unwrap()
                .to_string()
                .contains("/nonexistent/tokens")
        );
    }

    #[test]
    fn reload_replaces_the_file_tokens_and_keeps_them_on_errors() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("tokens");
        std::fs::write(&file, "old:old-token-0123456789\n").unwrap();
        let f = file.to_str().unwrap().to_owned();
        let env = |k: &str| match k {
            TOKENS_FILE_ENV => Some(f.clone()),
            TOKENS_ENV => Some("e:env-token-0123456789".into()),
            _ => None,
        };
        let auth = Auth::load(&AuthConfig::default(), env).unwrap().unwrap();
        assert_eq!(auth.reload().ok(), Some(false));
        std::fs::write(&file, "new:new-token-0123456789\n").unwrap();
        assert_eq!(auth.reload().ok(), Some(true));
        assert_eq!(auth.verify("old-token-0123456789"), None);
        assert_eq!(auth.verify("new-token-0123456789").as_deref(), Some("new"));
        assert_eq!(auth.verify("env-token-0123456789").as_deref(), Some("e"));
        std::fs::write(&file, "bad name:x\n").unwrap();
        assert!(auth.reload().is_err());
        assert_eq!(auth.verify("new-token-0123456789").as_deref(), Some("new"));
        std::fs::write(&file, "# emptied\n").unwrap();
        assert_eq!(auth.reload().ok(), Some(true));
        assert_eq!(auth.len(), 1);
    }
}

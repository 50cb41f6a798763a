//! The gateway's configuration: one type, loaded from one YAML file and validated in one
//! place. Command-line flags override the file. `docs/configuration.md` documents every key.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub(crate) use crate::exec::kube::config::{KubernetesConfig, Profile};
pub(crate) use crate::exec::local::LocalConfig;
pub(crate) use crate::exec::remote::RemoteConfig;
pub(crate) use crate::limits::Limits;
pub(crate) use crate::mcp::config::McpConfig;

/// A configuration problem, naming the file and the field.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid configuration in {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("invalid configuration{}: `{field}` {message}", path.as_ref().map(|p| format!(" in {}", p.display())).unwrap_or_default())]
    Invalid {
        path: Option<PathBuf>,
        field: String,
        message: String,
    },
}

/// The host names a gateway answers to by default (`server.allowed_hosts`).
pub(crate) const LOOPBACK_HOSTS: &[&str] = &["localhost", "127.0.0.1", "::1"];

/// Which backend runs commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// Child processes of the gateway.
    #[default]
    Local,
    /// One ephemeral pod per request, through the Kubernetes exec API.
    Kube,
    /// Another gateway's `/raw` (`remote.server`, `--server` or `RUN_REMOTE_SERVER`).
    Remote,
}

/// The whole configuration file.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub server: ServerConfig,
    pub limits: Limits,
    pub local: LocalConfig,
    pub kubernetes: KubernetesConfig,
    pub mcp: McpConfig,
    pub remote: RemoteConfig,
    /// Runner profiles of the Kubernetes backend; `default` is always there.
    pub profiles: BTreeMap<String, Profile>,
    /// The execution policy (docs/policy.md).
    pub policy: crate::policy::PolicyConfig,
    /// Bearer-token auth (docs/policy.md).
    pub auth: crate::auth::AuthConfig,
    /// Secrets replaced by `[REDACTED]` in output (docs/policy.md).
    pub redaction: crate::redact::RedactionConfig,
    /// Operator-declared CLI tools, each its own MCP tool (docs/tools.md).
    pub tools: Vec<crate::mcp::tools::ToolConfig>,
    /// Workspaces: limits and the content cache (docs/workspaces.md).
    pub workspaces: crate::workspace::WorkspaceConfig,
    /// Bounds of the profiles' cache volumes (docs/caches.md).
    pub caches: crate::exec::cache::CachesConfig,
    /// Sessions: runners kept across calls (docs/sessions.md).
    pub sessions: crate::session::SessionConfig,
    /// Output templates of the MCP tool, added to the built-ins (docs/templates.md);
    /// checked at start by `templates::Catalog::with_templates`.
    pub templates: BTreeMap<String, yaml_serde::Value>,
    /// The file this was loaded from, for error messages.
    #[serde(skip)]
    pub source: Option<PathBuf>,
}

/// The HTTP listener and its behaviour.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub backend: BackendKind,
    /// Seconds of silence after which a `keepalive` event is sent on a `/raw` stream.
    pub keepalive_secs: u64,
    /// On SIGTERM/SIGINT, how long running commands may go on before they are killed.
    pub shutdown_grace_secs: u64,
    /// The largest request body accepted, in bytes.
    pub max_body_bytes: usize,
    /// `Host` (and `Origin`) names every endpoint but the probes and `/metrics` accepts:
    /// DNS-rebinding protection. `*` accepts any host.
    pub allowed_hosts: Vec<String>,
    /// Listen on a non-loopback address without auth (refused otherwise).
    pub insecure_no_auth: bool,
    /// Seconds a client has to send a request's headers; also the longest idle time of a
    /// keep-alive connection between requests.
    pub header_timeout_secs: u64,
    /// The longest silence, in seconds, while a request body arrives.
    pub body_timeout_secs: u64,
    /// Connections at once; more are answered 503 and closed.
    pub max_connections: usize,
    /// Connections at once that have not made an authenticated request yet (any request
    /// when auth is off).
    pub max_unauthenticated_connections: usize,
    /// The base URLs of the other replicas of this gateway (`--peer URL`, repeatable): kept
    /// MCP outputs are read through any of them (docs/deployment.md "Scaling").
    pub peers: Vec<String>,
    /// A file holding the secret replicas authenticate each other with; the environment
    /// variable `MCP_RUN_PEER_SECRET` wins. Required with `peers` and `peer_service`.
    pub peer_secret_file: Option<PathBuf>,
    /// Where the peer channel (`/peer/v1/`) is served: its own port, so that a
    /// NetworkPolicy can admit it from the gateway's pods only. The gateway's port then
    /// refuses peer paths. Unset: peer requests go to `listen`.
    pub peer_listen: Option<SocketAddr>,
    /// The headless Service whose EndpointSlices list this gateway's replicas (`NAME`, in
    /// the gateway's namespace, or `NAMESPACE/NAME`): on a cluster the replicas find each
    /// other from the Kubernetes API, added to `peers`.
    pub peer_service: Option<String>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            backend: BackendKind::Local,
            keepalive_secs: 15,
            shutdown_grace_secs: 30,
            max_body_bytes: 1024 * 1024,
            allowed_hosts: LOOPBACK_HOSTS.iter().map(|s| s.to_string()).collect(),
            insecure_no_auth: false,
            header_timeout_secs: 10,
            body_timeout_secs: 30,
            max_connections: 512,
            max_unauthenticated_connections: 128,
            peers: Vec::new(),
            peer_secret_file: None,
            peer_listen: None,
            peer_service: None,
        }
    }
}

impl Config {
    /// Loads and validates a configuration file (YAML; JSON is YAML too).
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text, Some(path))
    }

    /// Parses and validates configuration text; `path` is only used in messages.
    pub fn parse(text: &str, path: Option<&Path>) -> Result<Self, ConfigError> {
        let mut config: Config = if text.trim().is_empty() {
            Config::default()
        } else {
            yaml_serde::from_str(text).map_err(|e| ConfigError::Parse {
                path: path
                    .map(Path::to_owned)
                    .unwrap_or_else(|| PathBuf::from("<config>")),
                message: e.to_string(),
            })?
        };
        config.source = path.map(Path::to_owned);
        config.move_deprecated()?;
        config.validate()?;
        config.ensure_default_profile();
        Ok(config)
    }

    /// Checks the rules that types alone do not express.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |field: &str, message: String| ConfigError::Invalid {
            path: self.source.clone(),
            field: field.into(),
            message,
        };
        self.limits.validate().map_err(|(f, m)| invalid(&f, m))?;
        if self.server.keepalive_secs == 0 {
            return Err(invalid(
                "server.keepalive_secs",
                "must be at least 1".into(),
            ));
        }
        for (i, peer) in self.server.peers.iter().enumerate() {
            crate::peers::parse_url(peer)
                .map_err(|m| invalid(&format!("server.peers[{i}]"), m.to_string()))?;
        }
        if let Some(service) = &self.server.peer_service {
            crate::peers::discovery::parse_service(service)
                .map_err(|m| invalid("server.peer_service", m.to_string()))?;
        }
        if self.server.max_body_bytes < 1024 {
            return Err(invalid(
                "server.max_body_bytes",
                "must be at least 1024".into(),
            ));
        }
        self.kubernetes
            .validate(&self.limits)
            .map_err(|(f, m)| invalid(&f, m))?;
        self.caches.validate().map_err(|(f, m)| invalid(&f, m))?;
        for (name, profile) in &self.profiles {
            profile
                .validate()
                .map_err(|(f, m)| invalid(&format!("profiles.{name}.{f}"), m))?;
            for (i, c) in profile.caches.iter().enumerate() {
                c.validate(&self.caches)
                    .map_err(|(f, m)| invalid(&format!("profiles.{name}.caches[{i}].{f}"), m))?;
            }
        }
        if !self.profiles.is_empty() && !self.profiles.contains_key("default") {
            return Err(invalid(
                "profiles",
                "must contain a `default` profile".into(),
            ));
        }
        for (field, v) in [
            (
                "server.header_timeout_secs",
                self.server.header_timeout_secs as usize,
            ),
            (
                "server.body_timeout_secs",
                self.server.body_timeout_secs as usize,
            ),
            ("server.max_connections", self.server.max_connections),
            (
                "server.max_unauthenticated_connections",
                self.server.max_unauthenticated_connections,
            ),
        ] {
            if v == 0 {
                return Err(invalid(field, "must be at least 1".into()));
            }
        }
        if self.server.allowed_hosts.is_empty() {
            return Err(invalid(
                "server.allowed_hosts",
                "must name at least one host (`*` accepts any)".into(),
            ));
        }
        self.mcp.validate().map_err(|(f, m)| invalid(f, m))?;
        self.remote.validate().map_err(|(f, m)| invalid(&f, m))?;
        self.local.validate().map_err(|(f, m)| invalid(&f, m))?;
        self.workspaces
            .validate()
            .map_err(|(f, m)| invalid(&f, m))?;
        self.sessions.validate().map_err(|(f, m)| invalid(&f, m))?;
        crate::mcp::tools::validate(&self.tools).map_err(|e| invalid(&e.field, e.message))?;
        self.redaction
            .validate()
            .map_err(|e| invalid(&e.field, e.message))?;
        self.policy
            .validate(&self.limits)
            .map_err(|e| invalid(&e.field, e.message))?;
        for (i, t) in self.tools.iter().enumerate() {
            if let Some(p) = &t.profile
                && p != "default"
                && !self.profiles.contains_key(p)
            {
                return Err(invalid(
                    &format!("tools[{i}].profile"),
                    format!("{p:?} names no profile of `profiles`"),
                ));
            }
        }
        // An override for a profile no request can name would be dead configuration.
        for name in self.policy.profiles.keys() {
            if name != "default" && !self.profiles.contains_key(name) {
                return Err(invalid(
                    &format!("policy.profiles.{name}"),
                    format!(
                        "names no profile of `profiles` (known: {})",
                        std::iter::once("default")
                            .chain(
                                self.profiles
                                    .keys()
                                    .map(String::as_str)
                                    .filter(|k| *k != "default")
                            )
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Moves `mcp.allowed_hosts` (deprecated) to `server.allowed_hosts`.
    fn move_deprecated(&mut self) -> Result<(), ConfigError> {
        if let Some(hosts) = self.mcp.allowed_hosts.take() {
            if self.server.allowed_hosts != ServerConfig::default().allowed_hosts {
                return Err(ConfigError::Invalid {
                    path: self.source.clone(),
                    field: "mcp.allowed_hosts".into(),
                    message: "is the old name of `server.allowed_hosts`: set only that one".into(),
                });
            }
            tracing::warn!(
                "`mcp.allowed_hosts` is deprecated: `server.allowed_hosts` now covers every endpoint"
            );
            self.server.allowed_hosts = if hosts.is_empty() {
                vec!["*".into()]
            } else {
                hosts
            };
        }
        Ok(())
    }

    /// The profiles with `default` filled in when the file has none.
    pub fn ensure_default_profile(&mut self) {
        self.profiles.entry("default".into()).or_default();
    }

    pub fn keepalive(&self) -> Duration {
        Duration::from_secs(self.server.keepalive_secs)
    }

    pub fn shutdown_grace(&self) -> Duration {
        Duration::from_secs(self.server.shutdown_grace_secs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_is_defaults() {
        let c = Config::parse("", None).unwrap();
        assert_eq!(c.limits.default_timeout_secs, 600);
        assert_eq!(c.server.listen.port(), 8080);
    }

    /// The example at the top of docs/configuration.md is a valid configuration.
    #[test]
    fn documented_example_is_valid() {
        let doc = include_str!("../docs/configuration.md");
        let start = doc.find("```yaml\n").expect("a yaml block") + 8;
        let len = doc[start..].find("```").expect("its end");
        let c = Config::parse(&doc[start..start + len], None).unwrap();
        assert_eq!(c.tools.len(), 1);
        assert_eq!(c.limits.max_concurrent_executions, Some(16));
    }

    #[test]
    fn errors_name_file_and_field() {
        let e = Config::parse(
            "limits:\n  max_timeout_secs: 0\n",
            Some(Path::new("/etc/mcp-run.yaml")),
        )
        .unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("/etc/mcp-run.yaml") && msg.contains("limits.max_timeout_secs"),
            "{msg}"
        );
        let e = Config::parse("limitz: {}\n", Some(Path::new("c.yaml")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("c.yaml") && e.contains("limitz"), "{e}");
        let e = Config::parse("local:\n  inherit_env: ['A-B']\n", None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("local.inherit_env"), "{e}");
    }
}

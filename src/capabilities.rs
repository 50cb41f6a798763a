//! The runtime capabilities document: which runtime executes an agent's commands, what is
//! allowed and what is not (the capability-reporting pattern of the design references).
//! The same document is the `mcp-run/runtime` experimental capability of the MCP
//! `initialize` result, the MCP resource `mcp-run://capabilities`, and `GET /capabilities`.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::limits::Limits;

/// The URI of the capabilities resource.
pub(crate) const RESOURCE_URI: &str = "mcp-run://capabilities";
/// The key of the experimental capability in the MCP `initialize` result.
pub(crate) const EXPERIMENTAL_KEY: &str = "mcp-run/runtime";

/// What a backend says about itself.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct BackendCapabilities {
    /// `kubernetes`, `local`, or a remote gateway's backend.
    pub backend: String,
    /// `isolated-pod` (each command in its own pod), `host-process` (processes of the
    /// gateway's host, no isolation), or what a remote gateway reports.
    pub safety_level: String,
    /// One or two lines for agents: where commands run.
    pub description: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// The runner profiles a request may name (`profile`).
    pub profiles: Vec<ProfileInfo>,
    /// For the `remote` backend: the gateway that runs the commands.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<String>,
}

/// A runner profile as agents see it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ProfileInfo {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_class: Option<String>,
    /// Requests and limits, as in a pod spec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<serde_json::Value>,
    /// Warm pods kept for this profile by each gateway replica (0: none).
    #[serde(default)]
    pub warm_pool: usize,
    /// Storage kept between this profile's runs of one caller (docs/caches.md).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub caches: Vec<CacheInfo>,
}

/// A profile's cache, as a caller needs to know it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct CacheInfo {
    pub name: String,
    /// `identity` (every run of the caller), or `workspace` (runs with the same
    /// `cache_scope`, else the same workspace).
    pub scope: String,
    /// The variables that point tools at it (`CARGO_TARGET_DIR`, ...).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub variables: Vec<String>,
}

/// The limits a request meets.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub(crate) struct LimitsInfo {
    pub default_timeout_secs: u64,
    pub max_timeout_secs: u64,
    /// Per stream, the output of an MCP run kept for `resources/read`; `/raw` is not capped.
    pub max_output_bytes: usize,
    pub stdin: bool,
    pub tty: bool,
}

/// The whole document.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub(crate) struct Capabilities {
    pub server: ServerInfo,
    #[serde(flatten)]
    pub backend: BackendCapabilities,
    pub limits: LimitsInfo,
    /// What agents cannot do, in words.
    pub limitations: Vec<String>,
    /// The execution policy in force; null when none is configured.
    pub policy: Option<serde_json::Value>,
    /// Output templates on offer (names).
    pub templates: Vec<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub(crate) struct ServerInfo {
    pub name: String,
    pub version: String,
}

impl Capabilities {
    pub(crate) fn new(
        backend: BackendCapabilities,
        limits: &Limits,
        max_output_bytes: usize,
    ) -> Self {
        // Every backend feeds stdin (`/raw`'s stdin mode, MCP's `stdin` argument; on
        // Kubernetes through the exec's stdin channel).
        let stdin = limits.allow_stdin;
        let mut limitations = vec![
            if stdin {
                "stdin only as given in the request (MCP: the `stdin` argument); commands read nothing else".to_string()
            } else {
                "no stdin: commands read nothing (use files or arguments)".to_string()
            },
            "no TTY: interactive programs do not work".into(),
            format!(
                "MCP results carry the head and tail of each stream within a character budget; the full output (up to {} MiB per stream) stays readable as a resource for a while",
                max_output_bytes >> 20
            ),
            "arguments are passed as argv, never through a shell: use `sh -c` explicitly when you need one".into(),
        ];
        if backend.safety_level == "isolated-pod" {
            limitations.push(
                "each call runs in a fresh pod: nothing persists between calls except mounted volumes".into(),
            );
        }
        Self {
            server: ServerInfo {
                name: "mcp-run".into(),
                version: env!("CARGO_PKG_VERSION").into(),
            },
            backend,
            limits: LimitsInfo {
                default_timeout_secs: limits.default_timeout_secs,
                max_timeout_secs: limits.max_timeout_secs,
                max_output_bytes,
                stdin,
                tty: false,
            },
            limitations,
            policy: None,
            templates: Vec::new(),
        }
    }

    /// One line for tool descriptions.
    pub(crate) fn where_line(&self) -> String {
        let b = &self.backend;
        let mut s = b.description.clone();
        if !b.profiles.is_empty() && b.backend == "kubernetes" {
            let p: Vec<String> = b
                .profiles
                .iter()
                .map(|p| format!("{} ({})", p.name, p.image.as_deref().unwrap_or("?")))
                .collect();
            s.push_str(&format!(" Profiles: {}.", p.join(", ")));
        }
        s
    }
}

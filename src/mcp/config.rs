//! The `mcp:` section of the configuration (docs/configuration.md, docs/mcp.md).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The default budget of one result: characters of output an agent reads (agent clients
/// cap a tool result near 25,000 tokens; Claude Code moves results over 50,000 characters
/// to a file).
pub(crate) const DEFAULT_RESULT_CHARS: usize = 30_000;

/// The MCP server (`/mcp` and `mcp-run stdio`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct McpConfig {
    /// Per stream, the most output of one run kept for `resources/read` (the result itself
    /// carries at most `result_chars`).
    pub max_output_bytes: usize,
    /// The characters of output one tool result carries by default (head and tail kept, the
    /// cut marked in place); a call may ask for up to `max_result_chars`.
    pub result_chars: usize,
    /// The most a call may ask for with `result_chars` (and the size of one resource page).
    pub max_result_chars: usize,
    /// The most bytes a call may give the command on stdin.
    pub max_stdin_bytes: usize,
    /// Where and for how long full outputs are kept.
    pub output_store: OutputStoreConfig,
    /// Deprecated alias of `server.allowed_hosts` (which covers every endpoint since);
    /// `[]` means any host. Moved there when the file is loaded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allowed_hosts: Option<Vec<String>>,
    /// Open sessions of `/mcp` at most; an `initialize` over it gets 429.
    pub max_sessions: usize,
    /// Open sessions per client (token name, else address) at most.
    pub max_sessions_per_client: usize,
    /// A session that sees no request for this many seconds is closed.
    pub session_idle_secs: u64,
}

/// The store of full outputs (`mcp-run://runs/{id}/{stream}`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OutputStoreConfig {
    /// The directory in which a private directory for the outputs is made (removed at exit);
    /// default: the system's temporary directory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dir: Option<PathBuf>,
    /// All kept outputs together; the oldest finished runs are removed beyond it.
    pub max_bytes: u64,
    /// How long a finished run's output stays readable.
    pub max_age_secs: u64,
}

impl Default for OutputStoreConfig {
    fn default() -> Self {
        Self {
            dir: None,
            max_bytes: 1 << 30,
            max_age_secs: 3600,
        }
    }
}

impl Default for McpConfig {
    fn default() -> Self {
        Self {
            max_output_bytes: 64 << 20,
            result_chars: DEFAULT_RESULT_CHARS,
            max_result_chars: 200_000,
            max_stdin_bytes: 1 << 20,
            output_store: OutputStoreConfig::default(),
            allowed_hosts: None,
            max_sessions: 256,
            max_sessions_per_client: 16,
            session_idle_secs: 120,
        }
    }
}

impl McpConfig {
    /// Checks the section; errors name the field (under `mcp.`) and what is wrong.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        for (field, v) in [
            ("mcp.max_sessions", self.max_sessions as u64),
            (
                "mcp.max_sessions_per_client",
                self.max_sessions_per_client as u64,
            ),
            ("mcp.session_idle_secs", self.session_idle_secs),
        ] {
            if v == 0 {
                return Err((field, "must be at least 1".into()));
            }
        }
        if self.max_output_bytes < 1024 {
            return Err(("mcp.max_output_bytes", "must be at least 1024".into()));
        }
        if self.result_chars < 1000 {
            return Err(("mcp.result_chars", "must be at least 1000".into()));
        }
        if self.max_result_chars < self.result_chars {
            return Err((
                "mcp.max_result_chars",
                format!("must be at least result_chars ({})", self.result_chars),
            ));
        }
        if self.max_result_chars > 10_000_000 {
            return Err(("mcp.max_result_chars", "must be at most 10000000".into()));
        }
        if self.output_store.max_age_secs == 0 {
            return Err(("mcp.output_store.max_age_secs", "must be at least 1".into()));
        }
        Ok(())
    }
}

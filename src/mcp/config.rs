//! The MCP server's section of the configuration (`mcp:`).

use serde::{Deserialize, Serialize};

/// The MCP server (`/mcp` and `mcp-run stdio`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct McpConfig {
    /// Per stream, the most output kept in a tool result (head and tail).
    pub max_output_bytes: usize,
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

impl Default for McpConfig {
    fn default() -> Self {
        Self {
            max_output_bytes: crate::result::DEFAULT_MAX_OUTPUT_BYTES,
            allowed_hosts: None,
            max_sessions: 256,
            max_sessions_per_client: 16,
            session_idle_secs: 120,
        }
    }
}

impl McpConfig {
    /// `(field, message)` on failure.
    pub fn validate(&self) -> Result<(), (String, String)> {
        for (field, v) in [
            ("mcp.max_sessions", self.max_sessions as u64),
            (
                "mcp.max_sessions_per_client",
                self.max_sessions_per_client as u64,
            ),
            ("mcp.session_idle_secs", self.session_idle_secs),
        ] {
            if v == 0 {
                return Err((field.into(), "must be at least 1".into()));
            }
        }
        if self.max_output_bytes < 1024 {
            return Err((
                "mcp.max_output_bytes".into(),
                "must be at least 1024".into(),
            ));
        }
        Ok(())
    }
}

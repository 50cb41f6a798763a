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
}

impl Default for McpConfig {
    fn default() -> Self {
        Self {
            max_output_bytes: crate::result::DEFAULT_MAX_OUTPUT_BYTES,
            allowed_hosts: None,
        }
    }
}

impl McpConfig {
    /// `(field, message)` on failure.
    pub fn validate(&self) -> Result<(), (String, String)> {
        if self.max_output_bytes < 1024 {
            return Err((
                "mcp.max_output_bytes".into(),
                "must be at least 1024".into(),
            ));
        }
        Ok(())
    }
}

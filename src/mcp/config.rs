//! The MCP server's section of the configuration (`mcp:`).

use serde::{Deserialize, Serialize};

/// The MCP server (`/mcp` and `mcp-run stdio`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct McpConfig {
    /// Per stream, the most output kept in a tool result (head and tail).
    pub max_output_bytes: usize,
    /// `Host` headers `/mcp` accepts (DNS-rebinding protection for gateways on a
    /// workstation); an empty list accepts any host, for a gateway behind a Service.
    pub allowed_hosts: Vec<String>,
}

impl Default for McpConfig {
    fn default() -> Self {
        Self {
            max_output_bytes: crate::result::DEFAULT_MAX_OUTPUT_BYTES,
            allowed_hosts: vec!["localhost".into(), "127.0.0.1".into(), "::1".into()],
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

//! The `workspaces:` section of the gateway's configuration (docs/configuration.md).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Limits and the content cache of workspaces.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkspaceConfig {
    /// Accept `POST /workspaces` and `workspace` in requests.
    pub enabled: bool,
    /// The content cache's directory [default: `$TMPDIR/mcp-run-cache-PID`, removed at
    /// shutdown]. The gateway owns its `blobs/` and `tmp/` subdirectories and empties them at
    /// start: give each gateway process its own directory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_dir: Option<PathBuf>,
    /// The cache's size bound: least recently used contents go first.
    pub max_cache_bytes: u64,
    /// Contents and workspaces unused for this long are dropped.
    pub max_age_secs: u64,
    /// Workspaces (manifests) kept at once; over it, the least recently used of the identity
    /// holding the most goes first.
    pub max_workspaces: usize,
    /// Memory the registered manifests may take, estimated (about 200 bytes per file plus
    /// its path); over it, the least recently used workspace of the identity holding the
    /// most goes first, and a single manifest larger than this is refused (413).
    pub max_registry_bytes: u64,
    /// Files (and symlinks) in one workspace.
    pub max_files: usize,
    /// Bytes of all files of one workspace.
    pub max_bytes: u64,
    /// Bytes of one file.
    pub max_file_bytes: u64,
    /// Bytes of one path.
    pub max_path_bytes: usize,
    /// Bytes of a `POST /workspaces` body.
    pub max_manifest_bytes: usize,
    /// Where the local backend materialises a workspace per run [default: the system's
    /// temporary directory].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub local_dir: Option<PathBuf>,
    /// Files and directories (inodes) that concurrent runs' trees may hold at once on the
    /// local backend; a run that would go over it is refused with 429.
    pub max_local_inodes: u64,
    /// Trees the local backend keeps between runs, so that a rerun copies only what changed
    /// (0: a fresh tree per run, removed afterwards).
    pub local_idle_trees: usize,
}

const MIB: u64 = 1024 * 1024;

impl Default for WorkspaceConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            cache_dir: None,
            max_cache_bytes: 2048 * MIB,
            max_age_secs: 24 * 3600,
            max_workspaces: 1000,
            max_registry_bytes: 64 * MIB,
            max_files: 100_000,
            max_bytes: 1024 * MIB,
            max_file_bytes: 256 * MIB,
            max_path_bytes: 1024,
            max_manifest_bytes: 64 * MIB as usize,
            local_dir: None,
            local_idle_trees: 2,
            max_local_inodes: 400_000,
        }
    }
}

impl WorkspaceConfig {
    /// Checks the rules that types do not express: `(field, message)`.
    pub fn validate(&self) -> Result<(), (String, String)> {
        let min = |field: &str, v: u64, m: u64| {
            if v < m {
                Err((
                    format!("workspaces.{field}"),
                    format!("must be at least {m}"),
                ))
            } else {
                Ok(())
            }
        };
        min("max_files", self.max_files as u64, 1)?;
        min("max_bytes", self.max_bytes, 1)?;
        min("max_file_bytes", self.max_file_bytes, 1)?;
        min("max_path_bytes", self.max_path_bytes as u64, 16)?;
        min("max_manifest_bytes", self.max_manifest_bytes as u64, 1024)?;
        min("max_workspaces", self.max_workspaces as u64, 1)?;
        min("max_registry_bytes", self.max_registry_bytes, MIB)?;
        min("max_local_inodes", self.max_local_inodes, 16)?;
        min("max_age_secs", self.max_age_secs, 1)?;
        if self.max_cache_bytes < self.max_file_bytes {
            return Err((
                "workspaces.max_cache_bytes".into(),
                format!(
                    "must be at least workspaces.max_file_bytes ({})",
                    self.max_file_bytes
                ),
            ));
        }
        Ok(())
    }

    pub fn cache_dir(&self) -> PathBuf {
        self.cache_dir.clone().unwrap_or_else(|| {
            std::env::temp_dir().join(format!("mcp-run-cache-{}", std::process::id()))
        })
    }

    pub fn local_dir(&self) -> PathBuf {
        self.local_dir.clone().unwrap_or_else(std::env::temp_dir)
    }
}

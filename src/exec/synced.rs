//! `mcp-run stdio --backend remote --workspace DIR`: before each command, DIR is synced to
//! the gateway (incrementally: an unchanged tree costs one manifest, an edit one upload) and
//! the command runs in that workspace, in the same directory relative to DIR as its `cwd`.
//! So an agent's MCP calls always run on its current edits.

use std::path::{Path, PathBuf};
use std::time::Duration;

use futures_util::future::BoxFuture;

use super::remote::RemoteExecutor;
use super::{ExecSpec, Execution, Executor, StartOptions};
use crate::contract::{ErrorBody, ErrorCode, RunRequest};
use crate::workspace::client::{SyncError, WorkspaceClient};

/// The remote backend with a directory synced before every run.
pub struct SyncedRemote {
    remote: RemoteExecutor,
    client: WorkspaceClient,
    root: PathBuf,
}

impl SyncedRemote {
    pub fn new(remote: RemoteExecutor, dir: &Path) -> Result<Self, String> {
        let root = dir
            .canonicalize()
            .map_err(|e| format!("--workspace {}: {e}", dir.display()))?;
        if !root.is_dir() {
            return Err(format!("--workspace {}: not a directory", root.display()));
        }
        Ok(Self {
            client: remote.workspace_client(),
            remote,
            root,
        })
    }

    /// The request's directory relative to the workspace root.
    fn relative_cwd(&self, cwd: Option<&str>) -> Result<Option<String>, ErrorBody> {
        let Some(cwd) = cwd else { return Ok(None) };
        let path = Path::new(cwd);
        let path = path.canonicalize().unwrap_or_else(|_| path.to_owned());
        let rel = path.strip_prefix(&self.root).map_err(|_| {
            ErrorBody::new(
                ErrorCode::InvalidRequest,
                format!(
                    "`cwd` {cwd:?} is outside the workspace {} that this server syncs",
                    self.root.display()
                ),
            )
        })?;
        Ok(rel.to_str().filter(|r| !r.is_empty()).map(str::to_owned))
    }

    async fn sync(&self) -> Result<String, ErrorBody> {
        match self.client.sync_dir(&self.root).await {
            Ok(s) => {
                tracing::info!(
                    workspace = %s.workspace,
                    uploaded_files = s.uploaded_files,
                    uploaded_bytes = s.uploaded_bytes,
                    "workspace synced"
                );
                Ok(s.workspace)
            }
            Err(SyncError::Local(m)) => Err(ErrorBody::new(
                ErrorCode::InvalidRequest,
                format!("cannot send the workspace {}: {m}", self.root.display()),
            )),
            Err(SyncError::Gateway(e)) => Err(e),
        }
    }
}

impl Executor for SyncedRemote {
    fn name(&self) -> &'static str {
        "remote"
    }

    fn start(
        &self,
        spec: ExecSpec,
        opts: StartOptions,
    ) -> BoxFuture<'_, Result<Execution, ErrorBody>> {
        Box::pin(async move {
            let mut req = RunRequest {
                cwd: self.relative_cwd(spec.cwd.as_deref())?,
                executable: spec.executable,
                args: spec.args,
                env: spec.env,
                timeout_secs: Some(spec.timeout.as_secs().max(1)),
                profile: spec.profile,
                workspace: Some(self.sync().await?),
                sync_back: Vec::new(),
            };
            match self.remote.run(&req, opts.cancel.clone()).await {
                // Evicted between the sync and the run (or another replica): once more.
                Err(e) if e.code == ErrorCode::WorkspaceIncomplete => {
                    req.workspace = Some(self.sync().await?);
                    self.remote.run(&req, opts.cancel).await
                }
                r => r,
            }
        })
    }

    fn timeout_slack(&self) -> Duration {
        self.remote.timeout_slack()
    }

    fn capabilities(&self) -> BoxFuture<'_, crate::capabilities::BackendCapabilities> {
        self.remote.capabilities()
    }
}

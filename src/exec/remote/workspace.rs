//! `mcp-run stdio --backend remote --workspace DIR`: before each command, DIR is synced to
//! the gateway (incrementally: an unchanged tree costs one manifest, an edit one upload) and
//! the command runs in that workspace, in the same directory relative to DIR as its `cwd`.
//! So an agent's MCP calls always run on its current edits.
//!
//! Also [`forward`]: a gateway with the remote backend that gets a workspace run uploads the
//! tree from its own cache to the upstream gateway and brings sync-back results into its
//! cache, so that its clients download them from it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{RemoteExecutor, SetupError};
use crate::contract::{ChangedFile, ErrorBody, ErrorCode, Event, RunRequest};
use crate::exec::{ExecSpec, Execution, Executor, StartOptions};
use crate::workspace::client::{SyncError, WorkspaceClient};

/// The remote backend with a directory synced before every run.
pub(crate) struct SyncedRemote {
    remote: RemoteExecutor,
    client: WorkspaceClient,
    root: PathBuf,
}

impl SyncedRemote {
    pub(crate) fn new(remote: RemoteExecutor, dir: &Path) -> Result<Self, SetupError> {
        let root = dir.canonicalize().map_err(|source| SetupError::Workspace {
            path: dir.to_owned(),
            source,
        })?;
        if !root.is_dir() {
            return Err(SetupError::NotADirectory(root));
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
                cache_scope: spec.cache_scope,
                session: spec.session,
                session_busy: spec.session_busy,
                ..RunRequest::default()
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

    fn forwards_sessions(&self) -> bool {
        true
    }

    fn capabilities(&self) -> BoxFuture<'_, crate::capabilities::BackendCapabilities> {
        self.remote.capabilities()
    }
}

/// Runs a workspace run of this gateway on the upstream gateway: syncs the tree from the
/// local cache, runs it there, and copies the reported sync-back contents into the local
/// cache before passing the report on.
pub(crate) async fn forward(
    remote: &RemoteExecutor,
    spec: ExecSpec,
    run: crate::workspace::WorkspaceRun,
    opts: StartOptions,
) -> Result<Execution, ErrorBody> {
    let cancel = opts.cancel.clone();
    let pin = run.store.pin(&run.workspace)?;
    let sources = run
        .workspace
        .contents
        .keys()
        .map(|h| (h.clone(), run.store.path_of(&pin, h)))
        .collect();
    let walked = crate::workspace::walk::Walked {
        manifest: run.workspace.manifest.clone(),
        sources,
        hashed: 0,
    };
    let client = remote.workspace_client();
    let timeout = super::request_timeout(&spec);
    let mut req = RunRequest {
        executable: spec.executable,
        args: spec.args,
        cwd: (!run.cwd.is_empty()).then(|| run.cwd.clone()),
        env: spec.env,
        timeout_secs: Some(timeout),
        steps: spec.steps,
        continue_on_error: spec.continue_on_error,
        profile: spec.profile,
        workspace: Some(client.sync(&walked).await?.workspace),
        sync_back: run.sync_back.clone(),
        cache_scope: spec.cache_scope,
        session: spec.session,
        session_busy: spec.session_busy,
    };
    let inner = match remote.run_with(&req, opts).await {
        // Evicted upstream between the sync and the run: once more (the first attempt took
        // the stdin, if any).
        Err(e) if e.code == ErrorCode::WorkspaceIncomplete => {
            req.workspace = Some(client.sync(&walked).await?.workspace);
            remote.run(&req, cancel.clone()).await?
        }
        r => r?,
    };
    drop(pin);
    if run.sync_back.is_empty() {
        return Ok(inner);
    }
    let context = inner.context().clone();
    let own = cancel.child_token();
    let (tx, rx) = mpsc::channel(crate::exec::EVENT_BUFFER);
    tokio::spawn(relay_changes(inner, tx, own.clone(), client, run));
    Ok(Execution::new(context, rx, own))
}

/// Passes the upstream events on; the contents named by `workspace_changes` are downloaded
/// into this gateway's cache first (for the workspace's owner).
async fn relay_changes(
    mut inner: Execution,
    tx: mpsc::Sender<Event>,
    cancel: CancellationToken,
    client: WorkspaceClient,
    run: crate::workspace::WorkspaceRun,
) {
    let mut killed = false;
    loop {
        let ev = tokio::select! {
            ev = inner.next() => ev,
            _ = cancel.cancelled(), if !killed => {
                inner.kill();
                killed = true;
                continue;
            }
        };
        let Some(mut ev) = ev else { return };
        if let Event::WorkspaceChanges {
            workspace,
            files,
            truncated,
        } = ev
        {
            let mut kept = Vec::new();
            let mut cut = truncated;
            let rules = crate::workspace::results::ResultRules::new(&run.sync_back);
            for f in files {
                let stored = match &rules {
                    Ok(rules) => match rules.check(&f) {
                        Ok(()) => store_result(&client, &run, &f).await,
                        Err(why) => Err(ErrorBody::new(ErrorCode::ProtocolError, why.to_string())),
                    },
                    Err(e) => Err(ErrorBody::new(ErrorCode::InvalidRequest, e.to_string())),
                };
                match stored {
                    Ok(()) => kept.push(ChangedFile {
                        mode: crate::workspace::results::safe_mode(f.mode),
                        ..f
                    }),
                    Err(e) => {
                        tracing::warn!(
                            "sync-back of {:?} from upstream refused or failed: {}",
                            f.path.escape_debug().to_string(),
                            e.message
                        );
                        cut = true;
                    }
                }
            }
            tracing::debug!(upstream = %workspace, "sync-back relayed");
            ev = Event::WorkspaceChanges {
                workspace: run.workspace.id.clone(),
                files: kept,
                truncated: cut,
            };
        }
        let terminal = ev.is_terminal();
        if tx.send(ev).await.is_err() {
            inner.kill();
            return;
        }
        if terminal {
            return;
        }
    }
}

/// Streams one upstream result into this gateway's cache, for the workspace's owner: never
/// more than its announced size, stored only when it hashes to its announced hash.
async fn store_result(
    client: &WorkspaceClient,
    run: &crate::workspace::WorkspaceRun,
    f: &ChangedFile,
) -> Result<(), ErrorBody> {
    use futures_util::TryStreamExt as _;
    let resp = client.download_response(&f.hash).await?;
    let stream = resp.bytes_stream().map_err(std::io::Error::other);
    let mut reader = tokio_util::io::SyncIoBridge::new(tokio_util::io::StreamReader::new(stream));
    let store = run.store.clone();
    let owner = run.workspace.owner.clone();
    let (hash, size) = (f.hash.clone(), f.size);
    tokio::task::spawn_blocking(move || store.receive(&mut reader, &hash, size, &owner))
        .await
        .map_err(|e| ErrorBody::new(ErrorCode::Internal, e.to_string()))?
        .map_err(ErrorBody::from)
}

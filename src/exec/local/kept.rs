//! The local backend's kept runner (a session's, or a multi-step run's): a private directory
//! that lives across commands, holding `work/` and `tmp/`. Commands without a `cwd` run in
//! `work/`; a workspace's tree is kept there ([`crate::workspace::kept`]), so build outputs
//! stay between calls; `TMPDIR` points at `tmp/` (unless the request sets it), so temporary
//! files stay with the session and go with it. Each command is an ordinary local process
//! group with its own kill: killing one leaves the directory.
//!
//! After a gateway SIGKILL the commands die with it (parent-death signal, reaper process);
//! the directories it left are removed by the next gateway that keeps a runner (their names
//! carry the pid of the gateway that made them).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use futures_util::future::BoxFuture;
use tokio::sync::mpsc;

use super::{LocalError, LocalExecutor};
use crate::contract::{ErrorBody, Event, RunContext};
use crate::exec::{EVENT_BUFFER, ExecSpec, Execution, KeptRunner, StartOptions};
use crate::workspace::kept::KeptTree;

/// The prefix of a kept runner's directory: `mcp-run-session-PID-RANDOM`.
const PREFIX: &str = "mcp-run-session-";

pub(super) struct LocalKept {
    /// A copy of the executor's spawning parts (environment, `PATH`, host).
    spawner: LocalExecutor,
    /// The runner's directory (removed by `close`), and in it the commands' working
    /// directory and their `TMPDIR`.
    dir: PathBuf,
    work: PathBuf,
    tmp: PathBuf,
    tree: Arc<Mutex<KeptTree>>,
}

/// Where kept runners' directories live.
fn base() -> PathBuf {
    std::env::temp_dir().join("mcp-run-sessions")
}

/// Removes the directories of gateways that are gone (once per process).
fn sweep(base: &std::path::Path) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let Ok(dir) = std::fs::read_dir(base) else {
            return;
        };
        let me = std::process::id();
        for entry in dir.flatten() {
            let name = entry.file_name();
            let Some(pid) = name
                .to_str()
                .and_then(|n| n.strip_prefix(PREFIX))
                .and_then(|rest| rest.split('-').next())
                .and_then(|p| p.parse::<u32>().ok())
            else {
                continue;
            };
            if pid != me && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
                tracing::info!(dir = %entry.path().display(), "removing the session directory of a gateway that is gone");
                crate::workspace::trees::remove_tree(&entry.path());
            }
        }
    });
}

impl LocalExecutor {
    /// A new kept runner: a fresh private directory.
    pub(super) fn keep_local(&self) -> Result<LocalKept, LocalError> {
        use std::os::unix::fs::DirBuilderExt as _;
        let base = base();
        let failed = |source| LocalError::SessionDir {
            base: base.clone(),
            source,
        };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&base)
            .map_err(failed)?;
        sweep(&base);
        let dir = base.join(format!(
            "{PREFIX}{}-{:016x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        let (work, tmp) = (dir.join("work"), dir.join("tmp"));
        for d in [&dir, &work, &tmp] {
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(d)
                .map_err(failed)?;
        }
        Ok(LocalKept {
            spawner: LocalExecutor {
                base_env: self.base_env.clone(),
                path: self.path.clone(),
                host: self.host.clone(),
                _reaper: None,
                profiles: self.profiles.clone(),
                trees: self.trees.clone(),
                caches: self.caches.clone(),
                inodes: self.inodes.clone(),
            },
            tree: Arc::new(Mutex::new(KeptTree::new(work.clone()))),
            dir,
            work,
            tmp,
        })
    }
}

impl LocalKept {
    /// The runner's directory.
    pub(super) fn dir(&self) -> &std::path::Path {
        &self.dir
    }
}

impl KeptRunner for LocalKept {
    fn context(&self) -> RunContext {
        self.spawner.context(None)
    }

    fn start(
        &self,
        mut spec: ExecSpec,
        opts: StartOptions,
        sync_tree: bool,
    ) -> BoxFuture<'_, Result<Execution, ErrorBody>> {
        Box::pin(async move {
            let cancel = opts.cancel.child_token();
            if !spec.env.contains_key("TMPDIR") {
                let tmp = self.tmp.to_str().ok_or(LocalError::SessionNotUtf8)?;
                spec.env.insert("TMPDIR".into(), tmp.to_owned());
            }
            let Some(run) = spec.workspace.take() else {
                if spec.cwd.is_none() {
                    spec.cwd = Some(
                        self.work
                            .to_str()
                            .ok_or(LocalError::SessionNotUtf8)?
                            .to_owned(),
                    );
                }
                return Ok(self.spawner.spawn(&spec, cancel, opts.stdin, None)?);
            };
            if sync_tree {
                let tree = self.tree.clone();
                let r = run.clone();
                let stats = tokio::task::spawn_blocking(move || {
                    let mut tree = tree.lock().unwrap_or_else(|p| p.into_inner());
                    tree.sync(&r)
                })
                .await
                .map_err(LocalError::Syncing)??;
                tracing::debug!(
                    workspace = run.workspace.id,
                    kept = stats.kept,
                    written = stats.written,
                    removed = stats.removed,
                    "session tree ready"
                );
            }
            let cwd = self.work.join(&run.cwd);
            spec.cwd = Some(
                cwd.to_str()
                    .map(str::to_owned)
                    .ok_or(LocalError::SessionNotUtf8)?,
            );
            let inner = self
                .spawner
                .spawn(&spec, cancel.clone(), opts.stdin, None)?;
            let mut context = inner.context().clone();
            context.workspace = Some(run.workspace.id.clone());
            context.workspace_version = Some(run.workspace.digest.clone());
            if run.sync_back.is_empty() {
                return Ok(relay(inner, context, cancel, None));
            }
            Ok(relay(
                inner,
                context,
                cancel,
                Some((self.work.clone(), run)),
            ))
        })
    }

    fn check(&self) -> BoxFuture<'_, Result<(), crate::exec::Gone>> {
        Box::pin(async move {
            if self.work.is_dir() && self.tmp.is_dir() {
                Ok(())
            } else {
                Err(crate::exec::Gone::Lost(format!(
                    "its directory {} (or its work/ or tmp/) was removed",
                    self.dir.display()
                )))
            }
        })
    }

    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let dir = self.dir.clone();
            let _ = tokio::task::spawn_blocking(move || crate::workspace::trees::remove_tree(&dir))
                .await;
        })
    }
}

/// Passes `inner`'s events on under `context`; with a sync-back, reports the changed files
/// before the `exit`. Dropping the returned execution drops `inner` (which kills the command).
fn relay(
    mut inner: Execution,
    context: RunContext,
    cancel: tokio_util::sync::CancellationToken,
    sync_back: Option<(PathBuf, crate::workspace::WorkspaceRun)>,
) -> Execution {
    let (tx, rx) = mpsc::channel(EVENT_BUFFER);
    tokio::spawn(async move {
        while let Some(ev) = inner.next().await {
            if let (Event::Exit(_), Some((root, run))) = (&ev, &sync_back)
                && !tx.is_closed()
            {
                let (root, run) = (root.clone(), run.clone());
                let id = run.workspace.id.clone();
                let collected = tokio::task::spawn_blocking(move || {
                    crate::workspace::local::collect_changes(&root, &run)
                })
                .await;
                if let Ok((files, truncated)) = collected
                    && tx
                        .send(Event::WorkspaceChanges {
                            workspace: id,
                            files,
                            truncated,
                        })
                        .await
                        .is_err()
                {
                    return;
                }
            }
            if tx.send(ev).await.is_err() {
                return;
            }
        }
    });
    Execution::new(context, rx, cancel)
}

//! Materialising a workspace in a directory of the gateway's host (the local backend: a
//! tree holding exactly the manifest, kept between runs by [`super::trees`]), and collecting
//! what a run changed (sync-back), which every backend that has the tree on a local disk
//! shares.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio::sync::mpsc;

use super::WorkspaceRun;
use super::manifest::EntryKind;
use super::trees::{Tree, TreeError, Trees};
use crate::contract::{ChangedFile, Event};

/// A workspace written out for one run; handed back to the idle trees when dropped.
pub(crate) struct LocalTree {
    pub root: PathBuf,
    /// The command's working directory inside `root`.
    pub cwd: PathBuf,
    run: WorkspaceRun,
    tree: Option<Tree>,
    trees: Arc<Trees>,
    /// Set once the command has exited: only then is the tree handed back for reuse. A run
    /// that ended otherwise (client gone, error) may still have processes writing into it,
    /// so the tree is removed instead.
    exited: bool,
    /// Its share of `workspaces.max_local_inodes`, while it is in use.
    _inodes: tokio::sync::OwnedSemaphorePermit,
}

/// A tree holding exactly the run's workspace, from `trees` (an idle one brought up to date,
/// else a fresh one). Blocking.
pub(crate) fn materialize(run: &WorkspaceRun, trees: &Arc<Trees>) -> Result<LocalTree, TreeError> {
    let inodes = run.store.reserve_inodes(&run.workspace)?;
    // Held while copying from the cache; the tree has its own copies afterwards.
    let pin = run.store.pin(&run.workspace)?;
    let (tree, stats) = trees.check_out(run, &pin)?;
    tracing::debug!(
        workspace = run.workspace.id,
        kept = stats.kept,
        written = stats.written,
        removed = stats.removed,
        "workspace tree ready"
    );
    let root = tree.root().to_owned();
    Ok(LocalTree {
        cwd: root.join(&run.cwd),
        root,
        run: run.clone(),
        tree: Some(tree),
        trees: trees.clone(),
        exited: false,
        _inodes: inodes,
    })
}

impl LocalTree {
    pub(crate) fn workspace_id(&self) -> &str {
        &self.run.workspace.id
    }

    pub(crate) fn workspace_version(&self) -> &str {
        &self.run.workspace.digest
    }

    /// The files matching the run's `sync_back` globs that the command created or changed,
    /// copied into the cache for download. Blocking.
    pub(crate) fn changes(&self) -> (Vec<ChangedFile>, bool) {
        collect_changes(&self.root, &self.run)
    }
}

impl Drop for LocalTree {
    /// Blocking: cleans the tree of the run's output for reuse after an exit, else removes
    /// it (`Tree`'s own drop).
    fn drop(&mut self) {
        if let Some(tree) = self.tree.take()
            && self.exited
        {
            self.trees.check_in(tree, &self.run);
        }
    }
}

pub(crate) use super::results::globs;

/// Walks `root` without following symlinks and stores every regular file that matches the
/// globs and differs from the manifest (new, other content, or other mode). Returns the
/// files and whether the limits (the workspace's file and byte limits) cut the list short.
pub(crate) fn collect_changes(root: &Path, run: &WorkspaceRun) -> (Vec<ChangedFile>, bool) {
    use std::os::unix::fs::PermissionsExt as _;
    let Ok(set) = globs(&run.sync_back) else {
        return (Vec::new(), false);
    };
    let cfg = run.store.config();
    let manifest = &run.workspace.manifest.entries;
    let mut out = Vec::new();
    let mut bytes = 0u64;
    let mut truncated = false;
    for entry in walkdir::WalkDir::new(root)
        .follow_links(false)
        .sort_by_file_name()
        .into_iter()
        .flatten()
    {
        if !entry.file_type().is_file() {
            continue;
        }
        let Ok(rel) = entry.path().strip_prefix(root) else {
            continue;
        };
        let Some(rel) = rel.to_str() else { continue };
        // Never reported: what no caller may write (`.git`, unprintable names).
        if !set.is_match(rel) || super::results::check_result_path(rel).is_err() {
            continue;
        }
        let Ok(meta) = entry.metadata() else { continue };
        let mode = if meta.permissions().mode() & 0o111 != 0 {
            super::manifest::MODE_EXEC
        } else {
            super::manifest::MODE_FILE
        };
        let before = manifest
            .binary_search_by(|e| e.path.as_str().cmp(rel))
            .ok()
            .map(|i| &manifest[i]);
        if let Some(b) = before
            && b.kind == EntryKind::File
            && b.size == meta.len()
            && b.mode == mode
            && super::hash_file(entry.path()).is_ok_and(|h| h == b.hash)
        {
            continue;
        }
        if out.len() >= cfg.max_files || bytes + meta.len() > cfg.max_bytes {
            truncated = true;
            break;
        }
        match run
            .store
            .add_file(entry.path(), &run.workspace.owner, cfg.max_file_bytes)
        {
            Ok((hash, size)) => {
                bytes += size;
                out.push(ChangedFile {
                    path: rel.to_owned(),
                    mode,
                    size,
                    hash,
                });
            }
            Err(e) => {
                tracing::warn!("sync-back of {rel:?} skipped: {e}");
                truncated = true;
            }
        }
    }
    (out, truncated)
}

/// Relays a backend's events; before the terminal `exit`, reports the sync-back files; after
/// it, hands the tree back (cleaning it of the run's output is not the caller's wait; the
/// next run of the same workspace waits for it). Back-pressure passes through: both
/// channels are bounded and the relay awaits each send.
pub(crate) fn relay(mut rx: mpsc::Receiver<Event>, tree: LocalTree) -> mpsc::Receiver<Event> {
    let (tx, out) = mpsc::channel(8);
    tokio::spawn(async move {
        let mut tree = Some(tree);
        while let Some(ev) = rx.recv().await {
            if matches!(ev, Event::Exit(_))
                && let Some(mut t) = tree.take()
            {
                t.exited = true;
                let id = t.run.workspace.id.clone();
                // Nobody to report to when the consumer is gone.
                let wanted = !t.run.sync_back.is_empty() && !tx.is_closed();
                // Collecting touches many files: off the async threads.
                let (collected, t) = match tokio::task::spawn_blocking(move || {
                    let changes = wanted.then(|| t.changes());
                    (changes, t)
                })
                .await
                {
                    Ok((c, t)) => (c, Some(t)),
                    Err(_) => (None, None),
                };
                tree = t;
                if let Some((files, truncated)) = collected
                    && tx
                        .send(Event::WorkspaceChanges {
                            workspace: id,
                            files,
                            truncated,
                        })
                        .await
                        .is_err()
                {
                    break;
                }
            }
            let terminal = ev.is_terminal();
            if tx.send(ev).await.is_err() || terminal {
                break;
            }
        }
        drop(tx);
        if let Some(t) = tree.take() {
            let _ = tokio::task::spawn_blocking(move || drop(t)).await;
        }
    });
    out
}

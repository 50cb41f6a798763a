//! Materialising a workspace in a directory of the gateway's host (the local backend: a
//! fresh directory per run, removed afterwards), and collecting what a run changed
//! (sync-back), which every backend that has the tree on a local disk shares.

use std::path::{Path, PathBuf};

use tokio::sync::mpsc;

use super::WorkspaceRun;
use super::manifest::EntryKind;
use super::store::Pinned;
use crate::contract::{ChangedFile, ErrorBody, ErrorCode, Event};

/// A workspace written out for one run; removed when dropped.
pub struct LocalTree {
    pub root: PathBuf,
    /// The command's working directory inside `root`.
    pub cwd: PathBuf,
    run: WorkspaceRun,
    _pin: Pinned,
}

fn failed(what: String, e: std::io::Error) -> ErrorBody {
    ErrorBody::new(
        ErrorCode::StartFailed,
        format!("cannot materialise the workspace: {what}: {e}"),
    )
}

/// Writes the workspace into a new directory below `base`. Blocking.
pub fn materialize(run: &WorkspaceRun, base: &Path) -> Result<LocalTree, ErrorBody> {
    use std::os::unix::fs::DirBuilderExt as _;
    let pin = run.store.pin(&run.workspace)?;
    std::fs::create_dir_all(base).map_err(|e| failed(base.display().to_string(), e))?;
    let root = base.join(format!("mcp-run-ws-{:016x}", rand::random::<u64>()));
    // Private to the gateway's user (the command runs as that user).
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&root)
        .map_err(|e| failed(root.display().to_string(), e))?;
    // From here on the directory goes away with `tree` whatever happens.
    let tree = LocalTree {
        cwd: root.join(&run.cwd),
        root,
        run: run.clone(),
        _pin: pin,
    };
    // Directories first, then the files in parallel (copying is most of a run's set-up).
    let entries = &run.workspace.manifest.entries;
    let mut dirs = std::collections::BTreeSet::new();
    for e in entries {
        if let Some((parent, _)) = e.path.rsplit_once('/') {
            dirs.insert(parent);
        }
    }
    for d in dirs {
        std::fs::create_dir_all(tree.root.join(d)).map_err(|err| failed(d.to_owned(), err))?;
    }
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .clamp(1, 4);
    let chunk = entries.len().div_ceil(threads).max(1);
    std::thread::scope(|s| {
        let handles: Vec<_> = entries
            .chunks(chunk)
            .map(|part| s.spawn(|| part.iter().try_for_each(|e| write_entry(&tree, e))))
            .collect();
        handles.into_iter().try_for_each(|h| {
            h.join().unwrap_or_else(|_| {
                Err(failed(
                    "a copy thread".into(),
                    std::io::Error::other("panicked"),
                ))
            })
        })
    })?;
    std::fs::create_dir_all(&tree.cwd).map_err(|e| failed(run.cwd.clone(), e))?;
    Ok(tree)
}

/// Writes one file or symlink of the tree (its directory exists).
fn write_entry(tree: &LocalTree, e: &super::manifest::ManifestEntry) -> Result<(), ErrorBody> {
    use std::os::unix::fs::PermissionsExt as _;
    let dest = tree.root.join(&e.path);
    match e.kind {
        EntryKind::File => {
            let blob = tree.run.store.path_of(&tree._pin, &e.hash);
            std::fs::copy(&blob, &dest).map_err(|err| failed(e.path.clone(), err))?;
            std::fs::set_permissions(&dest, std::fs::Permissions::from_mode(e.mode))
                .map_err(|err| failed(e.path.clone(), err))
        }
        EntryKind::Symlink => {
            let target = e.target.as_deref().unwrap_or_default();
            std::os::unix::fs::symlink(target, &dest).map_err(|err| failed(e.path.clone(), err))
        }
    }
}

impl LocalTree {
    pub fn workspace_id(&self) -> &str {
        &self.run.workspace.id
    }

    pub fn workspace_version(&self) -> &str {
        &self.run.workspace.digest
    }

    /// The files matching the run's `sync_back` globs that the command created or changed,
    /// copied into the cache for download. Blocking.
    pub fn changes(&self) -> (Vec<ChangedFile>, bool) {
        collect_changes(&self.root, &self.run)
    }
}

impl Drop for LocalTree {
    fn drop(&mut self) {
        remove_tree(&self.root);
    }
}

/// Removes a directory tree, making directories writable where a command took that away.
pub fn remove_tree(root: &Path) {
    if std::fs::remove_dir_all(root).is_ok() || !root.exists() {
        return;
    }
    use std::os::unix::fs::PermissionsExt as _;
    for entry in walkdir::WalkDir::new(root)
        .follow_links(false)
        .into_iter()
        .flatten()
    {
        if entry.file_type().is_dir() {
            let _ = std::fs::set_permissions(entry.path(), std::fs::Permissions::from_mode(0o700));
        }
    }
    if let Err(e) = std::fs::remove_dir_all(root) {
        tracing::warn!(
            "cannot remove the workspace directory {}: {e}",
            root.display()
        );
    }
}

/// Compiles the sync-back globs: `*` stays within one path component, `**` spans several.
pub fn globs(patterns: &[String]) -> Result<globset::GlobSet, String> {
    let mut b = globset::GlobSetBuilder::new();
    for p in patterns {
        let g = globset::GlobBuilder::new(p)
            .literal_separator(true)
            .build()
            .map_err(|e| format!("invalid sync_back glob {p:?}: {e}"))?;
        b.add(g);
    }
    b.build()
        .map_err(|e| format!("invalid sync_back globs: {e}"))
}

/// Walks `root` without following symlinks and stores every regular file that matches the
/// globs and differs from the manifest (new, other content, or other mode). Returns the
/// files and whether the limits (the workspace's file and byte limits) cut the list short.
pub fn collect_changes(root: &Path, run: &WorkspaceRun) -> (Vec<ChangedFile>, bool) {
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
        if !set.is_match(rel) {
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
                tracing::warn!("sync-back of {rel:?} skipped: {}", e.message);
                truncated = true;
            }
        }
    }
    (out, truncated)
}

/// Relays a backend's events; before the terminal `exit`, runs `finish` (which reports the
/// sync-back files) and drops the tree. Back-pressure passes through: both channels are
/// bounded and the relay awaits each send.
pub fn relay(mut rx: mpsc::Receiver<Event>, tree: LocalTree) -> mpsc::Receiver<Event> {
    let (tx, out) = mpsc::channel(8);
    tokio::spawn(async move {
        let mut tree = Some(tree);
        while let Some(ev) = rx.recv().await {
            if matches!(ev, Event::Exit(_))
                && let Some(t) = tree.take()
            {
                let id = t.run.workspace.id.clone();
                // Nobody to report to when the consumer is gone.
                let wanted = !t.run.sync_back.is_empty() && !tx.is_closed();
                // Collecting and removing touch many files: off the async threads.
                let collected = tokio::task::spawn_blocking(move || {
                    let changes = wanted.then(|| t.changes());
                    drop(t);
                    changes
                })
                .await
                .ok()
                .flatten();
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
                    return;
                }
            }
            let terminal = ev.is_terminal();
            if tx.send(ev).await.is_err() || terminal {
                break;
            }
        }
        if let Some(t) = tree.take() {
            let _ = tokio::task::spawn_blocking(move || drop(t)).await;
        }
    });
    out
}

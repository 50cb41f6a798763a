//! `run-remote --workspace[=DIR]` and `--sync-back GLOB...`: sends DIR's files to the
//! gateway before the run (incrementally), and copies matching results back after it.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::outcome::{Failure, Reason};
use crate::contract::{ChangedFile, Event};
use crate::exec::EventFilter;
use crate::workspace::client::{SyncError, Synced, WorkspaceClient};

/// The directory to send and where the command runs inside it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Resolved {
    pub root: PathBuf,
    /// The current directory relative to `root` (`""`: the root, also when the current
    /// directory is outside it).
    pub cwd: String,
}

/// `dir` as given to `--workspace` (empty: the git work tree around the current directory,
/// else the current directory).
pub(crate) fn resolve(dir: &str, cwd: std::io::Result<PathBuf>) -> Result<Resolved, Failure> {
    let cwd = cwd
        .and_then(|c| c.canonicalize())
        .map_err(|e| Failure::config(format!("cannot read the current directory: {e}")))?;
    let root = if dir.is_empty() {
        crate::workspace::walk::default_root(&cwd)
    } else {
        cwd.join(dir)
            .canonicalize()
            .map_err(|e| Failure::new(Reason::Workspace, format!("--workspace {dir:?}: {e}")))?
    };
    if !root.is_dir() {
        return Err(Failure::new(
            Reason::Workspace,
            format!("--workspace {}: not a directory", root.display()),
        ));
    }
    let rel = match cwd.strip_prefix(&root) {
        Ok(rel) => rel
            .to_str()
            .ok_or_else(|| Failure::new(Reason::Workspace, format!("{rel:?} is not valid UTF-8")))?
            .to_owned(),
        Err(_) => String::new(),
    };
    Ok(Resolved { root, cwd: rel })
}

/// Syncs the tree; one line on stderr when something was uploaded.
pub(crate) async fn sync(
    client: &WorkspaceClient,
    root: &Path,
    quiet: bool,
) -> Result<Synced, Failure> {
    match client.sync_dir(root).await {
        Ok(s) => {
            if s.uploaded_files > 0 && !quiet {
                eprintln!(
                    "run-remote: workspace {}: uploaded {} of {} files ({})",
                    root.display(),
                    s.uploaded_files,
                    s.files,
                    human_bytes(s.uploaded_bytes)
                );
            }
            Ok(s)
        }
        Err(SyncError::Local(m)) => {
            Err(Failure::new(Reason::Workspace, format!("--workspace: {m}")))
        }
        Err(SyncError::Gateway(e)) => {
            let mut f = Failure::gateway(&e);
            f.message = format!("--workspace: {}", f.message);
            Err(f)
        }
    }
}

pub(crate) fn human_bytes(n: u64) -> String {
    match n {
        n if n >= 1 << 20 => format!("{:.1} MiB", n as f64 / (1 << 20) as f64),
        n if n >= 1 << 10 => format!("{:.1} KiB", n as f64 / 1024.0),
        n => format!("{n} B"),
    }
}

/// What the gateway reported back: the changed files and whether the list was cut.
pub(crate) type Changes = Arc<Mutex<Option<(Vec<ChangedFile>, bool)>>>;

/// Keeps the `workspace_changes` event of a run (it passes on unchanged).
pub(crate) struct CaptureChanges(pub Changes);

impl EventFilter for CaptureChanges {
    fn filter(&mut self, event: Event, out: &mut std::collections::VecDeque<Event>) {
        if let Event::WorkspaceChanges {
            files, truncated, ..
        } = &event
            && let Ok(mut slot) = self.0.lock()
        {
            *slot = Some((files.clone(), *truncated));
        }
        out.push_back(event);
    }
}

/// Copies the reported files into `root` (only those the rules of
/// [`crate::workspace::results`] accept for `globs`); one summary line on stderr, and one
/// per refused file. A refused file fails the sync-back after the others are written.
pub(crate) async fn sync_back(
    client: &WorkspaceClient,
    root: &Path,
    globs: &[String],
    changes: &Changes,
    quiet: bool,
) -> Result<Vec<ChangedFile>, Failure> {
    let taken = changes.lock().ok().and_then(|mut s| s.take());
    let Some((files, truncated)) = taken else {
        return Err(Failure::new(
            Reason::SyncBack,
            "--sync-back: the gateway reported no changed files (it may not support sync-back)",
        ));
    };
    let rules = crate::workspace::results::ResultRules::new(globs)
        .map_err(|m| Failure::new(Reason::SyncBack, format!("--sync-back: {m}")))?;
    let (written, refused) = client
        .sync_back(root, &files, &rules)
        .await
        .map_err(|m| Failure::new(Reason::SyncBack, format!("--sync-back: {m}")))?;
    if !quiet {
        let bytes: u64 = written.iter().map(|f| f.size).sum();
        eprintln!(
            "run-remote: sync-back: {} file{} ({}) copied into {}{}",
            written.len(),
            if written.len() == 1 { "" } else { "s" },
            human_bytes(bytes),
            root.display(),
            if truncated {
                " (cut short by the gateway's workspace limits)"
            } else {
                ""
            }
        );
    }
    if let Some(first) = refused.first() {
        for why in &refused {
            eprintln!("run-remote: sync-back: {why}");
        }
        return Err(Failure::new(
            Reason::SyncBack,
            format!(
                "--sync-back: {} result{} refused ({first})",
                refused.len(),
                if refused.len() == 1 { "" } else { "s" },
            ),
        ));
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolves_root_and_relative_cwd() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().canonicalize().unwrap();
        std::fs::create_dir_all(root.join(".git")).unwrap();
        std::fs::create_dir_all(root.join("a/b")).unwrap();
        let r = resolve("", Ok(root.join("a/b"))).unwrap();
        assert_eq!((r.root.as_path(), r.cwd.as_str()), (root.as_path(), "a/b"));
        let r = resolve("..", Ok(root.join("a/b"))).unwrap();
        assert_eq!((r.root, r.cwd.as_str()), (root.join("a"), "b"));
        let r = resolve(root.join("a/b").to_str().unwrap(), Ok(root.clone())).unwrap();
        assert_eq!(r.cwd, "", "outside the workspace: its root");
        assert_eq!(
            resolve("missing", Ok(root)).unwrap_err().reason,
            Reason::Workspace
        );
    }
}

//! A session's tree (the local backend): brought to each call's manifest for the paths the
//! manifest covers, everything else left alone, so that build outputs (`target/`,
//! `node_modules/`, `.venv/`) stay between calls.
//!
//! Unlike [`super::trees`], which makes a tree hold exactly the manifest, a kept tree only:
//! writes the manifest's files that are missing or differ, removes the files an earlier
//! manifest had and this one has not (a file deleted in the caller's checkout), and never
//! touches a path no manifest named. A file is known intact by the `lstat` recorded when it
//! was written (as git's index does, see [`super::trees`] for the racy-clock argument), so an
//! unchanged rerun writes nothing.
//!
//! Safety as for a fresh tree: nothing is written through a symlink. Every parent directory
//! of a path is checked with `lstat` from the root down, and a symlink or file in the way
//! (a command may have put one there) is removed and replaced by a real directory; the
//! destination itself is removed before it is written. Only the gateway writes while the
//! tree syncs: a session's calls run one at a time and a call's processes are killed when
//! it ends.

use std::collections::HashMap;
use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

use super::WorkspaceRun;
use super::trees::{Stamp, TreeError, Written, settle, write_entry};

/// Mode of the directories the sync makes.
const DIR_MODE: u32 = 0o755;

/// What a sync did (logged at debug level; tests read it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct KeptSync {
    pub kept: usize,
    pub written: usize,
    pub removed: usize,
}

/// A session's tree below `root`, and what the gateway wrote into it.
#[derive(Debug)]
pub(crate) struct KeptTree {
    root: PathBuf,
    written: HashMap<String, Written>,
}

fn failed(what: &str, source: std::io::Error) -> TreeError {
    TreeError::Session {
        what: what.to_owned(),
        source,
    }
}

impl KeptTree {
    /// A tree in `root` (an existing directory that may hold files of earlier calls).
    pub(crate) fn new(root: PathBuf) -> Self {
        Self {
            root,
            written: HashMap::new(),
        }
    }

    /// Brings the tree to `run`'s manifest for the paths it covers. Blocking.
    pub(crate) fn sync(&mut self, run: &WorkspaceRun) -> Result<KeptSync, TreeError> {
        let pin = run.store.pin(&run.workspace)?;
        let entries = &run.workspace.manifest.entries;
        let mut stats = KeptSync::default();
        for rel in gone(self.written.keys(), entries) {
            self.written.remove(&rel);
            if let Some(path) = self.existing_parent(&rel)?
                && path.symlink_metadata().is_ok()
            {
                remove_any(&path).map_err(|e| failed(&rel, e))?;
                stats.removed += 1;
            }
        }
        let mut newest = None;
        for e in entries {
            let dest = self.make_parents(&e.path)?;
            let now = dest.symlink_metadata().ok();
            let intact = match (self.written.get(&e.path), &now) {
                (Some(r), Some(m)) => r.is(e) && r.stamp == Stamp::of(m),
                _ => false,
            };
            if intact {
                stats.kept += 1;
                continue;
            }
            if now.is_some() {
                remove_any(&dest).map_err(|err| failed(&e.path, err))?;
            }
            let record = write_entry(e, &dest, run, &pin, failed)?;
            newest = newest.max(Some(record.stamp.ctime));
            self.written.insert(e.path.clone(), record);
            stats.written += 1;
        }
        if !run.cwd.is_empty() {
            // The command's directory (a trailing `.` makes every component a parent).
            self.make_parents(&format!("{}/.", run.cwd))?;
        }
        if let Some(newest) = newest
            && !settle(&self.root, newest, failed)?
        {
            // The file system's clock did not move on: a later edit could keep the recorded
            // ctime, so nothing written is trusted (the next sync writes it again).
            self.written.clear();
        }
        Ok(stats)
    }

    /// The path of `rel` when every parent directory is a real directory, else `None`
    /// (then nothing of the tree is there to remove).
    fn existing_parent(&self, rel: &str) -> Result<Option<PathBuf>, TreeError> {
        let mut path = self.root.clone();
        let parts: Vec<&str> = rel.split('/').collect();
        for part in &parts[..parts.len() - 1] {
            path.push(part);
            match path.symlink_metadata() {
                Ok(m) if m.is_dir() => {}
                _ => return Ok(None),
            }
        }
        path.push(parts[parts.len() - 1]);
        Ok(Some(path))
    }

    /// Makes `rel`'s parent directories real directories (replacing a symlink or file in the
    /// way), giving them back their permissions; returns `rel`'s path.
    fn make_parents(&self, rel: &str) -> Result<PathBuf, TreeError> {
        let mut path = self.root.clone();
        let parts: Vec<&str> = rel.split('/').collect();
        for part in &parts[..parts.len() - 1] {
            path.push(part);
            match path.symlink_metadata() {
                Ok(m) if m.is_dir() => {
                    if m.mode() & 0o700 != 0o700 {
                        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(DIR_MODE))
                            .map_err(|e| failed(rel, e))?;
                    }
                    continue;
                }
                Ok(_) => remove_any(&path).map_err(|e| failed(rel, e))?,
                Err(_) => {}
            }
            std::fs::DirBuilder::new()
                .mode(DIR_MODE)
                .create(&path)
                .map_err(|e| failed(rel, e))?;
        }
        if parts[parts.len() - 1] != "." {
            path.push(parts[parts.len() - 1]);
        }
        Ok(path)
    }
}

/// The paths of `before` (what earlier manifests put into a session's tree) that `entries`
/// (a manifest's, sorted) has not: files deleted in the caller's checkout since, which the
/// tree loses too. Shared by the local and the Kubernetes session trees.
pub(crate) fn gone<'a>(
    before: impl IntoIterator<Item = &'a String>,
    entries: &[super::manifest::ManifestEntry],
) -> Vec<String> {
    before
        .into_iter()
        .filter(|p| {
            entries
                .binary_search_by(|e| e.path.as_str().cmp(p.as_str()))
                .is_err()
        })
        .cloned()
        .collect()
}

/// Removes a file, symlink (not its target) or directory tree.
fn remove_any(path: &Path) -> std::io::Result<()> {
    match path.symlink_metadata() {
        Ok(m) if m.is_dir() => {
            super::trees::remove_tree(path);
            match path.symlink_metadata() {
                Ok(_) => Err(std::io::Error::other("the directory could not be removed")),
                Err(_) => Ok(()),
            }
        }
        Ok(_) => std::fs::remove_file(path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

//! Materialised trees kept between runs (the local backend): an unchanged rerun must not copy
//! the whole tree again, yet every run must see exactly its manifest's tree.
//!
//! A [`Tree`] remembers, for every file and symlink it wrote, the `lstat` of the result (device,
//! inode, mode, link count, size, mtime, ctime), as git's index does. Before a run the tree is
//! brought back to the manifest by one walk: what the run's manifest wants and whose `lstat`
//! is unchanged stays, everything else (files a command created, changed, chmod'ed, replaced
//! or hard-linked; other contents; other directories) is removed, then what is missing is
//! copied from the cache. A command cannot fake an unchanged `lstat`: any write, chmod, link
//! or rename sets the ctime to the current time, and [`Tree::sync`] does not return before
//! the file system's clock has passed every ctime it recorded (the "racy git" case: a change
//! within the same clock tick as the copy would otherwise keep its ctime).
//!
//! Files are copied (`std::fs::copy`: `copy_file_range`, which shares extents where the file
//! system can, as btrfs and XFS do), never hard-linked: a write through a link would change
//! the cache. A tree is used by one run at a time; a run concurrent with another on the same
//! workspace gets another tree (a fresh one if none is idle).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::WorkspaceRun;
use super::manifest::{EntryKind, ManifestEntry};
use super::store::StoreError;
use super::store::{Owner, Pinned};
use crate::contract::{ErrorBody, ErrorCode};

/// Mode of every directory of a tree (its root excepted: 0700).
const DIR_MODE: u32 = 0o755;

/// What `lstat` says about a file, as far as a change would alter it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Stamp {
    dev: u64,
    ino: u64,
    mode: u32,
    nlink: u64,
    size: u64,
    mtime: (i64, i64),
    pub(super) ctime: (i64, i64),
}

impl Stamp {
    pub(super) fn of(m: &std::fs::Metadata) -> Self {
        Self {
            dev: m.dev(),
            ino: m.ino(),
            mode: m.mode(),
            nlink: m.nlink(),
            size: m.size(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        }
    }
}

/// One file or symlink as written, and its `lstat` right after (also a session's tree's
/// record, `super::kept`).
#[derive(Debug, Clone)]
pub(super) struct Written {
    kind: EntryKind,
    mode: u32,
    /// Files: the content's hash; symlinks: the target.
    what: String,
    pub(super) stamp: Stamp,
}

impl Written {
    pub(super) fn is(&self, e: &ManifestEntry) -> bool {
        self.kind == e.kind
            && match e.kind {
                EntryKind::File => self.mode == e.mode && self.what == e.hash,
                EntryKind::Symlink => Some(self.what.as_str()) == e.target.as_deref(),
            }
    }
}

/// A directory holding a workspace's files; removed when dropped (unless handed to
/// [`Trees::check_in`]).
pub(crate) struct Tree {
    root: PathBuf,
    written: HashMap<String, Written>,
    /// The digest of the manifest the tree was last brought to (each record is then one of
    /// its entries).
    synced: Option<String>,
}

/// Why a tree could not be brought to a workspace: a run's tree (here) or a session's
/// ([`super::kept`]).
#[derive(Debug, thiserror::Error)]
pub(crate) enum TreeError {
    #[error("cannot materialise the workspace: {what}: {source}")]
    Materialise {
        what: String,
        source: std::io::Error,
    },
    #[error("cannot bring the session's tree to the workspace: {what}: {source}")]
    Session {
        what: String,
        source: std::io::Error,
    },
    /// The cache the tree is copied from (an inode reservation, a pin).
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl TreeError {
    pub(crate) fn code(&self) -> ErrorCode {
        match self {
            TreeError::Materialise { .. } | TreeError::Session { .. } => ErrorCode::StartFailed,
            TreeError::Store(e) => e.code(),
        }
    }
}

impl From<TreeError> for ErrorBody {
    fn from(e: TreeError) -> Self {
        ErrorBody::new(e.code(), e.to_string())
    }
}

fn failed(what: &str, source: std::io::Error) -> TreeError {
    TreeError::Materialise {
        what: what.to_owned(),
        source,
    }
}

/// Files the last [`Tree::sync`] kept, wrote and removed (logged at debug level).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct SyncStats {
    pub kept: usize,
    pub written: usize,
    pub removed: usize,
}

impl Tree {
    pub(crate) fn root(&self) -> &Path {
        &self.root
    }

    /// A new empty tree: a directory below `base` private to the gateway's user (commands
    /// run as that user).
    fn create(base: &Path) -> Result<Self, TreeError> {
        std::fs::create_dir_all(base).map_err(|e| failed(&base.display().to_string(), e))?;
        // Named with the gateway's pid: what a killed gateway leaves is found (crate::leftovers).
        let root = base.join(format!(
            "{}{:016x}",
            crate::leftovers::prefix("ws"),
            rand::random::<u64>()
        ));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&root)
            .map_err(|e| failed(&root.display().to_string(), e))?;
        Ok(Self {
            root,
            written: HashMap::new(),
            synced: None,
        })
    }

    /// Brings the tree to exactly `run`'s manifest (plus the run's `cwd`): keeps what is
    /// intact, removes everything else, copies what is missing from the cache. Blocking.
    pub(crate) fn sync(
        &mut self,
        run: &WorkspaceRun,
        pin: &Pinned,
    ) -> Result<SyncStats, TreeError> {
        let entries = &run.workspace.manifest.entries;
        let dirs = wanted_dirs(entries, &run.cwd);
        let (kept, seen_dirs, removed) = self.prune(run, &dirs, true)?;
        self.synced = None;
        for d in dirs.iter().filter(|d| !seen_dirs.contains(d.as_str())) {
            let p = self.root.join(d);
            std::fs::DirBuilder::new()
                .mode(DIR_MODE)
                .create(&p)
                .and_then(|()| {
                    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(DIR_MODE))
                })
                .map_err(|e| failed(d, e))?;
        }
        let missing: Vec<&ManifestEntry> = entries
            .iter()
            .filter(|e| !kept.contains(e.path.as_str()))
            .collect();
        let written = self.write_all(&missing, run, pin)?;
        let stats = SyncStats {
            kept: kept.len(),
            written: written.len(),
            removed,
        };
        let newest = written.iter().map(|(_, w)| w.stamp.ctime).max();
        self.written.extend(written);
        if let Some(newest) = newest
            && !settle(&self.root, newest, failed)?
        {
            // A file system whose clock did not move on (1-second timestamps: ext3, FAT,
            // some FUSE mounts): a later edit could keep the ctime just recorded, so nothing
            // written is trusted, and the next run of this tree writes every file again.
            self.written.clear();
        }
        self.synced = Some(run.workspace.digest.clone());
        Ok(stats)
    }

    /// After a run: removes what the run created (files and directories the manifest does
    /// not have), so that an idle tree does not hold a run's output. Names only (no `lstat`):
    /// files the run changed stay until the next [`Tree::sync`], which finds them by their
    /// `lstat`.
    fn clean(&mut self, run: &WorkspaceRun) -> Result<(), TreeError> {
        let entries = &run.workspace.manifest.entries;
        let dirs = wanted_dirs(entries, &run.cwd);
        self.prune(run, &dirs, false)?;
        Ok(())
    }

    /// One walk: keeps the directories in `dirs` and the files of `run`'s manifest that the
    /// tree wrote; removes everything else. With `stat`, a file is kept only when its
    /// `lstat` is still the recorded one and directories get their mode back; without, names
    /// decide (the clean-up after a run). Returns the kept files, the kept directories, and
    /// how many entries were removed. Entries are `lstat`ed relative to their open directory
    /// (`DirEntry::metadata`, not by full path), the subdirectories of the root in parallel:
    /// the `lstat`s are most of the walk's cost.
    fn prune(
        &mut self,
        run: &WorkspaceRun,
        dirs: &BTreeSet<String>,
        stat: bool,
    ) -> Result<(HashSet<String>, HashSet<String>, usize), TreeError> {
        std::fs::set_permissions(&self.root, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| failed("the tree's root", e))?;
        let walk = Walk {
            entries: &run.workspace.manifest.entries,
            // Synced to this very manifest: every record is one of its entries.
            same: self.synced.as_deref() == Some(run.workspace.digest.as_str()),
            written: &self.written,
            dirs,
            stat,
        };
        let mut top = Level::default();
        walk.level(&self.root, "", &mut top)?;
        let threads = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
            .clamp(1, 4);
        let subdirs = std::mem::take(&mut top.subdirs);
        let parts: Vec<Result<Level, TreeError>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let mut stack: Vec<(PathBuf, String)> =
                        subdirs.iter().skip(t).step_by(threads).cloned().collect();
                    let walk = &walk;
                    s.spawn(move || {
                        let mut part = Level::default();
                        while let Some((dir, rel)) = stack.pop() {
                            walk.level(&dir, &rel, &mut part)?;
                            stack.append(&mut part.subdirs);
                        }
                        Ok(part)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(failed("a walk thread", std::io::Error::other("panicked")))
                    })
                })
                .collect()
        });
        for part in parts {
            let part = part?;
            top.kept.extend(part.kept);
            top.seen_dirs.extend(part.seen_dirs);
            top.removed += part.removed;
        }
        let kept = top.kept;
        self.written.retain(|p, _| kept.contains(p));
        Ok((kept, top.seen_dirs, top.removed))
    }

    /// Writes the entries (their directories exist), in parallel: copying is most of a
    /// fresh tree's cost.
    fn write_all(
        &self,
        missing: &[&ManifestEntry],
        run: &WorkspaceRun,
        pin: &Pinned,
    ) -> Result<Vec<(String, Written)>, TreeError> {
        if missing.is_empty() {
            return Ok(Vec::new());
        }
        let threads = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
            .clamp(1, 4);
        let chunk = missing.len().div_ceil(threads).max(1);
        std::thread::scope(|s| {
            let handles: Vec<_> = missing
                .chunks(chunk)
                .map(|part| {
                    s.spawn(|| {
                        part.iter()
                            .map(|e| self.write_entry(e, run, pin).map(|w| (e.path.clone(), w)))
                            .collect::<Result<Vec<_>, _>>()
                    })
                })
                .collect();
            let mut out = Vec::with_capacity(missing.len());
            for h in handles {
                let part = h.join().unwrap_or_else(|_| {
                    Err(failed("a copy thread", std::io::Error::other("panicked")))
                })?;
                out.extend(part);
            }
            Ok(out)
        })
    }

    /// Writes one file or symlink and records its `lstat`.
    fn write_entry(
        &self,
        e: &ManifestEntry,
        run: &WorkspaceRun,
        pin: &Pinned,
    ) -> Result<Written, TreeError> {
        write_entry(e, &self.root.join(&e.path), run, pin, failed)
    }
}

/// Writes one file or symlink at `dest` (nothing is there) and records its `lstat`; errors
/// in the words of `failed`.
pub(super) fn write_entry(
    e: &ManifestEntry,
    dest: &Path,
    run: &WorkspaceRun,
    pin: &Pinned,
    failed: fn(&str, std::io::Error) -> TreeError,
) -> Result<Written, TreeError> {
    let what = match e.kind {
        EntryKind::File => {
            let blob = run.store.path_of(pin, &e.hash);
            // `copy` creates the file (nothing is there, and no other writer runs).
            std::fs::copy(&blob, dest).map_err(|err| failed(&e.path, err))?;
            std::fs::set_permissions(dest, std::fs::Permissions::from_mode(e.mode))
                .map_err(|err| failed(&e.path, err))?;
            e.hash.clone()
        }
        EntryKind::Symlink => {
            let target = e.target.clone().unwrap_or_default();
            std::os::unix::fs::symlink(&target, dest).map_err(|err| failed(&e.path, err))?;
            target
        }
    };
    let meta = dest
        .symlink_metadata()
        .map_err(|err| failed(&e.path, err))?;
    Ok(Written {
        kind: e.kind,
        mode: e.mode,
        what,
        stamp: Stamp::of(&meta),
    })
}

/// Waits until the file system's clock (as it stamps a change of `root`) is past `newest`,
/// so that any later change of a written file gets a later ctime than the one recorded. At
/// most a clock tick (1 to 10 ms) after copying, and only then; false when the clock did
/// not move on within 200 ms.
pub(super) fn settle(
    root: &Path,
    newest: (i64, i64),
    failed: fn(&str, std::io::Error) -> TreeError,
) -> Result<bool, TreeError> {
    for _ in 0..200 {
        std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| failed("the tree's root", e))?;
        let m = root
            .symlink_metadata()
            .map_err(|e| failed("the tree's root", e))?;
        if (m.ctime(), m.ctime_nsec()) > newest {
            return Ok(true);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(false)
}

/// What one walk of a tree keeps.
struct Walk<'a> {
    entries: &'a [ManifestEntry],
    same: bool,
    written: &'a HashMap<String, Written>,
    dirs: &'a BTreeSet<String>,
    stat: bool,
}

/// What the walk of some directories found.
#[derive(Default)]
struct Level {
    kept: HashSet<String>,
    seen_dirs: HashSet<String>,
    /// Kept directories still to read.
    subdirs: Vec<(PathBuf, String)>,
    removed: usize,
}

impl Walk<'_> {
    /// Reads one directory (`rel_dir` in the tree): keeps, removes, and lists the kept
    /// subdirectories in `out.subdirs`.
    fn level(&self, dir: &Path, rel_dir: &str, out: &mut Level) -> Result<(), TreeError> {
        let reading = |e| failed("reading the previous run's tree", e);
        for entry in std::fs::read_dir(dir).map_err(reading)? {
            let entry = entry.map_err(reading)?;
            let rel = entry.file_name().to_str().map(|n| {
                if rel_dir.is_empty() {
                    n.to_owned()
                } else {
                    format!("{rel_dir}/{n}")
                }
            });
            let path = entry.path();
            let meta = if self.stat {
                Some(entry.metadata().map_err(reading)?)
            } else {
                None
            };
            let is_dir = match &meta {
                Some(m) => m.is_dir(),
                None => entry.file_type().map_err(reading)?.is_dir(),
            };
            if is_dir {
                if let Some(rel) = rel.filter(|r| self.dirs.contains(r)) {
                    // Before it is read: a command may have taken the permission away.
                    if let Some(m) = &meta
                        && m.mode() & 0o7777 != DIR_MODE
                    {
                        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(DIR_MODE))
                            .map_err(|e| failed(&rel, e))?;
                    }
                    out.seen_dirs.insert(rel.clone());
                    out.subdirs.push((path, rel));
                } else {
                    remove_all(&path).map_err(|e| failed("removing a directory", e))?;
                    out.removed += 1;
                }
                continue;
            }
            let intact = rel.as_deref().is_some_and(|rel| {
                self.written.get(rel).is_some_and(|w| {
                    meta.as_ref().is_none_or(|m| w.stamp == Stamp::of(m))
                        && (self.same
                            || self
                                .entries
                                .binary_search_by(|e| e.path.as_str().cmp(rel))
                                .is_ok_and(|i| w.is(&self.entries[i])))
                })
            });
            match rel {
                Some(rel) if intact => {
                    out.kept.insert(rel);
                }
                _ => {
                    std::fs::remove_file(&path).map_err(|e| failed("removing a file", e))?;
                    out.removed += 1;
                }
            }
        }
        Ok(())
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        if !self.root.as_os_str().is_empty() {
            remove_tree(&self.root);
        }
    }
}

/// The directories a manifest implies, and those of `cwd`.
fn wanted_dirs(entries: &[ManifestEntry], cwd: &str) -> BTreeSet<String> {
    let mut dirs = BTreeSet::new();
    let mut add = |p: &str| {
        for (i, _) in p.match_indices('/') {
            dirs.insert(p[..i].to_owned());
        }
    };
    for e in entries {
        add(&e.path);
    }
    if !cwd.is_empty() {
        add(&format!("{cwd}/"));
    }
    dirs
}

/// Removes a directory tree, making directories writable where a command took that away.
fn remove_all(root: &Path) -> std::io::Result<()> {
    if std::fs::remove_dir_all(root).is_ok() || !root.exists() {
        return Ok(());
    }
    for entry in walkdir::WalkDir::new(root)
        .follow_links(false)
        .into_iter()
        .flatten()
    {
        if entry.file_type().is_dir() {
            let _ = std::fs::set_permissions(entry.path(), std::fs::Permissions::from_mode(0o700));
        }
    }
    std::fs::remove_dir_all(root)
}

/// Removes a directory tree (see [`remove_all`]); a failure is logged.
pub(crate) fn remove_tree(root: &Path) {
    if let Err(e) = remove_all(root) {
        tracing::warn!(
            "cannot remove the workspace directory {}: {e}",
            root.display()
        );
    }
}

struct Idle {
    tree: Tree,
    owner: Owner,
    digest: String,
    since: Instant,
}

#[derive(Default)]
struct State {
    idle: Vec<Idle>,
    /// `(owner, digest)` of trees being cleaned after their run.
    cleaning: Vec<(Owner, String)>,
}

/// How long a run waits for a tree of its workspace that is being cleaned after the
/// previous run, rather than copying a fresh one.
const CLEANING_WAIT: Duration = Duration::from_secs(2);

/// The idle trees of a gateway, for reuse by the next run of the same owner.
pub(crate) struct Trees {
    base: PathBuf,
    keep: usize,
    max_age: Duration,
    state: Mutex<State>,
    cleaned: Condvar,
}

impl Trees {
    /// Trees live below `base`; at most `keep` idle ones are kept (0: every run gets a fresh
    /// tree, removed afterwards), none idle longer than `max_age`.
    pub(crate) fn new(base: PathBuf, keep: usize, max_age: Duration) -> Self {
        Self {
            base,
            keep,
            max_age,
            state: Mutex::new(State::default()),
            cleaned: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A tree holding exactly `run`'s workspace, for one run: an idle tree of the same
    /// owner brought up to date (the same version's first, waiting a little for one being
    /// cleaned after its run), else a fresh one. Blocking.
    pub(crate) fn check_out(
        &self,
        run: &WorkspaceRun,
        pin: &Pinned,
    ) -> Result<(Tree, SyncStats), TreeError> {
        let owner = &run.workspace.owner;
        let digest = &run.workspace.digest;
        let deadline = Instant::now() + CLEANING_WAIT;
        let mut expired = Vec::new();
        let reuse = {
            let mut st = self.lock();
            loop {
                let now = Instant::now();
                let (old, young): (Vec<Idle>, Vec<Idle>) = st
                    .idle
                    .drain(..)
                    .partition(|t| now.saturating_duration_since(t.since) > self.max_age);
                st.idle = young;
                expired.extend(old);
                let same = st
                    .idle
                    .iter()
                    .position(|t| t.owner == *owner && t.digest == *digest);
                if let Some(i) = same {
                    break Some(st.idle.swap_remove(i));
                }
                let coming = st.cleaning.iter().any(|(o, d)| o == owner && d == digest);
                if coming && now < deadline {
                    st = self
                        .cleaned
                        .wait_timeout(st, deadline - now)
                        .map(|(g, _)| g)
                        .unwrap_or_else(|p| p.into_inner().0);
                    continue;
                }
                let other = st
                    .idle
                    .iter()
                    .enumerate()
                    .filter(|(_, t)| t.owner == *owner)
                    .max_by_key(|(_, t)| t.since)
                    .map(|(i, _)| i);
                break other.map(|i| st.idle.swap_remove(i));
            }
        };
        drop(expired);
        if let Some(mut idle) = reuse {
            match idle.tree.sync(run, pin) {
                Ok(stats) => return Ok((idle.tree, stats)),
                Err(e) => tracing::warn!(
                    "an idle workspace tree could not be brought up to date, using a fresh one: {e}"
                ),
            }
        }
        let mut tree = Tree::create(&self.base)?;
        let stats = tree.sync(run, pin)?;
        Ok((tree, stats))
    }

    /// After a run: cleans the tree of what the run left and keeps it for the next run
    /// (the least recently used idle tree goes beyond the bound). Blocking.
    pub(crate) fn check_in(&self, mut tree: Tree, run: &WorkspaceRun) {
        if self.keep == 0 {
            return;
        }
        let key = (run.workspace.owner.clone(), run.workspace.digest.clone());
        self.lock().cleaning.push(key.clone());
        let cleaned = tree.clean(run);
        let evicted = {
            let mut st = self.lock();
            if let Some(i) = st.cleaning.iter().position(|k| *k == key) {
                st.cleaning.swap_remove(i);
            }
            let mut evicted = Vec::new();
            match cleaned {
                Ok(()) => st.idle.push(Idle {
                    tree,
                    owner: key.0,
                    digest: key.1,
                    since: Instant::now(),
                }),
                Err(e) => {
                    tracing::warn!("a workspace tree could not be cleaned, removing it: {e}");
                    evicted.push(tree);
                }
            }
            // Expired ones go here too, not only when a run checks a tree out: a quiet
            // gateway does not keep copies of sources past `max_age`.
            let now = Instant::now();
            let (expired, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut st.idle)
                .into_iter()
                .partition(|t| now.saturating_duration_since(t.since) > self.max_age);
            st.idle = keep;
            evicted.extend(expired.into_iter().map(|t| t.tree));
            while st.idle.len() > self.keep {
                if let Some((i, _)) = st.idle.iter().enumerate().min_by_key(|(_, t)| t.since) {
                    evicted.push(st.idle.swap_remove(i).tree);
                }
            }
            evicted
        };
        self.cleaned.notify_all();
        // Removed outside the lock.
        drop(evicted);
    }
}

//! The client's side: which files of a directory make up the workspace, and their hashes.
//!
//! The files are what git would consider part of the tree: tracked and untracked files that
//! no `.gitignore` (at any depth), `.git/info/exclude` or the global excludes file ignores;
//! `.git` itself never. The rules are the `ignore` crate's (ripgrep's), which implements
//! git's; they also apply outside a git repository. Hashes are remembered per file (by size,
//! modification time, change time and inode) in the user's cache directory, so that an
//! unchanged tree is not read again.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

use super::manifest::{Manifest, ManifestEntry, symlink_stays_inside};

/// A file of the walked tree.
#[derive(Debug, Clone)]
pub struct Walked {
    pub manifest: Manifest,
    /// Where each content is on disk (one path per hash).
    pub sources: HashMap<String, PathBuf>,
    /// Files whose hash was computed (not taken from the hash cache).
    pub hashed: usize,
}

/// Why a tree cannot be sent.
#[derive(Debug, thiserror::Error)]
pub(crate) enum WalkError {
    #[error(
        "symlink {path} points outside the workspace ({target}): workspaces keep only symlinks that stay inside the tree"
    )]
    SymlinkLeaves { path: String, target: String },
    #[error("{0:?} is not valid UTF-8: workspace paths must be")]
    NotUtf8(PathBuf),
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot walk the workspace: {0}")]
    Walk(String),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> WalkError + '_ {
    move |source| WalkError::Io {
        path: path.to_owned(),
        source,
    }
}

/// What identifies an unchanged file without reading it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    size: u64,
    mtime_ns: i128,
    ctime_ns: i128,
    ino: u64,
}

impl Stamp {
    fn of(m: &std::fs::Metadata) -> Self {
        Self {
            size: m.len(),
            mtime_ns: m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128,
            ctime_ns: m.ctime() as i128 * 1_000_000_000 + m.ctime_nsec() as i128,
            ino: m.ino(),
        }
    }
}

/// Remembered hashes of one tree: `relative path -> (stamp, hash)`.
#[derive(Debug, Default)]
pub(crate) struct HashCache {
    file: Option<PathBuf>,
    entries: HashMap<String, (Stamp, String)>,
    /// Changed since loaded: [`HashCache::save`] writes only then (an unchanged rerun
    /// rewrites nothing).
    changed: bool,
}

impl HashCache {
    /// The cache of `root` in `$XDG_CACHE_HOME/mcp-run` (else `~/.cache/mcp-run`); an
    /// unreadable cache is an empty one.
    pub(crate) fn load(root: &Path) -> Self {
        let dir = std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")));
        let Some(dir) = dir else {
            return Self::default();
        };
        let name = super::hash_bytes(root.as_os_str().as_encoded_bytes());
        let file = dir.join("mcp-run").join(format!("hashes-{}", &name[..32]));
        let mut entries = HashMap::new();
        if let Ok(text) = std::fs::read_to_string(&file) {
            for line in text.lines() {
                let mut f = line.splitn(6, ' ');
                let (Some(hash), Some(size), Some(m), Some(c), Some(ino), Some(path)) =
                    (f.next(), f.next(), f.next(), f.next(), f.next(), f.next())
                else {
                    continue;
                };
                let (Ok(size), Ok(mtime_ns), Ok(ctime_ns), Ok(ino)) =
                    (size.parse(), m.parse(), c.parse(), ino.parse())
                else {
                    continue;
                };
                entries.insert(
                    path.to_owned(),
                    (
                        Stamp {
                            size,
                            mtime_ns,
                            ctime_ns,
                            ino,
                        },
                        hash.to_owned(),
                    ),
                );
            }
        }
        Self {
            file: Some(file),
            entries,
            changed: false,
        }
    }

    /// Writes the cache back (best effort: a cache that cannot be written costs time only).
    pub(crate) fn save(&self) {
        let Some(file) = &self.file else { return };
        if !self.changed {
            return;
        }
        let mut text = String::with_capacity(self.entries.len() * 128);
        for (path, (s, hash)) in &self.entries {
            if path.contains('\n') {
                continue;
            }
            text.push_str(&format!(
                "{hash} {} {} {} {} {path}\n",
                s.size, s.mtime_ns, s.ctime_ns, s.ino
            ));
        }
        if let Some(dir) = file.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let tmp = file.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, text).is_ok() {
            let _ = std::fs::rename(&tmp, file);
        }
    }
}

/// The git work tree around `dir` (the nearest ancestor with a `.git`), else `dir`.
pub(crate) fn default_root(dir: &Path) -> PathBuf {
    dir.ancestors()
        .find(|d| d.join(".git").exists())
        .unwrap_or(dir)
        .to_owned()
}

/// Walks `root` and hashes its files (using and updating `cache`).
pub(crate) fn walk(root: &Path, cache: &mut HashCache) -> Result<Walked, WalkError> {
    let mut files: Vec<(String, PathBuf, std::fs::Metadata)> = Vec::new();
    let mut entries = Vec::new();
    let walker = ignore::WalkBuilder::new(root)
        .hidden(false)
        .ignore(false)
        .parents(false)
        .git_ignore(true)
        .git_global(true)
        .git_exclude(true)
        .require_git(false)
        .follow_links(false)
        .filter_entry(|e| e.file_name() != ".git")
        .build();
    for entry in walker {
        let entry = entry.map_err(|e| WalkError::Walk(e.to_string()))?;
        let Some(ft) = entry.file_type() else {
            continue;
        };
        if ft.is_dir() {
            continue;
        }
        let path = entry.path();
        let rel = path
            .strip_prefix(root)
            .map_err(|e| WalkError::Walk(e.to_string()))?;
        let rel = rel
            .to_str()
            .ok_or_else(|| WalkError::NotUtf8(path.to_owned()))?
            .to_owned();
        if ft.is_symlink() {
            let target = std::fs::read_link(path).map_err(io(path))?;
            let target = target
                .to_str()
                .ok_or_else(|| WalkError::NotUtf8(path.to_owned()))?
                .to_owned();
            if !symlink_stays_inside(&rel, &target) {
                return Err(WalkError::SymlinkLeaves { path: rel, target });
            }
            entries.push(ManifestEntry::symlink(rel, target));
        } else if ft.is_file() {
            let meta = std::fs::symlink_metadata(path).map_err(io(path))?;
            files.push((rel, path.to_owned(), meta));
        }
        // Sockets, FIFOs and devices are not part of a tree (git skips them too).
    }
    // Files whose stamp is unchanged keep their hash; the rest are hashed in parallel.
    let now_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i128)
        .unwrap_or(0);
    let mut todo = Vec::new();
    let mut hashes: Vec<Option<String>> = vec![None; files.len()];
    for (i, (rel, _, meta)) in files.iter().enumerate() {
        match cache.entries.get(rel) {
            Some((stamp, hash)) if *stamp == Stamp::of(meta) => hashes[i] = Some(hash.clone()),
            _ => todo.push(i),
        }
    }
    let hashed = todo.len();
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(8);
    let results: Vec<(usize, Result<String, WalkError>)> = std::thread::scope(|s| {
        let chunks: Vec<Vec<usize>> = (0..threads)
            .map(|t| todo.iter().copied().skip(t).step_by(threads).collect())
            .collect();
        let handles: Vec<_> = chunks
            .into_iter()
            .map(|chunk| {
                let files = &files;
                s.spawn(move || {
                    chunk
                        .into_iter()
                        .map(|i| (i, super::hash_file(&files[i].1).map_err(io(&files[i].1))))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_default())
            .collect()
    });
    for (i, r) in results {
        hashes[i] = Some(r?);
    }
    let mut sources = HashMap::new();
    for ((rel, path, meta), hash) in files.into_iter().zip(hashes) {
        let Some(hash) = hash else {
            return Err(WalkError::Walk(format!("{rel}: not hashed")));
        };
        let stamp = Stamp::of(&meta);
        // A file changed within the last two seconds may change again within the clock's
        // granularity without a new stamp ("racy git"): not remembered.
        if now_ns - stamp.mtime_ns > 2_000_000_000
            && !matches!(cache.entries.get(&rel), Some((s, h)) if *s == stamp && *h == hash)
        {
            cache.entries.insert(rel.clone(), (stamp, hash.clone()));
            cache.changed = true;
        }
        let executable = meta.mode() & 0o111 != 0;
        sources.entry(hash.clone()).or_insert(path);
        entries.push(ManifestEntry::file(rel, executable, meta.len(), hash));
    }
    entries.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(Walked {
        manifest: Manifest { entries },
        sources,
        hashed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    #[test]
    fn follows_git_rules_and_keeps_modes_and_inner_symlinks() {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        std::fs::create_dir_all(r.join(".git/info")).unwrap();
        std::fs::write(r.join(".git/config"), "x").unwrap();
        std::fs::write(r.join(".git/info/exclude"), "excluded\n").unwrap();
        std::fs::write(r.join(".gitignore"), "*.log\n/target\n").unwrap();
        std::fs::create_dir_all(r.join("src/deep")).unwrap();
        std::fs::write(r.join("src/.gitignore"), "gen.rs\n").unwrap();
        std::fs::write(r.join("src/main.rs"), "fn main(){}").unwrap();
        std::fs::write(r.join("src/gen.rs"), "x").unwrap();
        std::fs::write(r.join("src/deep/a.log"), "x").unwrap();
        std::fs::write(r.join("excluded"), "x").unwrap();
        std::fs::create_dir_all(r.join("target")).unwrap();
        std::fs::write(r.join("target/out"), "x").unwrap();
        std::fs::write(r.join("run.sh"), "#!/bin/sh").unwrap();
        std::fs::set_permissions(r.join("run.sh"), std::fs::Permissions::from_mode(0o755)).unwrap();
        std::os::unix::fs::symlink("src/main.rs", r.join("link")).unwrap();
        let w = walk(r, &mut HashCache::default()).unwrap();
        let paths: Vec<_> = w.manifest.entries.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                ".gitignore",
                "link",
                "run.sh",
                "src/.gitignore",
                "src/main.rs"
            ]
        );
        assert_eq!(w.manifest.entries[2].mode, 0o755);
        assert_eq!(w.manifest.entries[4].mode, 0o644);
        assert_eq!(w.manifest.entries[1].target.as_deref(), Some("src/main.rs"));
        std::os::unix::fs::symlink("../outside", r.join("bad")).unwrap();
        let e = walk(r, &mut HashCache::default()).unwrap_err();
        assert!(matches!(e, WalkError::SymlinkLeaves { .. }), "{e}");
    }

    #[test]
    fn default_root_is_the_git_work_tree() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join(".git")).unwrap();
        std::fs::create_dir_all(d.path().join("a/b")).unwrap();
        assert_eq!(default_root(&d.path().join("a/b")), d.path());
        let e = tempfile::tempdir().unwrap();
        assert_eq!(default_root(e.path()), e.path());
    }
}

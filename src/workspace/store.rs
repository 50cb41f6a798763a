//! The gateway's side of workspaces: the registry of posted manifests and the bounded,
//! content-addressed cache of file contents on disk.
//!
//! A content is stored under its SHA-256 only after the bytes were hashed on arrival, so the
//! cache never holds content under a wrong name. Each content remembers which identities
//! proved they have it (by uploading it), so that one caller cannot learn from the
//! `missing` list whether another holds a given file, nor use another's upload.
//!
//! Size: about 510 lines: the cache's index, its bounds and eviction, and the uploads that fill
//! it share one lock and one invariant (no content under a wrong hash); plus unit tests.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use sha2::Digest as _;

use super::config::WorkspaceConfig;
use super::manifest::Manifest;
use crate::contract::{ErrorBody, ErrorCode};

/// Who uploaded: the auth identity (`None` with auth off: shared by every caller).
pub(crate) type Owner = Option<String>;

/// A posted manifest.
#[derive(Debug)]
pub struct Workspace {
    /// `ws_` and 32 hex digits, derived from the owner and the manifest: posting the same
    /// tree again gives the same id.
    pub id: String,
    pub owner: Owner,
    /// SHA-256 of the canonical manifest: the version of the tree.
    pub digest: String,
    /// Sorted by path, validated.
    pub manifest: Manifest,
    /// Each distinct content and its size.
    pub contents: HashMap<String, u64>,
    pub files: usize,
    /// Directories the paths imply.
    pub dirs: usize,
    pub bytes: u64,
    /// About what the workspace costs in the gateway's memory ([`registry_cost`]).
    pub memory: u64,
}

/// About what a registered manifest costs in memory: each entry's strings and fixed part
/// (with allocator overhead), and each distinct content in the index. An estimate, on the
/// high side (docs/workspaces.md has the measured figure).
pub(crate) fn registry_cost(manifest: &Manifest, contents: usize) -> u64 {
    const CONTENT: u64 = 160;
    let entries: u64 = manifest
        .entries
        .iter()
        .map(super::manifest::entry_cost)
        .sum();
    entries + contents as u64 * CONTENT
}

struct Blob {
    size: u64,
    used: Instant,
    owners: Vec<Owner>,
    /// Runs materialising it right now: not evicted meanwhile.
    pins: u32,
}

#[derive(Default)]
struct Inner {
    blobs: HashMap<String, Blob>,
    total: u64,
    workspaces: HashMap<String, (Arc<Workspace>, Instant)>,
    /// The workspace id a manifest body was posted as, by [`WorkspaceStore::body_key`]: the
    /// same body posted again (every rerun) is not parsed and validated again.
    bodies: HashMap<String, String>,
    evicted: u64,
}

/// The answer to `POST /workspaces`.
#[derive(Debug)]
pub struct Posted {
    pub workspace: Arc<Workspace>,
    /// Contents the caller has to upload.
    pub missing: Vec<String>,
    pub missing_bytes: u64,
}

/// The registry and the cache.
pub struct WorkspaceStore {
    cfg: WorkspaceConfig,
    root: PathBuf,
    /// Created by us with a per-process default name: removed when the store is dropped.
    remove_root: bool,
    inner: Mutex<Inner>,
    /// Files and directories that runs may have materialised at once on this host
    /// (`workspaces.max_local_inodes`).
    inodes: Arc<tokio::sync::Semaphore>,
}

/// Why the workspace cache refused or failed; [`ErrorBody`] at the fronts, by [`StoreError::code`].
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The cache's own files failed: the cause is logged, the client learns what failed.
    #[error("the gateway's workspace cache failed: {what}")]
    Internal {
        what: &'static str,
        source: std::io::Error,
    },
    /// An id that does not exist or belongs to someone else (the same answer, so that ids
    /// of others cannot be probed).
    #[error(
        "unknown workspace {0:?} (never posted, expired, or posted by another identity): post the manifest again"
    )]
    UnknownWorkspace(String),
    /// The manifest's own checks.
    #[error(transparent)]
    Manifest(#[from] super::manifest::ManifestError),
    #[error(
        "the manifest would take about {memory} bytes of the gateway's memory, more than its registry of {max} bytes (workspaces.max_registry_bytes)"
    )]
    RegistryFull { memory: u64, max: u64 },
    #[error("the upload of {hash} broke off or is not valid compressed data: {source}")]
    UploadBroke {
        hash: String,
        source: std::io::Error,
    },
    #[error("content {hash} is longer than the manifest's {size} bytes")]
    TooLong { hash: String, size: u64 },
    #[error("content {hash} has {got} bytes, the manifest says {size}: the upload was cut short")]
    CutShort { hash: String, got: u64, size: u64 },
    #[error("the uploaded bytes hash to {got}, not {hash}: nothing was stored")]
    HashMismatch { hash: String, got: String },
    #[error("{what} is larger than {max} bytes")]
    ResultTooLarge { what: String, max: u64 },
    #[error("no content {0} for this caller (never stored, or evicted)")]
    NoContent(String),
    #[error("{0:?} is not a content hash (64 lowercase hex digits)")]
    NotAHash(String),
    #[error(
        "workspace {id} lacks {missing} of its {total} contents (not uploaded, or evicted from the cache): post the manifest again and upload what it reports missing"
    )]
    Incomplete {
        id: String,
        missing: usize,
        total: usize,
    },
    #[error(
        "workspace {id} needs {n} files and directories, more than the {max} this gateway writes at once (workspaces.max_local_inodes)"
    )]
    TooManyInodes { id: String, n: u64, max: u64 },
    #[error(
        "runs in progress and open sessions hold most of the {max} files and directories this gateway writes at once (workspaces.max_local_inodes); workspace {id} needs {n}: retry when they end"
    )]
    InodesBusy { id: String, n: u64, max: u64 },
}

impl StoreError {
    pub(crate) fn code(&self) -> ErrorCode {
        match self {
            StoreError::Internal { .. } => ErrorCode::Internal,
            StoreError::UnknownWorkspace(_) => ErrorCode::UnknownWorkspace,
            StoreError::Manifest(e) => e.code(),
            StoreError::RegistryFull { .. }
            | StoreError::ResultTooLarge { .. }
            | StoreError::TooManyInodes { .. } => ErrorCode::PayloadTooLarge,
            StoreError::UploadBroke { .. }
            | StoreError::TooLong { .. }
            | StoreError::CutShort { .. }
            | StoreError::NotAHash(_) => ErrorCode::InvalidRequest,
            StoreError::HashMismatch { .. } => ErrorCode::HashMismatch,
            StoreError::NoContent(_) => ErrorCode::NotFound,
            StoreError::Incomplete { .. } => ErrorCode::WorkspaceIncomplete,
            StoreError::InodesBusy { .. } => ErrorCode::TooManyRequests,
        }
    }
}

impl From<StoreError> for ErrorBody {
    fn from(e: StoreError) -> Self {
        ErrorBody::new(e.code(), e.to_string())
    }
}

fn internal(what: &'static str, source: std::io::Error) -> StoreError {
    tracing::error!("workspace cache: {what}: {source}");
    StoreError::Internal { what, source }
}

impl WorkspaceStore {
    /// Opens the cache in the configured directory, emptying what a previous process left.
    pub fn open(cfg: WorkspaceConfig) -> std::io::Result<Self> {
        let root = cfg.cache_dir();
        let remove_root = cfg.cache_dir.is_none();
        for sub in ["blobs", "tmp"] {
            let dir = root.join(sub);
            match std::fs::remove_dir_all(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
            std::fs::create_dir_all(&dir)?;
        }
        // Shared with the local backend's sessions (exec::local::budget).
        let inodes = crate::limits::shared_budget(&cfg.local_dir(), cfg.max_local_inodes);
        Ok(Self {
            cfg,
            root,
            remove_root,
            inner: Mutex::new(Inner::default()),
            inodes,
        })
    }

    pub fn config(&self) -> &WorkspaceConfig {
        &self.cfg
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The key of a manifest body posted by `owner` (SHA-256 of both).
    pub fn body_key(body: &[u8], owner: &Owner) -> String {
        let mut h = Self::body_hasher(owner);
        h.update(body);
        Self::key_of(h)
    }

    /// A hasher for [`WorkspaceStore::body_key`] to feed the body into as it arrives.
    pub fn body_hasher(owner: &Owner) -> sha2::Sha256 {
        let mut h = sha2::Sha256::new();
        h.update(owner.as_deref().unwrap_or("").as_bytes());
        h.update([0u8]);
        h
    }

    /// The key from a [`WorkspaceStore::body_hasher`] fed the whole body.
    pub fn key_of(h: sha2::Sha256) -> String {
        super::hex(&h.finalize())
    }

    /// [`WorkspaceStore::post`] of a body `owner` posted before (`key` from
    /// [`WorkspaceStore::body_key`]), while its workspace is still registered; `None`
    /// otherwise.
    pub fn post_again(&self, key: &str, owner: &Owner) -> Option<Posted> {
        let now = Instant::now();
        let mut inner = self.lock();
        self.evict(&mut inner, now);
        let id = inner.bodies.get(key)?.clone();
        let workspace = match inner.workspaces.get_mut(&id) {
            Some((ws, used)) if ws.owner == *owner => {
                *used = now;
                ws.clone()
            }
            _ => return None,
        };
        let (missing, missing_bytes) = Self::missing(&mut inner, &workspace.contents, owner, now);
        Some(Posted {
            workspace,
            missing,
            missing_bytes,
        })
    }

    /// The contents `owner` does not have (sorted) and their bytes; marks the others used.
    fn missing(
        inner: &mut Inner,
        contents: &HashMap<String, u64>,
        owner: &Owner,
        now: Instant,
    ) -> (Vec<String>, u64) {
        let mut missing = Vec::new();
        let mut missing_bytes = 0;
        for (hash, size) in contents {
            match inner.blobs.get_mut(hash) {
                Some(b) if b.owners.contains(owner) => b.used = now,
                _ => {
                    missing.push(hash.clone());
                    missing_bytes += size;
                }
            }
        }
        missing.sort();
        (missing, missing_bytes)
    }

    /// Registers a manifest and says which contents `owner` still has to upload; `key`
    /// (from [`WorkspaceStore::body_key`]) remembers the body for
    /// [`WorkspaceStore::post_again`].
    pub fn post_body(
        &self,
        manifest: Manifest,
        owner: &Owner,
        key: Option<String>,
    ) -> Result<Posted, StoreError> {
        let posted = self.post(manifest, owner)?;
        if let Some(key) = key {
            let mut inner = self.lock();
            if inner.workspaces.contains_key(&posted.workspace.id) {
                inner.bodies.insert(key, posted.workspace.id.clone());
            }
        }
        Ok(posted)
    }

    /// Registers a manifest and says which contents `owner` still has to upload.
    pub fn post(&self, manifest: Manifest, owner: &Owner) -> Result<Posted, StoreError> {
        let checked = manifest.check(&self.cfg)?;
        let mut h = sha2::Sha256::new();
        h.update(owner.as_deref().unwrap_or("").as_bytes());
        h.update([0u8]);
        h.update(checked.digest.as_bytes());
        let id = format!("ws_{}", &super::hex(&h.finalize())[..32]);
        let memory = registry_cost(&checked.manifest, checked.contents.len());
        if memory > self.cfg.max_registry_bytes {
            return Err(StoreError::RegistryFull {
                memory,
                max: self.cfg.max_registry_bytes,
            });
        }
        let now = Instant::now();
        let mut inner = self.lock();
        self.evict(&mut inner, now);
        let (missing, missing_bytes) = Self::missing(&mut inner, &checked.contents, owner, now);
        let workspace = Arc::new(Workspace {
            memory,
            id: id.clone(),
            owner: owner.clone(),
            digest: checked.digest,
            manifest: checked.manifest,
            contents: checked.contents,
            files: checked.files,
            dirs: checked.dirs,
            bytes: checked.bytes,
        });
        inner.workspaces.insert(id, (workspace.clone(), now));
        self.evict(&mut inner, now);
        Ok(Posted {
            workspace,
            missing,
            missing_bytes,
        })
    }

    /// The workspace `id` if `owner` posted it.
    pub fn get(&self, id: &str, owner: &Owner) -> Result<Arc<Workspace>, StoreError> {
        let mut inner = self.lock();
        match inner.workspaces.get_mut(id) {
            Some((ws, used)) if ws.owner == *owner => {
                *used = Instant::now();
                Ok(ws.clone())
            }
            _ => Err(StoreError::UnknownWorkspace(id.to_owned())),
        }
    }

    fn blob_path(&self, hash: &str) -> PathBuf {
        self.root.join("blobs").join(&hash[..2]).join(hash)
    }

    /// A new temporary file in the cache, removed unless persisted.
    fn temp(&self) -> Result<Temp, StoreError> {
        let name = format!("{:032x}", rand::random::<u128>());
        let path = self.root.join("tmp").join(name);
        let file = File::create_new(&path).map_err(|e| internal("cannot create a file", e))?;
        Ok(Temp {
            path,
            file: Some(file),
        })
    }

    /// Stores one content read from `reader`, which must be exactly `size` bytes hashing
    /// to `hash`; `owner` then has it. Blocking: call from a blocking thread.
    pub fn receive(
        &self,
        reader: &mut dyn Read,
        hash: &str,
        size: u64,
        owner: &Owner,
    ) -> Result<(), StoreError> {
        let mut temp = self.temp()?;
        let mut hasher = sha2::Sha256::new();
        let mut n = 0u64;
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let k = match reader.read(&mut buf) {
                Ok(0) => break,
                Ok(k) => k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(source) => {
                    return Err(StoreError::UploadBroke {
                        hash: hash.to_owned(),
                        source,
                    });
                }
            };
            n += k as u64;
            if n > size {
                return Err(StoreError::TooLong {
                    hash: hash.to_owned(),
                    size,
                });
            }
            hasher.update(&buf[..k]);
            temp.write(&buf[..k])?;
        }
        if n != size {
            return Err(StoreError::CutShort {
                hash: hash.to_owned(),
                got: n,
                size,
            });
        }
        let got = super::hex(&hasher.finalize());
        if got != hash {
            return Err(StoreError::HashMismatch {
                hash: hash.to_owned(),
                got,
            });
        }
        self.persist(temp, hash, size, owner)
    }

    /// Moves a verified temporary file into the cache under `hash`.
    fn persist(
        &self,
        mut temp: Temp,
        hash: &str,
        size: u64,
        owner: &Owner,
    ) -> Result<(), StoreError> {
        let path = self.blob_path(hash);
        let now = Instant::now();
        let mut inner = self.lock();
        if let Some(b) = inner.blobs.get_mut(hash) {
            if !b.owners.contains(owner) {
                b.owners.push(owner.clone());
            }
            b.used = now;
            return Ok(());
        }
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| internal("cannot create a directory", e))?;
        }
        temp.file = None;
        std::fs::rename(&temp.path, &path).map_err(|e| internal("cannot store a content", e))?;
        temp.path = PathBuf::new();
        inner.blobs.insert(
            hash.to_owned(),
            Blob {
                size,
                used: now,
                owners: vec![owner.clone()],
                pins: 0,
            },
        );
        inner.total += size;
        self.evict(&mut inner, now);
        Ok(())
    }

    /// Copies a file of a finished run into the cache (sync-back): its hash and size.
    /// The file is opened without following a symlink; at most `max` bytes are taken.
    pub fn add_file(
        &self,
        path: &Path,
        owner: &Owner,
        max: u64,
    ) -> Result<(String, u64), StoreError> {
        use std::os::unix::fs::OpenOptionsExt as _;
        let mut src = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(path)
            .map_err(|e| internal("cannot read a result file", e))?;
        let what = path.display().to_string();
        // Kept whatever its hash: always `Some`.
        self.add_stream(&mut src, &what, owner, max, &|_| true)?
            .ok_or_else(|| internal("a result file", std::io::Error::other("not kept")))
    }

    /// Stores a result read from `src` (a file of a finished run; `what` names it in
    /// errors) under the hash of its bytes, unless `keep` says no to that hash: its hash and
    /// size, or `None` when not kept. At most `max` bytes are taken. Blocking.
    pub fn add_stream(
        &self,
        src: &mut dyn Read,
        what: &str,
        owner: &Owner,
        max: u64,
        keep: &dyn Fn(&str) -> bool,
    ) -> Result<Option<(String, u64)>, StoreError> {
        let mut temp = self.temp()?;
        let mut hasher = sha2::Sha256::new();
        let mut n = 0u64;
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let k = match src.read(&mut buf) {
                Ok(k) => k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(internal("cannot read a result file", e)),
            };
            if k == 0 {
                break;
            }
            n += k as u64;
            if n > max {
                return Err(StoreError::ResultTooLarge {
                    what: what.to_owned(),
                    max,
                });
            }
            hasher.update(&buf[..k]);
            temp.write(&buf[..k])?;
        }
        let hash = super::hex(&hasher.finalize());
        if !keep(&hash) {
            return Ok(None);
        }
        self.persist(temp, &hash, n, owner)?;
        Ok(Some((hash, n)))
    }

    /// Opens a content `owner` has (downloads of sync-back results).
    pub fn open_blob(&self, hash: &str, owner: &Owner) -> Result<(File, u64), StoreError> {
        let not_found = || StoreError::NoContent(hash.to_owned());
        if !super::is_hash(hash) {
            return Err(StoreError::NotAHash(hash.to_owned()));
        }
        let size = {
            let mut inner = self.lock();
            match inner.blobs.get_mut(hash) {
                Some(b) if b.owners.contains(owner) => {
                    b.used = Instant::now();
                    b.size
                }
                _ => return Err(not_found()),
            }
        };
        let file = File::open(self.blob_path(hash)).map_err(|_| not_found())?;
        Ok((file, size))
    }

    /// Holds every content of `ws` in the cache until the returned guard is dropped, or
    /// says how many are missing (not uploaded, or evicted since).
    pub fn pin(self: &Arc<Self>, ws: &Arc<Workspace>) -> Result<Pinned, StoreError> {
        let now = Instant::now();
        let mut inner = self.lock();
        // One pass (a rerun pins every content of a large tree): pinned as found, undone
        // when one is missing.
        let mut missing = 0;
        for h in ws.contents.keys() {
            match inner.blobs.get_mut(h) {
                Some(b) if b.owners.contains(&ws.owner) => {
                    b.pins += 1;
                    b.used = now;
                }
                _ => missing += 1,
            }
        }
        if missing > 0 {
            for h in ws.contents.keys() {
                if let Some(b) = inner.blobs.get_mut(h)
                    && b.owners.contains(&ws.owner)
                {
                    b.pins = b.pins.saturating_sub(1);
                }
            }
            return Err(StoreError::Incomplete {
                id: ws.id.clone(),
                missing,
                total: ws.contents.len(),
            });
        }
        Ok(Pinned {
            store: self.clone(),
            workspace: ws.clone(),
        })
    }

    /// Reserves the inodes (files and directories) of `ws` for a tree written on this host,
    /// until the permit is dropped: concurrent runs cannot together make more than
    /// `workspaces.max_local_inodes`. Refused at once (429) when others hold too many.
    pub fn reserve_inodes(
        &self,
        ws: &Workspace,
    ) -> Result<tokio::sync::OwnedSemaphorePermit, StoreError> {
        let max = self.cfg.max_local_inodes;
        let n = (ws.files + ws.dirs + 1) as u64;
        if n > max {
            return Err(StoreError::TooManyInodes {
                id: ws.id.clone(),
                n,
                max,
            });
        }
        self.inodes
            .clone()
            .try_acquire_many_owned(n as u32)
            .map_err(|_| StoreError::InodesBusy {
                id: ws.id.clone(),
                n,
                max,
            })
    }

    /// Where a pinned content is on disk.
    pub fn path_of(&self, _pin: &Pinned, hash: &str) -> PathBuf {
        self.blob_path(hash)
    }

    /// Bytes and contents in the cache, and how many contents were evicted so far.
    pub fn usage(&self) -> (u64, usize, u64) {
        let inner = self.lock();
        (inner.total, inner.blobs.len(), inner.evicted)
    }

    /// Drops what is too old; then, while the registry or the cache is over a bound, the least
    /// recently used of the identity that holds the most: one identity's traffic never
    /// evicts what another holds within its fair share (a bound divided by the identities
    /// using it). Pinned contents stay.
    fn evict(&self, inner: &mut Inner, now: Instant) {
        let max_age = Duration::from_secs(self.cfg.max_age_secs);
        let old = |t: Instant| now.saturating_duration_since(t) > max_age;
        inner.workspaces.retain(|_, (_, used)| !old(*used));
        self.evict_workspaces(inner);
        let Inner {
            bodies, workspaces, ..
        } = &mut *inner;
        bodies.retain(|_, id| workspaces.contains_key(id));
        let aged: Vec<String> = inner
            .blobs
            .iter()
            .filter(|(_, b)| b.pins == 0 && old(b.used))
            .map(|(h, _)| h.clone())
            .collect();
        for h in aged {
            self.drop_blob(inner, &h);
        }
        if inner.total > self.cfg.max_cache_bytes {
            self.evict_blobs(inner);
        }
    }

    /// Over `max_workspaces` or `max_registry_bytes`: the least recently used workspace of
    /// the identity holding the most goes, until both hold.
    fn evict_workspaces(&self, inner: &mut Inner) {
        loop {
            let count = inner.workspaces.len();
            let bytes: u64 = inner.workspaces.values().map(|(w, _)| w.memory).sum();
            let by_count = count > self.cfg.max_workspaces;
            if !by_count && bytes <= self.cfg.max_registry_bytes {
                return;
            }
            let mut held: HashMap<&Owner, (u64, usize)> = HashMap::new();
            for (w, _) in inner.workspaces.values() {
                let h = held.entry(&w.owner).or_default();
                h.0 += w.memory;
                h.1 += 1;
            }
            let Some(top) = held
                .into_iter()
                .max_by_key(|(_, (b, n))| {
                    if by_count {
                        (*n as u64, *b)
                    } else {
                        (*b, *n as u64)
                    }
                })
                .map(|(o, _)| o.clone())
            else {
                return;
            };
            let victim = inner
                .workspaces
                .iter()
                .filter(|(_, (w, _))| w.owner == top)
                .min_by_key(|(_, (_, used))| *used)
                .map(|(id, _)| id.clone());
            match victim {
                Some(id) => {
                    inner.workspaces.remove(&id);
                }
                None => return,
            }
        }
    }

    /// Over `max_cache_bytes`: the identity holding the most bytes (every owner of a content
    /// is charged its size) gives up its least recently used unpinned content; a content
    /// nobody holds any longer is deleted. Until the cache fits.
    fn evict_blobs(&self, inner: &mut Inner) {
        let mut charged: HashMap<Owner, u64> = HashMap::new();
        let mut lru: HashMap<Owner, std::collections::VecDeque<(Instant, String)>> = HashMap::new();
        for (h, b) in &inner.blobs {
            for o in &b.owners {
                *charged.entry(o.clone()).or_default() += b.size;
                if b.pins == 0 {
                    lru.entry(o.clone())
                        .or_default()
                        .push_back((b.used, h.clone()));
                }
            }
        }
        for q in lru.values_mut() {
            q.make_contiguous().sort();
        }
        while inner.total > self.cfg.max_cache_bytes {
            let Some(top) = charged
                .iter()
                .filter(|(o, _)| lru.get(*o).is_some_and(|q| !q.is_empty()))
                .max_by_key(|(_, c)| **c)
                .map(|(o, _)| o.clone())
            else {
                return;
            };
            let Some((_, h)) = lru.get_mut(&top).and_then(|q| q.pop_front()) else {
                return;
            };
            let Some(b) = inner.blobs.get_mut(&h) else {
                continue;
            };
            b.owners.retain(|o| *o != top);
            if let Some(c) = charged.get_mut(&top) {
                *c = c.saturating_sub(b.size);
            }
            if b.owners.is_empty() {
                self.drop_blob(inner, &h);
            }
        }
    }

    /// Deletes a content from the cache.
    fn drop_blob(&self, inner: &mut Inner, hash: &str) {
        if let Some(b) = inner.blobs.remove(hash) {
            inner.total -= b.size;
            inner.evicted += 1;
            let _ = std::fs::remove_file(self.blob_path(hash));
        }
    }
}

impl Drop for WorkspaceStore {
    fn drop(&mut self) {
        if self.remove_root {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }
}

/// Contents held for a run: every content of `workspace`.
pub struct Pinned {
    store: Arc<WorkspaceStore>,
    workspace: Arc<Workspace>,
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let mut inner = self.store.lock();
        for h in self.workspace.contents.keys() {
            if let Some(b) = inner.blobs.get_mut(h) {
                b.pins = b.pins.saturating_sub(1);
            }
        }
        // Contents kept over the size bound only because they were pinned go now; age is
        // looked at by the next post or upload.
        if inner.total > self.store.cfg.max_cache_bytes {
            self.store.evict(&mut inner, Instant::now());
        }
    }
}

/// A temporary file in the cache's `tmp/`, removed unless it was moved into place.
struct Temp {
    path: PathBuf,
    file: Option<File>,
}

impl Temp {
    fn write(&mut self, data: &[u8]) -> Result<(), StoreError> {
        match &mut self.file {
            Some(f) => f
                .write_all(data)
                .map_err(|e| internal("cannot write a content", e)),
            None => Ok(()),
        }
    }
}

impl Drop for Temp {
    fn drop(&mut self) {
        if !self.path.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workspace::manifest::ManifestEntry;

    fn store(max_cache: u64) -> (tempfile::TempDir, Arc<WorkspaceStore>) {
        let dir = tempfile::tempdir().unwrap();
        let cfg = WorkspaceConfig {
            cache_dir: Some(dir.path().to_owned()),
            max_cache_bytes: max_cache,
            max_file_bytes: 100,
            ..Default::default()
        };
        (dir, Arc::new(WorkspaceStore::open(cfg).unwrap()))
    }

    fn entry(path: &str, data: &[u8]) -> ManifestEntry {
        ManifestEntry::file(
            path,
            false,
            data.len() as u64,
            crate::workspace::hash_bytes(data),
        )
    }

    #[test]
    fn upload_is_verified_and_owned() {
        let (_d, s) = store(1000);
        let alice = Some("alice".to_owned());
        let m = Manifest {
            entries: vec![entry("a", b"hello")],
        };
        let p = s.post(m.clone(), &alice).unwrap();
        assert_eq!(p.missing.len(), 1);
        let h = p.missing[0].clone();
        let e = s.receive(&mut &b"hellO"[..], &h, 5, &alice).unwrap_err();
        assert_eq!(e.code(), ErrorCode::HashMismatch);
        assert!(s.receive(&mut &b"hell"[..], &h, 5, &alice).is_err());
        assert!(s.receive(&mut &b"hello!"[..], &h, 5, &alice).is_err());
        assert_eq!(s.usage().1, 0, "nothing stored under a wrong hash");
        assert!(s.pin(&p.workspace).is_err());
        s.receive(&mut &b"hello"[..], &h, 5, &alice).unwrap();
        assert!(s.pin(&p.workspace).is_ok());
        assert!(s.post(m.clone(), &alice).unwrap().missing.is_empty());
        // Another identity must prove it has the content, and cannot use alice's id.
        let bob = Some("bob".to_owned());
        assert_eq!(s.post(m, &bob).unwrap().missing.len(), 1);
        assert_eq!(
            s.get(&p.workspace.id, &bob).unwrap_err().code(),
            ErrorCode::UnknownWorkspace
        );
        assert!(s.open_blob(&h, &bob).is_err());
        assert!(s.open_blob(&h, &alice).is_ok());
    }

    #[test]
    fn a_body_posted_again_answers_as_the_first_post_for_its_owner_only() {
        let (_d, s) = store(1000);
        let alice = Some("alice".to_owned());
        let m = Manifest {
            entries: vec![entry("a", b"hello")],
        };
        let body = serde_json::to_vec(&m).unwrap();
        let key = WorkspaceStore::body_key(&body, &alice);
        assert!(s.post_again(&key, &alice).is_none());
        let p = s.post_body(m, &alice, Some(key.clone())).unwrap();
        let again = s.post_again(&key, &alice).unwrap();
        assert_eq!(again.workspace.id, p.workspace.id);
        assert_eq!(again.missing, p.missing);
        s.receive(&mut &b"hello"[..], &p.missing[0], 5, &alice)
            .unwrap();
        assert!(s.post_again(&key, &alice).unwrap().missing.is_empty());
        let bob = Some("bob".to_owned());
        assert_ne!(WorkspaceStore::body_key(&body, &bob), key);
        assert!(s.post_again(&key, &bob).is_none(), "not another identity's");
    }

    #[test]
    fn one_identity_cannot_evict_another_within_its_share() {
        let (_d, s) = store(200);
        let (alice, bob) = (Some("alice".to_owned()), Some("bob".to_owned()));
        let data = vec![7u8; 40];
        let m = Manifest {
            entries: vec![entry("a", &data)],
        };
        let p = s.post(m, &alice).unwrap();
        s.receive(&mut &data[..], &p.missing[0], 40, &alice)
            .unwrap();
        for i in 0..20u8 {
            let data = vec![i; 40];
            let m = Manifest {
                entries: vec![entry(&format!("f{i}"), &data)],
            };
            let p = s.post(m, &bob).unwrap();
            s.receive(&mut &data[..], &p.missing[0], 40, &bob).unwrap();
        }
        assert!(s.usage().0 <= 200);
        assert!(s.pin(&s.get(&p.workspace.id, &alice).unwrap()).is_ok());
    }

    #[test]
    fn eviction_keeps_the_bound_and_pinned_contents() {
        let (_d, s) = store(100);
        let mut hashes = Vec::new();
        let mut pins = Vec::new();
        for i in 0..5u8 {
            let data = vec![i; 40];
            let m = Manifest {
                entries: vec![entry("f", &data)],
            };
            let p = s.post(m, &None).unwrap();
            s.receive(&mut &data[..], &p.missing[0], 40, &None).unwrap();
            hashes.push(p.missing[0].clone());
            if i == 0 {
                pins.push(s.pin(&p.workspace).unwrap());
            }
        }
        let (total, n, evicted) = s.usage();
        assert!(total <= 100 + 40, "{total}");
        assert_eq!((n, evicted), (2, 3));
        assert!(
            s.open_blob(&hashes[0], &None).is_ok(),
            "pinned content kept"
        );
        assert!(s.open_blob(&hashes[4], &None).is_ok(), "newest kept");
        assert!(s.open_blob(&hashes[1], &None).is_err());
    }
}

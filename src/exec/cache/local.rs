//! The local backend's caches: a directory per cache key below `caches.local_dir`, with a
//! small JSON record beside it (owner hash, cache, profile, last use, measured size), so that
//! a restarted gateway still knows its caches and their idle time.
//!
//! One run holds a key at a time (the same rule as a Kubernetes claim's): another run of the
//! key waits or runs without it (`when_busy`). After each run the directory is measured while
//! still held; one over its size bound is emptied (the next run is cold, and the log says
//! why). A sweeper deletes keys idle for `caches.idle_ttl_secs`.

use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tokio::sync::OwnedMutexGuard;
use tokio_util::sync::CancellationToken;

use super::{CacheError, CacheKey, CacheRequest, CacheSpec, CachesConfig, WhenBusy};
use crate::contract::{CacheState, Phase};
use crate::exec::{ExecSpec, Progress};

/// Where the caches of runs that could not have their own live while they run.
const SKIPPED_DIR: &str = ".skipped";

/// What is kept beside a cache's directory.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Record {
    owner: String,
    cache: String,
    profile: String,
    scope: String,
    /// Unix seconds of the last run's end (or start, while one runs).
    last_used: u64,
    /// Disk usage measured after the last run, in bytes.
    #[serde(default)]
    bytes: u64,
}

/// The caches of the local backend.
pub(crate) struct LocalCaches {
    root: PathBuf,
    cfg: CachesConfig,
    profiles: BTreeMap<String, Vec<CacheSpec>>,
    /// One lock per key: held by the run using it.
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// This process's exclusive lock on the directory: the locks above are in memory, so two
    /// gateways must not share one `local_dir`.
    _owner: nix::fcntl::Flock<std::fs::File>,
}

/// A run's caches, released (measured, last use recorded) when dropped.
pub(crate) struct LocalHold {
    caches: Arc<LocalCaches>,
    held: Vec<Held>,
    skipped: Vec<PathBuf>,
    env: Vec<(String, String)>,
    states: BTreeMap<String, CacheState>,
}

struct Held {
    id: String,
    bound: u64,
    _guard: OwnedMutexGuard<()>,
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl LocalCaches {
    /// Caches below `cfg.local_dir()` for the profiles that declare some; `None` when none
    /// does. Removes what runs without their own cache left behind, and starts the sweeper.
    pub(crate) fn start(
        cfg: &CachesConfig,
        profiles: BTreeMap<String, Vec<CacheSpec>>,
        stop: CancellationToken,
    ) -> std::io::Result<Option<Arc<Self>>> {
        let profiles: BTreeMap<_, _> = profiles
            .into_iter()
            .filter(|(_, c)| !c.is_empty())
            .collect();
        if profiles.is_empty() {
            return Ok(None);
        }
        let root = cfg.local_dir();
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&root)?;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(root.join(".lock"))?;
        let owner = nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock)
            .map_err(|(_, e)| {
                std::io::Error::other(format!(
                    "another gateway uses this directory ({e}); give each gateway its own caches.local_dir"
                ))
            })?;
        let _ = std::fs::remove_dir_all(root.join(SKIPPED_DIR));
        let caches = Arc::new(Self {
            root,
            cfg: cfg.clone(),
            profiles,
            locks: Mutex::new(HashMap::new()),
            _owner: owner,
        });
        // Weak: the sweeper ends with the caches (and releases the directory's lock with them).
        let sweeper = Arc::downgrade(&caches);
        let every = Duration::from_secs(cfg.sweep_interval_secs);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => {}
                }
                let Some(s) = sweeper.upgrade() else { return };
                match tokio::task::spawn_blocking(move || s.sweep(now_secs())).await {
                    Ok(n) if n > 0 => tracing::info!(deleted = n, "idle local caches deleted"),
                    _ => {}
                }
            }
        });
        Ok(Some(caches))
    }

    /// What the capabilities document says about a profile's caches.
    pub(crate) fn info(&self, profile: &str) -> Vec<crate::capabilities::CacheInfo> {
        self.profiles
            .get(profile)
            .map(|c| super::info(c))
            .unwrap_or_default()
    }

    fn lock_of(&self, id: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.locks.lock().unwrap_or_else(|e| e.into_inner());
        locks.entry(id.to_string()).or_default().clone()
    }

    fn dir(&self, id: &str) -> PathBuf {
        self.root.join(id)
    }

    fn record_path(&self, id: &str) -> PathBuf {
        self.root.join(format!("{id}.json"))
    }

    fn read_record(path: &Path) -> Option<Record> {
        serde_json::from_slice(&std::fs::read(path).ok()?).ok()
    }

    fn write_record(&self, id: &str, r: &Record) {
        let path = self.record_path(id);
        let tmp = self.root.join(format!(".{id}.json.tmp"));
        let ok = serde_json::to_vec(r)
            .map_err(std::io::Error::other)
            .and_then(|b| std::fs::write(&tmp, b))
            .and_then(|_| std::fs::rename(&tmp, &path));
        if let Err(e) = ok {
            tracing::warn!(cache = r.cache, "cannot record the cache's use: {e}");
        }
    }

    /// Keys of one owner that exist now.
    fn count_of(&self, owner: &str) -> usize {
        let Ok(dir) = std::fs::read_dir(&self.root) else {
            return 0;
        };
        dir.flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
            .filter_map(|e| Self::read_record(&e.path()))
            .filter(|r| r.owner == owner)
            .count()
    }

    /// Takes the caches of a run's profile for it: the directories, the variables that
    /// point at them, and what became of each. `None` when its profile has no caches.
    pub(crate) async fn acquire(
        self: &Arc<Self>,
        spec: &ExecSpec,
        progress: &Progress,
        cancel: &CancellationToken,
    ) -> Result<Option<LocalHold>, CacheError> {
        let profile = spec.profile.as_deref().unwrap_or("default");
        let Some(list) = self.profiles.get(profile) else {
            return Ok(None);
        };
        let req = CacheRequest {
            owner: spec.owner.as_deref(),
            scope: spec.cache_scope.as_deref(),
            workspace: spec.workspace.as_ref().map(|w| w.workspace.id.as_str()),
        };
        let mut hold = LocalHold {
            caches: self.clone(),
            held: Vec::new(),
            skipped: Vec::new(),
            env: Vec::new(),
            states: BTreeMap::new(),
        };
        for c in list {
            let key = CacheKey::new(profile, c, &req);
            let lock = self.lock_of(&key.id);
            let guard = match lock.clone().try_lock_owned() {
                Ok(g) => Some(g),
                Err(_) if c.when_busy == WhenBusy::Skip => None,
                Err(_) => {
                    let wait = Duration::from_secs(self.cfg.busy_wait_secs);
                    progress.report(
                        Phase::Queued,
                        Some(format!(
                            "cache {} is in use by another run; waiting up to {}s",
                            c.name,
                            wait.as_secs()
                        )),
                    );
                    tokio::select! {
                        g = tokio::time::timeout(wait, lock.lock_owned()) => match g {
                            Ok(g) => Some(g),
                            Err(_) => return Err(CacheError::Busy { name: c.name.clone(), secs: wait.as_secs() }),
                        },
                        _ = cancel.cancelled() => {
                            return Err(CacheError::Cancelled);
                        }
                    }
                }
            };
            let Some(guard) = guard else {
                progress.report(
                    Phase::Queued,
                    Some(format!(
                        "cache {} is in use by another run; running without it",
                        c.name
                    )),
                );
                let dir = hold.skip(c)?;
                hold.push_env(c, &dir);
                continue;
            };
            let this = self.clone();
            let k = key.clone();
            let prepared = tokio::task::spawn_blocking(move || this.prepare(&k))
                .await
                .map_err(CacheError::Preparing)?;
            match prepared {
                Ok(Some((dir, state))) => {
                    hold.states.insert(c.name.clone(), state);
                    hold.push_env(c, &dir);
                    hold.held.push(Held {
                        id: key.id,
                        bound: self.cfg.size_of(c),
                        _guard: guard,
                    });
                }
                Ok(None) => {
                    tracing::warn!(
                        cache = c.name,
                        owner = key.owner_hash,
                        max = self.cfg.max_per_identity,
                        "the identity has caches.max_per_identity caches: running without one more"
                    );
                    progress.report(
                        Phase::Queued,
                        Some(format!(
                            "cache {}: the caller has {} caches already (caches.max_per_identity); running without it",
                            c.name, self.cfg.max_per_identity
                        )),
                    );
                    drop(guard);
                    let dir = hold.skip(c)?;
                    hold.push_env(c, &dir);
                }
                Err(e) => {
                    return Err(CacheError::Prepare {
                        name: c.name.clone(),
                        source: e,
                    });
                }
            }
        }
        Ok(Some(hold))
    }

    /// The key's directory, created when new (unless the owner has too many); recorded as
    /// used now.
    fn prepare(&self, key: &CacheKey) -> std::io::Result<Option<(PathBuf, CacheState)>> {
        let dir = self.dir(&key.id);
        let record = Self::read_record(&self.record_path(&key.id));
        let state = if dir.is_dir() && record.is_some() {
            CacheState::Reused
        } else {
            if self.count_of(&key.owner_hash) >= self.cfg.max_per_identity {
                return Ok(None);
            }
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
            CacheState::Created
        };
        self.write_record(
            &key.id,
            &Record {
                owner: key.owner_hash.clone(),
                cache: key.cache.clone(),
                profile: key.profile.clone(),
                scope: key.scope_key.clone(),
                last_used: now_secs(),
                bytes: record.map(|r| r.bytes).unwrap_or(0),
            },
        );
        Ok(Some((dir, state)))
    }

    /// After a run: measures the directory, empties one over its bound, records the use.
    fn release(&self, id: &str, bound: u64) {
        let dir = self.dir(id);
        let Some(mut r) = Self::read_record(&self.record_path(id)) else {
            return;
        };
        r.bytes = disk_usage(&dir);
        r.last_used = now_secs();
        if r.bytes > bound {
            tracing::warn!(
                cache = r.cache,
                owner = r.owner,
                bytes = r.bytes,
                bound,
                "cache over its size bound: emptied (the next run starts cold)"
            );
            let _ = std::fs::remove_dir_all(&dir);
            let _ = std::fs::remove_file(self.record_path(id));
            return;
        }
        self.write_record(id, &r);
    }

    /// Deletes the caches idle for longer than the TTL that no run holds. Returns how many.
    /// Also removes a directory whose record is missing (a gateway killed between making one
    /// and recording it, or while emptying one): nothing would find it again.
    pub(crate) fn sweep(&self, now: u64) -> usize {
        let Ok(dir) = std::fs::read_dir(&self.root) else {
            return 0;
        };
        let mut n = 0;
        for e in dir.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(id) = name.strip_suffix(".json") else {
                let key_like = name.len() == 40 && name.bytes().all(|b| b.is_ascii_hexdigit());
                if key_like && !self.record_path(&name).exists() {
                    let lock = self.lock_of(&name);
                    if let Ok(_held) = lock.try_lock()
                        && !self.record_path(&name).exists()
                    {
                        let _ = std::fs::remove_dir_all(e.path());
                    }
                }
                continue;
            };
            if id.starts_with('.') {
                continue;
            }
            let Some(r) = Self::read_record(&e.path()) else {
                continue;
            };
            if r.last_used.saturating_add(self.cfg.idle_ttl_secs) > now {
                continue;
            }
            // Held by a run: not idle, whatever the record says.
            let lock = self.lock_of(id);
            let Ok(_held) = lock.try_lock() else {
                continue;
            };
            let _ = std::fs::remove_dir_all(self.dir(id));
            if std::fs::remove_file(e.path()).is_ok() {
                tracing::info!(cache = r.cache, owner = r.owner, "idle cache deleted");
                n += 1;
            }
            self.locks
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(id);
        }
        n
    }
}

/// Bytes a directory takes on disk (allocated blocks, so sparse files count as stored),
/// symlinks not followed.
pub(crate) fn disk_usage(dir: &Path) -> u64 {
    walkdir::WalkDir::new(dir)
        .follow_links(false)
        .into_iter()
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.blocks() * 512)
        .sum()
}

impl LocalHold {
    /// The variables that point the run's tools at its caches.
    pub(crate) fn env(&self) -> impl Iterator<Item = (String, String)> + '_ {
        self.env.iter().cloned()
    }

    /// What became of each cache.
    pub(crate) fn states(&self) -> BTreeMap<String, CacheState> {
        self.states.clone()
    }

    fn push_env(&mut self, c: &CacheSpec, dir: &Path) {
        let root = dir.to_string_lossy();
        self.env.extend(c.env_at(&root));
    }

    /// An empty directory for a run that cannot have its cache, removed after the run.
    fn skip(&mut self, c: &CacheSpec) -> Result<PathBuf, CacheError> {
        self.states.insert(c.name.clone(), CacheState::Skipped);
        let parent = self.caches.root.join(SKIPPED_DIR);
        let made = std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&parent)
            .and_then(|_| tempfile::Builder::new().prefix(&c.name).tempdir_in(&parent));
        match made {
            Ok(d) => {
                let path = d.keep();
                self.skipped.push(path.clone());
                Ok(path)
            }
            Err(source) => Err(CacheError::SkipDir {
                name: c.name.clone(),
                source,
            }),
        }
    }
}

impl Drop for LocalHold {
    fn drop(&mut self) {
        let caches = self.caches.clone();
        let held = std::mem::take(&mut self.held);
        let skipped = std::mem::take(&mut self.skipped);
        let work = move || {
            for h in held {
                // Measured while still held: no run starts in a directory being emptied.
                caches.release(&h.id, h.bound);
                drop(h);
            }
            for d in skipped {
                let _ = std::fs::remove_dir_all(d);
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn_blocking(work);
            }
            Err(_) => work(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup(dir: &Path, yaml: &str, ttl: u64) -> Arc<LocalCaches> {
        let cfg = CachesConfig {
            local_dir: Some(dir.to_path_buf()),
            idle_ttl_secs: ttl,
            max_per_identity: 2,
            ..CachesConfig::default()
        };
        let specs: Vec<CacheSpec> = yaml_serde::from_str(yaml).unwrap();
        LocalCaches::start(
            &cfg,
            [("default".to_string(), specs)].into(),
            CancellationToken::new(),
        )
        .unwrap()
        .unwrap()
    }

    fn spec(owner: Option<&str>) -> ExecSpec {
        ExecSpec {
            owner: owner.map(str::to_owned),
            ..ExecSpec::default()
        }
    }

    async fn env_of(c: &Arc<LocalCaches>, owner: Option<&str>) -> (LocalHold, String) {
        let h = c
            .acquire(
                &spec(owner),
                &Progress::default(),
                &CancellationToken::new(),
            )
            .await
            .unwrap()
            .unwrap();
        let v = h.env().next().unwrap().1;
        (h, v)
    }

    #[tokio::test]
    async fn kept_per_key_busy_skips_and_idle_ones_are_swept() {
        let tmp = tempfile::tempdir().unwrap();
        let c = setup(
            tmp.path(),
            "[{name: c, path: /c, env: {C: sub}, when_busy: skip, size: 1Mi}]",
            60,
        );
        let (h, dir) = env_of(&c, Some("alice")).await;
        assert!(dir.ends_with("/sub"), "{dir}");
        assert_eq!(h.states()["c"], CacheState::Created);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(format!("{dir}/f"), b"kept").unwrap();
        // Held: a second run of the key gets an empty directory of its own.
        let (h2, other) = env_of(&c, Some("alice")).await;
        assert_eq!(h2.states()["c"], CacheState::Skipped);
        assert_ne!(other, dir);
        drop(h2);
        drop(h);
        // Released in the background: the next acquire waits for the lock.
        let (h, again) = loop {
            let (h, v) = env_of(&c, Some("alice")).await;
            if h.states()["c"] != CacheState::Skipped {
                break (h, v);
            }
            drop(h);
            tokio::task::yield_now().await;
        };
        assert_eq!(again, dir);
        assert_eq!(h.states()["c"], CacheState::Reused);
        assert_eq!(std::fs::read(format!("{dir}/f")).unwrap(), b"kept");
        // Another identity: another directory.
        let (hb, bob) = env_of(&c, Some("bob")).await;
        assert_ne!(bob, dir);
        assert_eq!(hb.states()["c"], CacheState::Created);
        // Held caches survive a sweep whatever their age; released idle ones go.
        assert_eq!(c.sweep(now_secs() + 3600), 0);
        drop(h);
        drop(hb);
        let mut swept = 0;
        for _ in 0..200 {
            swept += c.sweep(now_secs() + 3600);
            if swept == 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(swept, 2);
        assert!(!Path::new(&dir).exists());
        // A directory without its record (a gateway killed in between) goes too.
        let orphan = tmp.path().join("a".repeat(40));
        std::fs::create_dir(&orphan).unwrap();
        c.sweep(now_secs());
        assert!(!orphan.exists());
    }

    #[tokio::test]
    async fn one_gateway_per_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let first = setup(tmp.path(), "[{name: c, path: /c}]", 60);
        let cfg = CachesConfig {
            local_dir: Some(tmp.path().to_path_buf()),
            ..CachesConfig::default()
        };
        let specs: Vec<CacheSpec> = yaml_serde::from_str("[{name: c, path: /c}]").unwrap();
        let second = LocalCaches::start(
            &cfg,
            [("default".to_string(), specs.clone())].into(),
            CancellationToken::new(),
        );
        let e = second.err().expect("refused");
        assert!(
            e.to_string()
                .contains("another gateway uses this directory"),
            "{e}"
        );
        drop(first);
        // Free once the caches are gone (a sweep running now holds them a moment longer).
        let mut again = None;
        for _ in 0..200 {
            let map = [("default".to_string(), specs.clone())].into();
            if let Ok(c) = LocalCaches::start(&cfg, map, CancellationToken::new()) {
                again = c;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(again.is_some(), "the directory is free again");
    }

    #[tokio::test]
    async fn over_the_bound_is_emptied_and_the_count_is_bounded() {
        let tmp = tempfile::tempdir().unwrap();
        let c = setup(
            tmp.path(),
            "[{name: c, path: /c, env: {C: .}, size: 64Ki}]",
            60,
        );
        let (h, dir) = env_of(&c, Some("a")).await;
        std::fs::write(format!("{dir}/big"), vec![1u8; 256 * 1024]).unwrap();
        let id = h.held[0].id.clone();
        drop(h);
        for _ in 0..200 {
            // The record goes last.
            if !c.record_path(&id).exists() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(!Path::new(&dir).exists(), "emptied");
        assert!(!c.record_path(&id).exists());
        // max_per_identity 2: scopes are per profile here, so use the count directly.
        let k = |s: &str| CacheKey {
            cache: s.into(),
            profile: "p".into(),
            id: format!("{s:0>40}"),
            owner_hash: "o".into(),
            scope_key: "identity".into(),
        };
        assert!(c.prepare(&k("1")).unwrap().is_some());
        assert!(c.prepare(&k("2")).unwrap().is_some());
        assert!(c.prepare(&k("3")).unwrap().is_none());
        assert_eq!(c.prepare(&k("1")).unwrap().unwrap().1, CacheState::Reused);
    }
}

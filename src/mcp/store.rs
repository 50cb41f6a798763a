//! The full output of MCP runs, kept for a while so that a result can stay small: every
//! byte of both streams goes to a file in a private temporary directory (removed when the
//! server stops), and `resources/read` of `mcp-run://runs/{id}/{stream}` reads it back
//! (`resources.rs`). Bounded by age, by total size (the oldest finished runs go first) and
//! per stream; an expired run is remembered as expired, so that a read says so.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::auth::Caller;
use crate::result::Stream;

/// How many expired run ids are remembered (to say "expired" rather than "unknown").
const EXPIRED_REMEMBERED: usize = 10_000;

/// Bounds of the store (`mcp.output_store` in the configuration).
#[derive(Debug, Clone)]
pub(crate) struct StoreLimits {
    /// All kept output together; the oldest finished runs are removed beyond it.
    pub max_bytes: u64,
    /// How long a finished run's output is kept.
    pub max_age: Duration,
    /// Per stream of one run; bytes beyond it are not kept (the read says so).
    pub max_stream_bytes: u64,
}

/// One run's kept output.
pub(crate) struct Recording {
    pub id: String,
    owner: Option<String>,
    paths: [PathBuf; 2],
    writers: [Mutex<Option<BufWriter<File>>>; 2],
    /// Bytes written by the command, per stream.
    total: [AtomicU64; 2],
    /// Bytes kept in the file, per stream.
    kept: [AtomicU64; 2],
    finished: AtomicBool,
    /// When it finished (for the age bound).
    ended: Mutex<Option<Instant>>,
    max_stream_bytes: u64,
}

fn index(s: Stream) -> usize {
    match s {
        Stream::Stdout => 0,
        Stream::Stderr => 1,
    }
}

impl Recording {
    /// Appends a chunk of a stream. A write error stops keeping that stream (the read says
    /// how much was kept); the run itself goes on.
    pub(crate) fn push(&self, stream: Stream, data: &[u8]) {
        let i = index(stream);
        self.total[i].fetch_add(data.len() as u64, Ordering::Relaxed);
        let kept = self.kept[i].load(Ordering::Relaxed);
        let room = self.max_stream_bytes.saturating_sub(kept) as usize;
        let data = &data[..data.len().min(room)];
        if data.is_empty() {
            return;
        }
        let Ok(mut w) = self.writers[i].lock() else {
            return;
        };
        if let Some(f) = w.as_mut() {
            if f.write_all(data).is_ok() {
                self.kept[i].fetch_add(data.len() as u64, Ordering::Relaxed);
            } else {
                tracing::warn!(run = %self.id, "cannot keep the output of an MCP run");
                *w = None;
            }
        }
    }

    /// The URI of one stream.
    pub(crate) fn uri(&self, stream: Stream) -> String {
        format!("mcp-run://runs/{}/{}", self.id, stream_name(stream))
    }

    /// How long ago it finished (zero while it runs).
    pub(crate) fn age(&self) -> Duration {
        self.ended
            .lock()
            .ok()
            .and_then(|e| *e)
            .map(|e| e.elapsed())
            .unwrap_or_default()
    }

    /// Bytes the command wrote to a stream.
    pub(crate) fn total(&self, stream: Stream) -> u64 {
        self.total[index(stream)].load(Ordering::Relaxed)
    }

    /// Bytes of a stream kept (readable).
    pub(crate) fn kept(&self, stream: Stream) -> u64 {
        self.kept[index(stream)].load(Ordering::Relaxed)
    }

    pub(crate) fn path(&self, stream: Stream) -> &std::path::Path {
        &self.paths[index(stream)]
    }

    fn flush(&self) {
        for w in &self.writers {
            if let Ok(mut w) = w.lock()
                && let Some(f) = w.as_mut()
            {
                let _ = f.flush();
            }
        }
    }

    fn size(&self) -> u64 {
        self.kept(Stream::Stdout) + self.kept(Stream::Stderr)
    }

    fn remove_files(&self) {
        for (w, p) in self.writers.iter().zip(&self.paths) {
            if let Ok(mut w) = w.lock() {
                *w = None;
            }
            let _ = std::fs::remove_file(p);
        }
    }
}

/// `stdout` or `stderr`.
pub(crate) fn stream_name(s: Stream) -> &'static str {
    match s {
        Stream::Stdout => "stdout",
        Stream::Stderr => "stderr",
    }
}

/// Why a run's output cannot be read.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Missing {
    /// It was kept and has been removed (age or size bound).
    Expired,
    /// No such run (or not this caller's).
    Unknown,
}

#[derive(Default)]
struct Inner {
    runs: HashMap<String, Arc<Recording>>,
    /// Run ids, oldest first.
    order: VecDeque<String>,
    expired: HashSet<String>,
    expired_order: VecDeque<String>,
}

/// The store: one per server process, shared by every session.
pub(crate) struct OutputStore {
    dir: tempfile::TempDir,
    limits: StoreLimits,
    /// This replica's tag, the first characters of every run id when the gateway has peers
    /// (`crate::peers`): a read on another replica is forwarded here.
    tag: Option<String>,
    inner: Mutex<Inner>,
}

/// Who may read a run: the identity that ran it (none without authentication).
fn owner_of(caller: &Caller) -> Option<String> {
    caller.identity.clone()
}

impl OutputStore {
    /// A store in a new private directory under `parent` (the system's temporary directory
    /// when `None`).
    pub(crate) fn new(
        parent: Option<&std::path::Path>,
        limits: StoreLimits,
    ) -> std::io::Result<Self> {
        let mut b = tempfile::Builder::new();
        // Named with the gateway's pid: what a killed gateway leaves is found (crate::leftovers).
        let prefix = crate::leftovers::prefix("outputs");
        b.prefix(&prefix);
        let dir = match parent {
            Some(p) => b.tempdir_in(p)?,
            None => b.tempdir()?,
        };
        Ok(Self {
            dir,
            limits,
            tag: None,
            inner: Mutex::new(Inner::default()),
        })
    }

    /// Starts every run id with `tag` (this replica's, [`crate::peers::Peers::tag`]).
    pub(crate) fn set_tag(&mut self, tag: &str) {
        self.tag = Some(tag.to_owned());
    }

    pub(crate) fn limits(&self) -> &StoreLimits {
        &self.limits
    }

    /// Starts keeping a run's output. `None` when its files cannot be created (the result
    /// then says that the full output is not kept).
    pub(crate) fn begin(&self, caller: &Caller) -> Option<Arc<Recording>> {
        self.evict();
        let id = format!("{}{}", self.tag.as_deref().unwrap_or_default(), random_id());
        let paths = [
            self.dir.path().join(format!("{id}.stdout")),
            self.dir.path().join(format!("{id}.stderr")),
        ];
        let open = |p: &PathBuf| match File::create_new(p) {
            Ok(f) => Some(BufWriter::with_capacity(64 * 1024, f)),
            Err(e) => {
                tracing::warn!(path = %p.display(), error = %e, "cannot keep MCP output");
                None
            }
        };
        let (o, e) = (open(&paths[0])?, open(&paths[1])?);
        let r = Arc::new(Recording {
            id: id.clone(),
            owner: owner_of(caller),
            paths,
            writers: [Mutex::new(Some(o)), Mutex::new(Some(e))],
            total: [AtomicU64::new(0), AtomicU64::new(0)],
            kept: [AtomicU64::new(0), AtomicU64::new(0)],
            finished: AtomicBool::new(false),
            ended: Mutex::new(None),
            max_stream_bytes: self.limits.max_stream_bytes,
        });
        if let Ok(mut inner) = self.inner.lock() {
            inner.runs.insert(id.clone(), r.clone());
            inner.order.push_back(id);
        }
        Some(r)
    }

    /// The run ended: its files are complete.
    pub(crate) fn finish(&self, r: &Recording) {
        r.flush();
        if let Ok(mut e) = r.ended.lock() {
            *e = Some(Instant::now());
        }
        r.finished.store(true, Ordering::Release);
        self.evict();
    }

    /// A run as `caller` may read it.
    pub(crate) fn get(&self, id: &str, caller: &Caller) -> Result<Arc<Recording>, Missing> {
        self.evict();
        let inner = self.inner.lock().map_err(|_| Missing::Unknown)?;
        match inner.runs.get(id) {
            Some(r) if r.owner == owner_of(caller) => Ok(r.clone()),
            Some(_) => Err(Missing::Unknown),
            None if inner.expired.contains(id) => Err(Missing::Expired),
            None => Err(Missing::Unknown),
        }
    }

    /// The finished runs `caller` may read, newest first, at most `n`.
    pub(crate) fn list(&self, caller: &Caller, n: usize) -> Vec<Arc<Recording>> {
        let Ok(inner) = self.inner.lock() else {
            return Vec::new();
        };
        let owner = owner_of(caller);
        inner
            .order
            .iter()
            .rev()
            .filter_map(|id| inner.runs.get(id))
            .filter(|r| r.owner == owner && r.finished.load(Ordering::Acquire))
            .take(n)
            .cloned()
            .collect()
    }

    /// Removes finished runs past the age bound, then the oldest finished ones while the
    /// total is over the size bound.
    fn evict(&self) {
        let Ok(mut inner) = self.inner.lock() else {
            return;
        };
        let now = Instant::now();
        let mut total: u64 = inner.runs.values().map(|r| r.size()).sum();
        let mut gone = Vec::new();
        for id in &inner.order {
            let Some(r) = inner.runs.get(id) else {
                continue;
            };
            if !r.finished.load(Ordering::Acquire) {
                continue;
            }
            let old = r
                .ended
                .lock()
                .ok()
                .and_then(|e| *e)
                .is_some_and(|e| now.duration_since(e) > self.limits.max_age);
            if old || total > self.limits.max_bytes {
                total -= r.size();
                gone.push(id.clone());
            }
        }
        for id in gone {
            if let Some(r) = inner.runs.remove(&id) {
                r.remove_files();
            }
            inner.order.retain(|x| *x != id);
            inner.expired.insert(id.clone());
            inner.expired_order.push_back(id);
            if inner.expired_order.len() > EXPIRED_REMEMBERED
                && let Some(old) = inner.expired_order.pop_front()
            {
                inner.expired.remove(&old);
            }
        }
    }
}

/// The tag of the replica that keeps run `id`, when the id carries one (ids of a gateway
/// with peers: the tag, then 32 hex digits).
pub(crate) fn replica_of(id: &str) -> Option<&str> {
    (id.len() == crate::peers::TAG_LEN + 32).then(|| &id[..crate::peers::TAG_LEN])
}

/// 128 random bits in hex: run ids cannot be guessed.
fn random_id() -> String {
    let bits: u128 = rand::random();
    format!("{bits:032x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(max_bytes: u64, max_age: Duration) -> OutputStore {
        OutputStore::new(
            None,
            StoreLimits {
                max_bytes,
                max_age,
                max_stream_bytes: 100,
            },
        )
        .unwrap()
    }

    #[test]
    fn keeps_every_byte_up_to_the_stream_bound() {
        let s = store(1 << 20, Duration::from_secs(60));
        let me = Caller::default();
        let r = s.begin(&me).unwrap();
        r.push(Stream::Stdout, b"hello ");
        r.push(Stream::Stdout, &[b'x'; 200]);
        r.push(Stream::Stderr, b"\0err");
        s.finish(&r);
        assert_eq!(r.total(Stream::Stdout), 206);
        assert_eq!(r.kept(Stream::Stdout), 100);
        assert_eq!(std::fs::read(r.path(Stream::Stderr)).unwrap(), b"\0err");
        assert_eq!(s.get(&r.id, &me).unwrap().id, r.id);
        assert_eq!(
            r.uri(Stream::Stderr),
            format!("mcp-run://runs/{}/stderr", r.id)
        );
        // Another identity does not see it.
        let other = Caller {
            identity: Some("mallory".into()),
            ..Caller::default()
        };
        assert_eq!(s.get(&r.id, &other).err(), Some(Missing::Unknown));
        assert_eq!(s.list(&me, 10).len(), 1);
    }

    #[test]
    fn run_ids_name_their_replica_when_tagged() {
        let mut s = store(1 << 20, Duration::from_secs(60));
        let me = Caller::default();
        let plain = s.begin(&me).unwrap();
        assert_eq!((plain.id.len(), replica_of(&plain.id)), (32, None));
        s.set_tag("0badcafe");
        let tagged = s.begin(&me).unwrap();
        assert_eq!(tagged.id.len(), 40);
        assert_eq!(replica_of(&tagged.id), Some("0badcafe"));
        assert!(s.get(&tagged.id, &me).is_ok());
    }

    #[test]
    fn size_and_age_bounds_expire_the_oldest() {
        let s = store(150, Duration::from_secs(60));
        let me = Caller::default();
        let a = s.begin(&me).unwrap();
        a.push(Stream::Stdout, &[b'a'; 100]);
        s.finish(&a);
        let b = s.begin(&me).unwrap();
        b.push(Stream::Stdout, &[b'b'; 100]);
        s.finish(&b);
        assert_eq!(s.get(&a.id, &me).err(), Some(Missing::Expired));
        assert!(!a.path(Stream::Stdout).exists());
        assert!(s.get(&b.id, &me).is_ok());
        assert_eq!(s.get("nope", &me).err(), Some(Missing::Unknown));

        let s = store(1 << 20, Duration::ZERO);
        let c = s.begin(&me).unwrap();
        s.finish(&c);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(s.get(&c.id, &me).err(), Some(Missing::Expired));
    }
}

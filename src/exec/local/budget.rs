//! A local session's directory counts against `workspaces.max_local_inodes`, the bound on the
//! files and directories that runs' trees may hold at once on this host, for as long as the
//! session lives: what its calls leave there (a workspace tree, build outputs, temporary
//! files) stays between calls, unlike a one-shot run's outputs, which go with its tree.
//!
//! The directory is counted when the session opens and again after each call (off the
//! async threads, after the call's execution is dropped); the session holds that many
//! permits of the budget its runs' trees also draw from. When it cannot (others hold the
//! rest, or the directory alone is larger than the bound), its next call is refused with a
//! message that names the bound and the count, until the budget has room again (or the
//! session ends and gives its share back). So a session can go over its share by what one
//! call writes, never by more; what a single command writes is bounded only by the file
//! system, as for one-shot runs (docs/policy.md).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use futures_util::future::BoxFuture;

use super::LocalError;
use crate::contract::{ErrorBody, RunContext};
use crate::exec::{ExecSpec, Execution, Gone, KeptRunner, Progress, StartOptions};

/// The budget and its bound (`workspaces.max_local_inodes`).
#[derive(Clone)]
pub(super) struct Pool {
    pub(super) budget: Arc<Semaphore>,
    pub(super) max: u64,
}

/// One session's share.
pub(super) struct SessionBudget {
    dir: PathBuf,
    pool: Option<Pool>,
    held: Mutex<Held>,
}

#[derive(Default)]
struct Held {
    permit: Option<OwnedSemaphorePermit>,
    /// What the directory held at the last count.
    counted: u64,
}

impl SessionBudget {
    /// The share of the session in `dir` (just made): refused when the budget has no room
    /// for even its empty directories.
    pub(super) fn open(dir: PathBuf, pool: Option<Pool>) -> Result<Arc<Self>, LocalError> {
        let me = Arc::new(Self {
            dir,
            pool,
            held: Mutex::new(Held::default()),
        });
        let n = count(&me.dir);
        me.settle(n);
        me.check()?;
        Ok(me)
    }

    /// Before a call: the last count is within what the session holds, or the budget gives
    /// the rest now.
    pub(super) fn check(&self) -> Result<(), LocalError> {
        let Some(pool) = &self.pool else {
            return Ok(());
        };
        let mut held = self.lock();
        let have = held.permit.as_ref().map_or(0, |p| p.num_permits() as u64);
        if held.counted <= have {
            return Ok(());
        }
        let n = held.counted;
        if n > pool.max {
            return Err(LocalError::SessionTooLarge { n, max: pool.max });
        }
        match grow(pool, &mut held.permit, n - have) {
            true => Ok(()),
            false => Err(LocalError::SessionBudgetFull { n, max: pool.max }),
        }
    }

    /// After a call: counts the directory again (blocking, so in the background).
    pub(super) fn recount(self: &Arc<Self>) {
        if self.pool.is_none() {
            return;
        }
        let me = self.clone();
        let work = move || {
            let n = count(&me.dir);
            me.settle(n);
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn_blocking(work);
            }
            Err(_) => work(),
        }
    }

    /// Holds `n` permits if the budget allows, else what it can keep (never more than `n`);
    /// [`check`](Self::check) refuses the next call while short.
    fn settle(&self, n: u64) {
        let Some(pool) = &self.pool else {
            return;
        };
        let mut held = self.lock();
        held.counted = n;
        let have = held.permit.as_ref().map_or(0, |p| p.num_permits() as u64);
        if n < have {
            if let Some(p) = held.permit.as_mut() {
                drop(p.split((have - n) as usize));
            }
        } else if n > have && n <= pool.max {
            grow(pool, &mut held.permit, n - have);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Adds `more` permits to `permit` if the budget has them now.
fn grow(pool: &Pool, permit: &mut Option<OwnedSemaphorePermit>, more: u64) -> bool {
    let Ok(more) = u32::try_from(more) else {
        return false;
    };
    match pool.budget.clone().try_acquire_many_owned(more) {
        Ok(extra) => {
            match permit {
                Some(p) => p.merge(extra),
                None => *permit = Some(extra),
            }
            true
        }
        Err(_) => false,
    }
}

/// Files, directories and other entries below `dir`, itself included (what the file system
/// spends inodes on; hard links counted once each name).
fn count(dir: &Path) -> u64 {
    walkdir::WalkDir::new(dir)
        .follow_links(false)
        .into_iter()
        .filter(|e| e.is_ok())
        .count() as u64
}

/// Recounts the session's directory when the call's execution goes.
pub(super) struct RecountOnDrop(pub(super) Arc<SessionBudget>);

impl Drop for RecountOnDrop {
    fn drop(&mut self) {
        self.0.recount();
    }
}

/// A local kept runner whose directory counts against the budget: each call is checked
/// first, and the directory recounted when the call's execution goes.
pub(super) struct Budgeted {
    inner: super::kept::LocalKept,
    budget: Arc<SessionBudget>,
}

impl Budgeted {
    pub(super) fn new(
        inner: super::kept::LocalKept,
        pool: Option<Pool>,
    ) -> Result<Self, LocalError> {
        let budget = match SessionBudget::open(inner.dir().to_owned(), pool) {
            Ok(b) => b,
            Err(e) => {
                // Not kept: its directory goes.
                let dir = inner.dir().to_owned();
                crate::workspace::trees::remove_tree(&dir);
                return Err(e);
            }
        };
        Ok(Self { inner, budget })
    }
}

impl KeptRunner for Budgeted {
    fn context(&self) -> RunContext {
        self.inner.context()
    }

    fn start(
        &self,
        spec: ExecSpec,
        opts: StartOptions,
        sync_tree: bool,
    ) -> BoxFuture<'_, Result<Execution, ErrorBody>> {
        Box::pin(async move {
            self.budget.check()?;
            let recount = RecountOnDrop(self.budget.clone());
            let started = self.inner.start(spec, opts, sync_tree).await;
            // A failed start may have synced the tree: counted too.
            started.map(|e| e.hold(recount))
        })
    }

    fn check(&self) -> BoxFuture<'_, Result<(), Gone>> {
        self.inner.check()
    }

    fn begin_call(
        &self,
        until: std::time::SystemTime,
        fail: bool,
        deadline: tokio::time::Instant,
        progress: &Progress,
    ) -> BoxFuture<'_, Result<Option<String>, ErrorBody>> {
        self.inner.begin_call(until, fail, deadline, progress)
    }

    fn end_call(&self, hold: Option<String>) -> BoxFuture<'_, ()> {
        self.inner.end_call(hold)
    }

    fn last_used(&self) -> Option<std::time::SystemTime> {
        self.inner.last_used()
    }

    fn ending(&self, expired: Option<String>) -> BoxFuture<'_, ()> {
        self.inner.ending(expired)
    }

    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            self.inner.close().await;
            // Gone with its directory: the share goes back now, not when the last
            // reference to the runner does.
            self.budget.lock().permit = None;
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::ErrorCode;

    #[test]
    fn a_session_holds_what_its_directory_holds_and_gives_it_back() {
        let dir = tempfile::tempdir().unwrap();
        let pool = Pool {
            budget: Arc::new(Semaphore::new(10)),
            max: 10,
        };
        let s = SessionBudget::open(dir.path().to_owned(), Some(pool.clone())).unwrap();
        assert_eq!(pool.budget.available_permits(), 9);
        for i in 0..4 {
            std::fs::write(dir.path().join(format!("f{i}")), "x").unwrap();
        }
        s.settle(count(dir.path()));
        assert_eq!(pool.budget.available_permits(), 5);
        s.check().unwrap();
        // Others take the rest; the session writes more: its next call is refused (429),
        // until they give it back.
        let others = pool.budget.clone().try_acquire_many_owned(5).unwrap();
        for i in 4..8 {
            std::fs::write(dir.path().join(format!("f{i}")), "x").unwrap();
        }
        s.settle(count(dir.path()));
        let e = ErrorBody::from(s.check().unwrap_err());
        assert_eq!(e.code, ErrorCode::TooManyRequests, "{}", e.message);
        assert!(
            e.message.contains("workspaces.max_local_inodes"),
            "{}",
            e.message
        );
        drop(others);
        s.check().unwrap();
        assert_eq!(pool.budget.available_permits(), 1);
        // Over the bound alone: 413.
        for i in 8..12 {
            std::fs::write(dir.path().join(format!("f{i}")), "x").unwrap();
        }
        s.settle(count(dir.path()));
        assert_eq!(
            ErrorBody::from(s.check().unwrap_err()).code,
            ErrorCode::PayloadTooLarge
        );
        // Files removed: the share shrinks.
        for i in 0..12 {
            std::fs::remove_file(dir.path().join(format!("f{i}"))).unwrap();
        }
        s.settle(count(dir.path()));
        s.check().unwrap();
        assert_eq!(pool.budget.available_permits(), 9);
        drop(s);
        assert_eq!(pool.budget.available_permits(), 10);
    }
}

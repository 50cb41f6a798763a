//! Processes that escaped everything else: a command's descendant that left its process
//! group (`setsid`) and cleared its environment (`env -i`, so no [`RUN_TAG_VAR`] tag), on a
//! machine without a cgroup v2 per command ([`crate::exec::cgroup`]).
//!
//! The gateway is a child subreaper (`PR_SET_CHILD_SUBREAPER`): a process whose parent dies
//! is given to the gateway, not to init, so every escapee of every command ends up as a
//! child of the gateway as soon as the processes between them are gone. The gateway knows
//! the children it started itself (commands' first processes until tokio reaped them, the
//! reaper process); any other child is an orphan of some command.
//!
//! Which command? An orphan can only come from a command that was running when the orphan
//! started. So the gateway keeps the start of each running command, in the clock of
//! `/proc/PID/stat` (ticks since boot), and kills an orphan when no running command started
//! at or before it: when the last one that could have made it has ended. With one command
//! at a time that is exact; with overlapping ones an orphan may live until the end of a
//! command that started before it and did not make it, never past every command that could
//! have. A session's call is a command like any other: as with its process group, nothing
//! it started runs between calls (docs/sessions.md).
//!
//! Reaping: an adopted orphan is waited for here, by its pid only (`waitpid(pid)`), never
//! with `waitpid(-1)`: tokio reaps its own children by their pids, and a wildcard wait would
//! steal their exit statuses. Spawning holds the same lock as the sweep, so a child being
//! started is never mistaken for an orphan.
//!
//! [`RUN_TAG_VAR`]: crate::exec::reaper::RUN_TAG_VAR

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;

/// After a command ended, how long the sweep keeps looking every [`PERIOD`]: its
/// descendants are given to the gateway only as the processes between them die.
const AFTERWARDS: Duration = Duration::from_secs(5);
/// How often the sweep looks while runs are live or have just ended.
const PERIOD: Duration = Duration::from_secs(1);
/// After a sweep killed something, the next look: the killed ones' children come next.
const AGAIN: Duration = Duration::from_millis(50);
/// How long a sweep waits for a killed orphan to become a zombie it can reap (a process in
/// uninterruptible sleep dies later; a later sweep reaps it).
const REAP_WAIT: Duration = Duration::from_secs(1);

struct State {
    /// Children the gateway started itself: never orphans, never waited for here.
    own: BTreeSet<i32>,
    /// The start of each running command (ticks since boot), by a number of its own.
    live: BTreeMap<u64, u64>,
    /// When the last command ended.
    ended: Option<Instant>,
    /// Something ended since the sweep last looked.
    dirty: bool,
}

static STATE: Mutex<State> = Mutex::new(State {
    own: BTreeSet::new(),
    live: BTreeMap::new(),
    ended: None,
    dirty: false,
});
static WAKE: Condvar = Condvar::new();
static ENABLED: AtomicBool = AtomicBool::new(false);

fn state() -> MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Makes the gateway a child subreaper and starts the sweep. `own` are children it started
/// before (the reaper process). Only the gateway binary calls this (not a test binary that
/// embeds the local backend, whose other children are not commands').
fn enable(own: Option<u32>) {
    if let Err(e) = nix::sys::prctl::set_child_subreaper(true) {
        tracing::warn!(
            "cannot become a child subreaper ({e}): processes that commands start in a new session with a cleared environment can outlive their run"
        );
        return;
    }
    if let Some(pid) = own.and_then(|p| i32::try_from(p).ok()) {
        state().own.insert(pid);
    }
    if ENABLED.swap(true, Ordering::SeqCst) {
        return;
    }
    let started = std::thread::Builder::new()
        .name("mcp-run-orphans".into())
        .spawn(sweeper);
    if let Err(e) = started {
        ENABLED.store(false, Ordering::SeqCst);
        let _ = nix::sys::prctl::set_child_subreaper(false);
        tracing::warn!("cannot start the orphan sweep ({e}): not a child subreaper");
    }
}

/// A running command: orphans that started after its start live at most until it ends
/// (dropped).
pub(in crate::exec) struct Live {
    id: u64,
}

impl Live {
    fn begin_locked(state: &mut State, start: u64) -> Live {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        state.live.insert(id, start);
        Live { id }
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        let mut s = state();
        s.live.remove(&self.id);
        s.ended = Some(Instant::now());
        s.dirty = true;
        drop(s);
        WAKE.notify_all();
    }
}

/// A command's first process, started by [`spawn`]: its run is live until this is dropped.
pub(in crate::exec) struct Run {
    _live: Live,
    pid: Option<i32>,
}

impl Run {
    /// Tokio has reaped the process: its pid is free (and may be anyone's next).
    pub(in crate::exec) fn reaped(&mut self) {
        if let Some(pid) = self.pid.take() {
            state().own.remove(&pid);
        }
    }
}

/// Starts a command's first process: the run is live from before the fork, and the child
/// is known as the gateway's own before the sweep can look at it.
pub(in crate::exec) fn spawn(
    cmd: &mut tokio::process::Command,
) -> std::io::Result<(tokio::process::Child, Run)> {
    let mut s = state();
    let live = Live::begin_locked(&mut s, now_ticks());
    let child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            // Unlocked first: ending the run takes the lock.
            drop(s);
            drop(live);
            return Err(e);
        }
    };
    let pid = child.id().and_then(|p| i32::try_from(p).ok());
    if let Some(pid) = pid {
        s.own.insert(pid);
    }
    drop(s);
    Ok((child, Run { _live: live, pid }))
}

/// The gateway's reaper process, and the subreaper's last sweep when the executor that
/// started them goes (the gateway is shutting down): every orphan is killed, then the
/// reaper is let go.
pub(in crate::exec) struct Guard {
    _reaper: crate::exec::reaper::Reaper,
}

impl Guard {
    /// Makes the gateway a subreaper too (see [`enable`]).
    pub(in crate::exec) fn new(reaper: crate::exec::reaper::Reaper) -> Guard {
        enable(Some(reaper.pid()));
        Guard { _reaper: reaper }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        kill_all();
    }
}

/// The kernel's clock of process starts: ticks (`CLK_TCK`) since boot, rounded down, so
/// that a process started after this call never has an earlier start.
fn now_ticks() -> u64 {
    let mut ts = nix::libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { nix::libc::clock_gettime(nix::libc::CLOCK_BOOTTIME, &mut ts) };
    let hz = clock_ticks();
    (ts.tv_sec as u64) * hz + (ts.tv_nsec as u64) * hz / 1_000_000_000
}

fn clock_ticks() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { nix::libc::sysconf(nix::libc::_SC_CLK_TCK) };
    u64::try_from(hz).ok().filter(|&h| h > 0).unwrap_or(100)
}

/// A process's parent, whether it is a zombie, and its start (ticks since boot), from
/// `/proc/PID/stat`.
fn stat(pid: i32) -> Option<(i32, bool, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: the fields follow the last ')'.
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // state is field 3 of stat(5), ppid 4, starttime 22.
    let zombie = *fields.first()? == "Z";
    let ppid = fields.get(1)?.parse().ok()?;
    let start = fields.get(19)?.parse().ok()?;
    Some((ppid, zombie, start))
}

/// The gateway's children: from each thread's `children` list (a subreaper's adopted
/// children are its threads'), else by reading every process's parent.
fn children() -> Vec<i32> {
    let me = std::process::id() as i32;
    let listed = std::fs::read_dir("/proc/self/task").ok().and_then(|tasks| {
        let mut out = Vec::new();
        for t in tasks.flatten() {
            // A thread that ended meanwhile has nothing to list; a kernel without
            // CONFIG_PROC_CHILDREN has no such file at all.
            match std::fs::read_to_string(t.path().join("children")) {
                Ok(text) => out.extend(
                    text.split_whitespace()
                        .filter_map(|p| p.parse::<i32>().ok()),
                ),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && t.path().exists() => {
                    return None;
                }
                Err(_) => {}
            }
        }
        Some(out)
    });
    if let Some(list) = listed {
        return list;
    }
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    procs
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| stat(pid).is_some_and(|(ppid, _, _)| ppid == me))
        .collect()
}

/// What to do with an orphan that started at `start`, given the starts of the live runs and
/// commands: kill it when none of those could have made it.
fn doomed(start: u64, live: impl IntoIterator<Item = u64>) -> bool {
    live.into_iter().all(|since| since > start)
}

/// Kills the orphans that no running command can have made, and reaps them and those
/// that ended by themselves. `all`: every orphan (the gateway is going). Whether it found
/// any.
fn sweep(all: bool) -> bool {
    let me = std::process::id() as i32;
    let kids = children();
    let mut reap = Vec::new();
    {
        // Under the lock: no command is being started, so a child that is not ours now is
        // an orphan, and stays our unreaped child (its pid cannot be reused) until we wait.
        let s = state();
        for pid in kids.into_iter().filter(|p| !s.own.contains(p)) {
            let Some((ppid, zombie, start)) = stat(pid) else {
                continue;
            };
            if ppid != me {
                continue;
            }
            if zombie {
                reap.push(pid);
            } else if all || doomed(start, s.live.values().copied()) {
                if kill(Pid::from_raw(pid), Signal::SIGKILL).is_ok() {
                    tracing::info!(
                        pid,
                        "killed a process that had escaped its command's process group and environment"
                    );
                }
                reap.push(pid);
            }
        }
    }
    let deadline = Instant::now() + REAP_WAIT;
    for pid in &reap {
        loop {
            match waitpid(Pid::from_raw(*pid), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                _ => break,
            }
        }
    }
    !reap.is_empty()
}

/// The sweep's thread: looks after every end of a command, then every [`PERIOD`]
/// while commands run or just ended; idle otherwise.
fn sweeper() {
    loop {
        let found = sweep(false);
        let mut s = state();
        loop {
            if found || s.dirty {
                s.dirty = false;
                break;
            }
            let busy = !s.live.is_empty() || s.ended.is_some_and(|t| t.elapsed() < AFTERWARDS);
            if busy {
                s = WAKE
                    .wait_timeout(s, PERIOD)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
                break;
            }
            s = WAKE.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        let pause = if found { AGAIN } else { Duration::ZERO };
        drop(s);
        std::thread::sleep(pause);
    }
}

/// The gateway is going: kill every orphan now (their commands end with it).
fn kill_all() {
    if !ENABLED.load(Ordering::SeqCst) {
        return;
    }
    for _ in 0..20 {
        if !sweep(true) {
            break;
        }
        std::thread::sleep(AGAIN);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_orphan_lives_while_a_run_that_could_have_made_it_does() {
        // No live run: killed.
        assert!(doomed(100, []));
        // A run that started before (or in the same tick): it may be its maker.
        assert!(!doomed(100, [90]));
        assert!(!doomed(100, [100]));
        // Only runs that started after it: none of them made it.
        assert!(doomed(100, [101, 200]));
        assert!(!doomed(100, [101, 50]));
    }

    #[test]
    fn stat_reads_this_process() {
        let (ppid, zombie, start) = stat(std::process::id() as i32).unwrap();
        assert_eq!(ppid, nix::unistd::getppid().as_raw());
        assert!(!zombie);
        assert!(start <= now_ticks());
    }
}

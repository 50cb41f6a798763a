//! A cgroup v2 per local command, where the machine lets the gateway make them: every
//! process the command starts stays in its cgroup whatever it does (a new session, a
//! cleared environment, a double fork), and `cgroup.kill` ends them all at once. The
//! process group and the environment tag ([`super::reaper::RUN_TAG_VAR`]) remain the way
//! where cgroups are not available (cgroup v1 only, a read-only `/sys/fs/cgroup` in a
//! container without delegation, a kernel before 5.14).
//!
//! Layout: `<the gateway's own cgroup>/mcp-run-<PID>/<tag>`; the command enters its cgroup
//! between fork and exec (before it can start anything). After the command, the cgroup is
//! killed and removed; the gateway's reaper removes what a killed gateway left.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// Where this gateway's per-run cgroups go, if they can be made here.
fn base() -> Option<&'static Path> {
    static BASE: OnceLock<Option<PathBuf>> = OnceLock::new();
    BASE.get_or_init(|| {
        // Only the gateway, whose reaper removes them after it (not a test binary that
        // embeds the local backend).
        let exe = std::env::current_exe().ok()?;
        if !exe
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("mcp-run"))
        {
            return None;
        }
        let dir = own_cgroup()?.join(format!("mcp-run-{}", std::process::id()));
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => {
                tracing::info!(
                    "no cgroup per command ({}: {e}): commands that leave their process group and clear their environment can outlive their run",
                    dir.display()
                );
                return None;
            }
        }
        if !dir.join("cgroup.kill").exists() {
            let _ = std::fs::remove_dir(&dir);
            tracing::info!("no cgroup per command: the kernel has no cgroup.kill (before 5.14)");
            return None;
        }
        tracing::info!(cgroup = %dir.display(), "one cgroup v2 per command");
        Some(dir)
    })
    .as_deref()
}

/// The directory of this process's cgroup v2 (the `0::PATH` line of /proc/self/cgroup,
/// below the cgroup2 mount).
fn own_cgroup() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let mount = mounts.lines().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        right
            .starts_with("cgroup2 ")
            .then(|| left.split(' ').nth(4).map(PathBuf::from))
            .flatten()
    })?;
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let rel = own.lines().find_map(|l| l.strip_prefix("0::"))?;
    Some(mount.join(rel.trim_start_matches('/')))
}

/// The cgroup of one command.
pub(crate) struct RunCgroup {
    procs: CString,
}

/// Cgroups of running commands, by tag, for [`kill`] and [`release`].
static RUNNING: Mutex<Vec<(String, PathBuf)>> = Mutex::new(Vec::new());

/// A new cgroup for the command tagged `tag`; `None` where cgroups cannot be made.
pub(crate) fn for_run(tag: &str) -> Option<RunCgroup> {
    let dir = base()?.join(tag.replace(['/', '.'], "-"));
    std::fs::create_dir(&dir).ok()?;
    let procs = CString::new(
        dir.join("cgroup.procs")
            .into_os_string()
            .into_encoded_bytes(),
    )
    .ok()?;
    if let Ok(mut r) = RUNNING.lock() {
        r.push((tag.to_owned(), dir));
    }
    Some(RunCgroup { procs })
}

impl RunCgroup {
    /// Moves the calling process into the cgroup. Only async-signal-safe calls: for the
    /// child between fork and exec. Best effort: a command that could not enter still runs,
    /// and is killed the other ways.
    pub(crate) fn enter(&self) {
        // SAFETY: open, write and close on a path prepared before the fork.
        unsafe {
            let fd = nix::libc::open(
                self.procs.as_ptr(),
                nix::libc::O_WRONLY | nix::libc::O_CLOEXEC,
            );
            if fd >= 0 {
                // "0": the writing process.
                let _ = nix::libc::write(fd, b"0".as_ptr().cast(), 1);
                nix::libc::close(fd);
            }
        }
    }
}

fn dir_of(tag: &str) -> Option<PathBuf> {
    RUNNING
        .lock()
        .ok()?
        .iter()
        .find(|(t, _)| t == tag)
        .map(|(_, d)| d.clone())
}

/// Kills every process in the cgroup of `tag` (nothing when it has none).
pub(crate) fn kill(tag: &str) {
    if let Some(dir) = dir_of(tag) {
        let _ = std::fs::write(dir.join("cgroup.kill"), "1");
    }
}

/// The command `tag` is over: kills what is left in its cgroup and removes the cgroup once
/// empty (off the async threads).
pub(crate) fn release(tag: &str) {
    let Some(dir) = dir_of(tag) else { return };
    if let Ok(mut r) = RUNNING.lock() {
        r.retain(|(t, _)| t != tag);
    }
    let _ = std::fs::write(dir.join("cgroup.kill"), "1");
    std::thread::spawn(move || remove_when_empty(&dir));
}

/// Removes a killed cgroup: it can be removed once its processes are gone (a few
/// milliseconds after `cgroup.kill`).
fn remove_when_empty(dir: &Path) {
    for _ in 0..100 {
        match std::fs::remove_dir(dir) {
            Ok(()) => return,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(20)),
        }
    }
    tracing::warn!("cannot remove the cgroup {}", dir.display());
}

/// After the gateway `pid` is gone (its reaper): kills what is left in its cgroups and
/// removes them.
pub(crate) fn sweep(pid: u32) {
    let Some(own) = own_cgroup() else { return };
    let dir = own.join(format!("mcp-run-{pid}"));
    if !dir.is_dir() {
        return;
    }
    // Killing the parent kills every descendant.
    let _ = std::fs::write(dir.join("cgroup.kill"), "1");
    if let Ok(entries) = std::fs::read_dir(&dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_when_empty(&e.path());
            }
        }
    }
    remove_when_empty(&dir);
}

//! What a gateway leaves in temporary directories when it cannot clean up (SIGKILL, an OOM
//! kill, a shutdown whose clean-up ran past its bound), and how the next gateway (or the
//! gateway's reaper, once the gateway is gone) removes it.
//!
//! Every directory a gateway makes in a shared temporary directory carries its pid:
//! `mcp-run-cache-PID` (the content cache), `mcp-run-ws-PID-…` (workspace trees),
//! `mcp-run-outputs-PID-…` (kept MCP outputs). While it runs, a gateway holds an exclusive
//! `flock` on `mcp-run-PID.lock` beside them; the lock goes with the process however it
//! ends, and works across PID namespaces sharing the directory. A starting gateway removes
//! the entries of every pid whose lock it can take (or, without a lock file, whose process
//! does not exist), owned by its own user, in the background.

use std::path::{Path, PathBuf};

/// The name prefix of a directory of `kind` made by this process: `mcp-run-KIND-PID-`.
pub(crate) fn prefix(kind: &str) -> String {
    format!("mcp-run-{kind}-{}-", std::process::id())
}

/// The lock a running gateway holds, kept open for the process's life.
static LOCK: std::sync::OnceLock<std::fs::File> = std::sync::OnceLock::new();

fn lock_path(dir: &Path, pid: u32) -> PathBuf {
    dir.join(format!("mcp-run-{pid}.lock"))
}

/// Takes this process's lock in `dir` (the system's temporary directory): a later gateway
/// then knows this one is alive.
pub(crate) fn claim(dir: &Path) {
    use std::os::unix::fs::OpenOptionsExt as _;
    let path = lock_path(dir, std::process::id());
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(&path);
    match file {
        Ok(f) if try_lock(&f) => {
            let _ = LOCK.set(f);
        }
        Ok(_) => tracing::warn!("cannot lock {}", path.display()),
        Err(e) => tracing::warn!("cannot create {}: {e}", path.display()),
    }
}

/// Removes this process's lock file (a clean exit).
pub(crate) fn release(dir: &Path) {
    if LOCK.get().is_some() {
        let _ = std::fs::remove_file(lock_path(dir, std::process::id()));
    }
}

fn try_lock(f: &std::fs::File) -> bool {
    use std::os::fd::AsRawFd as _;
    // SAFETY: flock on a descriptor this function borrows.
    unsafe { nix::libc::flock(f.as_raw_fd(), nix::libc::LOCK_EX | nix::libc::LOCK_NB) == 0 }
}

/// The pid in a leftover's name, if it is one of ours: `mcp-run-{cache,ws,outputs}-PID…`
/// or `mcp-run-PID.lock`.
fn pid_of(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("mcp-run-")?;
    let digits = ["cache-", "ws-", "outputs-"]
        .iter()
        .find_map(|k| rest.strip_prefix(k))
        .or_else(|| rest.strip_suffix(".lock"))?;
    let end = digits
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(digits.len());
    // Older names (`mcp-run-ws-` and 16 hex digits) carry no pid.
    if end == 0 || (end < digits.len() && !digits[end..].starts_with('-')) {
        return None;
    }
    digits[..end].parse().ok()
}

/// Whether the gateway `pid` that left entries in `dir` is gone.
fn is_dead(dir: &Path, pid: u32) -> bool {
    if pid == std::process::id() {
        return false;
    }
    match std::fs::OpenOptions::new()
        .write(true)
        .open(lock_path(dir, pid))
    {
        // Taken: its holder is gone (the lock is dropped with the descriptor at exit).
        Ok(f) => try_lock(&f),
        Err(_) => {
            let exists = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), None);
            exists == Err(nix::errno::Errno::ESRCH)
        }
    }
}

/// The leftovers of dead gateways in `dir`, owned by this user, judged by the lock files in
/// `locks` (the system's temporary directory, where gateways keep them).
pub(crate) fn find(dir: &Path, locks: &Path) -> Vec<PathBuf> {
    use std::os::unix::fs::MetadataExt as _;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { nix::libc::geteuid() };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut dead: std::collections::HashMap<u32, bool> = Default::default();
    let mut out = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name.to_str().and_then(pid_of) else {
            continue;
        };
        if !e.metadata().is_ok_and(|m| m.uid() == uid) {
            continue;
        }
        if *dead.entry(pid).or_insert_with(|| is_dead(locks, pid)) {
            out.push(e.path());
        }
    }
    // Lock files last: their pid counts as dead only while they are there.
    out.sort_by_key(|p| p.extension().is_some_and(|x| x == "lock"));
    out
}

/// Removes what dead gateways left in `dir` (lock files there too); how many entries went.
pub(crate) fn sweep(dir: &Path) -> usize {
    remove(&find(dir, dir))
}

/// Removes what [`find`] found; returns how many entries went.
pub(crate) fn remove(found: &[PathBuf]) -> usize {
    let mut n = 0;
    for p in found {
        let gone = if p.is_dir() {
            remove_dir(p)
        } else {
            std::fs::remove_file(p)
        };
        match gone {
            Ok(()) => n += 1,
            // Another gateway starting at the same time took it.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!("cannot remove the leftover {}: {e}", p.display()),
        }
    }
    n
}

/// `remove_dir_all`, making directories writable where a command took that away.
fn remove_dir(root: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
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

/// Claims this gateway's lock in the system's temporary directory and removes, on a thread
/// of its own, what dead gateways left there and in `others` (a configured `local_dir`).
pub(crate) fn claim_and_sweep(others: &[PathBuf]) {
    let tmp = std::env::temp_dir();
    claim(&tmp);
    let others: Vec<PathBuf> = others.iter().filter(|d| **d != tmp).cloned().collect();
    std::thread::spawn(move || {
        let mut found = Vec::new();
        // Other directories first: their pids are judged by the lock files in `tmp`.
        for d in &others {
            found.extend(find(d, &tmp));
        }
        found.extend(find(&tmp, &tmp));
        if found.is_empty() {
            return;
        }
        let n = remove(&found);
        tracing::info!(
            removed = n,
            "removed what gateways that are gone left in temporary directories"
        );
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_the_pid() {
        assert_eq!(pid_of("mcp-run-cache-1234"), Some(1234));
        assert_eq!(pid_of("mcp-run-ws-99-00ff"), Some(99));
        assert_eq!(pid_of("mcp-run-outputs-7-abc"), Some(7));
        assert_eq!(pid_of("mcp-run-42.lock"), Some(42));
        assert_eq!(pid_of("mcp-run-ws-0123456789abcdef"), None);
        assert_eq!(pid_of("mcp-run-ws-"), None);
        assert_eq!(pid_of("other"), None);
    }

    #[test]
    fn only_the_dead_are_found() {
        let d = tempfile::tempdir().unwrap();
        let me = std::process::id();
        std::fs::create_dir(d.path().join(format!("mcp-run-ws-{me}-1"))).unwrap();
        // A pid that cannot exist (above pid_max) and no lock: dead.
        std::fs::create_dir(d.path().join("mcp-run-cache-4999999")).unwrap();
        std::fs::write(d.path().join("mcp-run-cache-4999999/x"), "x").unwrap();
        let found = find(d.path(), d.path());
        assert_eq!(found, [d.path().join("mcp-run-cache-4999999")]);
        assert_eq!(sweep(d.path()), 1);
        assert!(find(d.path(), d.path()).is_empty());
    }
}

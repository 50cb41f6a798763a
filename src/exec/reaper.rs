//! The local backend's last line: a small process (`mcp-run reap-on-exit`, this binary
//! again) that outlives the gateway only to kill what the gateway's commands left behind.
//!
//! A SIGKILLed gateway runs no cleanup. Its direct children die with it
//! (`PR_SET_PDEATHSIG`), but their own children would be adopted by init and keep running.
//! The reaper holds the read end of a pipe whose write end only the gateway has: when the
//! gateway is gone, however it died, the read sees EOF and the reaper kills every process
//! tagged `MCP_RUN_RUN=<gateway pid>.` ([`RUN_TAG_VAR`]), then exits.
//! It is in its own process group, so a Ctrl-C meant for the gateway does not stop it first.

use std::io::Read;
use std::process::{Child, ChildStdin, Command, Stdio};

use nix::sys::signal::Signal;
use nix::unistd::Pid;

/// The variable that marks every process of a local command (`GATEWAY_PID.N`), so that those
/// that left its process group (`setsid`) can still be found and killed.
pub(crate) const RUN_TAG_VAR: &str = "MCP_RUN_RUN";

/// The hidden subcommand that runs [`run`].
pub(crate) const SUBCOMMAND: &str = "reap-on-exit";

/// The running reaper; dropping this (the gateway exits) lets it sweep and end.
pub(crate) struct Reaper {
    _child: Child,
    _pipe: ChildStdin,
}

impl Reaper {
    /// The reaper process's pid (a child of the gateway).
    pub(crate) fn pid(&self) -> u32 {
        self._child.id()
    }
}

/// Starts the reaper for this gateway's commands.
pub(crate) fn spawn() -> std::io::Result<Reaper> {
    use std::os::unix::process::CommandExt;
    let exe = std::env::current_exe()?;
    // Only the gateway binary has the subcommand (a test binary that builds the gateway in
    // process must not start itself).
    if !exe
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with("mcp-run"))
    {
        return Err(std::io::Error::other(format!(
            "{} is not the mcp-run binary",
            exe.display()
        )));
    }
    let mut child = Command::new(exe)
        .arg(SUBCOMMAND)
        .arg(format!("{}.", std::process::id()))
        .env_clear()
        // Where the gateway's directories are, for the sweep after it is gone.
        .env("TMPDIR", std::env::temp_dir())
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .process_group(0)
        .spawn()?;
    let pipe = child
        .stdin
        .take()
        .ok_or_else(|| std::io::Error::other("no pipe to the reaper"))?;
    Ok(Reaper {
        _child: child,
        _pipe: pipe,
    })
}

/// The reaper's body: waits for EOF on stdin, then kills every process tagged with
/// `prefix`, again until none is left (a process may fork while it is being killed).
pub(crate) fn run(prefix: &str) -> std::process::ExitCode {
    let mut sink = [0u8; 64];
    let mut stdin = std::io::stdin();
    while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
    for _ in 0..20 {
        if kill_tagged(prefix, false) == 0 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // Its commands' cgroups, and what the gateway could not remove (killed, or its
    // shutdown ran out of time).
    if let Ok(pid) = prefix.trim_end_matches('.').parse() {
        super::cgroup::sweep(pid);
    }
    crate::leftovers::sweep(&std::env::temp_dir());
    std::process::ExitCode::SUCCESS
}

/// Kills every process whose environment carries `MCP_RUN_RUN=` followed by `tag` (a whole
/// tag, or a gateway's prefix `PID.`): what left the process group (`setsid`, double fork)
/// but kept the environment. Only processes of the same user are readable, which is all a
/// command can start without privileges.
pub(crate) fn kill_tagged(tag: &str, exact: bool) -> usize {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let needle = format!("{RUN_TAG_VAR}={tag}");
    let mut killed = 0;
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(environ) = std::fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        let hit = environ
            .split(|&b| b == 0)
            .any(|var| var.starts_with(needle.as_bytes()) && (!exact || var.len() == needle.len()));
        if hit && nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL).is_ok() {
            killed += 1;
        }
    }
    killed
}

//! The local backend: each command is a child process of the gateway, in its own process
//! group, so that killing it (timeout, client gone, shutdown) kills everything it started.
//!
//! Semantics shared by every backend (see docs/protocol.md): the command runs as
//! `env -C CWD NAME=VALUE... EXECUTABLE ARGS...` would, with the exit codes of `env(1)` for
//! what fails before the program runs: 125 when the working directory cannot be entered,
//! 126 when the program cannot be invoked, 127 when it is not found.

use std::io::ErrorKind;
use std::os::unix::process::ExitStatusExt;
use std::process::Stdio;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use futures_util::future::BoxFuture;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::process::{Child, Command};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{EVENT_BUFFER, ExecSpec, Execution, Executor, StartOptions, forward, read_opt};
use crate::contract::{ErrorBody, ErrorCode, Event, ExitInfo, RunContext};

/// The local backend's section of the configuration (`local:`).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LocalConfig {
    /// Variables of the gateway's environment that every command inherits.
    pub inherit_env: Vec<String>,
}

impl Default for LocalConfig {
    fn default() -> Self {
        Self {
            inherit_env: DEFAULT_INHERIT_ENV.iter().map(|s| s.to_string()).collect(),
        }
    }
}

impl LocalConfig {
    /// `(field, message)` on failure.
    pub fn validate(&self) -> Result<(), (String, String)> {
        for name in &self.inherit_env {
            if !crate::contract::is_valid_env_name(name) {
                return Err((
                    "local.inherit_env".into(),
                    format!("contains an invalid variable name {name:?}"),
                ));
            }
        }
        Ok(())
    }
}

/// Variables of the gateway's own environment that commands inherit by default. Nothing
/// else leaks from the gateway (which may hold credentials) into commands.
pub const DEFAULT_INHERIT_ENV: &[&str] =
    &["PATH", "HOME", "USER", "LANG", "LC_ALL", "TZ", "TMPDIR"];

/// After the main process exited, how long to wait for its pipes to close.
const DRAIN_GRACE: Duration = Duration::from_secs(2);

/// Runs commands as local child processes.
pub struct LocalExecutor {
    base_env: Vec<(String, String)>,
    host: String,
    /// Profile names requests may give. Profiles describe pods; here they only select the
    /// policy's per-profile overrides.
    profiles: Vec<String>,
}

impl LocalExecutor {
    /// `inherit_env` names the gateway variables passed on to every command.
    pub fn new(inherit_env: &[String]) -> Self {
        let base_env = inherit_env
            .iter()
            .filter_map(|name| std::env::var(name).ok().map(|v| (name.clone(), v)))
            .collect();
        let host = nix::unistd::gethostname()
            .ok()
            .and_then(|h| h.into_string().ok())
            .unwrap_or_else(|| "localhost".into());
        Self {
            base_env,
            host,
            profiles: vec!["default".into()],
        }
    }

    /// Accepts these profile names (the configuration's `profiles`) besides `default`.
    pub fn with_profiles(mut self, names: impl IntoIterator<Item = String>) -> Self {
        for name in names {
            if !self.profiles.contains(&name) {
                self.profiles.push(name);
            }
        }
        self.profiles.sort();
        self
    }

    fn context(&self, pid: Option<u32>) -> RunContext {
        RunContext {
            backend: "local".into(),
            host: Some(self.host.clone()),
            pid,
            ..Default::default()
        }
    }

    /// `cancel` kills the command; it is a child of the caller's token, so that shutdown
    /// reaches it too.
    fn spawn(&self, spec: &ExecSpec, cancel: CancellationToken) -> Result<Execution, ErrorBody> {
        if let Some(cwd) = &spec.cwd {
            // Checked here because a failed chdir and a missing program are the same io error
            // once inside spawn().
            if let Err(e) = std::fs::read_dir(cwd) {
                return Ok(Execution::finished(
                    self.context(None),
                    format!(
                        "mcp-run: cannot change directory to {cwd:?}: {}\n",
                        io_reason(&e)
                    ),
                    125,
                ));
            }
        }
        let mut cmd = Command::new(&spec.executable);
        cmd.args(&spec.args)
            .env_clear()
            .envs(self.base_env.iter().map(|(k, v)| (k, v)))
            .envs(&spec.env)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        if let Some(cwd) = &spec.cwd {
            cmd.current_dir(cwd);
        }
        let child = match cmd.spawn() {
            Ok(child) => child,
            Err(e) => {
                let (code, what) = match e.kind() {
                    ErrorKind::NotFound => (127, "command not found".to_owned()),
                    ErrorKind::PermissionDenied => (126, "permission denied".to_owned()),
                    _ if e.raw_os_error() == Some(nix::libc::ENOEXEC) => {
                        (126, "exec format error".to_owned())
                    }
                    _ if e.raw_os_error() == Some(nix::libc::EISDIR) => {
                        (126, "is a directory".to_owned())
                    }
                    _ => {
                        return Err(ErrorBody::new(
                            ErrorCode::StartFailed,
                            format!("cannot start {:?}: {e}", spec.executable),
                        ));
                    }
                };
                return Ok(Execution::finished(
                    self.context(None),
                    format!("mcp-run: {}: {what}\n", spec.executable),
                    code,
                ));
            }
        };
        let pid = child.id();
        let (tx, rx) = mpsc::channel(EVENT_BUFFER);
        tokio::spawn(supervise(child, tx, cancel.clone()));
        Ok(Execution::new(self.context(pid), rx, cancel))
    }
}

fn io_reason(e: &std::io::Error) -> String {
    match e.kind() {
        ErrorKind::NotFound => "no such file or directory".into(),
        ErrorKind::NotADirectory => "not a directory".into(),
        ErrorKind::PermissionDenied => "permission denied".into(),
        _ => e.to_string(),
    }
}

impl Executor for LocalExecutor {
    fn name(&self) -> &'static str {
        "local"
    }

    fn start(
        &self,
        spec: ExecSpec,
        opts: StartOptions,
    ) -> BoxFuture<'_, Result<Execution, ErrorBody>> {
        Box::pin(async move { self.spawn(&spec, opts.cancel.child_token()) })
    }

    /// Profiles are the configured names (`default` always).
    fn check(&self, spec: &ExecSpec) -> Result<(), ErrorBody> {
        match spec.profile.as_deref() {
            None => Ok(()),
            Some(p) if self.profiles.iter().any(|n| n == p) => Ok(()),
            Some(other) => Err(ErrorBody::new(
                ErrorCode::UnknownProfile,
                format!(
                    "unknown profile {other:?}; configured profiles: {}",
                    self.profiles.join(", ")
                ),
            )),
        }
    }

    fn capabilities(&self) -> BoxFuture<'_, crate::capabilities::BackendCapabilities> {
        Box::pin(async move {
            crate::capabilities::BackendCapabilities {
                backend: "local".into(),
                safety_level: "host-process".into(),
                description: format!(
                    "Commands run as processes of the gateway on host {} (no isolation: they see the host's files and network).",
                    self.host
                ),
                host: Some(self.host.clone()),
                profiles: self
                    .profiles
                    .iter()
                    .map(|name| crate::capabilities::ProfileInfo {
                        name: name.clone(),
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            }
        })
    }
}

/// Kills the whole process group of a command; it is gone already when this fails.
fn kill_group(pgid: Option<u32>) {
    if let Some(pid) = pgid.and_then(|p| i32::try_from(p).ok()) {
        let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
    }
}

/// Reads both pipes into the event channel until the command ended and its pipes closed,
/// then reports the exit. Owns the child, so the child is always reaped.
async fn supervise(mut child: Child, tx: mpsc::Sender<Event>, cancel: CancellationToken) {
    let started = Instant::now();
    let pgid = child.id();
    let mut stdout = child.stdout.take();
    let mut stderr = child.stderr.take();
    let mut out_buf = BytesMut::new();
    let mut err_buf = BytesMut::new();
    let mut status = None;
    let mut duration = Duration::ZERO;
    let mut killed = false;
    let drain_deadline = tokio::time::sleep(Duration::MAX / 4);
    tokio::pin!(drain_deadline);

    while status.is_none() || stdout.is_some() || stderr.is_some() {
        tokio::select! {
            _ = cancel.cancelled(), if !killed => {
                kill_group(pgid);
                killed = true;
            }
            n = read_opt(&mut stdout, &mut out_buf) => {
                if !forward(n, &mut stdout, &mut out_buf, &tx, |data| Event::Stdout { data }).await {
                    cancel.cancel();
                }
            }
            n = read_opt(&mut stderr, &mut err_buf) => {
                if !forward(n, &mut stderr, &mut err_buf, &tx, |data| Event::Stderr { data }).await {
                    cancel.cancel();
                }
            }
            s = child.wait(), if status.is_none() => {
                duration = started.elapsed();
                status = Some(s);
                // Whatever the command left running in its group goes with it: nothing is
                // orphaned, and its pipes close so that the drain below ends.
                kill_group(pgid);
                drain_deadline.as_mut().reset(tokio::time::Instant::now() + DRAIN_GRACE);
            }
            _ = &mut drain_deadline, if status.is_some() => {
                // A process that left the group still holds a pipe: stop reading.
                break;
            }
        }
    }

    let info = match status {
        Some(Ok(s)) => ExitInfo {
            code: s.code(),
            signal: s.signal(),
            duration_ms: duration.as_millis() as u64,
            timed_out: false,
        },
        _ => {
            let _ = tx
                .send(Event::Error {
                    code: ErrorCode::Internal,
                    message: "cannot wait for the command".into(),
                })
                .await;
            return;
        }
    };
    let _ = tx.send(Event::Exit(info)).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn spec(exe: &str, args: &[&str]) -> ExecSpec {
        ExecSpec {
            executable: exe.into(),
            args: args.iter().map(|s| s.to_string()).collect(),
            cwd: None,
            env: BTreeMap::new(),
            timeout: Duration::from_secs(10),
            profile: None,
        }
    }

    async fn run(spec: ExecSpec) -> (Vec<u8>, Vec<u8>, ExitInfo) {
        let ex = LocalExecutor::new(&["PATH".to_string()]);
        let mut e = ex.start(spec, StartOptions::default()).await.unwrap();
        let (mut out, mut err) = (vec![], vec![]);
        loop {
            match e.next().await {
                Some(Event::Stdout { data }) => out.extend_from_slice(&data),
                Some(Event::Stderr { data }) => err.extend_from_slice(&data),
                Some(Event::Exit(info)) => return (out, err, info),
                other => panic!("unexpected {other:?}"),
            }
        }
    }

    #[tokio::test]
    async fn runs_and_reports_codes() {
        let (out, err, info) = run(spec("sh", &["-c", "echo out; echo err >&2; exit 3"])).await;
        assert_eq!(
            (out.as_slice(), err.as_slice(), info.code),
            (&b"out\n"[..], &b"err\n"[..], Some(3))
        );
    }

    #[tokio::test]
    async fn missing_program_is_127_and_bad_cwd_is_125() {
        let (_, err, info) = run(spec("definitely-not-a-program-xyz", &[])).await;
        assert_eq!(info.code, Some(127));
        assert!(String::from_utf8_lossy(&err).contains("command not found"));
        let mut s = spec("true", &[]);
        s.cwd = Some("/nonexistent/dir".into());
        let (_, err, info) = run(s).await;
        assert_eq!(info.code, Some(125));
        assert!(String::from_utf8_lossy(&err).contains("/nonexistent/dir"));
        let (_, _, info) = run(spec("/etc/hostname", &[])).await;
        assert_eq!(info.code, Some(126));
    }

    #[tokio::test]
    async fn env_is_clean() {
        // SAFETY: tests in this module do not read this variable concurrently.
        unsafe { std::env::set_var("MCP_RUN_TEST_SECRET", "x") };
        let mut s = spec("env", &[]);
        s.env.insert("ASKED".into(), "yes".into());
        let (out, _, _) = run(s).await;
        let out = String::from_utf8(out).unwrap();
        assert!(out.contains("ASKED=yes"));
        assert!(!out.contains("MCP_RUN_TEST_SECRET"));
    }

    #[tokio::test]
    async fn background_processes_do_not_hold_the_run_open() {
        let t = Instant::now();
        let (_, _, info) = run(spec("sh", &["-c", "sleep 30 & echo started"])).await;
        assert_eq!(info.code, Some(0));
        assert!(t.elapsed() < Duration::from_secs(10));
    }
}

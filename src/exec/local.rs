//! The local backend: each command is a child process of the gateway, in its own process
//! group, so that killing it (timeout, client gone, shutdown) kills everything it started.
//!
//! Semantics shared by every backend (see docs/protocol.md): the command runs as
//! `env -C CWD NAME=VALUE... EXECUTABLE ARGS...` would, with the exit codes of `env(1)` for
//! what fails before the program runs: 125 when the working directory cannot be entered,
//! 126 when the program cannot be invoked, 127 when it is not found.
//!
//! Size: about 620 lines of code: one process's whole life (spawn with its limits checked,
//! stdin feeding, pipe reading, the group kill and reaping, the workspace directory), which
//! the supervisor loop ties together.

use std::io::ErrorKind;
use std::os::unix::process::ExitStatusExt;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures_util::future::BoxFuture;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::io::AsyncWriteExt;
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::mpsc;
use tokio_util::sync::{CancellationToken, DropGuard};

use super::{EVENT_BUFFER, ExecSpec, Execution, Executor, StartOptions, read_opt};

mod budget;
mod kept;
mod orphans;
use crate::contract::{ErrorBody, ErrorCode, Event, ExitInfo, RunContext};

/// The local backend's section of the configuration (`local:`).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LocalConfig {
    /// Variables of the gateway's environment that every command inherits.
    pub inherit_env: Vec<String>,
    /// Accept several identities (auth tokens with different names) although every command
    /// runs as the gateway's user, so that one identity's commands can read what another's
    /// leave in their trees and the content cache (docs/policy.md, "The local backend").
    /// Off: the gateway refuses to start with more than one identity on this backend.
    pub allow_multiple_identities: bool,
}

impl Default for LocalConfig {
    fn default() -> Self {
        Self {
            inherit_env: DEFAULT_INHERIT_ENV.iter().map(|s| s.to_string()).collect(),
            allow_multiple_identities: false,
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
pub(crate) const DEFAULT_INHERIT_ENV: &[&str] =
    &["PATH", "HOME", "USER", "LANG", "LC_ALL", "TZ", "TMPDIR"];

/// The capacity asked for the command's pipes (Linux' default is 64 KiB): a reader that
/// wakes up less often, and a command that runs ahead while the gateway sends.
const PIPE_SIZE: nix::libc::c_int = 1024 * 1024;

/// After the main process exited, how long to wait for its pipes to close.
const DRAIN_GRACE: Duration = Duration::from_secs(2);

pub(crate) use super::reaper::{RUN_TAG_VAR, kill_tagged};

/// Runs commands as local child processes.
pub(crate) struct LocalExecutor {
    base_env: Vec<(String, String)>,
    /// The gateway's own `PATH`: bare executable names are looked up there, never in the
    /// request's `PATH` (which would let a request pick what an allowed name runs).
    path: Option<std::ffi::OsString>,
    host: String,
    /// Kills what commands left behind if the gateway dies without cleaning up; with it the
    /// gateway is a child subreaper ([`orphans`]).
    _reaper: Option<orphans::Guard>,
    /// Profile names requests may give. Profiles describe pods; here they only select the
    /// policy's per-profile overrides.
    profiles: Vec<String>,
    /// Where runs' workspaces are written, and the trees kept between runs.
    trees: Arc<crate::workspace::trees::Trees>,
    /// The profiles' cache directories (docs/caches.md).
    caches: Option<Arc<super::cache::local::LocalCaches>>,
    /// `workspaces.max_local_inodes`, which sessions' directories count against too.
    inodes: Option<budget::Pool>,
}

impl LocalExecutor {
    /// `inherit_env` names the gateway variables passed on to every command.
    pub(crate) fn new(inherit_env: &[String]) -> Self {
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
            path: std::env::var_os("PATH"),
            _reaper: None,
            host,
            profiles: vec!["default".into()],
            trees: Arc::new(crate::workspace::trees::Trees::new(
                std::env::temp_dir(),
                0,
                Duration::ZERO,
            )),
            caches: None,
            inodes: None,
        }
    }

    /// Keeps the caches the profiles declare in directories (see [`super::cache::local`]).
    pub(crate) fn with_caches(
        mut self,
        caches: Option<Arc<super::cache::local::LocalCaches>>,
    ) -> Self {
        self.caches = caches;
        self
    }

    /// Starts the reaper process ([`super::reaper`]) so that descendants of commands die
    /// even when the gateway is SIGKILLed; without it (it could not start) only the direct
    /// children do. With it, the gateway becomes a child subreaper: what escapes a command's
    /// process group and tag is killed when its run ends ([`orphans`]).
    pub(crate) fn with_reaper(mut self) -> Self {
        match super::reaper::spawn() {
            Ok(r) => self._reaper = Some(orphans::Guard::new(r)),
            Err(e) => tracing::warn!(
                "cannot start the reaper process ({e}): if the gateway is killed, processes that commands started in the background may survive it"
            ),
        }
        self
    }

    /// Writes runs' workspaces below `cfg.local_dir`, keeping `cfg.local_idle_trees` trees
    /// between runs (docs/workspaces.md).
    pub(crate) fn with_workspaces(mut self, cfg: &crate::workspace::WorkspaceConfig) -> Self {
        self.trees = Arc::new(crate::workspace::trees::Trees::new(
            cfg.local_dir(),
            cfg.local_idle_trees,
            Duration::from_secs(cfg.max_age_secs),
        ));
        self.inodes = Some(budget::Pool {
            budget: crate::limits::shared_budget(&cfg.local_dir(), cfg.max_local_inodes),
            max: cfg.max_local_inodes,
        });
        self
    }

    /// Brings a tree to the workspace (an idle one from an earlier run, else a fresh one),
    /// then starts the command in it; the tree is cleaned of the run's output when the
    /// command has ended (after sync-back).
    async fn start_in_workspace(
        &self,
        mut spec: ExecSpec,
        run: crate::workspace::WorkspaceRun,
        cancel: CancellationToken,
        stdin: Option<mpsc::Receiver<Bytes>>,
    ) -> Result<Execution, LocalError> {
        let trees = self.trees.clone();
        let tree =
            tokio::task::spawn_blocking(move || crate::workspace::local::materialize(&run, &trees))
                .await
                .map_err(LocalError::Materialising)??;
        spec.cwd = Some(
            tree.cwd
                .to_str()
                .map(str::to_owned)
                .ok_or(LocalError::WorkspaceNotUtf8)?,
        );
        self.spawn(&spec, cancel, stdin, Some(tree))
    }

    /// Accepts these profile names (the configuration's `profiles`) besides `default`.
    pub(crate) fn with_profiles(mut self, names: impl IntoIterator<Item = String>) -> Self {
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
    fn spawn(
        &self,
        spec: &ExecSpec,
        cancel: CancellationToken,
        stdin: Option<mpsc::Receiver<Bytes>>,
        tree: Option<crate::workspace::local::LocalTree>,
    ) -> Result<Execution, LocalError> {
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
        let program = if spec.executable.contains('/') {
            std::path::PathBuf::from(&spec.executable)
        } else {
            match lookup(&spec.executable, self.path.as_deref()) {
                Some(p) => p,
                None => {
                    return Ok(Execution::finished(
                        self.context(None),
                        format!("mcp-run: {}: command not found\n", spec.executable),
                        127,
                    ));
                }
            }
        };
        let tag = next_tag();
        let mut cmd = Command::new(&program);
        cmd.arg0(&spec.executable)
            .args(&spec.args)
            .env_clear()
            .envs(self.base_env.iter().map(|(k, v)| (k, v)))
            .envs(&spec.env)
            .env(RUN_TAG_VAR, &tag)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        if let Some(cwd) = &spec.cwd {
            cmd.current_dir(cwd);
        }
        let gateway = nix::unistd::getpid();
        // Its own cgroup where the machine allows: nothing it starts can leave it.
        let cgroup = super::cgroup::for_run(&tag);
        // SAFETY: only async-signal-safe calls (prctl, getppid, open/write) between fork and
        // exec.
        unsafe {
            cmd.pre_exec(move || {
                if let Some(cg) = &cgroup {
                    cg.enter();
                }
                // The command dies with the gateway, even on SIGKILL (no cleanup runs then).
                nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
                if nix::unistd::getppid() != gateway {
                    // The gateway died before the line above: nobody would kill us.
                    return Err(std::io::Error::other("the gateway is gone"));
                }
                Ok(())
            });
        }
        let (mut child, run) = match orphans::spawn(&mut cmd) {
            Ok(started) => started,
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
                    _ if e.raw_os_error() == Some(nix::libc::E2BIG) => {
                        return Err(LocalError::E2big);
                    }
                    _ => {
                        return Err(LocalError::CannotStart {
                            executable: spec.executable.clone(),
                            source: e,
                        });
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
        if let Some(p) = &child.stdout {
            enlarge_pipe(p);
        }
        if let Some(p) = &child.stderr {
            enlarge_pipe(p);
        }
        if let Some(p) = &child.stdin {
            enlarge_pipe(p);
        }
        let (tx, rx) = mpsc::channel(EVENT_BUFFER);
        // Stops feeding stdin when the run ends (the supervisor is done) or is cancelled.
        let fed = cancel.child_token();
        if let (Some(pipe), Some(input)) = (child.stdin.take(), stdin) {
            tokio::spawn(feed_stdin(pipe, input, fed.clone()));
        }
        tokio::spawn(supervise(
            child,
            tx,
            cancel.clone(),
            fed.drop_guard(),
            tag,
            run,
        ));
        let mut context = self.context(pid);
        let rx = match tree {
            Some(tree) => {
                context.workspace = Some(tree.workspace_id().to_owned());
                context.workspace_version = Some(tree.workspace_version().to_owned());
                crate::workspace::local::relay(rx, tree)
            }
            None => rx,
        };
        Ok(Execution::new(context, rx, cancel))
    }
}

/// Best effort: a pipe keeps its size when the system refuses (`fs.pipe-max-size`, or the
/// user's pipe quota).
fn enlarge_pipe(pipe: &impl std::os::fd::AsFd) {
    let _ = nix::fcntl::fcntl(pipe, nix::fcntl::FcntlArg::F_SETPIPE_SZ(PIPE_SIZE));
}

/// Linux's limit on one argument or environment string (`MAX_ARG_STRLEN`, 32 pages).
const MAX_ARG_STRLEN: usize = 32 * 4096;

/// Why the local backend did not start a command or keep a runner.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LocalError {
    /// The blocking task that materialises a workspace panicked or was cancelled.
    #[error("materialising failed: {0}")]
    Materialising(tokio::task::JoinError),
    /// The same for a session's tree.
    #[error("sync failed: {0}")]
    Syncing(tokio::task::JoinError),
    #[error(transparent)]
    Tree(#[from] crate::workspace::trees::TreeError),
    #[error("the workspace directory is not valid UTF-8 (local.workspace_dir)")]
    WorkspaceNotUtf8,
    #[error("the session's directory is not valid UTF-8 (TMPDIR)")]
    SessionNotUtf8,
    #[error("cannot make the session's directory in {}: {source}", base.display())]
    SessionDir {
        base: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("the arguments and environment are over the operating system's limit (E2BIG)")]
    E2big,
    #[error("cannot start {executable:?}: {source}")]
    CannotStart {
        executable: String,
        source: std::io::Error,
    },
    /// One string over [`MAX_ARG_STRLEN`]: `which` is `executable` or `args[i]`.
    #[error(
        "{which} is {len} bytes, over the operating system's limit of {} bytes for one argument",
        MAX_ARG_STRLEN - 1
    )]
    ArgTooLong { which: String, len: usize },
    #[error(
        "environment variable {name} is over the operating system's limit of {} bytes for one variable",
        MAX_ARG_STRLEN - 1
    )]
    EnvTooLong { name: String },
    #[error(
        "the arguments and environment take {total} bytes, over the operating system's limit of {arg_max} (ARG_MAX)"
    )]
    ArgMax { total: usize, arg_max: usize },
    /// `profiles`: the configured names, joined.
    #[error("unknown profile {name:?}; configured profiles: {profiles}")]
    UnknownProfile { name: String, profiles: String },
    #[error(
        "the session's directory holds {n} files and directories, more than the {max} this gateway's runs and sessions may hold at once (workspaces.max_local_inodes): end the session"
    )]
    SessionTooLarge { n: u64, max: u64 },
    #[error(
        "the session's directory holds {n} files and directories, and runs in progress and other sessions hold the rest of the {max} this gateway allows at once (workspaces.max_local_inodes): retry when they end, or end the session"
    )]
    SessionBudgetFull { n: u64, max: u64 },
}

impl LocalError {
    fn code(&self) -> ErrorCode {
        match self {
            LocalError::Tree(e) => e.code(),
            LocalError::Materialising(_) | LocalError::Syncing(_) => ErrorCode::Internal,
            LocalError::WorkspaceNotUtf8
            | LocalError::SessionNotUtf8
            | LocalError::SessionDir { .. }
            | LocalError::CannotStart { .. } => ErrorCode::StartFailed,
            LocalError::ArgTooLong { .. } | LocalError::EnvTooLong { .. } => {
                ErrorCode::InvalidRequest
            }
            LocalError::E2big | LocalError::ArgMax { .. } | LocalError::SessionTooLarge { .. } => {
                ErrorCode::PayloadTooLarge
            }
            LocalError::UnknownProfile { .. } => ErrorCode::UnknownProfile,
            LocalError::SessionBudgetFull { .. } => ErrorCode::TooManyRequests,
        }
    }
}

impl From<LocalError> for ErrorBody {
    fn from(e: LocalError) -> Self {
        ErrorBody::new(e.code(), e.to_string())
    }
}

impl LocalExecutor {
    /// What `execve` would refuse with E2BIG, refused before anything starts: one string over
    /// [`MAX_ARG_STRLEN`] (400), or argv and environment together over `ARG_MAX` (413).
    fn check_exec_size(&self, spec: &ExecSpec) -> Result<(), LocalError> {
        let args = std::iter::once(&spec.executable).chain(&spec.args);
        if let Some((i, a)) = args
            .clone()
            .enumerate()
            .find(|(_, a)| a.len() + 1 > MAX_ARG_STRLEN)
        {
            let which = if i == 0 {
                "executable".to_owned()
            } else {
                format!("args[{}]", i - 1)
            };
            return Err(LocalError::ArgTooLong {
                which,
                len: a.len(),
            });
        }
        let env = self.base_env.iter().map(|(k, v)| (k, v)).chain(&spec.env);
        if let Some((k, _)) = env
            .clone()
            .find(|(k, v)| k.len() + v.len() + 2 > MAX_ARG_STRLEN)
        {
            return Err(LocalError::EnvTooLong { name: k.clone() });
        }
        // What the kernel counts: each string with its NUL, and a pointer to each.
        let ptr = std::mem::size_of::<usize>();
        let total: usize = args.map(|a| a.len() + 1 + ptr).sum::<usize>()
            + env.map(|(k, v)| k.len() + v.len() + 2 + ptr).sum::<usize>()
            + RUN_TAG_VAR.len()
            + 32
            + ptr;
        // SAFETY: sysconf has no preconditions.
        let arg_max = unsafe { nix::libc::sysconf(nix::libc::_SC_ARG_MAX) };
        let arg_max = usize::try_from(arg_max)
            .unwrap_or(128 * 1024)
            .max(128 * 1024);
        if total > arg_max {
            return Err(LocalError::ArgMax { total, arg_max });
        }
        Ok(())
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
        Box::pin(async move {
            let mut spec = spec;
            let hold = match &self.caches {
                Some(c) => c.acquire(&spec, &opts.progress, &opts.cancel).await?,
                None => None,
            };
            if let Some(h) = &hold {
                super::cache::merge_env(&mut spec.env, h.env());
            }
            let cancel = opts.cancel.child_token();
            let started = match spec.workspace.clone() {
                Some(run) => self.start_in_workspace(spec, run, cancel, opts.stdin).await,
                None => self.spawn(&spec, cancel, opts.stdin, None),
            };
            match (started, hold) {
                (Ok(mut e), Some(h)) => {
                    e.context_mut().caches = h.states();
                    Ok(e.hold(h))
                }
                (started, _) => Ok(started?),
            }
        })
    }

    fn supports_workspaces(&self) -> bool {
        true
    }

    fn keeps_runners(&self) -> bool {
        true
    }

    /// A private directory that lives across commands ([`kept`]).
    fn keep(
        &self,
        _spec: &ExecSpec,
        _keep: super::KeepFor,
        _opts: StartOptions,
    ) -> BoxFuture<'_, Result<Arc<dyn super::KeptRunner>, ErrorBody>> {
        Box::pin(async move {
            let kept = self.keep_local()?;
            // Its directory counts against workspaces.max_local_inodes while it lives.
            let kept = budget::Budgeted::new(kept, self.inodes.clone())?;
            Ok(Arc::new(kept) as Arc<dyn super::KeptRunner>)
        })
    }

    /// Profiles are the configured names (`default` always).
    fn check(&self, spec: &ExecSpec) -> Result<(), ErrorBody> {
        self.check_exec_size(spec)?;
        match spec.profile.as_deref() {
            None => Ok(()),
            Some(p) if self.profiles.iter().any(|n| n == p) => Ok(()),
            Some(other) => Err(LocalError::UnknownProfile {
                name: other.to_owned(),
                profiles: self.profiles.join(", "),
            }
            .into()),
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
                        caches: self
                            .caches
                            .as_ref()
                            .map(|c| c.info(name))
                            .unwrap_or_default(),
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            }
        })
    }
}

/// Looks a bare program name up in `path` (the gateway's `PATH`), as `execvp` would.
fn lookup(name: &str, path: Option<&std::ffi::OsStr>) -> Option<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    std::env::split_paths(path?)
        .filter(|dir| !dir.as_os_str().is_empty())
        .map(|dir| dir.join(name))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// A tag unique to one command of this gateway: `GATEWAY_PID.N`.
fn next_tag() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{}.{n}", std::process::id())
}

/// Kills the whole process group of a command; it is gone already when this fails.
fn kill_group(pgid: Option<u32>) {
    if let Some(pid) = pgid.and_then(|p| i32::try_from(p).ok()) {
        let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
    }
}

/// Writes the caller's stdin into the command's, chunk by chunk: awaiting the pipe is the
/// back-pressure on the caller. The end of the caller's input closes the pipe (EOF). A command
/// that closed its stdin or exited (EPIPE) simply gets no more, and dropping the receiver
/// tells the caller so; that is not an error of the run.
async fn feed_stdin(
    mut pipe: ChildStdin,
    mut input: mpsc::Receiver<Bytes>,
    stop: CancellationToken,
) {
    loop {
        let chunk = tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            c = input.recv() => c,
        };
        let Some(chunk) = chunk else { return };
        tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            written = pipe.write_all(&chunk) => if written.is_err() { return },
        }
    }
}

/// Kills a command's group and whatever escaped it, off the async threads.
fn kill_all(pgid: Option<u32>, tag: &str) {
    kill_group(pgid);
    super::cgroup::kill(tag);
    let tag = tag.to_owned();
    tokio::task::spawn_blocking(move || {
        let n = kill_tagged(&tag, true);
        if n > 0 {
            tracing::debug!(
                killed = n,
                "killed processes that had left the command's group"
            );
        }
    });
}

/// One read from a pipe as an event; `None` at EOF or on error (the pipe is then closed).
fn chunk<R>(
    n: std::io::Result<usize>,
    pipe: &mut Option<R>,
    buf: &mut BytesMut,
    make: impl FnOnce(bytes::Bytes) -> Event,
) -> Option<Event> {
    match n {
        Ok(0) | Err(_) => {
            *pipe = None;
            None
        }
        Ok(_) => Some(make(buf.split().freeze())),
    }
}

/// Reads both pipes into the event channel until the command ended and its pipes closed,
/// then reports the exit. Owns the child, so the child is always reaped.
///
/// At most one event waits for the consumer, and waiting for it is one branch of the loop
/// among the others: a consumer that stops reading holds the pipes (back-pressure) but never
/// keeps the kill, the reaping or the exit from happening.
async fn supervise(
    mut child: Child,
    tx: mpsc::Sender<Event>,
    cancel: CancellationToken,
    _stdin_stop: DropGuard,
    tag: String,
    mut run: orphans::Run,
) {
    let started = Instant::now();
    let pgid = child.id();
    let mut stdout = child.stdout.take();
    let mut stderr = child.stderr.take();
    let mut out_buf = BytesMut::new();
    let mut err_buf = BytesMut::new();
    let mut pending: Option<Event> = None;
    let mut gone = false;
    let mut status = None;
    let mut duration = Duration::ZERO;
    let mut killed = false;
    let drain_deadline = tokio::time::sleep(Duration::MAX / 4);
    tokio::pin!(drain_deadline);

    while status.is_none() || stdout.is_some() || stderr.is_some() || pending.is_some() {
        tokio::select! {
            _ = cancel.cancelled(), if !killed => {
                // The group id is only ours while the leader is unreaped (see below).
                kill_all(pgid.filter(|_| status.is_none()), &tag);
                killed = true;
            }
            permit = tx.reserve(), if pending.is_some() => {
                match permit {
                    Ok(permit) => {
                        if let Some(event) = pending.take() {
                            permit.send(event);
                        }
                        if status.is_some() {
                            drain_deadline.as_mut().reset(tokio::time::Instant::now() + DRAIN_GRACE);
                        }
                    }
                    Err(_) => {
                        // The consumer is gone: kill, and drop the output from now on.
                        pending = None;
                        gone = true;
                        cancel.cancel();
                    }
                }
            }
            n = read_opt(&mut stdout, &mut out_buf), if pending.is_none() => {
                pending = chunk(n, &mut stdout, &mut out_buf, |data| Event::Stdout { data }).filter(|_| !gone);
            }
            n = read_opt(&mut stderr, &mut err_buf), if pending.is_none() => {
                pending = chunk(n, &mut stderr, &mut err_buf, |data| Event::Stderr { data }).filter(|_| !gone);
            }
            s = child.wait(), if status.is_none() => {
                duration = started.elapsed();
                status = Some(s);
                run.reaped();
                // Whatever the command left running goes with it: nothing is orphaned, and
                // its pipes close so that the drain below ends. Not by its process group:
                // the leader is reaped now, and an empty group's id may already belong to
                // another process (pids wrap quickly on a busy machine); the tag is ours
                // only, and what stays in the group carries it.
                kill_all(None, &tag);
                drain_deadline.as_mut().reset(tokio::time::Instant::now() + DRAIN_GRACE);
            }
            _ = &mut drain_deadline, if status.is_some() && pending.is_none() => {
                // A process that escaped the kill still holds a pipe: stop reading.
                break;
            }
        }
    }

    super::cgroup::release(&tag);
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
            workspace: None,
            ..ExecSpec::default()
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
        // A file without execute permission (not /etc/hostname: some systems mark it
        // executable, and then it runs as a script, as with env(1)).
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("data");
        std::fs::write(&file, "x\n").unwrap();
        let (_, _, info) = run(spec(file.to_str().unwrap(), &[])).await;
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

//! The execution interface: one trait, several backends.
//!
//! A backend turns an [`ExecSpec`] into a running [`Execution`]: where it runs
//! ([`RunContext`]) and a bounded channel of [`Event`]s (`stdout`, `stderr`, then exactly one
//! terminal `exit` or `error`). Everything that is the same for every backend lives here
//! and in [`crate::runner`], written once: the timeout, cancellation when the consumer goes
//! away, the guarantee of exactly one terminal event.
//!
//! Contract for backends:
//! - send output in the order it was read, per stream, on a bounded channel, awaiting
//!   capacity (that is the back-pressure from the client down to the command's pipes);
//! - when the [`CancellationToken`] fires, kill the command (and its pod), then still send
//!   the `exit` event if the receiver is there;
//! - when the receiver is gone, kill the command and clean up.
//!
//! Size: about 420 lines of code; the rest are the unit tests of `Execution`'s timeout, kill
//! and filter semantics, kept beside it.

pub(crate) mod cache;
pub(crate) mod cgroup;
pub(crate) mod kube;
pub(crate) mod local;
pub(crate) mod reaper;
pub(crate) mod remote;
pub(crate) mod steps;

use std::collections::BTreeMap;
use std::pin::Pin;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures_util::future::BoxFuture;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::sync::mpsc;
use tokio::time::Sleep;
use tokio_util::sync::{CancellationToken, DropGuard};
use tokio_util::task::task_tracker::TaskTrackerToken;

use crate::contract::{ErrorBody, ErrorCode, Event, ExitInfo, RunContext};

/// How many events a backend may queue ahead of the consumer. With 256 KiB reads this bounds
/// the memory of one execution to about a MiB whatever the output size.
pub(crate) const EVENT_BUFFER: usize = 4;

/// The size of one read from a command's output. Large reads (with pipes enlarged to match,
/// see `local`) mean fewer events, syscalls and wake-ups per byte: the per-chunk costs, not
/// the copies, dominated the throughput with 64 KiB.
pub(crate) const READ_CHUNK: usize = 256 * 1024;

/// What to run, after the gateway resolved defaults and checked limits.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExecSpec {
    pub executable: String,
    pub args: Vec<String>,
    pub cwd: Option<String>,
    pub env: BTreeMap<String, String>,
    pub timeout: Duration,
    /// The runner profile; `None` means the backend's default.
    pub profile: Option<String>,
    /// The caller's tree to run in (`cwd` is then unset: the backend resolves the
    /// workspace's directory). Only backends whose [`Executor::supports_workspaces`] is true
    /// get one.
    pub workspace: Option<crate::workspace::WorkspaceRun>,
    /// The caller's identity (`None` with auth off): whose caches the run may use.
    pub owner: Option<String>,
    /// The request's `cache_scope` (see [`cache`]).
    pub cache_scope: Option<String>,
    /// Only for a backend that [`Executor::forwards_sessions`] (a remote gateway): the
    /// session to run in there, already made unique per caller. Other backends get sessions
    /// as a [`KeptRunner`] instead.
    pub session: Option<String>,
    pub session_busy: Option<crate::contract::SessionBusy>,
    /// Only for a backend that [`Executor::forwards_sessions`]: a multi-step run's steps
    /// (each checked by this gateway already), run there in one runner; `executable` and
    /// `args` are then unused. Other backends run steps in a [`KeptRunner`].
    pub steps: Vec<crate::contract::Step>,
    pub continue_on_error: bool,
}

/// What a caller hands a backend besides the spec: the cancellation token, where to report
/// start-up phases, and the command's standard input.
#[derive(Default)]
pub struct StartOptions {
    /// Fires when the caller gives up (client gone, shutdown): a backend that is still
    /// preparing (creating a pod) must stop and clean up.
    pub cancel: CancellationToken,
    /// Where the backend reports phases while it prepares the command.
    pub progress: Progress,
    /// The command's standard input, chunk by chunk in order; end of input when the sender is
    /// dropped. `None`: the command's stdin is closed (empty), as before stdin existed.
    pub stdin: Option<mpsc::Receiver<Bytes>>,
}

impl StartOptions {
    pub fn new(cancel: CancellationToken) -> Self {
        Self {
            cancel,
            ..Self::default()
        }
    }
}

/// A backend's start-up phases on their way to whoever waits (the `/raw` stream, MCP
/// progress notifications, `run-remote`'s status line). Advisory: a phase that finds the
/// queue full or nobody listening is dropped, so reporting never blocks a backend.
#[derive(Debug, Clone, Default)]
pub struct Progress(Option<mpsc::Sender<Event>>);

/// How many phases may wait for the consumer before new ones are dropped.
pub(crate) const PROGRESS_BUFFER: usize = 16;

impl Progress {
    /// A progress sink and the receiver of its `phase` events.
    pub fn channel() -> (Self, mpsc::Receiver<Event>) {
        let (tx, rx) = mpsc::channel(PROGRESS_BUFFER);
        (Self(Some(tx)), rx)
    }

    /// Whether anybody listens (a front end that shows phases); backends that must ask for
    /// phases (a remote gateway) ask only then.
    pub fn is_active(&self) -> bool {
        self.0.as_ref().is_some_and(|tx| !tx.is_closed())
    }

    /// Reports a phase, with an optional detail (the scheduler's or kubelet's message).
    pub fn report(&self, phase: crate::contract::Phase, message: Option<String>) {
        if let Some(tx) = &self.0 {
            let _ = tx.try_send(Event::Phase { phase, message });
        }
    }
}

/// Whom a kept runner belongs to and until when. Backends that make objects (a session's
/// pod) label them with it, so that any gateway replica finds the runner by its labels and
/// the reaper deletes it once it expired, even after the gateway that made it was killed.
#[derive(Debug, Clone)]
pub struct KeepFor {
    /// A hash of the owner's identity (never the identity itself: labels are readable).
    pub owner: String,
    /// A hash of the session's name and owner.
    pub name: String,
    /// When the runner must be gone at the latest (its maximum lifetime), whatever happens
    /// to the gateway.
    pub expires_at: std::time::SystemTime,
    /// A session's name and idle TTL, when any replica may serve it (a multi-step run's
    /// runner has none: it is nobody else's to find).
    pub session: Option<(String, Duration)>,
    /// The first call's timeout: how long that call holds the runner.
    pub first_call: Duration,
}

/// Why a kept runner is gone ([`KeptRunner::check`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Gone {
    /// Lost: its pod was evicted or deleted, its node went, its directory was removed.
    Lost(String),
    /// Another replica ended it at its owner's request: the name is free again.
    Ended,
    /// Another replica ended it at its idle TTL or maximum lifetime (the reason).
    Expired(String),
}

/// A session's runner found by its labels (made by another replica, or by this one before
/// it restarted), with what its objects say about the session.
pub struct FoundRunner {
    pub runner: std::sync::Arc<dyn KeptRunner>,
    pub profile: String,
    pub opened: std::time::SystemTime,
    pub expires_at: std::time::SystemTime,
    pub idle_ttl: Duration,
    pub last_used: Option<std::time::SystemTime>,
}

/// A live session as its runner's objects show it to any replica (`sessions list`).
pub struct KeptSession {
    pub name: String,
    /// The hash of its owner and name that labels its runner ([`KeepFor::name`]).
    pub hash: String,
    pub profile: String,
    pub context: RunContext,
    pub opened: std::time::SystemTime,
    pub expires_at: std::time::SystemTime,
    pub idle_ttl: Duration,
    pub last_used: Option<std::time::SystemTime>,
    /// Calls through every replica.
    pub calls: u64,
    /// A call holds it now.
    pub busy: bool,
}

/// A runner that lives across commands ("one runner, many execs"): a session's, or the one
/// runner of a multi-step run. Each command in it has the same contract as
/// [`Executor::start`]: its own timeout, kill and exactly one terminal event; killing a
/// command leaves the runner.
pub trait KeptRunner: Send + Sync + 'static {
    /// Where its commands run (the backend, host or pod).
    fn context(&self) -> RunContext;

    /// Starts a command in the runner. With a workspace, `sync_tree` brings the runner's
    /// tree to the workspace's manifest first (for the paths it covers; other paths, such as
    /// build outputs, stay); without it the tree is used as it is (the later steps of a
    /// multi-step run).
    fn start(
        &self,
        spec: ExecSpec,
        opts: StartOptions,
        sync_tree: bool,
    ) -> BoxFuture<'_, Result<Execution, ErrorBody>>;

    /// Whether the runner is still there: `Err` when it was lost (pod evicted or deleted,
    /// node gone, directory removed) or another replica ended it.
    fn check(&self) -> BoxFuture<'_, Result<(), Gone>>;

    /// Takes the runner for one call until `until` at the latest, across gateway replicas
    /// (this replica's calls are one at a time already): waits while another replica's call
    /// holds it (within `deadline`, as the phase `queued`), or fails at once with 409
    /// `session_busy` when `fail`. Runners only one gateway reaches need nothing.
    fn begin_call(
        &self,
        _until: std::time::SystemTime,
        _fail: bool,
        _deadline: tokio::time::Instant,
        _progress: &Progress,
    ) -> BoxFuture<'_, Result<Option<String>, ErrorBody>> {
        Box::pin(async { Ok(None) })
    }

    /// Gives the runner back after a call (and records its use, for every replica): `hold`
    /// is what [`KeptRunner::begin_call`] returned.
    fn end_call(&self, _hold: Option<String>) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }

    /// When any replica last used it, as its objects say (`None`: only this gateway uses it).
    fn last_used(&self) -> Option<std::time::SystemTime> {
        None
    }

    /// Records why the session ends (its owner ended it, or it expired: the reason) where
    /// the other replicas see it, before [`KeptRunner::close`].
    fn ending(&self, _expired: Option<String>) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }

    /// Releases the runner (kills what still runs, deletes the pod or directory). Called
    /// once; the runner is not used afterwards.
    fn close(&self) -> BoxFuture<'_, ()>;

    /// At this gateway's shutdown, instead of [`KeptRunner::close`]: leaves a live session's
    /// runner to the gateway's other replicas (or its next start), when they reach it
    /// ([`Executor::sessions_shared`]). `false`: it was not left, the caller closes it.
    fn leave(&self) -> BoxFuture<'_, bool> {
        Box::pin(async { false })
    }
}

/// A backend that runs commands.
pub trait Executor: Send + Sync + 'static {
    /// The backend's name as reported in `started` contexts: `local`, `kubernetes`, `remote`.
    fn name(&self) -> &'static str;

    /// Starts a command. An `Err` means nothing ran; it becomes an HTTP error before any
    /// stream (or an `error` event when the caller already streams phases). See
    /// [`StartOptions`] for cancellation, progress and stdin.
    fn start(
        &self,
        spec: ExecSpec,
        opts: StartOptions,
    ) -> BoxFuture<'_, Result<Execution, ErrorBody>>;

    /// Whether the backend can run commands now (`/readyz`).
    fn ready(&self) -> BoxFuture<'_, Result<(), ErrorBody>> {
        Box::pin(async { Ok(()) })
    }

    /// Whether the backend can run a command in a workspace ([`ExecSpec::workspace`]).
    fn supports_workspaces(&self) -> bool {
        false
    }

    /// Checks a request's backend-specific fields (such as the profile) before it starts.
    fn check(&self, _spec: &ExecSpec) -> Result<(), ErrorBody> {
        Ok(())
    }

    /// Extra time allowed beyond the timeout before the gateway gives up on a backend that
    /// enforces the timeout itself (a remote gateway).
    fn timeout_slack(&self) -> Duration {
        Duration::ZERO
    }

    /// Makes a runner that lives across commands, from `spec`'s profile (a session's first
    /// call). `Err` when the backend cannot keep runners.
    fn keep(
        &self,
        _spec: &ExecSpec,
        _keep: KeepFor,
        _opts: StartOptions,
    ) -> BoxFuture<'_, Result<std::sync::Arc<dyn KeptRunner>, ErrorBody>> {
        Box::pin(async move {
            Err(ErrorBody::new(
                ErrorCode::InvalidRequest,
                format!(
                    "the {} backend does not keep runners across calls (sessions, steps)",
                    self.name()
                ),
            ))
        })
    }

    /// Finds the runner of the session `name` (a hash, see [`KeepFor`]) of `owner` (a hash)
    /// that another replica made, when [`Executor::sessions_shared`].
    fn find_kept(
        &self,
        _owner: &str,
        _name: &str,
    ) -> BoxFuture<'_, Result<Option<FoundRunner>, ErrorBody>> {
        Box::pin(async { Ok(None) })
    }

    /// The live sessions of `owner` (a hash, see [`KeepFor`]) that every replica sees on
    /// their runners' objects, when [`Executor::sessions_shared`].
    fn list_kept(&self, _owner: &str) -> BoxFuture<'_, Result<Vec<KeptSession>, ErrorBody>> {
        Box::pin(async { Ok(Vec::new()) })
    }

    /// Whether [`Executor::keep`] can make runners that live across commands (sessions and
    /// multi-step runs).
    fn keeps_runners(&self) -> bool {
        false
    }

    /// Whether any gateway replica can serve a session of this backend: its state lives in
    /// objects every replica reaches (a session pod's labels and annotations), not only in
    /// the memory of the replica that opened it. When false (local: a directory on one
    /// host), a session's calls must reach the replica that holds it (forwarding).
    fn sessions_shared(&self) -> bool {
        false
    }

    /// Whether sessions are the backend's to keep (a remote gateway keeps them: the session
    /// name goes along in [`ExecSpec::session`]) rather than this gateway's.
    fn forwards_sessions(&self) -> bool {
        false
    }

    /// Called once at shutdown after every execution was cancelled: release what is left.
    fn shutdown(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }

    /// What the backend reports about itself in the capabilities document.
    fn capabilities(&self) -> BoxFuture<'_, crate::capabilities::BackendCapabilities> {
        Box::pin(async move {
            crate::capabilities::BackendCapabilities {
                backend: self.name().into(),
                safety_level: "unknown".into(),
                ..Default::default()
            }
        })
    }
}

/// A running command, as seen by whoever consumes its events.
///
/// Dropping an `Execution` cancels it: the backend kills the command. That is how a client
/// that disconnects gets its command killed.
pub struct Execution {
    context: RunContext,
    events: mpsc::Receiver<Event>,
    cancel: CancellationToken,
    _cancel_on_drop: DropGuard,
    /// Fired by the timeout's watchdog task, which kills the command whether or not anyone
    /// polls this execution (a client that stopped reading must not stop the timeout).
    timeout_fired: Option<CancellationToken>,
    /// After the timeout fired, how long to wait for the backend's `exit` before giving up.
    kill_grace: Option<Pin<Box<Sleep>>>,
    timed_out: bool,
    finished: bool,
    started: Instant,
    /// Counts this execution as running, for graceful shutdown.
    _tracked: Option<TaskTrackerToken>,
    /// Records its bytes and result in the gateway's metrics.
    observer: Option<crate::metrics::ExecutionObserver>,
    /// Transform the events on their way out (redaction, audit), in order.
    filters: Vec<Box<dyn EventFilter>>,
    /// Events the filters produced that were not handed out yet.
    pending: std::collections::VecDeque<Event>,
    /// A second buffer for passing events between filters, kept for its capacity.
    spare: std::collections::VecDeque<Event>,
    /// Held until the execution is dropped (a concurrency permit).
    _guards: Vec<Box<dyn std::any::Any + Send + Sync>>,
}

/// Sees every event of an execution before its consumer does, and decides what the consumer
/// gets: the event, a changed one, several, or none for now (a redactor holding back bytes).
/// After a terminal event nothing more is asked of it; whatever it held must go out before
/// that terminal event.
pub trait EventFilter: Send + Sync + 'static {
    fn filter(&mut self, event: Event, out: &mut std::collections::VecDeque<Event>);
}

/// How long a backend has to report the exit of a command it was told to kill.
const KILL_GRACE: Duration = Duration::from_secs(10);

impl Execution {
    /// Used by backends: `events` carries output and the terminal event; `cancel` is the
    /// token the backend watches to kill the command.
    pub fn new(
        context: RunContext,
        events: mpsc::Receiver<Event>,
        cancel: CancellationToken,
    ) -> Self {
        Self {
            context,
            events,
            _cancel_on_drop: cancel.clone().drop_guard(),
            cancel,
            timeout_fired: None,
            kill_grace: None,
            timed_out: false,
            finished: false,
            started: Instant::now(),
            _tracked: None,
            observer: None,
            filters: Vec::new(),
            pending: std::collections::VecDeque::new(),
            spare: std::collections::VecDeque::new(),
            _guards: Vec::new(),
        }
    }

    /// An execution that already ended, for failures reported the way a shell reports them
    /// (command not found is exit 127 with a message on stderr).
    pub fn finished(context: RunContext, stderr: String, code: i32) -> Self {
        let (tx, rx) = mpsc::channel(2);
        // Capacity 2 holds both events; the sends cannot fail.
        let _ = tx.try_send(Event::Stderr {
            data: stderr.into(),
        });
        let _ = tx.try_send(Event::Exit(ExitInfo {
            code: Some(code),
            signal: None,
            duration_ms: 0,
            timed_out: false,
        }));
        Self::new(context, rx, CancellationToken::new())
    }

    /// Kills the command after `timeout`; its `exit` event then says `timed_out: true`.
    /// A task watches the clock, so the kill happens even while nobody reads the events.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        let fired = CancellationToken::new();
        let cancel = self.cancel.clone();
        let watchdog = fired.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = tokio::time::sleep(timeout) => {
                    tracing::debug!("timeout reached, killing the command");
                    watchdog.cancel();
                    cancel.cancel();
                }
                // Ended, dropped or killed otherwise: nothing left to time.
                _ = cancel.cancelled() => {}
            }
        });
        self.timeout_fired = Some(fired);
        self
    }

    /// Keeps `guard` until the command is killed (timeout, shutdown, client gone) or the
    /// execution is dropped, whichever comes first: a concurrency slot is given back when the
    /// command is gone even if a stalled client still holds the stream.
    pub fn hold_while_running(self, guard: impl Send + 'static) -> Self {
        let cancel = self.cancel.clone();
        tokio::spawn(async move {
            cancel.cancelled().await;
            drop(guard);
        });
        self
    }

    /// Counts this execution as running until it is dropped.
    pub fn tracked(mut self, token: TaskTrackerToken) -> Self {
        self._tracked = Some(token);
        self
    }

    /// Reports this execution's events to the gateway's metrics.
    pub fn observed(mut self, observer: crate::metrics::ExecutionObserver) -> Self {
        self.observer = Some(observer);
        self
    }

    /// Passes every event through `filter` (after the filters added before).
    pub fn filtered(mut self, filter: impl EventFilter) -> Self {
        self.filters.push(Box::new(filter));
        self
    }

    /// Keeps `guard` alive as long as the execution (a concurrency permit).
    pub fn hold(mut self, guard: impl std::any::Any + Send + Sync) -> Self {
        self._guards.push(Box::new(guard));
        self
    }

    pub fn context(&self) -> &RunContext {
        &self.context
    }

    /// For a backend that learns more about the run after its start (its caches), and for
    /// whoever wraps a backend's execution and knows more (the session it ran in).
    pub fn context_mut(&mut self) -> &mut RunContext {
        &mut self.context
    }

    /// Kills the command; its events still arrive, ending with `exit`.
    pub fn kill(&self) {
        self.cancel.cancel();
    }

    /// The next event: output, then exactly one terminal event, then `None`.
    pub async fn next(&mut self) -> Option<Event> {
        let event = self.next_filtered().await;
        if let (Some(event), Some(observer)) = (&event, &mut self.observer) {
            observer.observe(event);
        }
        event
    }

    async fn next_filtered(&mut self) -> Option<Event> {
        loop {
            if let Some(event) = self.pending.pop_front() {
                return Some(event);
            }
            let event = self.next_event().await?;
            if self.filters.is_empty() {
                return Some(event);
            }
            // Two buffers swapped between filters: no allocation per event once warm.
            let mut cur = std::mem::take(&mut self.pending);
            let mut spare = std::mem::take(&mut self.spare);
            cur.push_back(event);
            for f in &mut self.filters {
                spare.clear();
                for e in cur.drain(..) {
                    f.filter(e, &mut spare);
                }
                std::mem::swap(&mut cur, &mut spare);
            }
            self.pending = cur;
            self.spare = spare;
        }
    }

    async fn next_event(&mut self) -> Option<Event> {
        if self.finished {
            return None;
        }
        loop {
            tokio::select! {
                ev = self.events.recv() => {
                    let ev = match ev {
                        Some(Event::Exit(mut info)) => {
                            // The watchdog marks the timeout before it kills.
                            info.timed_out |= self.timed_out
                                || self.timeout_fired.as_ref().is_some_and(|t| t.is_cancelled());
                            Event::Exit(info)
                        }
                        Some(ev) => ev,
                        None => Event::Error {
                            code: ErrorCode::BackendError,
                            message: "the backend ended the run without reporting an exit status".into(),
                        },
                    };
                    self.finished = ev.is_terminal();
                    return Some(ev);
                }
                _ = fired_opt(&self.timeout_fired), if !self.timed_out => {
                    self.timed_out = true;
                    self.kill_grace = Some(Box::pin(tokio::time::sleep(KILL_GRACE)));
                    self.cancel.cancel();
                }
                _ = sleep_opt(&mut self.kill_grace) => {
                    self.finished = true;
                    return Some(Event::Exit(ExitInfo {
                        code: None,
                        signal: None,
                        duration_ms: self.started.elapsed().as_millis() as u64,
                        timed_out: true,
                    }));
                }
            }
        }
    }
}

/// Waits for an optional timer; an absent timer never fires.
async fn sleep_opt(timer: &mut Option<Pin<Box<Sleep>>>) {
    match timer {
        Some(t) => t.await,
        None => std::future::pending().await,
    }
}

/// Waits for an optional token; an absent token never fires.
async fn fired_opt(token: &Option<CancellationToken>) {
    match token {
        Some(t) => t.cancelled().await,
        None => std::future::pending().await,
    }
}

/// Reads one chunk from a pipe, or waits forever when the pipe is closed already.
pub(crate) async fn read_opt<R: AsyncRead + Unpin>(
    pipe: &mut Option<R>,
    buf: &mut BytesMut,
) -> std::io::Result<usize> {
    match pipe {
        Some(p) => {
            buf.reserve(READ_CHUNK);
            p.read_buf(buf).await
        }
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Holds stdout events back until the terminal one, then releases them before it.
    struct Hold(Vec<Event>);
    impl EventFilter for Hold {
        fn filter(&mut self, event: Event, out: &mut std::collections::VecDeque<Event>) {
            if event.is_terminal() {
                out.extend(self.0.drain(..));
                out.push_back(event);
            } else {
                self.0.push(event);
            }
        }
    }

    /// Doubles every output event.
    struct Twice;
    impl EventFilter for Twice {
        fn filter(&mut self, event: Event, out: &mut std::collections::VecDeque<Event>) {
            if !event.is_terminal() {
                out.push_back(event.clone());
            }
            out.push_back(event);
        }
    }

    #[tokio::test]
    async fn filters_run_in_order_and_guards_live_as_long_as_the_execution() {
        let (tx, rx) = mpsc::channel(4);
        for b in [&b"a"[..], b"b"] {
            tx.send(Event::Stdout {
                data: bytes::Bytes::copy_from_slice(b),
            })
            .await
            .unwrap();
        }
        tx.send(Event::Exit(ExitInfo::default())).await.unwrap();
        let guard = std::sync::Arc::new(());
        let mut e = Execution::new(RunContext::default(), rx, CancellationToken::new())
            .filtered(Hold(Vec::new()))
            .filtered(Twice)
            .hold(guard.clone());
        let mut seen = Vec::new();
        while let Some(ev) = e.next().await {
            seen.push(match ev {
                Event::Stdout { data } => String::from_utf8_lossy(&data).into_owned(),
                Event::Exit(_) => "exit".into(),
                other => format!("{other:?}"),
            });
        }
        assert_eq!(seen, ["a", "a", "b", "b", "exit"]);
        assert_eq!(std::sync::Arc::strong_count(&guard), 2);
        drop(e);
        assert_eq!(std::sync::Arc::strong_count(&guard), 1);
    }

    #[tokio::test]
    async fn closed_channel_yields_one_error_then_none() {
        let (tx, rx) = mpsc::channel(1);
        drop(tx);
        let mut e = Execution::new(RunContext::default(), rx, CancellationToken::new());
        assert!(matches!(
            e.next().await,
            Some(Event::Error {
                code: ErrorCode::BackendError,
                ..
            })
        ));
        assert_eq!(e.next().await, None);
    }

    #[tokio::test]
    async fn drop_cancels() {
        let (_tx, rx) = mpsc::channel(1);
        let token = CancellationToken::new();
        let e = Execution::new(RunContext::default(), rx, token.clone());
        drop(e);
        assert!(token.is_cancelled());
    }

    #[tokio::test(start_paused = true)]
    async fn timeout_cancels_and_marks_exit() {
        let (tx, rx) = mpsc::channel(1);
        let token = CancellationToken::new();
        let mut e = Execution::new(RunContext::default(), rx, token.clone())
            .with_timeout(Duration::from_secs(5));
        let backend = tokio::spawn(async move {
            token.cancelled().await;
            tx.send(Event::Exit(ExitInfo {
                code: None,
                signal: Some(9),
                duration_ms: 5000,
                timed_out: false,
            }))
            .await
            .unwrap();
        });
        match e.next().await {
            Some(Event::Exit(info)) => assert!(info.timed_out && info.signal == Some(9)),
            other => panic!("unexpected {other:?}"),
        }
        backend.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_backend_that_ignores_the_kill_still_ends() {
        let (_tx, rx) = mpsc::channel::<Event>(1);
        let mut e = Execution::new(RunContext::default(), rx, CancellationToken::new())
            .with_timeout(Duration::from_secs(1));
        assert!(matches!(
            e.next().await,
            Some(Event::Exit(ExitInfo {
                timed_out: true,
                ..
            }))
        ));
        assert_eq!(e.next().await, None);
    }
}

//! The one entry point through which every front end (the `/raw` endpoint, the MCP service,
//! the CLI) runs a command: it validates the request against the server's limits, starts it
//! on the configured backend, applies the timeout, and tracks it for graceful shutdown.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::auth::Caller;
use crate::contract::{ErrorBody, ErrorCode, Event, RunRequest};
use crate::exec::{ExecSpec, Execution, Executor, Progress, StartOptions};
use crate::limits::Limits;
use crate::metrics::Metrics;
use crate::policy::{Policy, Subject};
use crate::rate_limit::RateLimiter;
use crate::redact::{RedactFilter, Redactor};
use tokio::sync::Semaphore;

/// After the grace period, how long killed commands get to report their exit before the
/// backend's shutdown runs anyway.
const KILL_WAIT: Duration = Duration::from_secs(10);

/// Ends the stream of a command that the gateway's shutdown killed with an `error` event
/// `shutting_down` instead of the `exit` of its SIGKILL, which would read as the command's own
/// fate (an out-of-memory kill). After the audit filter: the audit log keeps the real exit.
struct StoppedFilter(CancellationToken);

impl crate::exec::EventFilter for StoppedFilter {
    fn filter(&mut self, event: Event, out: &mut std::collections::VecDeque<Event>) {
        out.push_back(match event {
            Event::Exit(info) if self.0.is_cancelled() && info.code.is_none() && !info.timed_out => {
                Event::Error {
                    code: ErrorCode::ShuttingDown,
                    message: "the gateway stopped and killed the command at the end of its shutdown grace period".into(),
                }
            }
            e => e,
        });
    }
}

/// Why the runner itself refused a run (the policy, the workspace store, sessions and the
/// backend have their own errors).
#[derive(Debug, thiserror::Error)]
pub(crate) enum RunnerError {
    #[error("the gateway is shutting down")]
    ShuttingDown,
    #[error("this gateway does not accept workspaces (workspaces.enabled is false)")]
    WorkspacesOff,
    /// The backend's name.
    #[error("the {0} backend does not support workspaces")]
    NoWorkspaces(&'static str),
    #[error("this gateway keeps no sessions (sessions.enabled is false)")]
    SessionsOff,
    #[error("the {0} backend does not keep runners across calls: no sessions here")]
    NoSessions(&'static str),
    #[error("this gateway does not accept stdin for commands (limits.allow_stdin is false)")]
    StdinOff,
    #[error("a run with `steps` takes no stdin")]
    StepsStdin,
    /// All of `limits.max_concurrent_executions` (the number) run.
    #[error(
        "{0} executions are running, the gateway's maximum (limits.max_concurrent_executions); retry later"
    )]
    Busy(usize),
}

impl From<RunnerError> for ErrorBody {
    fn from(e: RunnerError) -> Self {
        let code = match e {
            RunnerError::ShuttingDown => ErrorCode::ShuttingDown,
            RunnerError::WorkspacesOff
            | RunnerError::NoWorkspaces(_)
            | RunnerError::SessionsOff
            | RunnerError::NoSessions(_)
            | RunnerError::StepsStdin => ErrorCode::InvalidRequest,
            RunnerError::StdinOff => ErrorCode::PolicyViolation,
            RunnerError::Busy(_) => {
                return ErrorBody::new(ErrorCode::TooManyRequests, e.to_string()).retry_after(1);
            }
        };
        ErrorBody::new(code, e.to_string())
    }
}

/// What a front end attaches to a run besides the request: the caller's stdin and where to
/// report start-up phases.
#[derive(Default)]
pub(crate) struct RunIo {
    pub progress: Progress,
    pub stdin: Option<tokio::sync::mpsc::Receiver<bytes::Bytes>>,
}

pub(crate) struct Runner {
    executor: Arc<dyn Executor>,
    limits: Limits,
    policy: Policy,
    /// Executions at once (`limits.max_concurrent_executions`).
    slots: Option<Arc<Semaphore>>,
    rate: Option<RateLimiter>,
    redactor: Option<Arc<Redactor>>,
    /// Posted workspaces and their contents; `None`: workspaces are off.
    workspaces: Option<Arc<crate::workspace::WorkspaceStore>>,
    /// Named runners that live across calls; `None`: sessions are off.
    sessions: Option<Arc<crate::session::Sessions>>,
    /// The other replicas: runs that need the caller's workspaces or sessions go to the
    /// replica that holds them (`crate::peers`, "homes").
    peers: Option<Arc<crate::peers::Peers>>,
    shutdown: CancellationToken,
    tracker: TaskTracker,
    metrics: Metrics,
}

impl Runner {
    pub(crate) fn new(executor: Arc<dyn Executor>, limits: Limits) -> Self {
        Self {
            executor,
            policy: Policy::unrestricted(limits.clone()),
            slots: limits
                .max_concurrent_executions
                .map(|n| Arc::new(Semaphore::new(n))),
            rate: limits.rate_limit.as_ref().map(RateLimiter::new),
            redactor: None,
            workspaces: None,
            sessions: None,
            peers: None,
            limits,
            shutdown: CancellationToken::new(),
            tracker: TaskTracker::new(),
            metrics: Metrics::default(),
        }
    }

    /// Checks every request against `policy` (built from the same limits).
    pub(crate) fn with_policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// Records executions and refusals in `metrics` (the gateway's, served on `/metrics`).
    pub(crate) fn with_metrics(mut self, metrics: Metrics) -> Self {
        self.metrics = metrics;
        self
    }

    pub(crate) fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Redacts secrets in every execution's output (and in audit lines).
    pub(crate) fn with_redactor(mut self, redactor: Option<Arc<Redactor>>) -> Self {
        self.redactor = redactor;
        self
    }

    /// Accepts requests with a `workspace` from this store.
    pub(crate) fn with_workspaces(
        mut self,
        store: Option<Arc<crate::workspace::WorkspaceStore>>,
    ) -> Self {
        self.workspaces = store;
        self
    }

    /// Keeps sessions with `config` (off when `config.enabled` is false). Needs a Tokio
    /// runtime (the task that expires idle sessions).
    pub(crate) fn with_sessions(mut self, config: crate::session::SessionConfig) -> Self {
        let here = config.enabled && self.executor.keeps_runners();
        self.sessions = here.then(|| {
            crate::session::Sessions::new(config, self.metrics.clone(), self.shutdown.child_token())
        });
        self
    }

    /// Forwards runs that need the caller's workspaces or sessions to the replica that holds
    /// them, among `peers`.
    pub(crate) fn with_peers(mut self, peers: Option<Arc<crate::peers::Peers>>) -> Self {
        self.peers = peers;
        self
    }

    /// Whether any replica serves a session's calls: its state lives where every replica
    /// reaches it (a Kubernetes session's pod), or the remote gateway keeps it. When false,
    /// a session lives in one replica's process and its calls go there (`crate::peers`).
    pub(crate) fn sessions_shared(&self) -> bool {
        self.executor.sessions_shared() || self.executor.forwards_sessions()
    }

    /// The other replicas, when the gateway has peers.
    pub(crate) fn peers(&self) -> Option<&Arc<crate::peers::Peers>> {
        self.peers.as_ref()
    }

    /// The sessions, when they are on (and kept here, not forwarded to a remote gateway).
    pub(crate) fn sessions(&self) -> Option<&Arc<crate::session::Sessions>> {
        self.sessions.as_ref()
    }

    /// The workspace store, when workspaces are on.
    pub(crate) fn workspaces(&self) -> Option<&Arc<crate::workspace::WorkspaceStore>> {
        self.workspaces.as_ref()
    }

    /// The redaction in force, if any.
    pub(crate) fn redactor(&self) -> Option<&Arc<Redactor>> {
        self.redactor.as_ref()
    }

    /// The request as results may show it: secrets in the command line and cwd redacted.
    pub(crate) fn redact_request(&self, req: &RunRequest) -> RunRequest {
        let Some(r) = &self.redactor else {
            return req.clone();
        };
        RunRequest {
            executable: r.redact_str(&req.executable),
            args: req.args.iter().map(|a| r.redact_str(a)).collect(),
            cwd: req.cwd.as_deref().map(|c| r.redact_str(c)),
            steps: req
                .steps
                .iter()
                .map(|s| crate::contract::Step {
                    executable: r.redact_str(&s.executable),
                    args: s.args.iter().map(|a| r.redact_str(a)).collect(),
                    cwd: s.cwd.as_deref().map(|c| r.redact_str(c)),
                    ..s.clone()
                })
                .collect(),
            ..req.clone()
        }
    }

    pub(crate) fn policy(&self) -> &Policy {
        &self.policy
    }

    pub(crate) fn executor(&self) -> &Arc<dyn Executor> {
        &self.executor
    }

    pub(crate) fn limits(&self) -> &Limits {
        &self.limits
    }

    /// [`Runner::spec`] for a known caller: a workspace must be the caller's.
    pub(crate) fn spec_for(&self, req: RunRequest, caller: &Caller) -> Result<ExecSpec, ErrorBody> {
        req.validate()?;
        let workspace = match &req.workspace {
            None => None,
            Some(id) => Some(self.workspace_run(id, &req, caller)?),
        };
        // The policy sees a workspace run's directory as below `/workspace`.
        let policy_cwd = workspace.as_ref().map(|w| {
            format!("{}/{}", crate::workspace::POLICY_ROOT, w.cwd)
                .trim_end_matches('/')
                .to_owned()
        });
        let env_names: Vec<&str> = req.env.keys().map(String::as_str).collect();
        let allowed = self.policy.check(&Subject {
            executable: &req.executable,
            args: &req.args,
            cwd: policy_cwd.as_deref().or(req.cwd.as_deref()),
            env_names: &env_names,
            timeout_secs: req.timeout_secs,
            profile: req.profile.as_deref(),
        })?;
        let spec = ExecSpec {
            executable: allowed.executable,
            args: req.args,
            cwd: if workspace.is_some() {
                None
            } else {
                allowed.cwd
            },
            env: req.env,
            timeout: Duration::from_secs(allowed.timeout_secs),
            profile: req.profile,
            workspace,
            owner: caller.identity.clone(),
            cache_scope: req.cache_scope,
            session: None,
            session_busy: None,
            steps: Vec::new(),
            continue_on_error: false,
        };
        self.executor.check(&spec)?;
        Ok(spec)
    }

    /// Resolves a request's workspace for `caller`.
    fn workspace_run(
        &self,
        id: &str,
        req: &RunRequest,
        caller: &Caller,
    ) -> Result<crate::workspace::WorkspaceRun, ErrorBody> {
        let Some(store) = &self.workspaces else {
            return Err(RunnerError::WorkspacesOff.into());
        };
        if !self.executor.supports_workspaces() {
            return Err(RunnerError::NoWorkspaces(self.executor.name()).into());
        }
        let workspace = store.get(id, &caller.identity)?;
        let cwd = crate::workspace::run_cwd(&workspace, req.cwd.as_deref())?;
        crate::workspace::local::globs(&req.sync_back)?;
        Ok(crate::workspace::WorkspaceRun {
            workspace,
            store: store.clone(),
            cwd,
            sync_back: req.sync_back.clone(),
        })
    }

    /// Logs a refused request in the audit log.
    fn audit_rejected(&self, req: &RunRequest, caller: &Caller, e: &ErrorBody) {
        let argv = crate::audit::argv_json(&req.executable, &req.args, self.redactor.as_deref());
        let env = crate::audit::env_names(&req.env);
        crate::audit::rejected(caller, &argv, &env, req.profile.as_deref(), e);
    }

    /// Starts a command for `caller` (rate limit key, audit identity), with the caller's stdin
    /// and a sink for start-up phases. The returned execution is killed when dropped or when
    /// its timeout passes. Refusals are counted in the metrics by error code.
    pub(crate) async fn start_with(
        &self,
        req: RunRequest,
        caller: &Caller,
        io: RunIo,
    ) -> Result<Execution, ErrorBody> {
        self.start_audited(req, caller, io, false).await
    }

    /// [`Runner::start_with`] of a run another replica forwarded here (this is the caller's
    /// home): served here whatever this replica thinks the home is, so that a run is never
    /// forwarded twice.
    pub(crate) async fn start_forwarded(
        &self,
        req: RunRequest,
        caller: &Caller,
        io: RunIo,
    ) -> Result<Execution, ErrorBody> {
        self.start_audited(req, caller, io, true).await
    }

    async fn start_audited(
        &self,
        req: RunRequest,
        caller: &Caller,
        io: RunIo,
        forwarded: bool,
    ) -> Result<Execution, ErrorBody> {
        let io = match self.relay(&req, caller, io, forwarded).await {
            Ok(relayed) => return relayed,
            Err(io) => io,
        };
        // Only the fields the audit line needs are kept for a refusal.
        let audit = RunRequest {
            executable: req.executable.clone(),
            args: req.args.clone(),
            env: req.env.keys().map(|k| (k.clone(), String::new())).collect(),
            profile: req.profile.clone(),
            ..RunRequest::default()
        };
        let mut started = self.start_inner(req, caller, io).await;
        // A refusal may quote the request (a policy rule, a profile name, an env name): it
        // leaves the gateway, so it is redacted like the output.
        if let (Err(e), Some(r)) = (&mut started, &self.redactor) {
            e.message = r.redact_str(&e.message);
        }
        if let Err(e) = &started {
            self.metrics.rejected(e.code);
            self.audit_rejected(&audit, caller, e);
        }
        started
    }

    /// Relays a run that needs the caller's workspaces or sessions to the replica that holds
    /// them (`Err(io)`: it runs here). That replica applies the rate limit, policy, slots
    /// and audit, and counts refusals; this one only relays, tracked so that its shutdown
    /// waits for the relay.
    async fn relay(
        &self,
        req: &RunRequest,
        caller: &Caller,
        io: RunIo,
        forwarded: bool,
    ) -> Result<Result<Execution, ErrorBody>, RunIo> {
        let Some(peers) = self.peers.as_ref().filter(|_| !forwarded) else {
            return Err(io);
        };
        if !crate::peers::needs_home(req, self.sessions_shared()) || self.tracker.is_closed() {
            return Err(io);
        }
        let crate::peers::Home::There(tag) = peers.home(caller).await else {
            return Err(io);
        };
        let (progress, retry) = (io.progress.clone(), io.stdin.is_none());
        let opts = StartOptions {
            cancel: self.shutdown.child_token(),
            progress: io.progress,
            stdin: io.stdin,
        };
        let mut started = peers.start_at(&tag, req, caller, opts).await;
        // A home that is gone (nothing ran there) is left out of the next pick: once more,
        // at the caller's new home (not with stdin, which the first attempt took).
        if let Err(e) = &started
            && e.code == ErrorCode::BackendUnavailable
            && retry
        {
            match peers.home(caller).await {
                crate::peers::Home::There(next) if next != tag => {
                    let opts = StartOptions {
                        cancel: self.shutdown.child_token(),
                        progress,
                        stdin: None,
                    };
                    started = peers.start_at(&next, req, caller, opts).await;
                }
                crate::peers::Home::Here => {
                    return Err(RunIo {
                        progress,
                        stdin: None,
                    });
                }
                crate::peers::Home::There(_) => {}
            }
        }
        Ok(started.map(|e| e.tracked(self.tracker.token())))
    }

    async fn start_inner(
        &self,
        req: RunRequest,
        caller: &Caller,
        io: RunIo,
    ) -> Result<Execution, ErrorBody> {
        if self.shutdown.is_cancelled() || self.tracker.is_closed() {
            return Err(RunnerError::ShuttingDown.into());
        }
        // A start under way counts as running for the shutdown's grace: its command may run
        // already (a local process is spawned before the start returns and is tracked).
        let _starting = self.tracker.token();
        // Every attempt costs a token, allowed or not, so that probing the policy is limited too.
        if let Some(rate) = &self.rate {
            rate.take(caller)?;
        }
        if !req.steps.is_empty() {
            return self.start_steps(req, caller, io).await;
        }
        let (session, busy) = (req.session.clone(), req.session_busy.unwrap_or_default());
        let mut spec = self.spec_for(req, caller)?;
        if io.stdin.is_some() && !self.limits.allow_stdin {
            return Err(RunnerError::StdinOff.into());
        }
        let call = self
            .session_call(session, busy, caller, &mut spec, &io.progress)
            .await?;
        let slot = self.slot()?;
        let timeout = spec.timeout + self.executor.timeout_slack();
        let audited = spec.clone();
        let execution = match &call {
            Some(c) => {
                let opts = StartOptions {
                    cancel: c.cancel(),
                    progress: io.progress,
                    stdin: io.stdin,
                };
                let mut e = c.runner().start(spec, opts, true).await?;
                let ctx = e.context_mut();
                ctx.session = Some(c.name().to_owned());
                ctx.session_call = Some(c.number());
                e
            }
            None => {
                self.executor
                    .start(
                        spec,
                        StartOptions {
                            cancel: self.shutdown.child_token(),
                            progress: io.progress,
                            stdin: io.stdin,
                        },
                    )
                    .await?
            }
        };
        Ok(self.wrap(execution, caller, &audited, timeout, slot, call))
    }

    /// The request's session for this call, when it names one (before the slot: a call
    /// waiting for its session's running call holds none). A backend that forwards sessions
    /// gets the name in the spec instead.
    async fn session_call(
        &self,
        session: Option<String>,
        busy: crate::contract::SessionBusy,
        caller: &Caller,
        spec: &mut ExecSpec,
        progress: &Progress,
    ) -> Result<Option<crate::session::SessionCall>, ErrorBody> {
        let Some(name) = session else {
            return Ok(None);
        };
        if self.executor.forwards_sessions() {
            spec.session = Some(crate::session::forwarded_name(caller, &name));
            spec.session_busy = Some(busy);
            return Ok(None);
        }
        let Some(sessions) = &self.sessions else {
            return Err(if self.executor.keeps_runners() {
                RunnerError::SessionsOff
            } else {
                RunnerError::NoSessions(self.executor.name())
            }
            .into());
        };
        let call = sessions
            .call(self.executor.as_ref(), caller, &name, spec, busy, progress)
            .await?;
        Ok(Some(call))
    }

    /// A concurrency slot, taken before the backend starts anything and released when the
    /// execution is dropped.
    fn slot(&self) -> Result<Option<tokio::sync::OwnedSemaphorePermit>, RunnerError> {
        match &self.slots {
            Some(s) => Ok(Some(s.clone().try_acquire_owned().map_err(|_| {
                RunnerError::Busy(self.limits.max_concurrent_executions.unwrap_or_default())
            })?)),
            None => Ok(None),
        }
    }

    /// What every execution goes through, written once: redaction, audit, the shutdown's
    /// error, the timeout, shutdown tracking, metrics, the slot and the session.
    fn wrap(
        &self,
        mut execution: Execution,
        caller: &Caller,
        audited: &ExecSpec,
        timeout: Duration,
        slot: Option<tokio::sync::OwnedSemaphorePermit>,
        call: Option<crate::session::SessionCall>,
    ) -> Execution {
        // Redaction first, so that the audit counts the bytes that actually leave.
        if let Some(r) = &self.redactor {
            execution = execution.filtered(RedactFilter::new(r));
        }
        let audit = crate::audit::AuditFilter::new(
            caller,
            audited,
            execution.context(),
            self.redactor.as_deref(),
        );
        execution
            .filtered(audit)
            .filtered(StoppedFilter(self.shutdown.clone()))
            .with_timeout(timeout)
            .tracked(self.tracker.token())
            .observed(self.metrics.execution_started(self.executor.name()))
            .hold_while_running(slot)
            // The session is busy until the call's consumer let go of it (sync-back
            // included), not merely until the kill.
            .hold(call)
    }

    /// A multi-step run: every step checked like a request, then the steps in order in one
    /// runner (the session's, or one kept for this run and released after it).
    async fn start_steps(
        &self,
        req: RunRequest,
        caller: &Caller,
        io: RunIo,
    ) -> Result<Execution, ErrorBody> {
        req.validate()?;
        if io.stdin.is_some() {
            return Err(RunnerError::StepsStdin.into());
        }
        let (session, busy) = (req.session.clone(), req.session_busy.unwrap_or_default());
        let continue_on_error = req.continue_on_error;
        let mut steps = Vec::with_capacity(req.steps.len());
        for (i, r) in req.step_requests().into_iter().enumerate() {
            let command = r.command_line();
            let spec = self.spec_for(r, caller).map_err(|mut e| {
                e.message = format!("steps[{i}]: {}", e.message);
                e
            })?;
            steps.push((spec, command));
        }
        let mut first = steps[0].0.clone();
        let call = self
            .session_call(session, busy, caller, &mut first, &io.progress)
            .await?;
        if self.executor.forwards_sessions() {
            return self
                .forward_steps(first, steps, continue_on_error, caller, io)
                .await;
        }
        let slot = self.slot()?;
        let (runner, cancel, close) = match &call {
            Some(c) => (c.runner().clone(), c.cancel(), false),
            None => {
                let keep = crate::exec::KeepFor {
                    owner: crate::session::label_hash(&[&caller.key()]),
                    // Three parts: never the hash of a session's (owner, name).
                    name: crate::session::label_hash(&[&caller.key(), "", "steps"]),
                    expires_at: std::time::SystemTime::now()
                        + steps.iter().map(|(s, _)| s.timeout).sum::<Duration>(),
                    session: None,
                    first_call: steps.iter().map(|(s, _)| s.timeout).sum::<Duration>(),
                };
                let opts = StartOptions {
                    cancel: self.shutdown.child_token(),
                    progress: io.progress.clone(),
                    stdin: None,
                };
                let runner = self.executor.keep(&first, keep, opts).await?;
                (runner, self.shutdown.child_token(), true)
            }
        };
        let mut context = runner.context();
        if let Some(c) = &call {
            context.session = Some(c.name().to_owned());
            context.session_call = Some(c.number());
        }
        io.progress.report(crate::contract::Phase::Running, None);
        let timeout =
            steps.iter().map(|(s, _)| s.timeout).sum::<Duration>() + self.executor.timeout_slack();
        let audited = ExecSpec {
            executable: "steps".into(),
            args: steps.iter().map(|(_, c)| c.clone()).collect(),
            ..first
        };
        let execution = crate::exec::steps::run(
            crate::exec::steps::Steps {
                runner,
                steps,
                continue_on_error,
                close,
            },
            context,
            cancel,
        );
        Ok(self.wrap(execution, caller, &audited, timeout, slot, call))
    }

    /// A multi-step run on a backend that forwards it whole (a remote gateway runs the steps
    /// in one runner of its own): each step as this gateway checked it.
    async fn forward_steps(
        &self,
        mut first: ExecSpec,
        steps: Vec<(ExecSpec, String)>,
        continue_on_error: bool,
        caller: &Caller,
        io: RunIo,
    ) -> Result<Execution, ErrorBody> {
        let timeout = steps.iter().map(|(s, _)| s.timeout).sum::<Duration>();
        first.steps = steps
            .iter()
            .map(|(s, _)| crate::contract::Step {
                executable: s.executable.clone(),
                args: s.args.clone(),
                // A workspace run's directory is relative to the workspace root.
                cwd: match &s.workspace {
                    Some(w) => (!w.cwd.is_empty()).then(|| w.cwd.clone()),
                    None => s.cwd.clone(),
                },
                env: s.env.clone(),
                timeout_secs: Some(s.timeout.as_secs().max(1)),
            })
            .collect();
        first.continue_on_error = continue_on_error;
        first.timeout = timeout;
        // Each step carries its own command, directory and environment.
        first.executable.clear();
        first.args.clear();
        first.cwd = None;
        first.env.clear();
        let audited = ExecSpec {
            executable: "steps".into(),
            args: steps.iter().map(|(_, c)| c.clone()).collect(),
            steps: Vec::new(),
            ..first.clone()
        };
        let slot = self.slot()?;
        let execution = self
            .executor
            .start(
                first,
                StartOptions {
                    cancel: self.shutdown.child_token(),
                    progress: io.progress,
                    stdin: None,
                },
            )
            .await?;
        let timeout = timeout + self.executor.timeout_slack();
        Ok(self.wrap(execution, caller, &audited, timeout, slot, None))
    }

    /// How many executions are running.
    pub(crate) fn in_flight(&self) -> usize {
        self.tracker.len()
    }

    pub(crate) fn is_shutting_down(&self) -> bool {
        self.tracker.is_closed()
    }

    /// Refuses new executions, lets running ones go on for `grace`, then kills them and
    /// lets the backend clean up.
    pub(crate) async fn shutdown(&self, grace: Duration) {
        self.tracker.close();
        if tokio::time::timeout(grace, self.tracker.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                running = self.tracker.len(),
                "grace period over, killing running commands"
            );
        }
        self.shutdown.cancel();
        if tokio::time::timeout(KILL_WAIT, self.tracker.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                running = self.tracker.len(),
                "commands did not report their exit after being killed"
            );
        }
        if let Some(s) = &self.sessions {
            s.shutdown().await;
        }
        self.executor.shutdown().await;
    }
}

//! The one entry point through which every front end (the `/raw` endpoint, the MCP service,
//! the CLI) runs a command: it validates the request against the server's limits, starts it
//! on the configured backend, applies the timeout, and tracks it for graceful shutdown.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Limits;
use crate::contract::{ErrorBody, ErrorCode, RunRequest};
use crate::exec::{ExecSpec, Execution, Executor};

/// After the grace period, how long killed commands get to report their exit before the
/// backend's shutdown runs anyway.
const KILL_WAIT: Duration = Duration::from_secs(10);

pub struct Runner {
    executor: Arc<dyn Executor>,
    limits: Limits,
    shutdown: CancellationToken,
    tracker: TaskTracker,
}

impl Runner {
    pub fn new(executor: Arc<dyn Executor>, limits: Limits) -> Self {
        Self {
            executor,
            limits,
            shutdown: CancellationToken::new(),
            tracker: TaskTracker::new(),
        }
    }

    pub fn executor(&self) -> &Arc<dyn Executor> {
        &self.executor
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Validates a request and resolves its defaults.
    pub fn spec(&self, req: RunRequest) -> Result<ExecSpec, ErrorBody> {
        req.validate()?;
        let max = self.limits.max_timeout_secs;
        let secs = req.timeout_secs.unwrap_or(self.limits.default_timeout_secs);
        if secs > max {
            return Err(ErrorBody::new(
                ErrorCode::InvalidRequest,
                format!("`timeout_secs` is {secs}, over the server maximum of {max}"),
            ));
        }
        let spec = ExecSpec {
            executable: req.executable,
            args: req.args,
            cwd: req.cwd,
            env: req.env,
            timeout: Duration::from_secs(secs),
            profile: req.profile,
        };
        self.executor.check(&spec)?;
        Ok(spec)
    }

    /// Starts a command. The returned execution is killed when dropped or when its timeout
    /// passes. Refusals are counted in the metrics by error code.
    pub async fn start(&self, req: RunRequest) -> Result<Execution, ErrorBody> {
        let started = self.start_inner(req).await;
        if let Err(e) = &started {
            crate::metrics::rejected(e.code);
        }
        started
    }

    async fn start_inner(&self, req: RunRequest) -> Result<Execution, ErrorBody> {
        if self.shutdown.is_cancelled() || self.tracker.is_closed() {
            return Err(ErrorBody::new(
                ErrorCode::ShuttingDown,
                "the gateway is shutting down",
            ));
        }
        let spec = self.spec(req)?;
        let timeout = spec.timeout + self.executor.timeout_slack();
        let execution = self
            .executor
            .start(spec, self.shutdown.child_token())
            .await?;
        Ok(execution
            .with_timeout(timeout)
            .tracked(self.tracker.token())
            .observed(crate::metrics::execution_started(self.executor.name())))
    }

    /// How many executions are running.
    pub fn in_flight(&self) -> usize {
        self.tracker.len()
    }

    pub fn is_shutting_down(&self) -> bool {
        self.tracker.is_closed()
    }

    /// Refuses new executions, lets running ones go on for `grace`, then kills them and
    /// lets the backend clean up.
    pub async fn shutdown(&self, grace: Duration) {
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
        self.executor.shutdown().await;
    }
}

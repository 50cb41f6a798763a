//! A request's pod from creation to a started command: create it (or claim a warm one),
//! watch it until its container runs, exec the command in it. Every API call is bounded:
//! the whole start by `kubernetes.pod_start_timeout_secs`, each create attempt and the exec
//! upgrade by their own timeouts, and retries of overloaded or failing API servers by the
//! start budget (docs/kubernetes.md, "Start-up on real clusters").

use std::time::Duration;

use futures_util::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt as _;
use kube::api::{AttachParams, PostParams};
use kube::runtime::{WatchStreamExt as _, watcher};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::config::Profile;
use super::guard::{PodGuard, Timings};
use super::pod::{self, CONTAINER, LABEL_GATEWAY, LABEL_INSTANCE};
use super::status::{self, PodState, Waiting};
use super::stream::{Input, supervise};
use super::{DEADLINE_MARGIN_SECS, KubeExecutor};
use crate::contract::{ErrorBody, ErrorCode, Phase, RunContext};
use crate::exec::{EVENT_BUFFER, ExecSpec, Execution, Progress, StartOptions};

/// One pod create call may take this long before it is retried.
const CREATE_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);

/// The exec request and its WebSocket upgrade may take this long.
pub(super) const EXEC_UPGRADE_TIMEOUT: Duration = Duration::from_secs(30);

/// First wait between create attempts after a 5xx without Retry-After; doubled each time.
const CREATE_BACKOFF: Duration = Duration::from_millis(200);

fn shutting_down() -> ErrorBody {
    ErrorBody::new(ErrorCode::ShuttingDown, "the gateway is shutting down")
}

impl KubeExecutor {
    /// Creates the pod, waits until it runs, starts the command.
    pub(super) async fn run(
        &self,
        spec: ExecSpec,
        opts: StartOptions,
    ) -> Result<Execution, ErrorBody> {
        let profile_name = spec.profile.clone().unwrap_or_else(|| "default".into());
        let profile = self.profile(&profile_name)?.clone();
        let permit = self.permits.clone().try_acquire_owned().map_err(|_| {
            ErrorBody::new(
                ErrorCode::TooManyRequests,
                format!(
                    "{} runner pods are running, the gateway's maximum (kubernetes.max_concurrent_pods); retry later",
                    self.config.max_concurrent_pods
                ),
            )
        })?;
        let pool = self.pools.get().and_then(|p| p.get(&profile_name)).cloned();
        if let Some(pool) = pool {
            let mut timings = Timings::new();
            if let Some((name, node)) = pool.claim(spec.timeout).await {
                timings.mark("claimed");
                opts.progress
                    .report(Phase::Scheduled, Some(format!("warm pod {name} on {node}")));
                let guard = PodGuard::arm(self.shared.clone(), name, permit);
                return self
                    .exec_in(spec, opts, guard, timings, node, &profile_name, &profile)
                    .await;
            }
        }
        let deadline =
            spec.timeout.as_secs() + self.config.pod_start_timeout_secs + DEADLINE_MARGIN_SECS;
        let name = pod::pod_name();
        // Before the start budget: waiting for a busy cache has its own bound.
        let caches = self
            .take_caches(
                &spec,
                &profile_name,
                &profile,
                &name,
                Duration::from_secs(deadline),
                &opts,
            )
            .await?;
        let mut spec = spec;
        let start_timeout = Duration::from_secs(self.config.pod_start_timeout_secs);
        let budget_end = Instant::now() + start_timeout;
        let mut timings = Timings::new();
        let mut manifest = pod::build(
            &pod::PodRequest {
                name: &name,
                namespace: &self.shared.namespace,
                profile_name: &profile_name,
                profile: &profile,
                active_deadline_secs: deadline as i64,
                now: k8s_openapi::jiff::Timestamp::now(),
            },
            &self.shared.identity,
        );
        if let Some(c) = &caches {
            c.mount(&mut manifest);
            crate::exec::cache::merge_env(&mut spec.env, c.env());
        }
        // Armed before the create call: whatever happens from here, the pod goes.
        let guard = PodGuard::arm(self.shared.clone(), name.clone(), permit);
        let created = tokio::select! {
            r = self.create(&manifest, budget_end) => r?,
            _ = opts.cancel.cancelled() => return Err(shutting_down()),
        };
        timings.mark("created");
        opts.progress
            .report(Phase::Scheduling, Some(format!("pod {name} created")));
        tracing::debug!(pod = name, profile = profile_name, "runner pod created");

        let node = tokio::select! {
            r = self.wait_running(created, budget_end, start_timeout, &mut timings, &opts.progress) => r?,
            _ = opts.cancel.cancelled() => return Err(shutting_down()),
        };
        self.shared.metrics.observe_pod_start(timings.since_start());
        let execution = self
            .exec_in(spec, opts, guard, timings, node, &profile_name, &profile)
            .await?;
        Ok(match caches {
            Some(c) => {
                let mut execution = execution;
                execution.context_mut().caches = c.states();
                execution.hold(c)
            }
            None => execution,
        })
    }

    /// Creates the pod within the start budget: each attempt bounded, 429/500/503/504 and
    /// lost connections retried (Retry-After honoured, else backoff), and a 409 AlreadyExists
    /// after a retry recognised as our own earlier attempt having succeeded.
    async fn create(&self, manifest: &Pod, budget_end: Instant) -> Result<Pod, ErrorBody> {
        let name = manifest.name_any();
        let mut backoff = CREATE_BACKOFF;
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            self.shared.throttle.acquire().await;
            let left = budget_end.saturating_duration_since(Instant::now());
            let attempt = tokio::time::timeout(
                CREATE_ATTEMPT_TIMEOUT.min(left),
                self.shared.pods.create(&PostParams::default(), manifest),
            )
            .await;
            let (wait, why) = match attempt {
                Ok(Ok(pod)) => return Ok(pod),
                Ok(Err(kube::Error::Api(s))) if s.code == 409 && attempts > 1 => {
                    // Names are random and ours: an earlier attempt whose answer was lost.
                    match self.shared.pods.get(&name).await {
                        Ok(p) if self.is_ours(&p) => return Ok(p),
                        _ => {
                            return Err(api_error(
                                "cannot create the runner pod",
                                &kube::Error::Api(s),
                            ));
                        }
                    }
                }
                Ok(Err(kube::Error::Api(s))) if matches!(s.code, 429 | 500 | 503 | 504) => {
                    let retry_after = s
                        .details
                        .as_ref()
                        .map(|d| d.retry_after_seconds)
                        .filter(|s| *s > 0)
                        .map(|s| Duration::from_secs(u64::from(s)));
                    let why = format!("{} ({}, HTTP {})", s.message, s.reason, s.code);
                    (retry_after.unwrap_or(backoff), why)
                }
                Ok(Err(e @ kube::Error::Api(_))) => {
                    return Err(api_error("cannot create the runner pod", &e));
                }
                // Connection refused or reset, TLS trouble: the API server may be rolling.
                Ok(Err(e)) => (backoff, e.to_string()),
                Err(_) => (
                    backoff,
                    format!(
                        "no answer within {}s",
                        CREATE_ATTEMPT_TIMEOUT.min(left).as_secs()
                    ),
                ),
            };
            if Instant::now() + wait >= budget_end {
                return Err(ErrorBody::new(
                    ErrorCode::BackendUnavailable,
                    format!(
                        "cannot create the runner pod within kubernetes.pod_start_timeout_secs ({attempts} attempts): {why}"
                    ),
                ));
            }
            tracing::warn!(
                pod = name,
                attempt = attempts,
                wait_ms = wait.as_millis() as u64,
                "creating the runner pod failed, retrying: {why}"
            );
            tokio::time::sleep(wait).await;
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }

    /// Whether a pod found under our chosen name was created by this gateway.
    fn is_ours(&self, p: &Pod) -> bool {
        let l = p.labels();
        l.get(LABEL_INSTANCE) == Some(&self.shared.identity.instance)
            && l.get(LABEL_GATEWAY) == Some(&self.shared.identity.gateway)
    }

    /// Starts the command in a running pod that `guard` owns.
    #[allow(clippy::too_many_arguments)]
    async fn exec_in(
        &self,
        spec: ExecSpec,
        opts: StartOptions,
        mut guard: PodGuard,
        mut timings: Timings,
        node: String,
        profile_name: &str,
        profile: &Profile,
    ) -> Result<Execution, ErrorBody> {
        let name = guard.name.clone();
        let pod_start = timings.since_start();
        opts.progress.report(
            Phase::Starting,
            Some(format!("starting the command in pod {name}")),
        );
        let mut cwd = spec.cwd.clone();
        if let Some(run) = &spec.workspace {
            let path = super::workspace::workspace_path(profile_name, profile)?;
            cwd = Some(self.place_workspace(&name, run, path, &opts.cancel).await?);
            timings.mark("workspace placed");
        }
        let command = pod::argv::exec_command(
            profile.shell(),
            &spec.executable,
            &spec.args,
            cwd.as_deref(),
            &spec.env,
            opts.stdin.is_some(),
        );
        let wants_stdin = command.wants_stdin(opts.stdin.is_some());
        let params = AttachParams {
            container: Some(CONTAINER.into()),
            stdin: wants_stdin,
            stdout: true,
            stderr: true,
            tty: false,
            ..Default::default()
        };
        let request = kube::core::Request::new(<Pod as kube::Resource>::url_path(
            &(),
            Some(&self.shared.namespace),
        ))
        .exec(&name, command.argv, &params)
        .map_err(|e| {
            ErrorBody::new(
                ErrorCode::StartFailed,
                format!("cannot build the exec request: {e}"),
            )
        })?;
        self.shared.throttle.acquire().await;
        let connection = tokio::select! {
            r = tokio::time::timeout(EXEC_UPGRADE_TIMEOUT, self.shared.client.connect(request)) => match r {
                Ok(r) => r.map_err(|e| api_error("cannot exec in the runner pod", &e))?,
                Err(_) => return Err(ErrorBody::new(
                    ErrorCode::BackendUnavailable,
                    format!(
                        "cannot exec in the runner pod: no WebSocket upgrade within {}s",
                        EXEC_UPGRADE_TIMEOUT.as_secs()
                    ),
                )),
            },
            _ = opts.cancel.cancelled() => return Err(shutting_down()),
        };
        let can_close = connection.supports_stream_close();
        timings.mark("exec started");
        guard.timings = Some(timings);
        opts.progress.report(Phase::Running, None);

        let context = RunContext {
            backend: "kubernetes".into(),
            namespace: Some(self.shared.namespace.clone()),
            pod: Some(name),
            node: Some(node),
            container: Some(CONTAINER.into()),
            image: Some(profile.image().to_string()),
            profile: Some(profile_name.to_string()),
            pod_start_ms: Some(pod_start.as_millis() as u64),
            workspace: spec.workspace.as_ref().map(|w| w.workspace.id.clone()),
            workspace_version: spec.workspace.as_ref().map(|w| w.workspace.digest.clone()),
            ..Default::default()
        };
        let token = opts.cancel.child_token();
        let (tx, rx) = mpsc::channel(EVENT_BUFFER);
        let input = Input {
            open: wants_stdin,
            header: command.header,
            user: opts.stdin,
            can_close,
            ping: self.shared.ping_interval,
        };
        let before_exit = match (&spec.workspace, profile.workspace_path.clone()) {
            (Some(run), Some(path)) if !run.sync_back.is_empty() => {
                let (pods, pod, run, cancel) = (
                    self.shared.pods.clone(),
                    guard.name.clone(),
                    run.clone(),
                    token.clone(),
                );
                let shell = profile.shell().to_owned();
                let hook: super::stream::BeforeExit = Box::new(move || {
                    Box::pin(async move {
                        super::workspace::sync_back(&pods, &pod, &path, &shell, &run, &cancel).await
                    })
                });
                Some(hook)
            }
            _ => None,
        };
        tokio::spawn(supervise(
            connection.into_stream(),
            input,
            tx,
            token.clone(),
            guard,
            super::stream::Ending {
                executable: spec.executable,
                shell: profile.shell().to_string(),
                before_exit,
            },
        ));
        Ok(Execution::new(context, rx, token))
    }

    pub(super) fn profile(&self, name: &str) -> Result<&Profile, ErrorBody> {
        self.profiles.get(name).ok_or_else(|| {
            ErrorBody::new(
                ErrorCode::UnknownProfile,
                format!(
                    "unknown profile {name:?}; configured profiles: {}",
                    self.profiles.keys().cloned().collect::<Vec<_>>().join(", ")
                ),
            )
        })
    }

    /// Watches the pod (kube-runtime's `watch_object`: a watch, not polling, resumed from
    /// the last resourceVersion after a transport error, relisted after 410 Gone) until its
    /// runner container runs or the start budget ends; reports phases on the way. Returns
    /// the node.
    async fn wait_running(
        &self,
        created: Pod,
        budget_end: Instant,
        start_timeout: Duration,
        timings: &mut Timings,
        progress: &Progress,
    ) -> Result<String, ErrorBody> {
        let name = created.name_any();
        let mut watch = Watch {
            last: Waiting {
                phase: Phase::Scheduling,
                what: "no status yet".into(),
                problem: None,
            },
            // `run` reported Scheduling when it created the pod.
            reported: Some((Phase::Scheduling, String::new())),
            scheduled: false,
        };
        let timed_out = |last: &Waiting| match &last.problem {
            Some(p) => ErrorBody::new(
                p.code,
                format!(
                    "{} (still so after {}s, kubernetes.pod_start_timeout_secs)",
                    p.message,
                    start_timeout.as_secs()
                ),
            ),
            None => ErrorBody::new(
                ErrorCode::PodStartTimeout,
                format!(
                    "runner pod {name} was not running after {}s (kubernetes.pod_start_timeout_secs); last state: {}",
                    start_timeout.as_secs(),
                    last.what
                ),
            ),
        };
        if let Some(done) = watch.observe(&created, timings, progress) {
            return done;
        }
        let mut events = watcher::watch_object(self.shared.pods.clone(), &name)
            .default_backoff()
            .boxed();
        loop {
            let next = match tokio::time::timeout_at(budget_end, events.next()).await {
                Ok(n) => n,
                Err(_) => return Err(timed_out(&watch.last)),
            };
            match next {
                Some(Ok(Some(pod))) => {
                    if let Some(done) = watch.observe(&pod, timings, progress) {
                        return done;
                    }
                }
                Some(Ok(None)) => {
                    return Err(ErrorBody::new(
                        ErrorCode::PodFailed,
                        format!("runner pod {name} was deleted while it started"),
                    ));
                }
                Some(Err(e)) => {
                    if let Some(kube::Error::Api(s)) = watcher_api_error(&e)
                        && matches!(s.code, 401 | 403)
                    {
                        return Err(api_error(
                            "cannot watch the runner pod",
                            &kube::Error::Api(s.clone()),
                        ));
                    }
                    // Transport errors and expired resourceVersions heal: the watcher
                    // resumes (after a backoff) from where it was.
                    tracing::debug!(pod = name, "watching the runner pod: {e}; resuming");
                }
                None => return Err(timed_out(&watch.last)),
            }
        }
    }
}

/// The API answer behind a watcher error, if it was one.
fn watcher_api_error(e: &watcher::Error) -> Option<&kube::Error> {
    match e {
        watcher::Error::InitialListFailed(e)
        | watcher::Error::WatchStartFailed(e)
        | watcher::Error::WatchFailed(e) => Some(e),
        _ => None,
    }
}

/// What `wait_running` has seen so far.
struct Watch {
    last: Waiting,
    /// The last phase reported, to report each change once.
    reported: Option<(Phase, String)>,
    scheduled: bool,
}

impl Watch {
    /// Looks at one state of the pod: `Some` when the wait is over.
    fn observe(
        &mut self,
        pod: &Pod,
        timings: &mut Timings,
        progress: &Progress,
    ) -> Option<Result<String, ErrorBody>> {
        if !self.scheduled
            && let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.as_ref())
        {
            self.scheduled = true;
            timings.mark("scheduled");
            progress.report(Phase::Scheduled, Some(node.clone()));
            self.reported = Some((Phase::Scheduled, node.clone()));
        }
        match status::assess(pod, CONTAINER) {
            PodState::Running { node } => {
                timings.mark("running");
                Some(Ok(node))
            }
            PodState::Failed(e) => Some(Err(e)),
            PodState::Waiting(w) => {
                // Scheduling → scheduled → pulling → starting: a phase is reported when it
                // (or its detail) changes, never backwards past Scheduled.
                // A new detail is news only when it is a problem (Unschedulable, a failing
                // pull): the caller learns why it waits.
                let fresh = self
                    .reported
                    .as_ref()
                    .is_none_or(|(p, m)| *p != w.phase || (w.problem.is_some() && *m != w.what));
                let backwards = self.scheduled && w.phase == Phase::Scheduling;
                if fresh && !backwards && w.phase != Phase::Scheduled {
                    progress.report(w.phase, Some(w.what.clone()));
                    self.reported = Some((w.phase, w.what.clone()));
                }
                self.last = w;
                None
            }
        }
    }
}

/// Maps a Kubernetes API failure before the stream started.
pub(super) fn api_error(what: &str, e: &kube::Error) -> ErrorBody {
    match e {
        kube::Error::Api(s) => {
            let code = match s.code {
                400 | 422 => ErrorCode::ContainerConfigError,
                401 | 403 | 404 | 409 => ErrorCode::StartFailed,
                _ => ErrorCode::BackendUnavailable,
            };
            ErrorBody::new(
                code,
                format!("{what}: {} ({}, HTTP {})", s.message, s.reason, s.code),
            )
        }
        other => ErrorBody::new(
            ErrorCode::BackendUnavailable,
            format!("{what}: the Kubernetes API server is not reachable: {other}"),
        ),
    }
}

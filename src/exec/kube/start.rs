//! A request's pod from creation to a started command: create it (or claim a warm one),
//! watch it until its container runs, exec the command in it. Every API call is bounded:
//! the whole start by `kubernetes.pod_start_timeout_secs`, each create attempt and the exec
//! upgrade by their own timeouts, and retries of overloaded or failing API servers by the
//! start budget (docs/kubernetes.md, "Start-up on real clusters").

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt as _;
use kube::api::{AttachParams, PostParams};
use tokio::sync::{OwnedSemaphorePermit, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::backoff::{self, Budget, EXEC_UPGRADE_TIMEOUT, Failure, WatchEnd};
use super::config::Profile;
use super::error::KubeError;
use super::error::api_error;
use super::guard::{PodGuard, Timings};
use super::pod::{self, CONTAINER, LABEL_GATEWAY, LABEL_INSTANCE};
use super::status::{self, PodState, Waiting};
use super::stream::{Input, supervise};
use super::{DEADLINE_MARGIN_SECS, KubeExecutor};
use crate::contract::{ErrorBody, Phase, RunContext};
use crate::exec::{EVENT_BUFFER, ExecSpec, Execution, Progress, StartOptions};

/// One pod create call may take this long before it is retried.
const CREATE_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);

/// A pod whose runner container runs, ready for the command.
struct RunningPod {
    /// Owns the pod: it goes when the run ends.
    guard: PodGuard,
    timings: Timings,
    node: String,
    /// The end of the start budget, which the exec's start counts against too.
    budget_end: Instant,
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
        // The start budget covers the wait for a slot, the pod's start and the exec.
        let start_timeout = Duration::from_secs(self.config.pod_start_timeout_secs);
        let budget_end = Instant::now() + start_timeout;
        let permit = self.slot(budget_end, &opts).await?;
        let pool = self.pools.get().and_then(|p| p.get(&profile_name)).cloned();
        if let Some(pool) = pool {
            let mut timings = Timings::new();
            if let Some((name, node)) = pool.claim(spec.timeout).await {
                timings.mark("claimed");
                opts.progress
                    .report(Phase::Scheduled, Some(format!("warm pod {name} on {node}")));
                let guard = PodGuard::arm(self.shared.clone(), name, permit);
                let pod = RunningPod {
                    guard,
                    timings,
                    node,
                    budget_end,
                };
                return self.exec_in(spec, opts, pod, &profile_name, &profile).await;
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
            _ = opts.cancel.cancelled() => return Err(KubeError::ShuttingDown.into()),
        };
        timings.mark("created");
        opts.progress
            .report(Phase::Scheduling, Some(format!("pod {name} created")));
        tracing::debug!(pod = name, profile = profile_name, "runner pod created");

        let node = tokio::select! {
            r = self.wait_running(created, budget_end, start_timeout, &mut timings, &opts.progress) => r?,
            _ = opts.cancel.cancelled() => return Err(KubeError::ShuttingDown.into()),
        };
        self.shared.metrics.observe_pod_start(timings.since_start());
        let pod = RunningPod {
            guard,
            timings,
            node,
            budget_end,
        };
        let execution = self
            .exec_in(spec, opts, pod, &profile_name, &profile)
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

    /// A pod slot (`max_concurrent_pods`): at once when one is free, else after the runs
    /// queued before this one (tokio's semaphore is fair: first come, first served), within
    /// the start budget. Refused with 429 only when `max_queued_runs` runs wait already.
    pub(super) async fn slot(
        &self,
        budget_end: Instant,
        opts: &StartOptions,
    ) -> Result<OwnedSemaphorePermit, KubeError> {
        use std::sync::atomic::Ordering;
        if let Ok(permit) = self.permits.clone().try_acquire_owned() {
            return Ok(permit);
        }
        let max = self.config.max_concurrent_pods;
        let ahead = self.queued.fetch_add(1, Ordering::SeqCst);
        struct Leave<'a>(&'a std::sync::atomic::AtomicUsize);
        impl Drop for Leave<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }
        let _leave = Leave(&self.queued);
        if ahead >= self.config.max_queued_runs {
            return Err(KubeError::QueueFull { max, ahead });
        }
        opts.progress.report(
            Phase::Queued,
            Some(format!(
                "waiting for a pod slot: {max} runner pods are running (kubernetes.max_concurrent_pods), {ahead} runs queued before this one"
            )),
        );
        let queued_at = Instant::now();
        tokio::select! {
            r = tokio::time::timeout_at(budget_end, self.permits.clone().acquire_owned()) => match r {
                Ok(Ok(permit)) => {
                    tracing::debug!(waited_ms = queued_at.elapsed().as_millis() as u64, "pod slot after queueing");
                    Ok(permit)
                }
                Ok(Err(_)) => Err(KubeError::ShuttingDown),
                Err(_) => Err(KubeError::NoSlot { queued_secs: queued_at.elapsed().as_secs(), max }),
            },
            _ = opts.cancel.cancelled() => Err(KubeError::ShuttingDown),
        }
    }

    /// Creates the pod within the start budget: each attempt bounded, 429/5xx and lost
    /// connections retried (backoff.rs: Retry-After honoured, bounded by the budget), and a
    /// 409 AlreadyExists after a retry recognised as our own earlier attempt having
    /// succeeded.
    pub(super) async fn create(
        &self,
        manifest: &Pod,
        budget_end: Instant,
    ) -> Result<Pod, KubeError> {
        let name = manifest.name_any();
        let mut attempts = 0u32;
        let budget = Budget {
            end: budget_end,
            attempt: CREATE_ATTEMPT_TIMEOUT,
            retry_internal: true,
        };
        backoff::call("creating the runner pod", budget, || {
            attempts += 1;
            let retried = attempts > 1;
            let name = &name;
            async move {
                self.shared.throttle.acquire().await;
                match self
                    .shared
                    .pods
                    .create(&PostParams::default(), manifest)
                    .await
                {
                    // Names are random and ours: an earlier attempt whose answer was lost.
                    Err(kube::Error::Api(s)) if s.code == 409 && retried => {
                        match self.shared.pods.get(name).await {
                            Ok(p) if self.is_ours(&p) => Ok(p),
                            _ => Err(kube::Error::Api(s)),
                        }
                    }
                    r => r,
                }
            }
        })
        .await
        .map_err(|f| self.start_error("cannot create the runner pod", f))
    }

    fn start_error(&self, what: &str, f: Failure) -> KubeError {
        self.shared.start_error(what, f)
    }

    fn unreachable(&self, what: &str, why: &str) -> KubeError {
        self.shared.unreachable(what, why)
    }

    /// Whether a pod found under our chosen name was created by this gateway.
    fn is_ours(&self, p: &Pod) -> bool {
        let l = p.labels();
        l.get(LABEL_INSTANCE) == Some(&self.shared.identity.instance)
            && l.get(LABEL_GATEWAY) == Some(&self.shared.identity.gateway)
    }

    /// Starts the command in a running pod of `profile`.
    async fn exec_in(
        &self,
        spec: ExecSpec,
        opts: StartOptions,
        pod: RunningPod,
        profile_name: &str,
        profile: &Profile,
    ) -> Result<Execution, ErrorBody> {
        let RunningPod {
            mut guard,
            mut timings,
            node,
            budget_end,
        } = pod;
        let name = guard.name.clone();
        let pod_start = timings.since_start();
        opts.progress.report(
            Phase::Starting,
            Some(format!("starting the command in pod {name}")),
        );
        let mut cwd = spec.cwd.clone();
        if let Some(run) = &spec.workspace {
            let path = super::workspace::workspace_path(profile_name, profile)?;
            cwd = Some(
                self.shared
                    .place_workspace(&name, run, path, None, &opts.cancel)
                    .await?,
            );
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
        let before_exit = match (&spec.workspace, &profile.workspace_path) {
            (Some(run), Some(path)) => {
                sync_back_hook(&self.shared, &guard.name, path, profile.shell(), run)
            }
            _ => None,
        };
        guard.timings = Some(timings);
        Ok(exec_command(
            &self.shared,
            command,
            spec.executable,
            profile.shell(),
            opts,
            guard,
            context,
            budget_end,
            before_exit,
        )
        .await?)
    }

    pub(super) fn profile(&self, name: &str) -> Result<&Profile, KubeError> {
        self.profiles
            .get(name)
            .ok_or_else(|| KubeError::UnknownProfile {
                name: name.to_owned(),
                profiles: self.profiles.keys().cloned().collect::<Vec<_>>().join(", "),
            })
    }

    /// Watches the pod (kube-runtime's `watch_object`: a watch, not polling, resumed from
    /// the last resourceVersion after a transport error, relisted after 410 Gone) until its
    /// runner container runs or the start budget ends; reports phases on the way. Returns
    /// the node.
    pub(super) async fn wait_running(
        &self,
        created: Pod,
        budget_end: Instant,
        start_timeout: Duration,
        timings: &mut Timings,
        progress: &Progress,
    ) -> Result<String, KubeError> {
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
            Some(p) => KubeError::StillSo {
                problem: p.clone(),
                secs: start_timeout.as_secs(),
            },
            None => KubeError::NotRunning {
                pod: name.clone(),
                secs: start_timeout.as_secs(),
                last: last.what.clone(),
            },
        };
        if let Some(done) = watch.observe(&created, timings, progress) {
            return done;
        }
        let seen = backoff::watch_pod(&self.shared.pods, &name, budget_end, |pod| match pod {
            Some(p) => watch.observe(&p, timings, progress),
            None => Some(Err(KubeError::DeletedWhileStarting(name.clone()))),
        })
        .await;
        match seen {
            Ok(done) => done,
            Err(WatchEnd::Deadline) => Err(timed_out(&watch.last)),
            Err(WatchEnd::Refused(e)) => Err(api_error("cannot watch the runner pod", &e)),
            Err(WatchEnd::Unreachable(why)) => {
                Err(self.unreachable("cannot watch the runner pod", &why))
            }
        }
    }
}

/// What runs before a successful `exit` is reported (workspace sync-back), given the
/// call's cancellation token.
/// The sync-back after a command in `pod` that ran in `run` below `path`, when the run asked
/// for one.
pub(super) fn sync_back_hook(
    shared: &super::Shared,
    pod: &str,
    path: &str,
    shell: &str,
    run: &crate::workspace::WorkspaceRun,
) -> Option<SyncBack> {
    if run.sync_back.is_empty() {
        return None;
    }
    let (pods, pod, run) = (shared.pods.clone(), pod.to_owned(), run.clone());
    let (path, shell) = (path.to_owned(), shell.to_owned());
    Some(Box::new(move |cancel: CancellationToken| {
        Box::pin(async move {
            super::workspace::sync_back(&pods, &pod, &path, &shell, &run, &cancel).await
        })
    }))
}

pub(super) type SyncBack = Box<
    dyn FnOnce(
            CancellationToken,
        ) -> futures_util::future::BoxFuture<'static, Vec<crate::contract::Event>>
        + Send,
>;

/// Opens the exec of `command` in the running pod `guard` names and supervises it: the part
/// of a start shared by one-shot runs and the calls of a kept runner (whose guard kills the
/// call instead of deleting the pod).
#[allow(clippy::too_many_arguments)]
pub(super) async fn exec_command(
    shared: &std::sync::Arc<super::Shared>,
    command: pod::argv::ExecCommand,
    executable: String,
    shell: &str,
    opts: StartOptions,
    guard: PodGuard,
    context: RunContext,
    budget_end: Instant,
    before_exit: Option<SyncBack>,
) -> Result<Execution, KubeError> {
    let name = guard.name.clone();
    let wants_stdin = command.wants_stdin(opts.stdin.is_some());
    let wrapped = command.header.is_some();
    let params = AttachParams {
        container: Some(CONTAINER.into()),
        stdin: wants_stdin,
        stdout: true,
        stderr: true,
        tty: false,
        ..Default::default()
    };
    let build = || {
        kube::core::Request::new(<Pod as kube::Resource>::url_path(
            &(),
            Some(&shared.namespace),
        ))
        .exec(&name, command.argv.clone(), &params)
    };
    build().map_err(|e| KubeError::ExecRequest(e.to_string()))?;
    // The upgrade gets at least one full attempt, even when the pod took most of the
    // start budget; 429/503/504 are retried within it (a 500 is the kubelet's answer).
    let budget = Budget {
        end: budget_end.max(Instant::now() + EXEC_UPGRADE_TIMEOUT),
        attempt: EXEC_UPGRADE_TIMEOUT,
        retry_internal: false,
    };
    let connect = backoff::call("opening the exec stream", budget, || {
        let request = build();
        async move {
            shared.throttle.acquire().await;
            shared
                .client
                .connect(request.map_err(kube::Error::BuildRequest)?)
                .await
        }
    });
    let connection = tokio::select! {
        r = connect => r.map_err(|f| shared.start_error("cannot exec in the runner pod", f))?,
        _ = opts.cancel.cancelled() => return Err(KubeError::ShuttingDown),
    };
    let can_close = connection.supports_stream_close();
    let mut guard = guard;
    if let Some(t) = guard.timings.as_mut() {
        t.mark("exec started");
    }
    opts.progress.report(Phase::Running, None);
    let token = opts.cancel.child_token();
    let (tx, rx) = mpsc::channel(EVENT_BUFFER);
    let input = Input {
        open: wants_stdin,
        header: command.header,
        user: opts.stdin,
        can_close,
        ping: shared.ping_interval,
    };
    let before_exit = before_exit.map(|hook| {
        let cancel = token.clone();
        let hook: super::stream::BeforeExit = Box::new(move || hook(cancel));
        hook
    });
    tokio::spawn(supervise(
        connection.into_stream(),
        input,
        tx,
        token.clone(),
        guard,
        super::stream::Ending {
            executable,
            shell: shell.to_string(),
            wrapped,
            before_exit,
        },
    ));
    Ok(Execution::new(context, rx, token))
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
    ) -> Option<Result<String, KubeError>> {
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
            PodState::Failed(e) => Some(Err(e.into())),
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

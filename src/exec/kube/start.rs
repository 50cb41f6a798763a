//! A request's pod from creation to a started command: create it (or claim a warm one),
//! watch it until its container runs, exec the command in it.

use std::time::Duration;

use futures_util::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt as _;
use kube::api::{AttachParams, PostParams, WatchEvent, WatchParams};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::config::Profile;
use super::guard::{PodGuard, Timings};
use super::pod::{self, CONTAINER};
use super::status::{self, PodState};
use super::stream::supervise;
use super::{DEADLINE_MARGIN_SECS, KubeExecutor};
use crate::contract::{ErrorBody, ErrorCode, RunContext};
use crate::exec::{EVENT_BUFFER, ExecSpec, Execution, READ_CHUNK};

impl KubeExecutor {
    /// Creates the pod, waits until it runs, starts the command.
    pub(super) async fn run(
        &self,
        spec: ExecSpec,
        cancel: CancellationToken,
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
                let guard = PodGuard::arm(self.shared.clone(), name, permit);
                return self
                    .exec_in(spec, cancel, guard, timings, node, &profile_name, &profile)
                    .await;
            }
        }
        let start_timeout = Duration::from_secs(self.config.pod_start_timeout_secs);
        let deadline =
            spec.timeout.as_secs() + self.config.pod_start_timeout_secs + DEADLINE_MARGIN_SECS;
        let name = pod::pod_name();
        let mut timings = Timings::new();
        let manifest = pod::build(
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
        // Armed before the create call: whatever happens from here, the pod goes.
        let guard = PodGuard::arm(self.shared.clone(), name.clone(), permit);
        let created = self
            .shared
            .pods
            .create(&PostParams::default(), &manifest)
            .await
            .map_err(|e| api_error("cannot create the runner pod", &e))?;
        timings.mark("created");
        tracing::debug!(pod = name, profile = profile_name, "runner pod created");

        let mut last_seen = String::from("no status yet");
        let running = tokio::select! {
            r = tokio::time::timeout(start_timeout, self.wait_running(created, &mut timings, &mut last_seen)) => r,
            _ = cancel.cancelled() => {
                return Err(ErrorBody::new(ErrorCode::ShuttingDown, "the gateway is shutting down"));
            }
        };
        let node = match running {
            Ok(r) => r?,
            Err(_) => {
                return Err(ErrorBody::new(
                    ErrorCode::PodStartTimeout,
                    format!(
                        "runner pod {name} was not running after {}s (kubernetes.pod_start_timeout_secs); last state: {last_seen}",
                        start_timeout.as_secs()
                    ),
                ));
            }
        };
        self.shared.metrics.observe_pod_start(timings.since_start());
        self.exec_in(spec, cancel, guard, timings, node, &profile_name, &profile)
            .await
    }

    /// Starts the command in a running pod that `guard` owns.
    #[allow(clippy::too_many_arguments)]
    async fn exec_in(
        &self,
        spec: ExecSpec,
        cancel: CancellationToken,
        mut guard: PodGuard,
        mut timings: Timings,
        node: String,
        profile_name: &str,
        profile: &Profile,
    ) -> Result<Execution, ErrorBody> {
        let name = guard.name.clone();
        let pod_start = timings.since_start();
        let mut cwd = spec.cwd.clone();
        if let Some(run) = &spec.workspace {
            let path = super::workspace::workspace_path(profile_name, profile, run)?;
            cwd = Some(self.place_workspace(&name, run, path, &cancel).await?);
            timings.mark("workspace placed");
        }
        let argv = pod::argv::exec_argv(
            profile.shell(),
            &spec.executable,
            &spec.args,
            cwd.as_deref(),
            &spec.env,
        );
        let params = AttachParams {
            container: Some(CONTAINER.into()),
            stdin: false,
            stdout: true,
            stderr: true,
            tty: false,
            max_stdout_buf_size: Some(READ_CHUNK),
            max_stderr_buf_size: Some(READ_CHUNK),
            ..Default::default()
        };
        let attached = tokio::select! {
            r = self.shared.pods.exec(&name, argv, &params) => r.map_err(|e| api_error("cannot exec in the runner pod", &e))?,
            _ = cancel.cancelled() => {
                return Err(ErrorBody::new(ErrorCode::ShuttingDown, "the gateway is shutting down"));
            }
        };
        timings.mark("exec started");
        guard.timings = Some(timings);

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
        let token = cancel.child_token();
        let (tx, rx) = mpsc::channel(EVENT_BUFFER);
        tokio::spawn(supervise(
            attached,
            tx,
            token.clone(),
            guard,
            spec.executable,
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

    /// Watches the pod (a watch, not polling) until its runner container runs; returns the
    /// node. `last_seen` keeps what it waited for, for the timeout message.
    async fn wait_running(
        &self,
        created: Pod,
        timings: &mut Timings,
        last_seen: &mut String,
    ) -> Result<String, ErrorBody> {
        let name = created.name_any();
        let mut rv = created.resource_version().unwrap_or_default();
        let mut scheduled = false;
        let mut observe = |pod: &Pod, timings: &mut Timings| -> Option<Result<String, ErrorBody>> {
            if !scheduled
                && pod
                    .spec
                    .as_ref()
                    .and_then(|s| s.node_name.as_ref())
                    .is_some()
            {
                scheduled = true;
                timings.mark("scheduled");
            }
            match status::assess(pod, CONTAINER) {
                PodState::Running { node } => Some(Ok(node)),
                PodState::Failed(e) => Some(Err(e)),
                PodState::Waiting(w) => {
                    *last_seen = w;
                    None
                }
            }
        };
        if let Some(done) = observe(&created, timings) {
            return done.inspect(|_| timings.mark("running"));
        }
        loop {
            let params = WatchParams::default()
                .fields(&format!("metadata.name={name}"))
                .timeout(290);
            let mut events = self
                .shared
                .pods
                .watch(&params, &rv)
                .await
                .map_err(|e| api_error("cannot watch the runner pod", &e))?
                .boxed();
            while let Some(event) = events
                .try_next()
                .await
                .map_err(|e| api_error("watching the runner pod failed", &e))?
            {
                match event {
                    WatchEvent::Added(p) | WatchEvent::Modified(p) => {
                        rv = p.resource_version().unwrap_or(rv);
                        if let Some(done) = observe(&p, timings) {
                            return done.inspect(|_| timings.mark("running"));
                        }
                    }
                    WatchEvent::Deleted(_) => {
                        return Err(ErrorBody::new(
                            ErrorCode::PodFailed,
                            format!("runner pod {name} was deleted while it started"),
                        ));
                    }
                    WatchEvent::Bookmark(b) => rv = b.metadata.resource_version,
                    WatchEvent::Error(e) if e.code == 410 => {
                        // Our resourceVersion is too old: start again from the pod as it is.
                        let p = self
                            .shared
                            .pods
                            .get(&name)
                            .await
                            .map_err(|e| api_error("cannot read the runner pod", &e))?;
                        rv = p.resource_version().unwrap_or_default();
                        if let Some(done) = observe(&p, timings) {
                            return done.inspect(|_| timings.mark("running"));
                        }
                        break;
                    }
                    WatchEvent::Error(e) => {
                        return Err(ErrorBody::new(
                            ErrorCode::BackendError,
                            format!("watching runner pod {name}: {} ({})", e.message, e.reason),
                        ));
                    }
                }
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

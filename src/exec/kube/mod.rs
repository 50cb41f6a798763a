//! The Kubernetes backend: each request runs in its own ephemeral pod, through the exec API.
//!
//! Per request: create a hardened pod from the request's profile ([`pod`]), watch it until
//! its container runs ([`status::assess`] turns pod states into specific errors), exec the
//! command in it (argv as argv; `cwd` and `env` through a constant wrapper script, see
//! [`status::exec_argv`]), stream stdout and stderr as they arrive, map the exec status
//! channel to the same `exit` event as the local backend, and delete the pod (grace 0).
//!
//! Cleanup on every path: a [`PodGuard`] is armed before the pod is created and deletes it
//! when dropped, whatever dropped it (exit, error, timeout, client gone, shutdown); the
//! executor's shutdown waits for those deletions; pods carry an owner reference to the
//! gateway pod when it runs in-cluster; and the [`reaper`] deletes leftovers of a crashed
//! gateway at start-up and periodically.

pub mod config;
pub mod pod;
mod pool;
mod reaper;
pub mod status;

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use futures_util::future::BoxFuture;
use futures_util::{FutureExt as _, StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{
    Api, AttachParams, AttachedProcess, DeleteParams, PostParams, WatchEvent, WatchParams,
};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, ResourceExt as _};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use self::config::{KubernetesConfig, Profile};
use self::pod::{CONTAINER, Identity};
use self::status::{ExecEnd, PodState};
use super::{
    EVENT_BUFFER, ExecSpec, Execution, Executor, READ_CHUNK, StartOptions, forward, read_opt,
};
use crate::contract::{ErrorBody, ErrorCode, Event, ExitInfo, RunContext};

/// Beyond the request's timeout and the start timeout, how long a runner pod may live
/// before Kubernetes itself kills it (`activeDeadlineSeconds`): the backstop if the gateway
/// dies without deleting it.
const DEADLINE_MARGIN_SECS: u64 = 120;

/// After the exec status arrived, how long output may still trickle in.
const DRAIN_GRACE: Duration = Duration::from_secs(2);

/// How long a pod deletion may be retried.
const DELETE_ATTEMPTS: u32 = 5;

/// Why the backend could not be set up (the gateway does not start).
#[derive(Debug, thiserror::Error)]
pub enum KubeSetupError {
    #[error("cannot read the kubeconfig: {0}")]
    Kubeconfig(#[from] kube::config::KubeconfigError),
    #[error("no Kubernetes credentials: {0}")]
    Infer(#[from] kube::config::InferConfigError),
    #[error("cannot build the Kubernetes client: {0}")]
    Client(#[from] kube::Error),
}

/// Runs each command in its own pod.
pub struct KubeExecutor {
    shared: Arc<Shared>,
    client: Client,
    profiles: BTreeMap<String, Profile>,
    config: KubernetesConfig,
    permits: Arc<Semaphore>,
    reaper: CancellationToken,
    /// Permissions the start-up access review found missing (re-checked by `/readyz`).
    missing: Mutex<Option<Vec<String>>>,
    /// Warm pools of the profiles that have one, started by `prepare`.
    pools: std::sync::OnceLock<BTreeMap<String, Arc<pool::WarmPool>>>,
}

/// What pod guards need after the request that armed them is gone.
struct Shared {
    pods: Api<Pod>,
    namespace: String,
    identity: Identity,
    /// Pods this process created and has not deleted yet; the reaper leaves them alone.
    live: Mutex<HashSet<String>>,
    /// Pending deletions, awaited at shutdown.
    deletions: TaskTracker,
}

impl KubeExecutor {
    /// Connects with the in-cluster account, else the kubeconfig (`KUBECONFIG` or
    /// `~/.kube/config`); `kubernetes.kubeconfig` / `kubernetes.context` pick one explicitly.
    pub async fn connect(
        config: KubernetesConfig,
        profiles: BTreeMap<String, Profile>,
    ) -> Result<Self, KubeSetupError> {
        // Whichever TLS user comes first installs the process's crypto provider.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let kube_config = if config.kubeconfig.is_some() || config.context.is_some() {
            let options = KubeConfigOptions {
                context: config.context.clone(),
                ..Default::default()
            };
            match &config.kubeconfig {
                Some(path) => {
                    kube::Config::from_custom_kubeconfig(Kubeconfig::read_from(path)?, &options)
                        .await?
                }
                None => kube::Config::from_kubeconfig(&options).await?,
            }
        } else if let Ok(c) = kube::Config::incluster() {
            c
        } else {
            kube::Config::infer().await?
        };
        let namespace = config
            .namespace
            .clone()
            .unwrap_or_else(|| kube_config.default_namespace.clone());
        let client = Client::try_from(kube_config)?;
        let gateway = std::env::var("MCP_RUN_POD_NAME")
            .ok()
            .filter(|s| !s.is_empty())
            .or_else(|| {
                nix::unistd::gethostname()
                    .ok()
                    .and_then(|h| h.into_string().ok())
            })
            .unwrap_or_else(|| "gateway".into());
        let identity = Identity {
            instance: config.instance.clone(),
            gateway: pod::label_value(&gateway),
            owner: pod::owner_from_env(|k| std::env::var(k).ok(), &namespace),
        };
        tracing::info!(
            namespace,
            instance = identity.instance,
            gateway = identity.gateway,
            owner_reference = identity.owner.is_some(),
            profiles = ?profiles.keys().collect::<Vec<_>>(),
            "Kubernetes backend"
        );
        Ok(Self {
            shared: Arc::new(Shared {
                pods: Api::namespaced(client.clone(), &namespace),
                namespace,
                identity,
                live: Mutex::new(HashSet::new()),
                deletions: TaskTracker::new(),
            }),
            client,
            permits: Arc::new(Semaphore::new(config.max_concurrent_pods)),
            profiles,
            config,
            reaper: CancellationToken::new(),
            missing: Mutex::new(None),
            pools: std::sync::OnceLock::new(),
        })
    }

    /// Checks permissions and deletes this gateway's leftovers from a previous run, then
    /// starts the periodic reaper and the warm pools. Called once before serving;
    /// `longest_request` is the server's maximum timeout.
    pub async fn prepare(&self, longest_request: Duration) {
        self.check_permissions().await;
        let reaper = reaper::Reaper {
            pods: self.shared.pods.clone(),
            identity: self.shared.identity.clone(),
            min_age: Duration::from_secs(self.config.reaper_min_age_secs),
        };
        let live = self.shared.clone();
        let is_live = move |name: &str| live.live.lock().map(|l| l.contains(name)).unwrap_or(true);
        match reaper.startup().await {
            Ok(n) if n > 0 => tracing::info!(
                deleted = n,
                "deleted runner pods left by a previous run of this gateway"
            ),
            Ok(_) => {}
            Err(e) => tracing::warn!("start-up reaping failed: {e}"),
        }
        let pools = self
            .profiles
            .iter()
            .filter(|(_, p)| p.warm_pool.size > 0)
            .map(|(name, p)| {
                let pool = pool::WarmPool::start(
                    self.shared.clone(),
                    name,
                    p,
                    longest_request + Duration::from_secs(self.config.pod_start_timeout_secs),
                    self.reaper.child_token(),
                );
                tracing::info!(profile = name, size = pool.size(), "warm pool started");
                (name.clone(), pool)
            })
            .collect();
        let _ = self.pools.set(pools);
        let interval = Duration::from_secs(self.config.reaper_interval_secs);
        let stop = self.reaper.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.tick().await;
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => {}
                }
                match reaper.sweep(&is_live).await {
                    Ok(n) if n > 0 => {
                        tracing::info!(deleted = n, "reaper deleted leftover runner pods")
                    }
                    Ok(_) => {}
                    Err(e) => tracing::warn!("reaper: {e}"),
                }
            }
        });
    }

    /// SelfSubjectAccessReview for everything the backend calls; logs exactly what is
    /// missing. Returns the missing permissions.
    async fn check_permissions(&self) -> Vec<String> {
        let ns = self.shared.namespace.clone();
        // Exec over WebSocket is authorized as `get` pods/exec, and from Kubernetes 1.35 as
        // `create` too. The warm pool claims pods with `patch`.
        let mut needed = vec![
            ("", "create"),
            ("", "get"),
            ("", "list"),
            ("", "watch"),
            ("", "delete"),
            ("exec", "create"),
            ("exec", "get"),
        ];
        if self.profiles.values().any(|p| p.warm_pool.size > 0) {
            needed.push(("", "patch"));
        }
        let api: Api<SelfSubjectAccessReview> = Api::all(self.client.clone());
        let mut missing = Vec::new();
        for (sub, verb) in needed {
            let review = SelfSubjectAccessReview {
                spec: SelfSubjectAccessReviewSpec {
                    resource_attributes: Some(ResourceAttributes {
                        namespace: Some(ns.clone()),
                        resource: Some("pods".into()),
                        subresource: (!sub.is_empty()).then(|| sub.to_string()),
                        verb: Some(verb.into()),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                ..Default::default()
            };
            let what = if sub.is_empty() {
                format!("{verb} pods")
            } else {
                format!("{verb} pods/{sub}")
            };
            match api.create(&PostParams::default(), &review).await {
                Ok(r) if r.status.as_ref().is_some_and(|s| s.allowed) => {}
                Ok(r) => {
                    let why = r.status.and_then(|s| s.reason).unwrap_or_default();
                    tracing::error!(
                        namespace = ns,
                        permission = what,
                        reason = why,
                        "the gateway is missing a permission it needs"
                    );
                    missing.push(what);
                }
                Err(e) => {
                    tracing::warn!(
                        namespace = ns,
                        permission = what,
                        "cannot check permission: {e}"
                    );
                }
            }
        }
        if missing.is_empty() {
            tracing::info!(namespace = ns, "permissions to run pods checked");
        }
        if let Ok(mut m) = self.missing.lock() {
            *m = Some(missing.clone());
        }
        missing
    }

    /// Creates the pod, waits until it runs, starts the command.
    async fn run(&self, spec: ExecSpec, cancel: CancellationToken) -> Result<Execution, ErrorBody> {
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
        crate::metrics::observe_pod_start(timings.since_start());
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
        let argv = status::exec_argv(
            profile.shell(),
            &spec.executable,
            &spec.args,
            spec.cwd.as_deref(),
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

    fn profile(&self, name: &str) -> Result<&Profile, ErrorBody> {
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

impl Executor for KubeExecutor {
    fn name(&self) -> &'static str {
        "kubernetes"
    }

    fn start(
        &self,
        spec: ExecSpec,
        opts: StartOptions,
    ) -> BoxFuture<'_, Result<Execution, ErrorBody>> {
        Box::pin(self.run(spec, opts.cancel))
    }

    fn check(&self, spec: &ExecSpec) -> Result<(), ErrorBody> {
        self.profile(spec.profile.as_deref().unwrap_or("default"))
            .map(|_| ())
    }

    /// Ready when the API server answers and the gateway has the permissions it needs.
    fn ready(&self) -> BoxFuture<'_, Result<(), ErrorBody>> {
        Box::pin(async move {
            match tokio::time::timeout(Duration::from_secs(3), self.client.apiserver_version())
                .await
            {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    return Err(ErrorBody::new(
                        ErrorCode::BackendUnavailable,
                        format!("the Kubernetes API server is not reachable: {e}"),
                    ));
                }
                Err(_) => {
                    return Err(ErrorBody::new(
                        ErrorCode::BackendUnavailable,
                        "the Kubernetes API server did not answer within 3s",
                    ));
                }
            }
            let missing = self.missing.lock().ok().and_then(|m| m.clone());
            let missing = match missing {
                Some(m) if m.is_empty() => return Ok(()),
                // Not checked yet, or missing last time: permissions may have been granted since.
                _ => self.check_permissions().await,
            };
            if missing.is_empty() {
                Ok(())
            } else {
                Err(ErrorBody::new(
                    ErrorCode::BackendUnavailable,
                    format!(
                        "the gateway may not {} in namespace {}",
                        missing.join(", "),
                        self.shared.namespace
                    ),
                ))
            }
        })
    }

    fn capabilities(&self) -> BoxFuture<'_, crate::capabilities::BackendCapabilities> {
        Box::pin(async move {
            let profiles = self
                .profiles
                .iter()
                .map(|(name, p)| crate::capabilities::ProfileInfo {
                    name: name.clone(),
                    description: p.description.clone(),
                    image: Some(p.image().to_string()),
                    runtime_class: p.runtime_class_name.clone(),
                    resources: p
                        .resources
                        .as_ref()
                        .and_then(|r| serde_json::to_value(r).ok()),
                    warm_pool: p.warm_pool.size,
                })
                .collect();
            crate::capabilities::BackendCapabilities {
                backend: "kubernetes".into(),
                safety_level: "isolated-pod".into(),
                description: format!(
                    "Each command runs in its own new pod in Kubernetes namespace {} (deleted afterwards; no service account token, no privilege escalation, all capabilities dropped).",
                    self.shared.namespace
                ),
                namespace: Some(self.shared.namespace.clone()),
                profiles,
                ..Default::default()
            }
        })
    }

    /// Stops the reaper and the warm pools, deletes the idle pool pods, and waits for every
    /// pod deletion.
    fn shutdown(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            self.reaper.cancel();
            for pool in self.pools.get().into_iter().flat_map(|p| p.values()) {
                pool.drain().await;
            }
            self.shared.deletions.close();
            if tokio::time::timeout(Duration::from_secs(15), self.shared.deletions.wait())
                .await
                .is_err()
            {
                tracing::warn!("runner pod deletions did not finish at shutdown");
            }
            let left: Vec<String> = self
                .shared
                .live
                .lock()
                .map(|l| l.iter().cloned().collect())
                .unwrap_or_default();
            for name in left {
                self.shared.delete(&name).await;
            }
        })
    }
}

impl Shared {
    /// Marks a pod as used by this gateway (the reaper leaves it alone).
    fn track(&self, name: &str) {
        if let Ok(mut live) = self.live.lock() {
            live.insert(name.to_string());
        }
    }

    fn untrack(&self, name: &str) {
        if let Ok(mut live) = self.live.lock() {
            live.remove(name);
        }
    }

    /// Deletes a pod at once (grace 0), retrying transient failures; a pod already gone is
    /// fine.
    async fn delete(&self, name: &str) -> bool {
        let params = DeleteParams {
            grace_period_seconds: Some(0),
            ..DeleteParams::background()
        };
        let mut wait = Duration::from_millis(100);
        for attempt in 1..=DELETE_ATTEMPTS {
            match self.pods.delete(name, &params).await {
                Ok(_) => return true,
                Err(kube::Error::Api(s)) if s.code == 404 => return true,
                Err(e) => {
                    tracing::warn!(pod = name, attempt, "cannot delete runner pod: {e}");
                    tokio::time::sleep(wait).await;
                    wait *= 2;
                }
            }
        }
        tracing::error!(pod = name, "runner pod not deleted; the reaper will retry");
        false
    }
}

/// Deletes its pod when dropped, on every path, and releases the concurrency permit once
/// the pod is gone.
struct PodGuard {
    shared: Arc<Shared>,
    name: String,
    permit: Option<OwnedSemaphorePermit>,
    timings: Option<Timings>,
    /// Deleted already (when killed): the drop only releases.
    deleted: bool,
}

impl PodGuard {
    async fn delete_now(&mut self) {
        self.deleted = self.shared.delete(&self.name).await;
    }

    fn arm(shared: Arc<Shared>, name: String, permit: OwnedSemaphorePermit) -> Self {
        shared.track(&name);
        Self {
            shared,
            name,
            permit: Some(permit),
            timings: None,
            deleted: false,
        }
    }
}

impl Drop for PodGuard {
    fn drop(&mut self) {
        let shared = self.shared.clone();
        let name = std::mem::take(&mut self.name);
        let permit = self.permit.take();
        let timings = self.timings.take();
        let already = self.deleted;
        let cleanup = async move {
            if already || shared.delete(&name).await {
                shared.untrack(&name);
            }
            if let Some(mut t) = timings {
                t.mark("deleted");
                tracing::debug!(pod = name, phases = %t, "runner pod phases");
            }
            drop(permit);
        };
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                // The tracker may be closed at shutdown; spawning on it still tracks.
                self.shared.deletions.spawn_on(cleanup, &handle);
            }
            Err(_) => tracing::error!(pod = self.name, "no runtime to delete the runner pod"),
        }
    }
}

/// Per-phase timings of one request, logged at debug level when its pod is deleted.
struct Timings {
    start: Instant,
    marks: Vec<(&'static str, Duration)>,
}

impl Timings {
    fn new() -> Self {
        Self {
            start: Instant::now(),
            marks: Vec::with_capacity(8),
        }
    }

    fn mark(&mut self, phase: &'static str) {
        self.marks.push((phase, self.start.elapsed()));
    }

    fn since_start(&self) -> Duration {
        self.start.elapsed()
    }
}

impl std::fmt::Display for Timings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, (phase, at)) in self.marks.iter().enumerate() {
            if i > 0 {
                f.write_str(" → ")?;
            }
            write!(f, "{phase} {}ms", at.as_millis())?;
        }
        Ok(())
    }
}

/// Maps a Kubernetes API failure before the stream started.
fn api_error(what: &str, e: &kube::Error) -> ErrorBody {
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

/// Streams the exec's output into the event channel, then its exit; deletes the pod on the
/// way out (the guard). Killing (timeout, client gone, shutdown) deletes the pod at once.
async fn supervise(
    mut process: AttachedProcess,
    tx: mpsc::Sender<Event>,
    cancel: CancellationToken,
    mut guard: PodGuard,
    executable: String,
) {
    let started = Instant::now();
    let mut stdout = process.stdout();
    let mut stderr = process.stderr();
    let mut status_rx = match process.take_status() {
        Some(f) => f.boxed(),
        None => futures_util::future::ready(None).boxed(),
    };
    let (mut out_buf, mut err_buf) = (BytesMut::new(), BytesMut::new());
    let mut status = None;
    let mut first_byte = false;
    let drain = tokio::time::sleep(Duration::MAX / 4);
    tokio::pin!(drain);

    while status.is_none() || stdout.is_some() || stderr.is_some() {
        tokio::select! {
            biased;
            _ = cancel.cancelled() => {
                // The pod goes now; with it the command and everything it started.
                let duration = started.elapsed();
                process.abort();
                drop(process);
                guard.delete_now().await;
                let _ = tx.send(Event::Exit(ExitInfo {
                    code: None,
                    signal: Some(9),
                    duration_ms: duration.as_millis() as u64,
                    timed_out: false,
                })).await;
                return;
            }
            n = read_opt(&mut stdout, &mut out_buf) => {
                mark_first(&mut first_byte, &mut guard);
                if !forward(n, &mut stdout, &mut out_buf, &tx, &cancel, |data| Event::Stdout { data }).await {
                    cancel.cancel();
                }
                if status.is_some() {
                    drain.as_mut().reset(tokio::time::Instant::now() + DRAIN_GRACE);
                }
            }
            n = read_opt(&mut stderr, &mut err_buf) => {
                mark_first(&mut first_byte, &mut guard);
                if !forward(n, &mut stderr, &mut err_buf, &tx, &cancel, |data| Event::Stderr { data }).await {
                    cancel.cancel();
                }
                if status.is_some() {
                    drain.as_mut().reset(tokio::time::Instant::now() + DRAIN_GRACE);
                }
            }
            s = &mut status_rx, if status.is_none() => {
                status = Some(s);
                if let Some(t) = guard.timings.as_mut() {
                    t.mark("exit");
                }
                drain.as_mut().reset(tokio::time::Instant::now() + DRAIN_GRACE);
            }
            _ = &mut drain, if status.is_some() => break,
        }
    }
    let duration_ms = started.elapsed().as_millis() as u64;
    let status = status.flatten();
    let event = match status::exec_end(status.as_ref(), &executable) {
        ExecEnd::Exit { code, signal } => Event::Exit(ExitInfo {
            code,
            signal,
            duration_ms,
            timed_out: false,
        }),
        ExecEnd::NotStarted { stderr, code } => {
            let _ = tx
                .send(Event::Stderr {
                    data: stderr.into(),
                })
                .await;
            Event::Exit(ExitInfo {
                code: Some(code),
                signal: None,
                duration_ms,
                timed_out: false,
            })
        }
        ExecEnd::Error(message) => {
            // Say what happened to the pod, when something did.
            let pod_note = match guard.shared.pods.get_opt(&guard.name).await {
                Ok(None) => Some(format!("runner pod {} was deleted", guard.name)),
                Ok(Some(p)) => match status::assess(&p, CONTAINER) {
                    PodState::Failed(e) => Some(e.message),
                    _ => None,
                },
                Err(_) => None,
            };
            Event::Error {
                code: if pod_note.is_some() {
                    ErrorCode::PodFailed
                } else {
                    ErrorCode::BackendError
                },
                message: match pod_note {
                    Some(n) => format!("{message}: {n}"),
                    None => message,
                },
            }
        }
    };
    let _ = tx.send(event).await;
}

fn mark_first(seen: &mut bool, guard: &mut PodGuard) {
    if !*seen {
        *seen = true;
        if let Some(t) = guard.timings.as_mut() {
            t.mark("first byte");
        }
    }
}

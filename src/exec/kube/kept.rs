//! The Kubernetes backend's kept runner (a session's, or a multi-step run's): one pod that
//! lives across calls ("one pod, many execs").
//!
//! The pod is made like a one-shot run's, from the call's profile (claimed from the
//! profile's warm pool when it has one), and is labelled with a hash of its owner's identity
//! and of the session's name ([`LABEL_SESSION_OWNER`], [`LABEL_SESSION`]; never the raw
//! identity, name or token) and annotated with its expiry (`mcp-run.dev/expires-at`, the
//! session's maximum lifetime; `activeDeadlineSeconds` a little later as the backstop).
//!
//! Each later call is one exec, nothing else: no create, no watch, no delete. The call runs
//! under the wrapper with a tag in its argv ([`pod::argv::kept_exec_command`]); killing the
//! call (timeout, client gone, owner's end) is a second exec that kills the call's process
//! tree ([`pod::argv::KILL_CALL`]) and leaves the pod, with what earlier calls wrote.
//!
//! Loss: one watch per kept pod, opened when it runs, records what happened to it (deleted,
//! evicted, OOM-killed, its node gone); the next call then gets `session_lost` with that
//! reason (see [`crate::session`]), never a fresh pod.
//!
//! Cleanup: `close` (session end, idle TTL, max lifetime) deletes the pod. A session's pod
//! belongs to the installation, not to the replica that made it (no owner reference to the
//! gateway pod): at a gateway's shutdown a live session's pod is left to the other replicas
//! ([`KeptRunner::leave`]), and after a SIGKILL any replica (the restarted one too) finds it
//! by its labels. Any replica's reaper deletes it once its annotations say the session is
//! over; `activeDeadlineSeconds` stops it at the latest. A multi-step run's pod is this
//! gateway's, deleted at its shutdown like a one-shot run's.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use futures_util::future::BoxFuture;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, DropGuard};

use super::error::KubeError;
use super::guard::{PodGuard, Timings};
use super::pod::{self, ANNOTATION_EXPIRES, CONTAINER, LABEL_SESSION, LABEL_SESSION_OWNER};
use super::{DEADLINE_MARGIN_SECS, KubeExecutor, Shared};
use crate::contract::{ErrorBody, Phase, RunContext};
use crate::exec::{
    ExecSpec, Execution, FoundRunner, Gone, KeepFor, KeptRunner, KeptSession, StartOptions,
};

/// A kept runner's pod and what its calls need.
pub(super) struct KubeKept {
    shared: Arc<Shared>,
    name: String,
    context: RunContext,
    shell: String,
    /// Each call's exec upgrade budget (`pod_start_timeout_secs`).
    start_timeout: Duration,
    /// The pod's concurrency slot (`max_concurrent_pods`): held while the pod exists.
    permit: Mutex<Option<OwnedSemaphorePermit>>,
    /// The variables pointing tools at the profile's caches, set for every call (a
    /// request's own values win).
    cache_env: Vec<(String, String)>,
    /// The caches mounted into the pod: released once the pod is gone (after `close`).
    caches: Mutex<Option<super::cache::KubeHold>>,
    /// The profile's `workspace_path` (where a session's tree is kept), and the profile's
    /// name for the error when it has none.
    workspace_path: Option<String>,
    profile: String,
    /// The paths earlier calls' manifests put into the tree ([`super::kept_tree`]); calls
    /// run one at a time, so the lock is never contended.
    tracked: tokio::sync::Mutex<std::collections::BTreeSet<String>>,
    /// What happened to the pod, once something did (set by the fate watch).
    lost: Arc<Mutex<Option<String>>>,
    /// A session any replica may serve (not a multi-step run's runner): its calls take the
    /// pod with a preconditioned annotation ([`ANNOTATION_BUSY_BY`]).
    shared_session: bool,
    /// This runner's holds are `ID-N` (this process's copy; N counts its calls).
    id: String,
    calls: std::sync::atomic::AtomicU64,
    /// The hold the pod was created with, for the opening call.
    opening: Mutex<Option<String>>,
    /// The pod's resourceVersion and annotations as last seen (the fate watch, patches).
    seen: Arc<Mutex<Seen>>,
    /// Woken by every change the fate watch sees.
    changed: Arc<tokio::sync::Notify>,
    /// Stops the fate watch when the runner closes (or is dropped).
    _watch: DropGuard,
    watch: CancellationToken,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl KubeExecutor {
    /// Makes a kept runner's pod from `spec`'s profile (warm pool first), labelled and
    /// annotated for `keep`, and waits until it runs.
    pub(super) async fn keep_pod(
        &self,
        spec: &ExecSpec,
        keep: KeepFor,
        opts: StartOptions,
    ) -> Result<KubeKept, ErrorBody> {
        let profile_name = spec.profile.clone().unwrap_or_else(|| "default".into());
        let profile = self.profile(&profile_name)?.clone();
        let start_timeout = Duration::from_secs(self.config.pod_start_timeout_secs);
        let budget_end = Instant::now() + start_timeout;
        let lifetime = keep
            .expires_at
            .duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO)
            .max(Duration::from_secs(1));
        let expires = timestamp(keep.expires_at);
        let id = hold_id(&self.shared.identity.gateway);
        let opening = keep.session.as_ref().map(|_| format!("{id}-0"));
        // Everything any replica needs to serve the session, on the pod.
        let mut annotations = serde_json::json!({ANNOTATION_EXPIRES: expires});
        if let (Some((session, idle_ttl)), Some(hold)) = (&keep.session, &opening) {
            let now = SystemTime::now();
            let a = annotations.as_object_mut().expect("an object");
            for (k, v) in [
                (ANNOTATION_SESSION_NAME, session.clone()),
                (ANNOTATION_IDLE_TTL, idle_ttl.as_secs().to_string()),
                (ANNOTATION_OPENED, timestamp(now)),
                (ANNOTATION_LAST_USED, timestamp(now)),
                (ANNOTATION_BUSY_BY, hold.clone()),
                (ANNOTATION_CALLS, "1".to_owned()),
                (
                    ANNOTATION_BUSY_UNTIL,
                    timestamp(
                        now + Duration::from_secs(self.config.pod_start_timeout_secs)
                            + keep.first_call,
                    ),
                ),
            ] {
                a.insert(k.into(), v.into());
            }
        }
        let permit = self.slot(budget_end, &opts).await?;
        let mut timings = Timings::new();
        let pool = self.pools.get().and_then(|p| p.get(&profile_name)).cloned();
        let mut caches = None;
        let claimed = match pool {
            Some(pool) => {
                pool.claim_with(
                    lifetime,
                    serde_json::json!({LABEL_SESSION_OWNER: keep.owner, LABEL_SESSION: keep.name}),
                    annotations.clone(),
                    keep.session.is_some(),
                )
                .await
            }
            None => None,
        };
        let (guard, node) = match claimed {
            Some((name, node)) => {
                opts.progress
                    .report(Phase::Scheduled, Some(format!("warm pod {name} on {node}")));
                (PodGuard::arm(self.shared.clone(), name, permit), node)
            }
            None => {
                let deadline =
                    lifetime.as_secs() + self.config.pod_start_timeout_secs + DEADLINE_MARGIN_SECS;
                let name = pod::pod_name();
                // The profile's caches, held for the pod's whole life (as a one-shot run
                // holds them for its pod): same keys, so the same scope and owner rules.
                caches = self
                    .take_caches(
                        spec,
                        &profile_name,
                        &profile,
                        &name,
                        Duration::from_secs(deadline),
                        &opts,
                    )
                    .await?;
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
                let meta = &mut manifest.metadata;
                if keep.session.is_some() {
                    // A session belongs to the installation, not to the replica that opened
                    // it: the garbage collector must not delete it with this gateway's pod
                    // (a rolling update). Its end, its expiry (any replica's reaper) and
                    // `activeDeadlineSeconds` delete it.
                    meta.owner_references = None;
                }
                let labels = meta.labels.get_or_insert_default();
                labels.insert(LABEL_SESSION_OWNER.into(), keep.owner.clone());
                labels.insert(LABEL_SESSION.into(), keep.name.clone());
                let all = meta.annotations.get_or_insert_default();
                for (k, v) in annotations.as_object().into_iter().flatten() {
                    all.insert(k.clone(), v.as_str().unwrap_or_default().to_owned());
                }
                if let Some(c) = &caches {
                    c.mount(&mut manifest);
                }
                // Armed before the create call: a failed start deletes the pod.
                let guard = PodGuard::arm(self.shared.clone(), name.clone(), permit);
                let created = tokio::select! {
                    r = self.create(&manifest, budget_end) => r?,
                    _ = opts.cancel.cancelled() => return Err(shutting_down()),
                };
                opts.progress
                    .report(Phase::Scheduling, Some(format!("pod {name} created")));
                let node = tokio::select! {
                    r = self.wait_running(created, budget_end, start_timeout, &mut timings, &opts.progress) => r?,
                    _ = opts.cancel.cancelled() => return Err(shutting_down()),
                };
                self.shared.metrics.observe_pod_start(timings.since_start());
                (guard, node)
            }
        };
        let name = guard.name.clone();
        let permit = guard.into_kept();
        tracing::info!(
            pod = name,
            profile = profile_name,
            session = keep.name,
            "session pod running"
        );
        let watch = CancellationToken::new();
        let lost = Arc::new(Mutex::new(None));
        let seen = Arc::new(Mutex::new(Seen::default()));
        let changed = Arc::new(tokio::sync::Notify::new());
        tokio::spawn(watch_fate(
            self.shared.clone(),
            name.clone(),
            Fate {
                lost: lost.clone(),
                seen: seen.clone(),
                changed: changed.clone(),
            },
            watch.clone(),
        ));
        let context = RunContext {
            backend: "kubernetes".into(),
            namespace: Some(self.shared.namespace.clone()),
            pod: Some(name.clone()),
            node: Some(node),
            container: Some(CONTAINER.into()),
            image: Some(profile.image().to_string()),
            profile: Some(profile_name),
            pod_start_ms: Some(timings.since_start().as_millis() as u64),
            caches: caches.as_ref().map(|c| c.states()).unwrap_or_default(),
            ..Default::default()
        };
        let cache_env = caches
            .as_ref()
            .map(|c| c.env().collect())
            .unwrap_or_default();
        Ok(KubeKept {
            workspace_path: profile.workspace_path.clone(),
            profile: context.profile.clone().unwrap_or_default(),
            tracked: Default::default(),
            cache_env,
            caches: Mutex::new(caches),
            shared: self.shared.clone(),
            name,
            context,
            shell: profile.shell().to_owned(),
            start_timeout,
            permit: Mutex::new(permit),
            lost,
            shared_session: keep.session.is_some(),
            id,
            calls: std::sync::atomic::AtomicU64::new(0),
            opening: Mutex::new(opening),
            seen,
            changed,
            _watch: watch.clone().drop_guard(),
            watch,
        })
    }

    /// This gateway's session pods matching `selector` (besides its instance) that are
    /// running, not being deleted, and whose session is still alive by their annotations.
    async fn live_session_pods(
        &self,
        selector: &str,
        what: &str,
    ) -> Result<Vec<k8s_openapi::api::core::v1::Pod>, ErrorBody> {
        let selector = format!("{},{selector}", self.shared.identity.instance_selector());
        self.shared.throttle.acquire().await;
        let pods = self
            .shared
            .pods
            .list(&kube::api::ListParams::default().labels(&selector))
            .await
            .map_err(|e| KubeError::SessionPod {
                what: what.into(),
                why: super::backoff::describe(&e),
            })?;
        let now = k8s_openapi::jiff::Timestamp::now();
        Ok(pods
            .items
            .into_iter()
            .filter(|p| {
                p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
                    && p.metadata.deletion_timestamp.is_none()
                    && session_alive(p, now) == Some(true)
            })
            .collect())
    }

    /// The session pod of `owner`'s session `name` (hashes), made by any replica, still
    /// live: a runner for this replica's calls, and what its annotations say.
    pub(super) async fn find_session_pod(
        &self,
        owner: &str,
        name: &str,
    ) -> Result<Option<FoundRunner>, ErrorBody> {
        use kube::ResourceExt as _;
        let Some(p) = self
            .live_session_pods(
                &format!("{LABEL_SESSION_OWNER}={owner},{LABEL_SESSION}={name}"),
                "cannot look for the session's pod",
            )
            .await?
            .into_iter()
            .next()
        else {
            return Ok(None);
        };
        let pod_name = p.name_any();
        let ann = p.annotations().clone();
        let Some(profile_name) = p.labels().get(pod::LABEL_PROFILE).cloned() else {
            return Ok(None);
        };
        let Ok(profile) = self.profile(&profile_name).cloned() else {
            // A profile this replica does not have (a configuration being rolled out).
            return Ok(None);
        };
        let Times {
            opened,
            expires_at,
            idle_ttl,
            last_used,
        } = Times::of(&p);
        let watch = CancellationToken::new();
        let lost = Arc::new(Mutex::new(None));
        let seen = Arc::new(Mutex::new(Seen {
            rv: p.resource_version(),
            annotations: ann.clone(),
        }));
        let changed = Arc::new(tokio::sync::Notify::new());
        tokio::spawn(watch_fate(
            self.shared.clone(),
            pod_name.clone(),
            Fate {
                lost: lost.clone(),
                seen: seen.clone(),
                changed: changed.clone(),
            },
            watch.clone(),
        ));
        let context = RunContext {
            backend: "kubernetes".into(),
            namespace: Some(self.shared.namespace.clone()),
            pod: Some(pod_name.clone()),
            node: p.spec.as_ref().and_then(|s| s.node_name.clone()),
            container: Some(CONTAINER.into()),
            image: Some(profile.image().to_string()),
            profile: Some(profile_name.clone()),
            pod_start_ms: Some(0),
            ..Default::default()
        };
        // Every cache of the profile is mounted at its path (a claim or an emptyDir).
        let cache_env = profile
            .caches
            .iter()
            .flat_map(|c| c.env_at(&c.path))
            .collect();
        tracing::info!(
            pod = pod_name,
            "session pod found (opened by another replica)"
        );
        let kept = KubeKept {
            shared: self.shared.clone(),
            name: pod_name,
            context,
            shell: profile.shell().to_owned(),
            start_timeout: Duration::from_secs(self.config.pod_start_timeout_secs),
            // The replica that made it holds its slot (or held it, before it went).
            permit: Mutex::new(None),
            cache_env,
            caches: Mutex::new(None),
            workspace_path: profile.workspace_path.clone(),
            profile: profile_name.clone(),
            // Files deleted in the checkout before this replica served the session stay.
            tracked: Default::default(),
            lost,
            shared_session: true,
            id: hold_id(&self.shared.identity.gateway),
            calls: std::sync::atomic::AtomicU64::new(0),
            opening: Mutex::new(None),
            seen,
            changed,
            _watch: watch.clone().drop_guard(),
            watch,
        };
        Ok(Some(FoundRunner {
            runner: Arc::new(kept),
            profile: profile_name,
            opened,
            expires_at,
            idle_ttl,
            last_used,
        }))
    }

    /// The live sessions of `owner` (a hash) on their pods, whichever replica made them:
    /// what `sessions list` shows, the same through every replica.
    pub(super) async fn list_session_pods(
        &self,
        owner: &str,
    ) -> Result<Vec<KeptSession>, ErrorBody> {
        use kube::ResourceExt as _;
        let pods = self
            .live_session_pods(
                &format!("{LABEL_SESSION_OWNER}={owner}"),
                "cannot list the sessions' pods",
            )
            .await?;
        let mut out = Vec::new();
        for p in pods {
            let (ann, labels) = (p.annotations(), p.labels());
            let (Some(name), Some(hash), Some(profile)) = (
                ann.get(ANNOTATION_SESSION_NAME),
                labels.get(LABEL_SESSION),
                labels.get(pod::LABEL_PROFILE),
            ) else {
                continue;
            };
            let held = Seen {
                rv: None,
                annotations: ann.clone(),
            }
            .holder()
            .is_some();
            let Times {
                opened,
                expires_at,
                idle_ttl,
                last_used,
            } = Times::of(&p);
            let spec = p.spec.as_ref();
            out.push(KeptSession {
                name: name.clone(),
                hash: hash.clone(),
                profile: profile.clone(),
                context: RunContext {
                    backend: "kubernetes".into(),
                    namespace: Some(self.shared.namespace.clone()),
                    pod: Some(p.name_any()),
                    node: spec.and_then(|s| s.node_name.clone()),
                    container: Some(CONTAINER.into()),
                    image: spec
                        .and_then(|s| s.containers.iter().find(|c| c.name == CONTAINER))
                        .and_then(|c| c.image.clone()),
                    profile: Some(profile.clone()),
                    ..Default::default()
                },
                opened,
                expires_at,
                idle_ttl,
                last_used,
                calls: ann
                    .get(ANNOTATION_CALLS)
                    .and_then(|c| c.parse().ok())
                    .unwrap_or(1),
                busy: held,
            });
        }
        Ok(out)
    }
}

/// When a session's pod says it was opened, expires, may idle and was last used.
struct Times {
    opened: SystemTime,
    expires_at: SystemTime,
    idle_ttl: Duration,
    last_used: Option<SystemTime>,
}

impl Times {
    fn of(p: &k8s_openapi::api::core::v1::Pod) -> Self {
        use kube::ResourceExt as _;
        let ann = p.annotations();
        let time = |k: &str| -> Option<SystemTime> {
            ann.get(k)
                .and_then(|t| t.parse::<k8s_openapi::jiff::Timestamp>().ok())
                .map(SystemTime::from)
        };
        let created = p
            .creation_timestamp()
            .map(|t| SystemTime::from(t.0))
            .unwrap_or_else(SystemTime::now);
        let opened = time(ANNOTATION_OPENED).unwrap_or(created);
        Self {
            opened,
            expires_at: time(ANNOTATION_EXPIRES).unwrap_or(opened),
            idle_ttl: Duration::from_secs(
                ann.get(ANNOTATION_IDLE_TTL)
                    .and_then(|t| t.parse().ok())
                    .unwrap_or(0),
            ),
            last_used: time(ANNOTATION_LAST_USED),
        }
    }
}

impl KubeKept {
    /// A merge patch of the pod (preconditioned when it names a resourceVersion); what it
    /// returns is the pod as now seen.
    async fn patch(&self, patch: &serde_json::Value) -> Result<(), kube::Error> {
        self.shared.throttle.acquire().await;
        let p = self
            .shared
            .pods
            .patch(
                &self.name,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(patch),
            )
            .await?;
        lock(&self.seen).update(&p);
        Ok(())
    }

    /// Reads the pod again (after a conflict).
    /// Reads the pod when the fate watch has not reported it yet (just made, a loaded
    /// machine): holds are judged and given back by what was seen, and an unseen pod would
    /// look unheld (an unconditional take) and its opening hold never given back.
    async fn seen_once(&self) {
        if lock(&self.seen).rv.is_none() {
            let _ = self.refresh().await;
        }
    }

    async fn refresh(&self) -> Result<(), ErrorBody> {
        self.shared.throttle.acquire().await;
        match self.shared.pods.get(&self.name).await {
            Ok(p) => {
                lock(&self.seen).update(&p);
                Ok(())
            }
            Err(kube::Error::Api(s)) if s.code == 404 => {
                Err(KubeError::SessionPodDeleted(self.name.clone()).into())
            }
            Err(e) => Err(KubeError::SessionPod {
                what: format!("cannot read session pod {}", self.name),
                why: super::backoff::describe(&e),
            }
            .into()),
        }
    }
}

/// A session's name (annotation: names are not secret; the owner is only a hash).
pub(super) const ANNOTATION_SESSION_NAME: &str = "mcp-run.dev/session-name";
/// The session's idle TTL in seconds.
pub(super) const ANNOTATION_IDLE_TTL: &str = "mcp-run.dev/idle-ttl-secs";
pub(super) const ANNOTATION_OPENED: &str = "mcp-run.dev/opened-at";
/// When a call last gave the pod back, on any replica.
pub(super) const ANNOTATION_LAST_USED: &str = "mcp-run.dev/last-used";
/// The call holding the pod (`ID-N`) and until when at the latest.
pub(super) const ANNOTATION_BUSY_BY: &str = "mcp-run.dev/busy-by";
pub(super) const ANNOTATION_BUSY_UNTIL: &str = "mcp-run.dev/busy-until";
/// Why the session ended (`ended`, or `expired: REASON`), set before the pod is deleted.
pub(super) const ANNOTATION_ENDED: &str = "mcp-run.dev/ended";
/// How many calls the session ran, through any replica (set with each call's hold).
pub(super) const ANNOTATION_CALLS: &str = "mcp-run.dev/calls";

fn timestamp(t: SystemTime) -> String {
    k8s_openapi::jiff::Timestamp::try_from(t)
        .unwrap_or_else(|_| k8s_openapi::jiff::Timestamp::now())
        .to_string()
}

/// `GATEWAY/PROCESS-RUNNER`: the replica, this process of it, this runner's copy.
fn hold_id(gateway: &str) -> String {
    format!("{}-{:08x}", process_prefix(gateway), rand::random::<u32>())
}

/// `GATEWAY/PROCESS`: a hold with this replica's name but another process's is a hold of
/// this replica before it restarted, which nothing will give back.
fn process_prefix(gateway: &str) -> String {
    static PROCESS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    format!("{gateway}/{:016x}", PROCESS.get_or_init(rand::random))
}

/// The pod as last seen.
#[derive(Default)]
struct Seen {
    rv: Option<String>,
    annotations: std::collections::BTreeMap<String, String>,
}

impl Seen {
    fn update(&mut self, p: &k8s_openapi::api::core::v1::Pod) {
        self.rv = p.metadata.resource_version.clone();
        self.annotations = p.metadata.annotations.clone().unwrap_or_default();
    }

    /// Who holds the pod now (a hold past its time holds nothing).
    fn holder(&self) -> Option<&str> {
        let until = self
            .annotations
            .get(ANNOTATION_BUSY_UNTIL)
            .and_then(|t| t.parse::<k8s_openapi::jiff::Timestamp>().ok())?;
        (until > k8s_openapi::jiff::Timestamp::now())
            .then(|| self.annotations.get(ANNOTATION_BUSY_BY).map(String::as_str))
            .flatten()
    }
}

/// Where the fate watch reports.
struct Fate {
    lost: Arc<Mutex<Option<String>>>,
    seen: Arc<Mutex<Seen>>,
    changed: Arc<tokio::sync::Notify>,
}

fn shutting_down() -> ErrorBody {
    KubeError::ShuttingDown.into()
}

/// Watches the kept pod until the runner closes; records the first thing that happened to
/// it (deleted, evicted, OOM-killed, failed). A watch that breaks is reopened.
async fn watch_fate(shared: Arc<Shared>, name: String, fate: Fate, stop: CancellationToken) {
    let Fate {
        lost,
        seen: last,
        changed,
    } = fate;
    loop {
        // Far enough that the watch ends only by an event or a failure; the runner's close
        // stops it.
        let end = Instant::now() + Duration::from_secs(24 * 3600);
        let seen = super::backoff::watch_pod(&shared.pods, &name, end, |pod| {
            let why = match pod {
                None => Some(format!("its pod {name} was deleted")),
                Some(p) => {
                    lock(&last).update(&p);
                    super::stream::fate(&p)
                }
            };
            changed.notify_one();
            why
        });
        let r = tokio::select! {
            r = seen => r,
            _ = stop.cancelled() => return,
        };
        match r {
            Ok(why) => {
                tracing::warn!(pod = name, "session pod lost: {why}");
                *lock(&lost) = Some(why);
                return;
            }
            Err(e) => {
                tracing::debug!(pod = name, "session pod watch ended ({e:?}); reopening");
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(2)) => {}
                    _ = stop.cancelled() => return,
                }
            }
        }
    }
}

impl KeptRunner for KubeKept {
    fn context(&self) -> RunContext {
        self.context.clone()
    }

    fn start(
        &self,
        spec: ExecSpec,
        opts: StartOptions,
        sync_tree: bool,
    ) -> BoxFuture<'_, Result<Execution, ErrorBody>> {
        Box::pin(async move {
            if let Some(why) = lock(&self.lost).clone() {
                return Err(KubeError::SessionLost(why).into());
            }
            let mut spec = spec;
            let mut workspace = None;
            if let Some(run) = spec.workspace.take() {
                let root = self
                    .workspace_path
                    .clone()
                    .ok_or_else(|| KubeError::NoWorkspacePath(self.profile.clone()))?;
                let cwd = if sync_tree {
                    opts.progress.report(
                        Phase::Starting,
                        Some(format!(
                            "bringing the tree in session pod {} to the workspace",
                            self.name
                        )),
                    );
                    let mut tracked = self.tracked.lock().await;
                    let (cwd, stats) = self
                        .shared
                        .sync_kept_tree(
                            &self.name,
                            &self.shell,
                            &root,
                            &run,
                            &mut tracked,
                            &opts.cancel,
                        )
                        .await?;
                    tracing::debug!(
                        pod = self.name,
                        workspace = run.workspace.id,
                        kept = stats.kept,
                        written = stats.written,
                        removed = stats.removed,
                        "session tree ready"
                    );
                    cwd
                } else {
                    let base = root.trim_end_matches('/');
                    if run.cwd.is_empty() {
                        base.to_owned()
                    } else {
                        format!("{base}/{}", run.cwd)
                    }
                };
                spec.cwd = Some(cwd);
                workspace = Some((run, root));
            }
            crate::exec::cache::merge_env(&mut spec.env, self.cache_env.iter().cloned());
            let call = format!("{:016x}", rand::random::<u64>());
            let command = pod::argv::kept_exec_command(
                &self.shell,
                &call,
                &spec.executable,
                &spec.args,
                spec.cwd.as_deref(),
                &spec.env,
                opts.stdin.is_some(),
            );
            let mut guard = PodGuard::call(
                self.shared.clone(),
                self.name.clone(),
                call,
                self.shell.clone(),
            );
            guard.timings = Some(Timings::new());
            opts.progress.report(
                Phase::Starting,
                Some(format!("starting the command in session pod {}", self.name)),
            );
            let mut context = self.context.clone();
            context.pod_start_ms = Some(0);
            let mut before_exit = None;
            if let Some((run, root)) = workspace {
                context.workspace = Some(run.workspace.id.clone());
                context.workspace_version = Some(run.workspace.digest.clone());
                before_exit = super::start::sync_back_hook(
                    &self.shared,
                    &self.name,
                    &root,
                    &self.shell,
                    &run,
                );
            }
            Ok(super::start::exec_command(
                &self.shared,
                command,
                spec.executable,
                &self.shell,
                opts,
                guard,
                context,
                Instant::now() + self.start_timeout,
                before_exit,
            )
            .await?)
        })
    }

    /// No API call: the fate watch has recorded a loss already.
    fn check(&self) -> BoxFuture<'_, Result<(), Gone>> {
        Box::pin(async move {
            let Some(why) = lock(&self.lost).clone() else {
                return Ok(());
            };
            // Deleted by another replica that said why first.
            let ended = lock(&self.seen).annotations.get(ANNOTATION_ENDED).cloned();
            Err(match ended {
                Some(e) if e == "ended" => Gone::Ended,
                Some(e) => Gone::Expired(e.strip_prefix("expired: ").unwrap_or(&e).to_owned()),
                None => Gone::Lost(why),
            })
        })
    }

    fn begin_call(
        &self,
        until: SystemTime,
        fail: bool,
        deadline: tokio::time::Instant,
        progress: &crate::exec::Progress,
    ) -> BoxFuture<'_, Result<Option<String>, ErrorBody>> {
        let progress = progress.clone();
        Box::pin(async move {
            if !self.shared_session {
                return Ok(None);
            }
            if let Some(hold) = lock(&self.opening).take() {
                return Ok(Some(hold));
            }
            let n = self
                .calls
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                + 1;
            let hold = format!("{}-{n}", self.id);
            self.seen_once().await;
            let mut queued = false;
            loop {
                let changed = self.changed.notified();
                let (rv, holder, calls) = {
                    let s = lock(&self.seen);
                    let calls: u64 = s
                        .annotations
                        .get(ANNOTATION_CALLS)
                        .and_then(|c| c.parse().ok())
                        .unwrap_or(1);
                    (s.rv.clone(), s.holder().map(str::to_owned), calls)
                };
                // This process's earlier call (its release may still be on its way) is
                // this call's to take over: calls of one replica are one at a time.
                let gateway = format!("{}/", self.shared.identity.gateway);
                let me = process_prefix(&self.shared.identity.gateway);
                let stale = |h: &str| h.starts_with(&gateway) && !h.starts_with(&me);
                if let Some(h) = holder.filter(|h| !h.starts_with(&self.id) && !stale(h)) {
                    if fail {
                        return Err(KubeError::SessionBusyFail(h).into());
                    }
                    if !queued {
                        queued = true;
                        progress.report(
                            Phase::Queued,
                            Some("waiting for the running call of the session (on another gateway replica) to end".into()),
                        );
                    }
                    tokio::select! {
                        _ = changed => {}
                        // A hold past its time frees the pod without a change.
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                        _ = tokio::time::sleep_until(deadline) => {
                            return Err(KubeError::SessionBusyTimeout.into());
                        }
                    }
                    continue;
                }
                let patch = serde_json::json!({"metadata": {
                    "resourceVersion": rv,
                    "annotations": {
                        ANNOTATION_BUSY_BY: hold,
                        ANNOTATION_BUSY_UNTIL: timestamp(until),
                        ANNOTATION_LAST_USED: timestamp(SystemTime::now()),
                        // Preconditioned: no other replica's call counted meanwhile.
                        ANNOTATION_CALLS: (calls + 1).to_string(),
                    }
                }});
                match self.patch(&patch).await {
                    Ok(()) => return Ok(Some(hold)),
                    // Changed meanwhile (another replica took it, or a status update): look again.
                    Err(kube::Error::Api(s)) if s.code == 409 => self.refresh().await?,
                    Err(kube::Error::Api(s)) if s.code == 404 => {
                        return Err(KubeError::SessionPodDeleted(self.name.clone()).into());
                    }
                    // No `patch` on pods (a Role made for one replica without a warm pool):
                    // calls are one at a time on this replica only.
                    Err(kube::Error::Api(s)) if s.code == 403 => {
                        static TOLD: std::sync::Once = std::sync::Once::new();
                        TOLD.call_once(|| {
                            tracing::warn!(
                                "no permission to patch pods: a session's calls are one at a time per gateway replica only, not across replicas (grant `patch` on pods)"
                            )
                        });
                        return Ok(None);
                    }
                    Err(e) => {
                        return Err(KubeError::SessionPod {
                            what: format!("cannot take session pod {}", self.name),
                            why: super::backoff::describe(&e),
                        }
                        .into());
                    }
                }
            }
        })
    }

    fn end_call(&self, hold: Option<String>) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let Some(hold) = hold else { return };
            self.seen_once().await;
            for _ in 0..8 {
                let rv = {
                    let s = lock(&self.seen);
                    if s.annotations.get(ANNOTATION_BUSY_BY) != Some(&hold) {
                        // Taken over by this replica's next call, or by another after its time.
                        return;
                    }
                    s.rv.clone()
                };
                let patch = serde_json::json!({"metadata": {
                    "resourceVersion": rv,
                    "annotations": {
                        ANNOTATION_BUSY_BY: null,
                        ANNOTATION_BUSY_UNTIL: null,
                        ANNOTATION_LAST_USED: timestamp(SystemTime::now()),
                    }
                }});
                match self.patch(&patch).await {
                    Ok(()) => return,
                    Err(kube::Error::Api(s)) if s.code == 409 => {
                        if self.refresh().await.is_err() {
                            return;
                        }
                    }
                    Err(kube::Error::Api(s)) if s.code == 404 || s.code == 403 => return,
                    Err(e) => {
                        tracing::warn!(pod = self.name, "cannot give the session pod back: {e}");
                        return;
                    }
                }
            }
        })
    }

    fn last_used(&self) -> Option<SystemTime> {
        if !self.shared_session {
            return None;
        }
        lock(&self.seen)
            .annotations
            .get(ANNOTATION_LAST_USED)
            .and_then(|t| t.parse::<k8s_openapi::jiff::Timestamp>().ok())
            .map(SystemTime::from)
    }

    fn ending(&self, expired: Option<String>) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            if !self.shared_session {
                return;
            }
            let why = match expired {
                Some(e) => format!("expired: {e}"),
                None => "ended".into(),
            };
            let patch = serde_json::json!({"metadata": {"annotations": {ANNOTATION_ENDED: why}}});
            if let Err(e) = self.patch(&patch).await {
                tracing::debug!(pod = self.name, "cannot mark the session pod ended: {e}");
            }
        })
    }

    /// A live session's pod outlives this gateway when the installation has other replicas
    /// or restarts it ([`Shared::leaves_sessions`]): they find the pod by its labels. Its
    /// hold (a call this shutdown killed) is given back first; the caches' claims stay with
    /// the pod (they end when it is gone). The reaper of any replica deletes it once its
    /// session is over.
    fn leave(&self) -> BoxFuture<'_, bool> {
        Box::pin(async move {
            let leaves = self
                .shared
                .leaves_sessions
                .load(std::sync::atomic::Ordering::Relaxed);
            if !self.shared_session || !leaves || lock(&self.lost).is_some() {
                return false;
            }
            self.seen_once().await;
            let (over, hold) = {
                let s = lock(&self.seen);
                let now = k8s_openapi::jiff::Timestamp::now();
                (
                    annotations_alive(&s.annotations, None, now) == Some(false),
                    s.annotations
                        .get(ANNOTATION_BUSY_BY)
                        .filter(|h| h.starts_with(&format!("{}-", self.id)))
                        .cloned(),
                )
            };
            if over {
                return false;
            }
            if hold.is_some() {
                self.end_call(hold).await;
            }
            self.watch.cancel();
            self.shared.untrack(&self.name);
            drop(lock(&self.permit).take());
            if let Some(c) = lock(&self.caches).take() {
                c.stay_with_pod();
            }
            tracing::info!(
                pod = self.name,
                "session pod left to the gateway's other replicas (its session lives on)"
            );
            true
        })
    }

    /// Deletes the pod and waits until it is gone; then its slot is free.
    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            self.watch.cancel();
            if self.shared.delete(&self.name).await {
                self.shared.untrack(&self.name);
                self.shared.await_gone(&self.name).await;
            }
            drop(lock(&self.permit).take());
            // Hands the claims on (it waits until the pod is gone, in the background).
            drop(lock(&self.caches).take());
        })
    }
}

/// For a session's pod any replica may serve (`None` for other pods): whether its session
/// lives, by its annotations: not ended, within its maximum lifetime, and held by a call or
/// used within its idle TTL.
pub(super) fn session_alive(
    p: &k8s_openapi::api::core::v1::Pod,
    now: k8s_openapi::jiff::Timestamp,
) -> Option<bool> {
    use kube::ResourceExt as _;
    annotations_alive(p.annotations(), p.creation_timestamp().map(|t| t.0), now)
}

/// [`session_alive`] by a pod's annotations (and creation time, the last resort for when it
/// was last used).
fn annotations_alive(
    a: &std::collections::BTreeMap<String, String>,
    created: Option<k8s_openapi::jiff::Timestamp>,
    now: k8s_openapi::jiff::Timestamp,
) -> Option<bool> {
    a.get(ANNOTATION_SESSION_NAME)?;
    let time = |k: &str| {
        a.get(k)
            .and_then(|t| t.parse::<k8s_openapi::jiff::Timestamp>().ok())
    };
    if a.contains_key(ANNOTATION_ENDED) || time(ANNOTATION_EXPIRES).is_none_or(|t| t <= now) {
        return Some(false);
    }
    if time(ANNOTATION_BUSY_UNTIL).is_some_and(|t| t > now) {
        return Some(true);
    }
    let ttl: u64 = a
        .get(ANNOTATION_IDLE_TTL)
        .and_then(|t| t.parse().ok())
        .unwrap_or(0);
    let last = time(ANNOTATION_LAST_USED)
        .or_else(|| time(ANNOTATION_OPENED))
        .or(created);
    let idle_until = last.and_then(|l| l.checked_add(Duration::from_secs(ttl)).ok());
    Some(idle_until.is_some_and(|t| t > now))
}

#[cfg(test)]
mod tests {
    use super::pod::argv::{KILL_CALL, kept_exec_command};
    use std::collections::BTreeMap;

    /// The wrapper stays the command's parent and passes its status on; the kill finds the
    /// call by its tag and kills its whole tree, not another call's.
    /// With dash, bash and busybox's ash (the shells of runner images), when present.
    #[test]
    fn a_call_is_killed_with_its_children_and_another_call_stays() {
        let dir = tempfile::tempdir().unwrap();
        let mut shells = vec!["/bin/sh".to_string()];
        for (name, path) in [("bash", "/bin/bash"), ("busybox", "/bin/busybox")] {
            if std::path::Path::new(path).exists() {
                // busybox runs its applet by the name it is called by.
                let link = dir.path().join(name).join("sh");
                std::fs::create_dir_all(link.parent().unwrap()).unwrap();
                std::os::unix::fs::symlink(path, &link).unwrap();
                shells.push(link.to_str().unwrap().to_owned());
            } else {
                eprintln!("skipped: {path} is not installed");
            }
        }
        for shell in shells {
            kill_one_of_two(&shell);
        }
    }

    fn kill_one_of_two(shell: &str) {
        let mut env = BTreeMap::new();
        env.insert("X".into(), "1".into());
        let dir = tempfile::tempdir().unwrap();
        // Each call starts a background child and names it in a file, then waits.
        let spawn = |id: &str| {
            let bg = dir.path().join(id);
            let script = format!(
                "sleep 300 & echo $! > {}.t; mv {0}.t {0}; sleep 301; exit 3",
                bg.display()
            );
            let c = kept_exec_command(shell, id, "sh", &["-c".into(), script], None, &env, false);
            let mut child = std::process::Command::new(&c.argv[0])
                .args(&c.argv[1..])
                .stdin(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            use std::io::Write as _;
            child
                .stdin
                .take()
                .unwrap()
                .write_all(c.header.as_ref().unwrap())
                .unwrap();
            child
        };
        let bg_pid = |id: &str| -> Option<i32> {
            std::fs::read_to_string(dir.path().join(id))
                .ok()?
                .trim()
                .parse()
                .ok()
        };
        let (a, b) = ("00000000000000aa", "00000000000000bb");
        let mut victim = spawn(a);
        let mut other = spawn(b);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while bg_pid(a).is_none() || bg_pid(b).is_none() {
            assert!(
                std::time::Instant::now() < deadline,
                "{shell}: calls did not start"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let status = std::process::Command::new(shell)
            .args(["-c", KILL_CALL, "mcp-run-kill", a])
            .status()
            .unwrap();
        assert!(status.success());
        let s = victim.wait().unwrap();
        assert!(!s.success(), "{shell}: {s:?}");
        // Alive: present and not a zombie (a killed orphan waits for init to reap it).
        let alive = |pid: i32| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .is_ok_and(|st| !st.contains(") Z ") && !st.contains(") X "))
        };
        let gone_by = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while alive(bg_pid(a).unwrap()) {
            assert!(
                std::time::Instant::now() < gone_by,
                "{shell}: the call's child lives on"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert!(
            other.try_wait().unwrap().is_none(),
            "{shell}: the other call runs on"
        );
        assert!(
            alive(bg_pid(b).unwrap()),
            "{shell}: the other call's child runs on"
        );
        std::process::Command::new(shell)
            .args(["-c", KILL_CALL, "mcp-run-kill", b])
            .status()
            .unwrap();
        other.wait().unwrap();
        assert!(
            !alive(bg_pid(b).unwrap()) || {
                std::thread::sleep(std::time::Duration::from_millis(500));
                !alive(bg_pid(b).unwrap())
            }
        );
    }
}

//! The warm pool: per profile, `warm_pool.size` runner pods that are already Running and
//! unclaimed, so that a request costs an exec rather than a pod start, while each request
//! still gets a pod of its own that is deleted after use and never reused.
//!
//! - Pool pods are ordinary runner pods with two more labels: `mcp-run.dev/pool=<profile>`
//!   and `mcp-run.dev/state=idle`. Every gateway replica watches the idle pods of its
//!   installation (a reflector: no polling) and keeps its share of `size` of its own in the
//!   pool: with the replicas found from the Kubernetes API (`server.peer_service`), the
//!   sorted list of their pods splits `size` (the first `size % n` keep one more), so the
//!   installation holds `size` idle pods whatever the number of replicas; a replica whose
//!   share shrank deletes its surplus (idle pods only, preconditioned). Without that list
//!   (`--peer` URLs, or one replica) each replica keeps `size`.
//! - A request claims an idle pod with a JSON merge patch that sets `state=claimed` and
//!   names the claiming gateway, carrying the pod's `metadata.resourceVersion` as a
//!   precondition: if anyone changed the pod since it was seen (another replica claimed it),
//!   the API server answers 409 Conflict and the request tries the next pod. Two replicas
//!   can never run in the same pod.
//! - Empty pool (or no claimable pod): the request falls back to creating its own pod, and
//!   the miss is counted. The pool refills in the background.
//! - A pool pod is claimable while its deadline leaves room for the request's timeout;
//!   older idle pods are replaced (`warm_pool.max_idle_secs`).
//! - Per-request `cwd` and `env` apply through the exec wrapper, as for fresh pods.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use backon::BackoffBuilder as _;
use futures_util::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt as _;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt as _, watcher};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::Shared;
use super::config::Profile;
use super::pod::CONTAINER;
use super::pod::{self, ANNOTATION_EXPIRES, LABEL_GATEWAY, LABEL_POOL, LABEL_STATE};
use super::status::{self, PodState};

/// A claim needs at least this beyond the request's timeout before the pod's deadline.
const CLAIM_MARGIN: Duration = Duration::from_secs(60);

/// The pool of one profile.
pub(super) struct WarmPool {
    shared: Arc<Shared>,
    profile_name: String,
    profile: Profile,
    size: usize,
    max_idle: Duration,
    /// A pool pod not Running after this long is stuck and replaced.
    start_timeout: Duration,
    /// `activeDeadlineSeconds` of pool pods: idle time plus the longest request.
    deadline_secs: u64,
    store: Store<Pod>,
    /// Pods this gateway created for the pool that the store has not shown yet.
    creating: Mutex<HashMap<String, Instant>>,
    /// Pool pods whose time to Running was recorded.
    measured: Mutex<std::collections::HashSet<String>>,
    wake: Notify,
    stop: CancellationToken,
    /// The pods of this gateway's replicas, sorted (`None`: not known, keep `size`).
    replicas: Option<tokio::sync::watch::Receiver<Vec<String>>>,
}

impl WarmPool {
    /// Starts watching the idle pods of the profile and refilling the pool.
    pub(super) fn start(
        shared: Arc<Shared>,
        profile_name: &str,
        profile: &Profile,
        longest_request: Duration,
        start_timeout: Duration,
        stop: CancellationToken,
        replicas: Option<tokio::sync::watch::Receiver<Vec<String>>>,
    ) -> Arc<Self> {
        let size = profile.warm_pool.size;
        let max_idle = Duration::from_secs(profile.warm_pool.max_idle_secs);
        let selector = format!(
            "{},{LABEL_POOL}={},{LABEL_STATE}=idle",
            shared.identity.instance_selector(),
            pod::label_value(profile_name)
        );
        let (store, writer) = reflector::store();
        let events = reflector::reflector(
            writer,
            watcher(
                shared.pods.clone(),
                watcher::Config::default().labels(&selector),
            ),
        )
        .default_backoff()
        .touched_objects();
        let pool = Arc::new(Self {
            shared,
            profile_name: profile_name.to_string(),
            profile: profile.clone(),
            size,
            max_idle,
            start_timeout,
            deadline_secs: (max_idle + longest_request + CLAIM_MARGIN).as_secs(),
            store,
            creating: Mutex::new(HashMap::new()),
            measured: Mutex::new(Default::default()),
            wake: Notify::new(),
            stop,
            replicas,
        });
        // A replica that comes or goes changes every replica's share.
        if let Some(mut replicas) = pool.replicas.clone() {
            let woken = pool.clone();
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        _ = woken.stop.cancelled() => return,
                        changed = replicas.changed() => match changed {
                            Ok(()) => woken.wake.notify_one(),
                            Err(_) => return,
                        }
                    }
                }
            });
        }
        let watch_pool = pool.clone();
        tokio::spawn(async move {
            let mut events = std::pin::pin!(events);
            loop {
                tokio::select! {
                    _ = watch_pool.stop.cancelled() => return,
                    ev = events.next() => match ev {
                        Some(Ok(_)) => watch_pool.wake.notify_one(),
                        Some(Err(e)) => tracing::warn!(profile = watch_pool.profile_name, "warm pool watch: {e}"),
                        None => return,
                    }
                }
            }
        });
        let refill_pool = pool.clone();
        tokio::spawn(async move { refill_pool.refill_loop().await });
        pool
    }

    pub(super) fn size(&self) -> usize {
        self.size
    }

    /// How many idle pods this replica keeps: its share of `size` (see the module's
    /// documentation).
    fn target(&self) -> usize {
        match &self.replicas {
            Some(r) => share(self.size, &r.borrow(), &self.shared.identity.gateway),
            None => self.size,
        }
    }

    /// Claims a Running idle pod whose deadline leaves room for `timeout`; `None` is a miss.
    /// On success the pod's name is in the live set and its node is returned.
    pub(super) async fn claim(&self, timeout: Duration) -> Option<(String, String)> {
        self.claim_with(timeout, serde_json::json!({}), serde_json::json!({}), false)
            .await
    }

    /// [`Self::claim`], adding `labels` and `annotations` to the claimed pod in the same
    /// patch (a session's owner, name and expiry); `orphan` drops the owner reference to
    /// the replica that made it (a session's pod outlives any one replica).
    pub(super) async fn claim_with(
        &self,
        timeout: Duration,
        labels: serde_json::Value,
        annotations: serde_json::Value,
        orphan: bool,
    ) -> Option<(String, String)> {
        let now = Timestamp::now();
        let me = self.shared.identity.gateway.clone();
        let mut candidates: Vec<Arc<Pod>> = self
            .store
            .state()
            .into_iter()
            .filter(|p| {
                p.metadata.deletion_timestamp.is_none()
                    && room_left(p, now) >= timeout + CLAIM_MARGIN
            })
            .collect();
        // Our own pods first (no contention with other replicas), oldest first.
        candidates.sort_by_key(|p| {
            (
                p.labels().get(LABEL_GATEWAY) != Some(&me),
                p.creation_timestamp().map(|t| t.0),
            )
        });
        for p in candidates {
            let PodState::Running { node } = status::assess(&p, CONTAINER) else {
                continue;
            };
            let name = p.name_any();
            let Some(rv) = p.resource_version() else {
                continue;
            };
            // Tracked only if no other request of this gateway holds or is claiming it: the
            // claim that loses (409) untracks the name, which must not free the winner's pod
            // to the reaper.
            let fresh = self
                .shared
                .live
                .lock()
                .is_ok_and(|mut live| live.insert(name.clone()));
            if !fresh {
                continue;
            }
            let mut l = labels.clone();
            l[LABEL_STATE] = "claimed".into();
            l[LABEL_GATEWAY] = me.clone().into();
            let mut patch = serde_json::json!({
                "metadata": {
                    "resourceVersion": rv,
                    "labels": l,
                    "annotations": annotations,
                }
            });
            if orphan {
                patch["metadata"]["ownerReferences"] = serde_json::Value::Null;
            }
            match self
                .shared
                .pods
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => {
                    self.shared
                        .metrics
                        .warm_pool_claim(&self.profile_name, true);
                    self.wake.notify_one();
                    return Some((name, node));
                }
                Err(e) => {
                    self.shared.untrack(&name);
                    match e {
                        kube::Error::Api(s) if s.code == 409 || s.code == 404 => {
                            tracing::debug!(pod = name, "warm pod taken by someone else");
                        }
                        other => {
                            tracing::warn!(pod = name, "cannot claim warm pod: {other}");
                            break;
                        }
                    }
                }
            }
        }
        self.shared
            .metrics
            .warm_pool_claim(&self.profile_name, false);
        self.wake.notify_one();
        None
    }

    /// Keeps `size` idle pods of this gateway: creates what is missing, replaces what is too
    /// old or cannot start, backs off while pods fail to start.
    async fn refill_loop(self: Arc<Self>) {
        if self.store.wait_until_ready().await.is_err() {
            return;
        }
        // While pool pods fail to start, passes back off (the shared backoff, from 1 s to a
        // minute, never sooner than an API server's Retry-After): a broken image makes no
        // storm of pods.
        let fresh = || {
            super::backoff::exponential()
                .with_min_delay(Duration::from_secs(1))
                .with_max_delay(Duration::from_secs(60))
                .build()
        };
        let mut backoff = fresh();
        loop {
            let wait = match self.tend().await {
                Tended::Fine => {
                    backoff = fresh();
                    Duration::from_secs(5)
                }
                Tended::Failed { retry_after } => {
                    let next = backoff.next().unwrap_or(Duration::from_secs(60));
                    retry_after.map_or(next, |r| r.max(next))
                }
            };
            tokio::select! {
                _ = self.stop.cancelled() => return,
                _ = self.wake.notified() => {}
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// One refill pass.
    async fn tend(&self) -> Tended {
        let me = &self.shared.identity.gateway;
        let now = Timestamp::now();
        let mine: Vec<Arc<Pod>> = self
            .store
            .state()
            .into_iter()
            .filter(|p| {
                p.labels().get(LABEL_GATEWAY) == Some(me) && p.metadata.deletion_timestamp.is_none()
            })
            .collect();
        let mut failed = false;
        let mut healthy = 0;
        for p in &mine {
            let name = p.name_any();
            let age = p
                .creation_timestamp()
                .and_then(|t| Duration::try_from(now.duration_since(t.0)).ok())
                .unwrap_or_default();
            let too_old = age > self.max_idle;
            match status::assess(p, CONTAINER) {
                PodState::Failed(e) => {
                    tracing::warn!(
                        profile = self.profile_name,
                        pod = name,
                        "warm pod cannot start: {e}"
                    );
                    failed = true;
                    self.delete_unclaimed(p).await;
                }
                _ if too_old => {
                    tracing::debug!(pod = name, "replacing an old warm pod");
                    self.delete_unclaimed(p).await;
                }
                PodState::Running { .. } => {
                    healthy += 1;
                    let mut measured = self.measured.lock().unwrap_or_else(|e| e.into_inner());
                    if measured.insert(name.clone()) {
                        self.shared
                            .metrics
                            .warm_pool_refill(&self.profile_name, age);
                    }
                }
                // Stuck (a pull that keeps failing, no node for it) beyond the start timeout:
                // replaced, not counted as idle.
                PodState::Waiting(w) if age > self.start_timeout => {
                    tracing::warn!(
                        profile = self.profile_name,
                        pod = name,
                        "warm pod stuck for {}s: {}",
                        age.as_secs(),
                        w.what
                    );
                    failed = true;
                    self.delete_unclaimed(p).await;
                }
                PodState::Waiting(_) => healthy += 1,
            }
        }
        self.measured
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|n| mine.iter().any(|p| p.metadata.name.as_deref() == Some(n)));
        let creating = {
            let mut c = self.creating.lock().unwrap_or_else(|e| e.into_inner());
            c.retain(|name, at| {
                !mine
                    .iter()
                    .any(|p| p.metadata.name.as_deref() == Some(name))
                    && at.elapsed() < Duration::from_secs(30)
            });
            c.len()
        };
        let target = self.target();
        // A smaller share (a replica came): the youngest surplus pods go, if still idle.
        if healthy > target {
            let mut surplus: Vec<&Arc<Pod>> = mine.iter().collect();
            surplus.sort_by_key(|p| std::cmp::Reverse(p.creation_timestamp().map(|t| t.0)));
            for p in surplus.into_iter().take(healthy - target) {
                tracing::debug!(
                    pod = p.name_any(),
                    target,
                    "warm pod beyond this replica's share"
                );
                self.delete_unclaimed(p).await;
            }
        }
        let missing = target.saturating_sub(healthy + creating);
        for _ in 0..missing {
            if self.stop.is_cancelled() {
                break;
            }
            let name = pod::pod_name();
            let mut manifest = pod::build(
                &pod::PodRequest {
                    name: &name,
                    namespace: &self.shared.namespace,
                    profile_name: &self.profile_name,
                    profile: &self.profile,
                    active_deadline_secs: self.deadline_secs as i64,
                    now,
                },
                &self.shared.identity,
            );
            let labels = manifest.metadata.labels.get_or_insert_default();
            labels.insert(LABEL_POOL.into(), pod::label_value(&self.profile_name));
            labels.insert(LABEL_STATE.into(), "idle".into());
            self.creating
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(name.clone(), Instant::now());
            match self
                .shared
                .pods
                .create(&PostParams::default(), &manifest)
                .await
            {
                Ok(_) => {}
                Err(e) => {
                    self.creating
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&name);
                    tracing::warn!(profile = self.profile_name, "cannot create a warm pod: {e}");
                    let retry_after = match super::backoff::classify(&e) {
                        super::backoff::Trouble::Busy { retry_after } => retry_after,
                        _ => None,
                    };
                    return Tended::Failed { retry_after };
                }
            }
        }
        if failed {
            Tended::Failed { retry_after: None }
        } else {
            Tended::Fine
        }
    }

    /// Deletes an idle pod only if it is still exactly the object seen (uid and
    /// resourceVersion preconditions): a pod a request claimed meanwhile has a new
    /// resourceVersion, and the API server refuses the delete with 409.
    async fn delete_unclaimed(&self, p: &Pod) {
        let name = p.name_any();
        let params = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions {
                uid: p.uid(),
                resource_version: p.resource_version(),
            }),
            ..DeleteParams::background()
        };
        match self.shared.pods.delete(&name, &params).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => {
                tracing::debug!(
                    pod = name,
                    "warm pod changed meanwhile (claimed or gone); left alone"
                );
            }
            Err(e) => tracing::warn!(pod = name, "cannot delete warm pod: {e}"),
        }
    }

    /// Deletes this gateway's idle pods (at shutdown).
    pub(super) async fn drain(&self) {
        let me = &self.shared.identity.gateway;
        for p in self.store.state() {
            if p.labels().get(LABEL_GATEWAY) == Some(me) {
                self.delete_unclaimed(&p).await;
            }
        }
    }
}

/// The part of a pool of `size` that the replica `me` keeps among `replicas` (pod names,
/// any order; `me` counts even when not listed yet): the parts add up to `size`.
fn share(size: usize, replicas: &[String], me: &str) -> usize {
    let mut all: Vec<String> = replicas.iter().map(|r| pod::label_value(r)).collect();
    if !all.iter().any(|r| r == me) {
        all.push(me.to_owned());
    }
    all.sort();
    all.dedup();
    let n = all.len();
    let i = all.iter().position(|r| r == me).unwrap_or(0);
    size / n + usize::from(i < size % n)
}

/// How a refill pass went.
enum Tended {
    Fine,
    /// A pool pod failed to start, or the API server refused a create (with its
    /// Retry-After, if it said one).
    Failed {
        retry_after: Option<Duration>,
    },
}

/// How long a pod may still live: until its `mcp-run.dev/expires-at`.
fn room_left(p: &Pod, now: Timestamp) -> Duration {
    p.annotations()
        .get(ANNOTATION_EXPIRES)
        .and_then(|t| t.parse::<Timestamp>().ok())
        .and_then(|t| Duration::try_from(t.duration_since(now)).ok())
        .unwrap_or(Duration::ZERO)
}

#[cfg(test)]
mod tests {
    use super::share;

    #[test]
    fn the_replicas_shares_add_up_to_the_pool_size() {
        let pods = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        for size in 0..7 {
            for n in 1..5 {
                let all: Vec<String> = (0..n).map(|i| format!("gw-{i}")).collect();
                let total: usize = all.iter().map(|me| share(size, &all, me)).sum();
                assert_eq!(total, size, "size {size}, {n} replicas");
            }
        }
        assert_eq!(share(3, &pods(&["gw-b", "gw-a"]), "gw-a"), 2);
        assert_eq!(share(3, &pods(&["gw-b", "gw-a"]), "gw-b"), 1);
        // Not listed yet (its endpoint is not in the slices): counted anyway.
        assert_eq!(share(4, &pods(&["gw-a"]), "gw-b"), 2);
        // Nobody listed: the whole pool.
        assert_eq!(share(4, &[], "gw-a"), 4);
    }
}

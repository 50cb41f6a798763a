//! Cache volumes on Kubernetes (docs/caches.md): a PersistentVolumeClaim per cache key,
//! mounted into the runs of that key, deleted after an idle TTL.
//!
//! Everything a replica needs to decide lives on the claim, so any replica decides alike:
//! - its name is the key's (`mcp-run-cache-<40 hex>`): two runs or two replicas creating it
//!   at once end with one claim (the second create is a 409, and it takes the first's);
//! - labels say whose it is without saying who (`mcp-run.dev/owner` is a hash of the
//!   identity), which cache and scope, and which installation;
//! - annotations hold who holds it (`mcp-run.dev/held-by`: the run's pod, with
//!   `held-since`/`held-until`) and when it was last used (`mcp-run.dev/last-used`).
//!
//! Taking a claim is a merge patch preconditioned on its `resourceVersion`: of two runs
//! that race, one wins and the other sees it held. A hold ends when its pod is gone (then the
//! annotation is removed), when `held-until` passed (the pod's deadline: its gateway died), or
//! when its pod does not exist once a pod start could have made it. The sweeper deletes
//! claims idle past `caches.idle_ttl_secs`, preconditioned on the `resourceVersion` it judged,
//! so a claim taken meanwhile stays; a claim still mounted is kept by Kubernetes'
//! `pvc-protection` finalizer until its pod is gone.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt as _;
use k8s_openapi::api::core::v1::{
    EmptyDirVolumeSource, PersistentVolumeClaim, PersistentVolumeClaimSpec,
    PersistentVolumeClaimVolumeSource, Pod, Volume, VolumeMount, VolumeResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt as _;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::watcher;
use tokio::time::Instant;

use super::config::Profile;
use super::error::{KubeError, api_error};
use super::pod::{
    CONTAINER, LABEL_COMPONENT, LABEL_INSTANCE, LABEL_MANAGED_BY, LABEL_NAME, LABEL_PROFILE,
    label_value,
};
use super::{KubeExecutor, Shared};
use crate::contract::{CacheState, ErrorBody, Phase};
use crate::exec::cache::{CacheKey, CacheRequest, CacheSpec, CachesConfig, WhenBusy};
use crate::exec::{ExecSpec, Progress, StartOptions};

pub(super) const LABEL_CACHE: &str = "mcp-run.dev/cache";
/// SHA-256 of the identity, 16 hex digits: never the identity or its token.
pub(super) const LABEL_OWNER: &str = "mcp-run.dev/owner";
/// `identity`, or a hash of the run's cache scope.
pub(super) const LABEL_SCOPE: &str = "mcp-run.dev/scope";
pub(super) const ANNOTATION_HELD_BY: &str = "mcp-run.dev/held-by";
pub(super) const ANNOTATION_HELD_SINCE: &str = "mcp-run.dev/held-since";
pub(super) const ANNOTATION_HELD_UNTIL: &str = "mcp-run.dev/held-until";
pub(super) const ANNOTATION_LAST_USED: &str = "mcp-run.dev/last-used";

/// How often a run waiting for a held claim looks again even when nothing changed on it
/// (its holder's pod may be gone without its gateway saying so).
const RECHECK: Duration = Duration::from_secs(5);

/// How many times in a row a claim may change under a run taking it before the run gives up
/// (each is another run winning a race, which then holds it: a busy wait follows).
const MAX_CONFLICTS: u32 = 16;

/// How long a released claim waits for its pod to be gone before it is handed on.
const RELEASE_WAIT: Duration = Duration::from_secs(60);

/// The caches of the Kubernetes backend.
pub(super) struct KubeCaches {
    shared: Arc<Shared>,
    pvcs: Api<PersistentVolumeClaim>,
    cfg: CachesConfig,
    /// A hold whose pod does not exist this long after it was taken is stale.
    stale_after: Duration,
}

/// A run's caches: mounted into its pod, released when dropped (after its pod is gone).
pub(super) struct KubeHold {
    caches: Arc<KubeCaches>,
    pod: String,
    /// Claims held, by cache.
    claims: Vec<(String, CacheSpec)>,
    /// Caches the run goes without (an `emptyDir` there instead).
    skipped: Vec<CacheSpec>,
    states: BTreeMap<String, CacheState>,
    fs_group: Option<i64>,
}

/// The claim of a key.
pub(super) fn claim_name(key: &CacheKey) -> String {
    format!("mcp-run-cache-{}", key.id)
}

fn now() -> Timestamp {
    Timestamp::now()
}

fn annotation<'a>(p: &'a PersistentVolumeClaim, k: &str) -> Option<&'a str> {
    p.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(k))
        .map(String::as_str)
}

fn time_of(p: &PersistentVolumeClaim, k: &str) -> Option<Timestamp> {
    annotation(p, k).and_then(|t| t.parse().ok())
}

/// What a run found on a claim.
enum Found {
    Free,
    /// Held by another run's pod (or being deleted): why, for the waiting caller.
    Busy(String),
}

impl KubeExecutor {
    /// Keeps the profiles' caches in claims (see the module's documentation); off when no
    /// profile declares one.
    pub fn with_caches(mut self, cfg: &CachesConfig) -> Self {
        if self.profiles.values().any(|p| !p.caches.is_empty()) {
            self.caches = Some(Arc::new(KubeCaches {
                shared: self.shared.clone(),
                pvcs: Api::namespaced(self.client.clone(), &self.shared.namespace),
                cfg: cfg.clone(),
                stale_after: Duration::from_secs(self.config.pod_start_timeout_secs + 30),
            }));
        }
        self
    }

    /// Starts the sweeper of idle claims (with the reaper; stopped with it).
    pub(super) fn start_cache_sweeper(&self) {
        let Some(caches) = self.caches.clone() else {
            return;
        };
        let stop = self.reaper.clone();
        let every = Duration::from_secs(caches.cfg.sweep_interval_secs);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => {}
                }
                match caches.sweep(now()).await {
                    Ok(n) if n > 0 => tracing::info!(deleted = n, "idle cache claims deleted"),
                    Ok(_) => {}
                    Err(e) => tracing::warn!("cache sweeper: {e}"),
                }
            }
        });
    }

    /// Takes the caches of a run's profile for the pod `pod` (not created yet), which lives
    /// at most `lifetime`.
    pub(super) async fn take_caches(
        &self,
        spec: &ExecSpec,
        profile_name: &str,
        profile: &Profile,
        pod: &str,
        lifetime: Duration,
        opts: &StartOptions,
    ) -> Result<Option<KubeHold>, ErrorBody> {
        let Some(caches) = &self.caches else {
            return Ok(None);
        };
        if profile.caches.is_empty() {
            return Ok(None);
        }
        let req = CacheRequest {
            owner: spec.owner.as_deref(),
            scope: spec.cache_scope.as_deref(),
            workspace: spec.workspace.as_ref().map(|w| w.workspace.id.as_str()),
        };
        let (_, group) = profile.run_as();
        let mut hold = KubeHold {
            caches: caches.clone(),
            pod: pod.to_string(),
            claims: Vec::new(),
            skipped: Vec::new(),
            states: BTreeMap::new(),
            fs_group: profile.fs_group.or(group),
        };
        for c in &profile.caches {
            let key = CacheKey::new(profile_name, c, &req);
            let taken = tokio::select! {
                r = caches.take(&key, c, pod, lifetime, &opts.progress) => r?,
                _ = opts.cancel.cancelled() => {
                    return Err(KubeError::ShuttingDown.into());
                }
            };
            match taken {
                Some(state) => {
                    hold.states.insert(c.name.clone(), state);
                    hold.claims.push((claim_name(&key), c.clone()));
                }
                None => {
                    hold.states.insert(c.name.clone(), CacheState::Skipped);
                    hold.skipped.push(c.clone());
                }
            }
        }
        Ok(Some(hold))
    }
}

impl KubeCaches {
    /// Takes one cache's claim for `pod`: `Some(state)`, or `None` when the run goes
    /// without it (busy with `when_busy: skip`, or one claim too many for the identity).
    async fn take(
        &self,
        key: &CacheKey,
        c: &CacheSpec,
        pod: &str,
        lifetime: Duration,
        progress: &Progress,
    ) -> Result<Option<CacheState>, ErrorBody> {
        let name = claim_name(key);
        let wait = Duration::from_secs(self.cfg.busy_wait_secs);
        let wait_end = Instant::now() + wait;
        let mut told = false;
        let mut conflicts = 0u32;
        loop {
            if conflicts > MAX_CONFLICTS {
                return Err(KubeError::ClaimConflicts {
                    cache: c.name.clone(),
                    claim: name,
                    times: MAX_CONFLICTS,
                }
                .into());
            }
            self.shared.throttle.acquire().await;
            let found = match self.pvcs.get_opt(&name).await {
                Ok(f) => f,
                Err(e) => return Err(api_error("cannot read the cache's claim", &e).into()),
            };
            let current = match found {
                None => {
                    if self.count(&key.owner_hash).await? >= self.cfg.max_per_identity {
                        tracing::warn!(
                            cache = c.name,
                            owner = key.owner_hash,
                            "the identity has caches.max_per_identity claims: running without one more"
                        );
                        progress.report(
                            Phase::Queued,
                            Some(format!(
                                "cache {}: the caller has {} caches already (caches.max_per_identity); running without it",
                                c.name, self.cfg.max_per_identity
                            )),
                        );
                        return Ok(None);
                    }
                    self.shared.throttle.acquire().await;
                    match self
                        .pvcs
                        .create(&PostParams::default(), &self.claim(key, c, pod, lifetime))
                        .await
                    {
                        Ok(_) => {
                            tracing::info!(claim = name, cache = c.name, "cache claim created");
                            self.shared.metrics.cache(&c.name, "created");
                            audit_line(&key.owner_hash, &c.name, "created", &name, pod);
                            return Ok(Some(CacheState::Created));
                        }
                        // Another run or replica created it first: take it as found.
                        Err(kube::Error::Api(s)) if s.code == 409 => {
                            conflicts += 1;
                            continue;
                        }
                        Err(e) => {
                            return Err(api_error("cannot create the cache's claim", &e).into());
                        }
                    }
                }
                Some(p) => p,
            };
            let why = match self.judge(&current, pod).await {
                Found::Free => {
                    match self.hold(&current, pod, lifetime).await {
                        Ok(()) => {
                            self.shared.metrics.cache(&c.name, "mounted");
                            audit_line(&key.owner_hash, &c.name, "mounted", &name, pod);
                            return Ok(Some(CacheState::Reused));
                        }
                        // Changed since it was read (another run took it), or deleted since:
                        // look again.
                        Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => {
                            conflicts += 1;
                            continue;
                        }
                        Err(e) => return Err(api_error("cannot take the cache's claim", &e).into()),
                    }
                }
                Found::Busy(why) => why,
            };
            if c.when_busy == WhenBusy::Skip {
                self.shared.metrics.cache(&c.name, "skipped");
                progress.report(
                    Phase::Queued,
                    Some(format!("cache {} is {why}; running without it", c.name)),
                );
                return Ok(None);
            }
            if !told {
                self.shared.metrics.cache(&c.name, "waited");
                progress.report(
                    Phase::Queued,
                    Some(format!(
                        "cache {} is {why}; waiting up to {}s",
                        c.name,
                        wait.as_secs()
                    )),
                );
                told = true;
            }
            if !self.changed(&name, &current, wait_end).await {
                return Err(crate::exec::cache::CacheError::Busy {
                    name: c.name.clone(),
                    secs: wait.as_secs(),
                }
                .into());
            }
        }
    }

    /// A new claim, held by `pod` from the start.
    fn claim(
        &self,
        key: &CacheKey,
        c: &CacheSpec,
        pod: &str,
        lifetime: Duration,
    ) -> PersistentVolumeClaim {
        let id = &self.shared.identity;
        let labels: BTreeMap<String, String> = [
            (LABEL_NAME, "mcp-run".to_string()),
            (LABEL_COMPONENT, "cache".into()),
            (LABEL_MANAGED_BY, "mcp-run".into()),
            (LABEL_INSTANCE, id.instance.clone()),
            (LABEL_PROFILE, label_value(&key.profile)),
            (LABEL_CACHE, key.cache.clone()),
            (LABEL_OWNER, key.owner_hash.clone()),
            (LABEL_SCOPE, key.scope_key.clone()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let storage_class = c
            .storage_class
            .clone()
            .or_else(|| self.cfg.storage_class.clone());
        PersistentVolumeClaim {
            metadata: ObjectMeta {
                name: Some(claim_name(key)),
                namespace: Some(self.shared.namespace.clone()),
                labels: Some(labels),
                annotations: Some(
                    held_annotations(pod, lifetime)
                        .into_iter()
                        .map(|(k, v)| (k.to_string(), v))
                        .collect(),
                ),
                ..Default::default()
            },
            spec: Some(PersistentVolumeClaimSpec {
                access_modes: Some(vec![self.cfg.access_mode.clone()]),
                storage_class_name: storage_class,
                volume_mode: Some("Filesystem".into()),
                resources: Some(VolumeResourceRequirements {
                    requests: Some(
                        [("storage".to_string(), Quantity(self.cfg.quantity_of(c)))].into(),
                    ),
                    limits: None,
                }),
                ..Default::default()
            }),
            status: None,
        }
    }

    /// Whether a claim is free for `pod`.
    async fn judge(&self, p: &PersistentVolumeClaim, pod: &str) -> Found {
        if p.metadata.deletion_timestamp.is_some() {
            return Found::Busy("being deleted (idle past caches.idle_ttl_secs)".into());
        }
        let Some(holder) = annotation(p, ANNOTATION_HELD_BY).filter(|h| !h.is_empty()) else {
            return Found::Free;
        };
        if holder == pod {
            return Found::Free;
        }
        let now = now();
        if time_of(p, ANNOTATION_HELD_UNTIL).is_none_or(|t| t <= now) {
            return Found::Free;
        }
        // A hold older than a pod start whose pod does not exist: its gateway died before
        // it created the pod, or after the pod went but before it released the claim.
        let since = time_of(p, ANNOTATION_HELD_SINCE).unwrap_or(now);
        let age: Duration = now
            .duration_since(since)
            .try_into()
            .unwrap_or(Duration::ZERO);
        if age >= self.stale_after {
            self.shared.throttle.acquire().await;
            if let Ok(None) = self.shared.pods.get_opt(holder).await {
                tracing::info!(
                    claim = p.name_any(),
                    holder,
                    "cache claim held by a pod that is gone: taken over"
                );
                return Found::Free;
            }
        }
        Found::Busy(format!("in use by the run in pod {holder}"))
    }

    /// Marks a claim held by `pod`, preconditioned on the version that was judged free.
    async fn hold(
        &self,
        p: &PersistentVolumeClaim,
        pod: &str,
        lifetime: Duration,
    ) -> Result<(), kube::Error> {
        let patch = serde_json::json!({
            "metadata": {
                "resourceVersion": p.resource_version(),
                "annotations": held_annotations(pod, lifetime),
            }
        });
        self.shared.throttle.acquire().await;
        self.pvcs
            .patch(
                &p.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
            .map(|_| ())
    }

    /// Waits until the claim changes (or is gone), [`RECHECK`] at most; `false` once
    /// `until` passed.
    async fn changed(&self, name: &str, seen: &PersistentVolumeClaim, until: Instant) -> bool {
        if Instant::now() >= until {
            return false;
        }
        let seen_rv = seen.resource_version();
        let mut events = watcher::watch_object(self.pvcs.clone(), name).boxed();
        let next_look = (Instant::now() + RECHECK).min(until);
        loop {
            match tokio::time::timeout_at(next_look, events.next()).await {
                Err(_) => return Instant::now() < until,
                Ok(None) => return true,
                Ok(Some(Ok(Some(p)))) if p.resource_version() == seen_rv => {}
                Ok(Some(Ok(_))) => return true,
                Ok(Some(Err(e))) => {
                    tracing::debug!(claim = name, "watching a busy cache's claim: {e}");
                    tokio::time::sleep_until(next_look).await;
                    return Instant::now() < until;
                }
            }
        }
    }

    fn selector(&self) -> String {
        format!(
            "{LABEL_MANAGED_BY}=mcp-run,{LABEL_COMPONENT}=cache,{LABEL_INSTANCE}={}",
            self.shared.identity.instance
        )
    }

    /// The claims of one owner.
    async fn count(&self, owner_hash: &str) -> Result<usize, ErrorBody> {
        self.shared.throttle.acquire().await;
        let lp = ListParams::default()
            .labels(&format!("{},{LABEL_OWNER}={owner_hash}", self.selector()));
        self.pvcs
            .list_metadata(&lp)
            .await
            .map(|l| l.items.len())
            .map_err(|e| api_error("cannot list the caller's cache claims", &e).into())
    }

    /// Deletes the claims nobody holds that were last used more than the TTL ago.
    async fn sweep(&self, now: Timestamp) -> Result<usize, kube::Error> {
        let list = self
            .pvcs
            .list(&ListParams::default().labels(&self.selector()))
            .await?;
        let ttl = Duration::from_secs(self.cfg.idle_ttl_secs);
        let mut n = 0;
        for p in list.items {
            if !is_idle(&p, now, ttl) {
                continue;
            }
            let name = p.name_any();
            let params = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: p.uid(),
                    resource_version: p.resource_version(),
                }),
                ..DeleteParams::background()
            };
            self.shared.throttle.acquire().await;
            match self.pvcs.delete(&name, &params).await {
                Ok(_) => {
                    tracing::info!(claim = name, "idle cache claim deleted");
                    let cache = p
                        .labels()
                        .get("mcp-run.dev/cache")
                        .cloned()
                        .unwrap_or_default();
                    let owner = p
                        .labels()
                        .get("mcp-run.dev/owner")
                        .cloned()
                        .unwrap_or_default();
                    self.shared.metrics.cache(&cache, "deleted");
                    audit_line(&owner, &cache, "deleted", &name, "");
                    n += 1;
                }
                // Taken (or deleted) by someone else since it was listed.
                Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
                Err(e) => tracing::warn!(claim = name, "cannot delete an idle cache claim: {e}"),
            }
        }
        Ok(n)
    }

    /// Ends `pod`'s hold of a claim once the pod is gone, recording the use.
    async fn release(&self, claim: &str, pod: &str) {
        for _ in 0..5 {
            self.shared.throttle.acquire().await;
            let p = match self.pvcs.get_opt(claim).await {
                Ok(Some(p)) => p,
                Ok(None) => return,
                Err(e) => {
                    tracing::warn!(claim, "cannot release a cache claim: {e}");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    continue;
                }
            };
            if annotation(&p, ANNOTATION_HELD_BY) != Some(pod) {
                // Taken over as stale: not ours to release any more.
                return;
            }
            let patch = serde_json::json!({
                "metadata": {
                    "resourceVersion": p.resource_version(),
                    "annotations": {
                        ANNOTATION_HELD_BY: null,
                        ANNOTATION_HELD_SINCE: null,
                        ANNOTATION_HELD_UNTIL: null,
                        ANNOTATION_LAST_USED: now().to_string(),
                    }
                }
            });
            self.shared.throttle.acquire().await;
            match self
                .pvcs
                .patch(claim, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => return,
                Err(kube::Error::Api(s)) if s.code == 409 => continue,
                Err(kube::Error::Api(s)) if s.code == 404 => return,
                Err(e) => {
                    tracing::warn!(claim, "cannot release a cache claim: {e}");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
        tracing::warn!(
            claim,
            "cache claim not released; it is free again when its hold expires"
        );
    }
}

fn held_annotations(pod: &str, lifetime: Duration) -> BTreeMap<&'static str, String> {
    let now = now();
    let until = now.checked_add(lifetime).unwrap_or(now);
    [
        (ANNOTATION_HELD_BY, pod.to_string()),
        (ANNOTATION_HELD_SINCE, now.to_string()),
        (ANNOTATION_HELD_UNTIL, until.to_string()),
        (ANNOTATION_LAST_USED, now.to_string()),
    ]
    .into()
}

/// Whether a claim is unused and was last used more than `ttl` ago (its creation, if it
/// was never released).
pub(super) fn is_idle(p: &PersistentVolumeClaim, now: Timestamp, ttl: Duration) -> bool {
    if p.metadata.deletion_timestamp.is_some() {
        return false;
    }
    let held = annotation(p, ANNOTATION_HELD_BY).is_some_and(|h| !h.is_empty())
        && time_of(p, ANNOTATION_HELD_UNTIL).is_some_and(|t| t > now);
    if held {
        return false;
    }
    let last = time_of(p, ANNOTATION_LAST_USED)
        .or_else(|| p.creation_timestamp().map(|t| t.0))
        .unwrap_or(now);
    let idle: Duration = now
        .duration_since(last)
        .try_into()
        .unwrap_or(Duration::ZERO);
    idle >= ttl
}

impl KubeHold {
    /// The variables that point the run's tools at its caches (mounted at their paths).
    pub(super) fn env(&self) -> impl Iterator<Item = (String, String)> + '_ {
        self.claims
            .iter()
            .map(|(_, c)| c)
            .chain(self.skipped.iter())
            .flat_map(|c| c.env_at(&c.path))
    }

    pub(super) fn states(&self) -> BTreeMap<String, CacheState> {
        self.states.clone()
    }

    /// Mounts the claims (and an `emptyDir` for each skipped cache) into the runner pod.
    /// The pod's `fsGroup` (the run's group unless the profile names one) makes a claim
    /// writable by the non-root user without a root init step, which Pod Security
    /// `restricted` would refuse; `OnRootMismatch` changes ownership only on a new volume,
    /// not through a warm cache's files on every run.
    pub(super) fn mount(&self, pod: &mut Pod) {
        let Some(spec) = pod.spec.as_mut() else {
            return;
        };
        let mut volumes = Vec::new();
        let mut mounts = Vec::new();
        for (claim, c) in &self.claims {
            volumes.push(Volume {
                name: volume_name(c),
                persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                    claim_name: claim.clone(),
                    read_only: Some(false),
                }),
                ..Default::default()
            });
            mounts.push(mount(c));
        }
        for c in &self.skipped {
            volumes.push(Volume {
                name: volume_name(c),
                empty_dir: Some(EmptyDirVolumeSource {
                    size_limit: Some(Quantity(self.caches.cfg.quantity_of(c))),
                    medium: None,
                }),
                ..Default::default()
            });
            mounts.push(mount(c));
        }
        spec.volumes.get_or_insert_with(Vec::new).extend(volumes);
        if let Some(container) = spec.containers.iter_mut().find(|c| c.name == CONTAINER) {
            container
                .volume_mounts
                .get_or_insert_with(Vec::new)
                .extend(mounts);
        }
        if let Some(group) = self.fs_group {
            let sc = spec.security_context.get_or_insert_with(Default::default);
            sc.fs_group.get_or_insert(group);
            sc.fs_group_change_policy
                .get_or_insert_with(|| "OnRootMismatch".into());
        }
    }
}

fn volume_name(c: &CacheSpec) -> String {
    format!("mcp-run-cache-{}", c.name)
}

fn mount(c: &CacheSpec) -> VolumeMount {
    VolumeMount {
        name: volume_name(c),
        mount_path: c.path.clone(),
        ..Default::default()
    }
}

impl KubeHold {
    /// The pod outlives this gateway (a session left to the other replicas): its claims
    /// stay held by it, and end as any hold does when its pod is gone or past its deadline.
    pub(super) fn stay_with_pod(mut self) {
        self.claims.clear();
    }
}

impl Drop for KubeHold {
    fn drop(&mut self) {
        let claims = std::mem::take(&mut self.claims);
        if claims.is_empty() {
            return;
        }
        let caches = self.caches.clone();
        let pod = std::mem::take(&mut self.pod);
        let release = async move {
            // Handed on only once the pod is gone: its volume is unmounted (and detachable).
            let gone = kube::runtime::wait::await_condition(
                caches.shared.pods.clone(),
                &pod,
                |p: Option<&Pod>| p.is_none(),
            );
            if tokio::time::timeout(RELEASE_WAIT, gone).await.is_err() {
                tracing::warn!(pod, "releasing cache claims of a pod that is still there");
            }
            for (claim, _) in &claims {
                caches.release(claim, &pod).await;
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                self.caches.shared.deletions.spawn_on(release, &handle);
            }
            Err(_) => tracing::error!("no runtime to release cache claims"),
        }
    }
}

/// The audit line of a claim's life (`created`, `mounted`, `deleted`), in the audit log
/// (`crate::audit`'s target; this layer sits below it, so the line is written here).
fn audit_line(owner_hash: &str, cache: &str, event: &str, claim: &str, pod: &str) {
    tracing::info!(
        target: "mcp_run::audit",
        owner = %owner_hash,
        cache = %cache,
        outcome = %format!("cache_{event}"),
        claim = %claim,
        pod = %pod,
        "cache {event}"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pvc(annotations: serde_json::Value, created: &str) -> PersistentVolumeClaim {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "c", "creationTimestamp": created, "annotations": annotations}
        }))
        .unwrap()
    }

    #[test]
    fn idle_means_unheld_and_unused_for_the_ttl() {
        let now: Timestamp = "2026-11-26T12:00:00Z".parse().unwrap();
        let ttl = Duration::from_secs(3600);
        let old = "2026-11-26T10:00:00Z";
        // Never released: its creation counts.
        assert!(is_idle(&pvc(serde_json::json!({}), old), now, ttl));
        assert!(!is_idle(
            &pvc(serde_json::json!({}), "2026-11-26T11:30:00Z"),
            now,
            ttl
        ));
        let used = |t: &str| serde_json::json!({ANNOTATION_LAST_USED: t});
        assert!(!is_idle(&pvc(used("2026-11-26T11:30:00Z"), old), now, ttl));
        assert!(is_idle(&pvc(used("2026-11-26T10:30:00Z"), old), now, ttl));
        // Held: never idle until the hold expires.
        let held = |until: &str| {
            serde_json::json!({
                ANNOTATION_LAST_USED: "2026-11-26T09:00:00Z",
                ANNOTATION_HELD_BY: "mcp-run-x",
                ANNOTATION_HELD_UNTIL: until,
            })
        };
        assert!(!is_idle(&pvc(held("2026-11-26T13:00:00Z"), old), now, ttl));
        assert!(is_idle(&pvc(held("2026-11-26T11:00:00Z"), old), now, ttl));
    }
}

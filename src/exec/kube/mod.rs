//! The Kubernetes backend: each request runs in its own ephemeral pod, through the exec API.
//!
//! Per request: create a hardened pod from the request's profile ([`pod`]), watch it until
//! its container runs ([`status::assess`] turns pod states into specific errors), exec the
//! command in it (argv as argv; `cwd` and `env` through a constant wrapper script, see
//! [`pod::argv`]), stream stdout and stderr as they arrive, map the exec status
//! channel to the same `exit` event as the local backend, and delete the pod (grace 1 s; its
//! concurrency slot is released when the kubelet has removed it).
//!
//! Cleanup on every path: a [`guard::PodGuard`] is armed before the pod is created and deletes it
//! when dropped, whatever dropped it (exit, error, timeout, client gone, shutdown); the
//! executor's shutdown waits for those deletions; pods carry an owner reference to the
//! gateway pod when it runs in-cluster; and the [`reaper`] deletes leftovers of a crashed
//! gateway at start-up and periodically.

mod backoff;
mod cache;
pub(crate) mod config;
mod error;
mod guard;
mod kept;
mod kept_tree;
pub(crate) mod pod;
mod pool;
mod reaper;
mod setup;
mod start;
pub(crate) mod status;
mod stream;
mod throttle;
mod workspace;

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::Api;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use self::config::{KubernetesConfig, Profile};
use self::error::KubeError;
use self::pod::Identity;
pub(crate) use self::setup::{KubeSetupError, client_config};
use super::{ExecSpec, Execution, Executor, StartOptions};
use crate::contract::ErrorBody;

/// Beyond the request's timeout and the start timeout, how long a runner pod may live
/// before Kubernetes itself kills it (`activeDeadlineSeconds`): the backstop if the gateway
/// dies without deleting it.
const DEADLINE_MARGIN_SECS: u64 = 120;

/// How long a pod deletion may be retried (429s and 5xx waited out, Retry-After honoured).
const DELETE_BUDGET: Duration = Duration::from_secs(30);

/// Runs each command in its own pod.
pub struct KubeExecutor {
    shared: Arc<Shared>,
    client: Client,
    profiles: BTreeMap<String, Profile>,
    config: KubernetesConfig,
    permits: Arc<Semaphore>,
    /// Runs waiting for a slot now (bounded by `max_queued_runs`).
    queued: Arc<std::sync::atomic::AtomicUsize>,
    reaper: CancellationToken,
    /// Permissions the start-up access review found missing (re-checked by `/readyz`).
    missing: Mutex<Option<Vec<String>>>,
    /// Warm pools of the profiles that have one, started by `prepare`.
    pools: std::sync::OnceLock<BTreeMap<String, Arc<pool::WarmPool>>>,
    /// The profiles' cache claims (docs/caches.md), when a profile declares caches.
    caches: Option<Arc<cache::KubeCaches>>,
    /// The pods of this gateway's replicas (`server.peer_service`): the warm pools share
    /// their size among them.
    replicas: Option<tokio::sync::watch::Receiver<Vec<String>>>,
}

/// What pod guards need after the request that armed them is gone.
struct Shared {
    client: Client,
    /// The API server's URL, for errors that say it cannot be reached.
    server: String,
    pods: Api<Pod>,
    /// The gateway's own rate limit to the API server, for the calls of requests.
    throttle: throttle::Throttle,
    namespace: String,
    identity: Identity,
    /// Pods this process created and has not deleted yet; the reaper leaves them alone.
    live: Mutex<HashSet<String>>,
    /// Pending deletions, awaited at shutdown.
    deletions: TaskTracker,
    /// Pod start and warm pool figures.
    metrics: crate::metrics::Metrics,
    /// How often exec WebSockets are pinged (`exec_ping_secs`).
    ping_interval: std::time::Duration,
    /// Whether live sessions' pods outlive this gateway's shutdown: it runs in a pod (the
    /// installation restarts it) or has replicas, and they find the pods by their labels.
    leaves_sessions: std::sync::atomic::AtomicBool,
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
        Box::pin(self.run(spec, opts))
    }

    fn check(&self, spec: &ExecSpec) -> Result<(), ErrorBody> {
        let name = spec.profile.as_deref().unwrap_or("default");
        let profile = self.profile(name)?;
        if spec.workspace.is_some() {
            workspace::workspace_path(name, profile)?;
        }
        Ok(())
    }

    /// One pod across calls ([`kept`]).
    fn keeps_runners(&self) -> bool {
        true
    }

    /// A session's state is on its pod (labels, annotations), which every replica finds.
    fn sessions_shared(&self) -> bool {
        true
    }

    /// By the session pod's labels ([`kept`]).
    fn find_kept(
        &self,
        owner: &str,
        name: &str,
    ) -> BoxFuture<'_, Result<Option<super::FoundRunner>, ErrorBody>> {
        let (owner, name) = (owner.to_owned(), name.to_owned());
        Box::pin(async move { self.find_session_pod(&owner, &name).await })
    }

    /// By the session pods' owner label ([`kept`]).
    fn list_kept(&self, owner: &str) -> BoxFuture<'_, Result<Vec<super::KeptSession>, ErrorBody>> {
        let owner = owner.to_owned();
        Box::pin(async move { self.list_session_pods(&owner).await })
    }

    fn keep(
        &self,
        spec: &ExecSpec,
        keep: super::KeepFor,
        opts: StartOptions,
    ) -> BoxFuture<'_, Result<Arc<dyn super::KeptRunner>, ErrorBody>> {
        let spec = spec.clone();
        Box::pin(async move {
            let kept = self.keep_pod(&spec, keep, opts).await?;
            Ok(Arc::new(kept) as Arc<dyn super::KeptRunner>)
        })
    }

    /// Into the profile's `workspace_path` (see [`workspace`]).
    fn supports_workspaces(&self) -> bool {
        true
    }

    /// Ready when the API server answers and the gateway has the permissions it needs.
    fn ready(&self) -> BoxFuture<'_, Result<(), ErrorBody>> {
        Box::pin(async move {
            match tokio::time::timeout(Duration::from_secs(3), self.client.apiserver_version())
                .await
            {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    return Err(KubeError::ApiServerUnreachable {
                        server: self.shared.server.clone(),
                        why: backoff::describe(&e),
                    }
                    .into());
                }
                Err(_) => return Err(KubeError::ApiServerSilent.into()),
            }
            let missing = self.missing.lock().ok().and_then(|m| m.clone());
            let missing = match missing {
                Some(m) if m.is_empty() => return Ok(()),
                // Not checked yet, or missing last time: permissions may have been granted since.
                _ => self.check_permissions().await?,
            };
            if missing.is_empty() {
                Ok(())
            } else {
                Err(KubeError::MissingPermissions {
                    missing: missing.join(", "),
                    namespace: self.shared.namespace.clone(),
                }
                .into())
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
                    caches: crate::exec::cache::info(&p.caches),
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
            // Deleted, and gone (their containers stopped) before the gateway exits.
            let shared = &self.shared;
            futures_util::future::join_all(left.iter().map(|name| async move {
                if shared.delete(name).await {
                    shared.await_gone(name).await;
                }
            }))
            .await;
        })
    }
}

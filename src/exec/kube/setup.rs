//! Setting the backend up: connecting to the API server, checking permissions, starting the
//! reaper and the warm pools.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::config::{KubernetesConfig, Profile};
use super::error::KubeError;
use super::pod::{self, Identity};
use super::{KubeExecutor, Shared, pool, reaper};

/// How long one permission check may retry a busy API server.
const PERMISSION_CHECK_BUDGET: Duration = Duration::from_secs(10);

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

/// The API server and credentials: the in-cluster account, else the kubeconfig (`KUBECONFIG`
/// or `~/.kube/config`); `kubernetes.kubeconfig` / `kubernetes.context` pick one explicitly.
/// Also what the replicas' discovery (`crate::peers::discovery`) connects with.
pub(crate) async fn client_config(
    config: &KubernetesConfig,
) -> Result<kube::Config, KubeSetupError> {
    // Whichever TLS user comes first installs the process's crypto provider.
    let _ = rustls::crypto::ring::default_provider().install_default();
    Ok(if config.kubeconfig.is_some() || config.context.is_some() {
        let options = KubeConfigOptions {
            context: config.context.clone(),
            ..Default::default()
        };
        match &config.kubeconfig {
            Some(path) => {
                kube::Config::from_custom_kubeconfig(Kubeconfig::read_from(path)?, &options).await?
            }
            None => kube::Config::from_kubeconfig(&options).await?,
        }
    } else if let Ok(c) = kube::Config::incluster() {
        c
    } else {
        kube::Config::infer().await?
    })
}

impl KubeExecutor {
    /// Shares the warm pools' sizes among the replicas that `replicas` lists (their pods),
    /// so that the installation keeps `warm_pool.size` idle pods, not that many per replica.
    pub(crate) fn with_replicas(
        mut self,
        replicas: Option<tokio::sync::watch::Receiver<Vec<String>>>,
    ) -> Self {
        if replicas.is_some() {
            self.shared
                .leaves_sessions
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
        self.replicas = replicas;
        self
    }

    /// Connects with the in-cluster account, else the kubeconfig (`KUBECONFIG` or
    /// `~/.kube/config`); `kubernetes.kubeconfig` / `kubernetes.context` pick one explicitly.
    pub async fn connect(
        config: KubernetesConfig,
        profiles: BTreeMap<String, Profile>,
        metrics: crate::metrics::Metrics,
    ) -> Result<Self, KubeSetupError> {
        let kube_config = client_config(&config).await?;
        let namespace = config
            .namespace
            .clone()
            .unwrap_or_else(|| kube_config.default_namespace.clone());
        // kube's own retry of 429/503/504 (up to 15 times) is off: the backend retries what
        // it can within the budget of each call's phase instead (backoff.rs), and the two
        // must not compound.
        let mut kube_config = kube_config;
        kube_config.default_retry = false;
        let server = kube_config.cluster_url.to_string();
        let client = kube::client::ClientBuilder::try_from(kube_config)?
            .with_layer(&super::backoff::retry_after_layer())
            .build();
        let pod_name = std::env::var("MCP_RUN_POD_NAME")
            .ok()
            .filter(|s| !s.is_empty());
        let in_pod = pod_name.is_some();
        let gateway = pod_name
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
                client: client.clone(),
                server,
                pods: Api::namespaced(client.clone(), &namespace),
                throttle: super::throttle::Throttle::new(config.api_qps, config.api_burst),
                namespace,
                identity,
                live: Mutex::new(HashSet::new()),
                deletions: TaskTracker::new(),
                metrics,
                ping_interval: Duration::from_secs(config.exec_ping_secs),
                leaves_sessions: in_pod.into(),
            }),
            client,
            permits: Arc::new(Semaphore::new(config.max_concurrent_pods)),
            queued: Default::default(),
            profiles,
            config,
            reaper: CancellationToken::new(),
            missing: Mutex::new(None),
            pools: std::sync::OnceLock::new(),
            caches: None,
            replicas: None,
        })
    }

    /// Checks permissions and deletes this gateway's leftovers from a previous run, then
    /// starts the periodic reaper and the warm pools. Called once before serving;
    /// `longest_request` is the server's maximum timeout.
    pub async fn prepare(&self, longest_request: Duration) {
        let _ = self.check_permissions().await;
        let reaper = reaper::Reaper {
            pods: self.shared.pods.clone(),
            identity: self.shared.identity.clone(),
            min_age: Duration::from_secs(self.config.reaper_min_age_secs),
            replicas: self.replicas.clone(),
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
                    Duration::from_secs(self.config.pod_start_timeout_secs),
                    self.reaper.child_token(),
                    self.replicas.clone(),
                );
                tracing::info!(profile = name, size = pool.size(), "warm pool started");
                (name.clone(), pool)
            })
            .collect();
        let _ = self.pools.set(pools);
        self.start_cache_sweeper();
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
    /// missing. Returns the missing permissions, or why they could not be checked (then
    /// nothing is logged as checked, and `/readyz` asks again).
    pub(super) async fn check_permissions(&self) -> Result<Vec<String>, KubeError> {
        let ns = self.shared.namespace.clone();
        // Exec over WebSocket is authorized as `get` pods/exec, and from Kubernetes 1.35 as
        // `create` too. The warm pool claims pods with `patch`.
        let mut needed = vec![
            ("pods", "", "create"),
            ("pods", "", "get"),
            ("pods", "", "list"),
            ("pods", "", "watch"),
            ("pods", "", "delete"),
            ("pods", "exec", "create"),
            ("pods", "exec", "get"),
        ];
        if self.profiles.values().any(|p| p.warm_pool.size > 0) {
            needed.push(("pods", "", "patch"));
        }
        if self.caches.is_some() {
            for verb in ["create", "get", "list", "watch", "patch", "delete"] {
                needed.push(("persistentvolumeclaims", "", verb));
            }
        }
        let api: Api<SelfSubjectAccessReview> = Api::all(self.client.clone());
        let mut missing = Vec::new();
        for (resource, sub, verb) in needed {
            let review = SelfSubjectAccessReview {
                spec: SelfSubjectAccessReviewSpec {
                    resource_attributes: Some(ResourceAttributes {
                        namespace: Some(ns.clone()),
                        resource: Some(resource.into()),
                        subresource: (!sub.is_empty()).then(|| sub.to_string()),
                        verb: Some(verb.into()),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                ..Default::default()
            };
            let what = if sub.is_empty() {
                format!("{verb} {resource}")
            } else {
                format!("{verb} {resource}/{sub}")
            };
            let budget = super::backoff::Budget {
                end: tokio::time::Instant::now() + PERMISSION_CHECK_BUDGET,
                attempt: Duration::from_secs(5),
                retry_internal: true,
            };
            let post = PostParams::default();
            let answer = super::backoff::call("checking a permission", budget, || {
                api.create(&post, &review)
            })
            .await;
            match answer {
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
                    let why = match e {
                        super::backoff::Failure::Unreachable(why) => {
                            KubeError::ApiServerUnreachable {
                                server: self.shared.server.clone(),
                                why,
                            }
                        }
                        super::backoff::Failure::OutOfTime { attempts, last } => {
                            KubeError::NoAnswer { attempts, last }
                        }
                        super::backoff::Failure::Api(e) => {
                            KubeError::Refused(super::backoff::describe(&e))
                        }
                    };
                    // Unknown, not granted: `/readyz` checks again.
                    tracing::error!(
                        namespace = ns,
                        "cannot check the gateway's permissions: {why}"
                    );
                    if let Ok(mut m) = self.missing.lock() {
                        *m = None;
                    }
                    return Err(why);
                }
            }
        }
        if missing.is_empty() {
            tracing::info!(namespace = ns, "permissions to run pods checked");
        }
        if let Ok(mut m) = self.missing.lock() {
            *m = Some(missing.clone());
        }
        Ok(missing)
    }
}

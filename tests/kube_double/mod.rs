//! An in-process test double of the Kubernetes API server: the subset the Kubernetes
//! backend uses, written to the API's documented behaviour, with pods "run" by local
//! processes. The e2e suite (e2e/) checks the same behaviour against real clusters, so this
//! double is never the only judge.
//!
//! Served (core/v1 pods in the configured namespaces, plain HTTP, bearer token required):
//! - `POST /api/v1/namespaces/{ns}/pods`: names from `metadata.name` or `generateName`; uid,
//!   `resourceVersion` (one global counter), `creationTimestamp`; 409 `AlreadyExists`, 422
//!   `Invalid` (no containers, a container without name or image), 404 for an unknown
//!   namespace; `dryRun=All` validates and stores nothing. Answers 201 with the object.
//! - A simulated kubelet and scheduler, one step every `step_delay`, each step a new
//!   resourceVersion and a `MODIFIED` watch event: scheduled (`spec.nodeName`,
//!   `PodScheduled=True`), then the container running (`phase: Running`, `Ready=True`).
//!   Failure injection by image name or spec:
//!   * image containing `pull-error`: waiting `ErrImagePull`, then `ImagePullBackOff`;
//!   * image containing `config-error`: waiting `CreateContainerConfigError`;
//!   * image containing `never-starts`: scheduled, waiting `ContainerCreating` forever;
//!   * a `nodeSelector` the node's labels (`kubernetes.io/hostname=<node>`,
//!     `kubernetes.io/os=linux`) do not match: `PodScheduled=False`, reason `Unschedulable`;
//!   * `activeDeadlineSeconds`: then `phase: Failed`, reason `DeadlineExceeded`, processes
//!     killed.
//! - `GET` one pod (404 `NotFound` Status), `LIST` with `labelSelector` (`=`, `==`, `!=`,
//!   `in`, `notin`, `key`, `!key`) and `fieldSelector` (`metadata.name`,
//!   `metadata.namespace`, `status.phase`, `spec.nodeName`; `=`, `==`, `!=`), list
//!   `metadata.resourceVersion` set.
//! - `WATCH` (`watch=true|1`): from `resourceVersion` (events after it; unset or `0`: a
//!   synthetic `ADDED` per current object first), selectors as for list, `timeoutSeconds`,
//!   `allowWatchBookmarks` (a `BOOKMARK` every second), an `ERROR` event with a 410 `Expired`
//!   Status for a resourceVersion older than the kept history.
//! - `DELETE` one pod: `DeleteOptions` in the body or `gracePeriodSeconds` in the query
//!   (0: gone at once; otherwise `deletionTimestamp` set and gone after the grace),
//!   preconditions (uid, resourceVersion: 409 `Conflict`); 200 with the object; `DELETED`.
//!   Deleting a pod kills its exec processes, as the kubelet killing its container would.
//! - `PATCH` one pod with `application/merge-patch+json` or
//!   `application/strategic-merge-patch+json` (applied as a JSON merge patch, which is what
//!   strategic merge does for labels and annotations); a `metadata.resourceVersion` in the
//!   patch is an optimistic-concurrency precondition: 409 `Conflict` when stale.
//! - `POST /apis/authorization.k8s.io/v1/selfsubjectaccessreviews`: allowed unless
//!   [`KubeDouble::deny`]ed. `GET /version`, `/readyz`, `/livez`.
//! - `pods/exec` (GET or POST, WebSocket upgrade): subprotocols `v5.channel.k8s.io` and
//!   `v4.channel.k8s.io` (the first the client offers that the server supports, as the API
//!   server's wsstream does; none → 400). Binary frames whose first byte is the channel: 0
//!   stdin, 1 stdout, 2 stderr, 3 status, 4 resize; v5's 255 closes a stream (`[255, 0]`
//!   closes stdin). The command runs as a local process, argv exactly as given (no shell),
//!   with the container's `env` values and the double's `PATH`, in the container's
//!   `workingDir` or `/`, in its own process group. Output is read from the pipes only as
//!   fast as frames are sent. At the end channel 3 carries the Status the kubelet writes:
//!   `Success`; `Failure`/`NonZeroExitCode` with an `ExitCode` cause (a process killed by
//!   signal N reports 128+N, as container runtimes do); a program that cannot be started is
//!   `Failure`/`InternalError` (code 500) with the OCI runtime's wording (`exec: "x":
//!   executable file not found in $PATH`). Exec into a missing pod: 404; into a pod whose
//!   container is not running: 400 `BadRequest`.
//! - Everything else: a 404 `NotFound` Status. Every error is an apimachinery `Status`.
#![allow(dead_code)]
// Handlers return whole responses as their errors: this is test code, not a hot path.
#![allow(clippy::result_large_err)]

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, Query, RawQuery, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::{SinkExt as _, StreamExt as _};
use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateRunning, ContainerStateWaiting, ContainerStatus, Pod,
    PodCondition, PodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use serde_json::{Value, json};
use tokio::io::AsyncReadExt as _;
use tokio::sync::{broadcast, oneshot};
use tokio_util::sync::CancellationToken;

/// How the double behaves.
#[derive(Debug, Clone)]
pub struct DoubleOptions {
    pub namespaces: Vec<String>,
    pub node_name: String,
    /// Time between two lifecycle steps of a pod.
    pub step_delay: Duration,
    /// The bearer token every request must carry.
    pub token: String,
    /// The exec subprotocols served, in preference order.
    pub exec_protocols: Vec<String>,
    /// Watch events kept for watches that resume from a resourceVersion.
    pub history: usize,
}

impl Default for DoubleOptions {
    fn default() -> Self {
        Self {
            namespaces: vec!["default".into()],
            node_name: "double-node-1".into(),
            step_delay: Duration::from_millis(30),
            token: "double-token".into(),
            exec_protocols: vec!["v5.channel.k8s.io".into(), "v4.channel.k8s.io".into()],
            history: 10_000,
        }
    }
}

/// A running double; dropping it stops the server and kills every exec process.
pub struct KubeDouble {
    state: Arc<Shared>,
    url: String,
    dir: tempfile::TempDir,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

struct Shared {
    opts: DoubleOptions,
    inner: Mutex<Inner>,
    events: broadcast::Sender<WatchEvent>,
    /// Killed when the double stops.
    stop: CancellationToken,
}

#[derive(Clone)]
struct WatchEvent {
    rv: u64,
    kind: &'static str,
    pod: Pod,
    /// The object before a MODIFIED event: a selector watch sees an object that stops
    /// matching as DELETED and one that starts matching as ADDED.
    prev: Option<Pod>,
}

#[derive(Default)]
struct Inner {
    rv: u64,
    pods: BTreeMap<(String, String), Pod>,
    history: VecDeque<WatchEvent>,
    created: Vec<Pod>,
    deletions: Vec<(String, String)>,
    requests: Vec<String>,
    denied: HashSet<(String, String, String, String)>,
    /// Per pod: the kill switch of its container (and exec processes).
    kill: HashMap<(String, String), CancellationToken>,
    execs: usize,
    uid: u64,
}

impl Inner {
    fn next_rv(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }
}

impl KubeDouble {
    pub fn start() -> KubeDouble {
        Self::start_with(DoubleOptions::default())
    }

    pub fn start_with(opts: DoubleOptions) -> KubeDouble {
        let (events, _) = broadcast::channel(4096);
        let state = Arc::new(Shared {
            opts,
            inner: Mutex::new(Inner::default()),
            events,
            stop: CancellationToken::new(),
        });
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let st = state.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("double runtime");
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                    .await
                    .expect("bind");
                addr_tx
                    .send(listener.local_addr().expect("addr"))
                    .expect("send addr");
                let app = router(st.clone());
                let stop = st.stop.clone();
                let serve = axum::serve(listener, app).with_graceful_shutdown(async move {
                    let _ = stop_rx.await;
                });
                tokio::select! {
                    _ = serve => {}
                    _ = stop.cancelled() => {}
                }
            });
            rt.shutdown_timeout(Duration::from_secs(2));
        });
        let addr = addr_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("double started");
        let url = format!("http://{addr}");
        let dir = tempfile::tempdir().expect("tempdir");
        let kubeconfig = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: double\n  cluster:\n    server: {url}\nusers:\n- name: double\n  user:\n    token: {}\ncontexts:\n- name: double\n  context:\n    cluster: double\n    user: double\n    namespace: {}\ncurrent-context: double\n",
            state.opts.token, state.opts.namespaces[0]
        );
        std::fs::write(dir.path().join("kubeconfig"), kubeconfig).expect("kubeconfig");
        KubeDouble {
            state,
            url,
            dir,
            stop: Some(stop_tx),
            thread: Some(thread),
        }
    }

    pub fn url(&self) -> String {
        self.url.clone()
    }

    /// A kubeconfig file for the double: server, token, context `double` (current) with
    /// the first namespace.
    pub fn kubeconfig(&self) -> PathBuf {
        self.dir.path().join("kubeconfig")
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.state.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The pods of a namespace as stored now.
    pub fn pods(&self, namespace: &str) -> Vec<Pod> {
        self.lock()
            .pods
            .iter()
            .filter(|((ns, _), _)| ns == namespace)
            .map(|(_, p)| p.clone())
            .collect()
    }

    pub fn pod_names(&self, namespace: &str) -> Vec<String> {
        self.lock()
            .pods
            .keys()
            .filter(|(ns, _)| ns == namespace)
            .map(|(_, n)| n.clone())
            .collect()
    }

    /// Every pod ever created through the API, as it was stored at creation.
    pub fn created_pods(&self) -> Vec<Pod> {
        self.lock().created.clone()
    }

    /// Stores a pod as given (creationTimestamp and labels kept), without a lifecycle, for
    /// tests of what clients do with existing pods.
    pub fn insert_pod(&self, mut pod: Pod) {
        let mut inner = self.lock();
        let rv = inner.next_rv();
        inner.uid += 1;
        let uid = format!("inserted-{}", inner.uid);
        let ns = pod
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into());
        let name = pod.metadata.name.clone().unwrap_or_default();
        pod.metadata.namespace = Some(ns.clone());
        pod.metadata.resource_version = Some(rv.to_string());
        pod.metadata.uid.get_or_insert(uid);
        pod.metadata
            .creation_timestamp
            .get_or_insert(Time(Timestamp::now()));
        inner.pods.insert((ns, name), pod.clone());
        publish(&self.state, &mut inner, "ADDED", pod, rv);
    }

    /// Every successful DELETE: (namespace, name).
    pub fn deletions(&self) -> Vec<(String, String)> {
        self.lock().deletions.clone()
    }

    /// `METHOD path?query` of every request.
    pub fn requests(&self) -> Vec<String> {
        self.lock().requests.clone()
    }

    /// Makes SelfSubjectAccessReview deny this permission.
    pub fn deny(&self, namespace: &str, resource: &str, subresource: &str, verb: &str) {
        self.lock().denied.insert((
            namespace.into(),
            resource.into(),
            subresource.into(),
            verb.into(),
        ));
    }

    /// Exec processes running now.
    pub fn running_execs(&self) -> usize {
        self.lock().execs
    }
}

impl Drop for KubeDouble {
    fn drop(&mut self) {
        self.state.stop.cancel();
        for (_, k) in self.lock().kill.drain() {
            k.cancel();
        }
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Records an event for watches.
fn publish(state: &Shared, inner: &mut Inner, kind: &'static str, pod: Pod, rv: u64) {
    let prev = if kind == "MODIFIED" {
        let key = (
            pod.metadata.namespace.clone().unwrap_or_default(),
            pod.metadata.name.clone().unwrap_or_default(),
        );
        inner
            .history
            .iter()
            .rev()
            .find(|e| {
                e.pod.metadata.namespace.as_deref() == Some(key.0.as_str())
                    && e.pod.metadata.name.as_deref() == Some(key.1.as_str())
            })
            .map(|e| e.pod.clone())
            .or_else(|| inner.pods.get(&key).cloned())
    } else {
        None
    };
    let ev = WatchEvent {
        rv,
        kind,
        pod,
        prev,
    };
    inner.history.push_back(ev.clone());
    while inner.history.len() > state.opts.history {
        inner.history.pop_front();
    }
    let _ = state.events.send(ev);
}

// ---------------------------------------------------------------------------------------
// Status objects

fn status(code: u16, reason: &str, message: impl Into<String>, details: Option<Value>) -> Response {
    let mut body = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message.into(),
        "reason": reason,
        "code": code,
    });
    if let Some(d) = details {
        body["details"] = d;
    }
    (
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn not_found(name: &str) -> Response {
    status(
        404,
        "NotFound",
        format!("pods \"{name}\" not found"),
        Some(json!({"name": name, "kind": "pods"})),
    )
}

fn conflict(name: &str, why: &str) -> Response {
    status(
        409,
        "Conflict",
        format!("Operation cannot be fulfilled on pods \"{name}\": {why}"),
        Some(json!({"name": name, "kind": "pods"})),
    )
}

fn ok_json(code: StatusCode, v: &impl serde::Serialize) -> Response {
    (
        code,
        [(header::CONTENT_TYPE, "application/json")],
        serde_json::to_string(v).unwrap_or_default(),
    )
        .into_response()
}

// ---------------------------------------------------------------------------------------
// Routing

type St = State<Arc<Shared>>;

fn router(state: Arc<Shared>) -> Router {
    Router::new()
        .route("/version", get(version))
        .route("/readyz", get(|| async { "ok" }))
        .route("/livez", get(|| async { "ok" }))
        .route(
            "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
            post(access_review),
        )
        .route(
            "/api/v1/namespaces/{ns}/pods",
            get(list_or_watch).post(create),
        )
        .route(
            "/api/v1/namespaces/{ns}/pods/{name}",
            get(get_pod).delete(delete_pod).patch(patch_pod),
        )
        .route(
            "/api/v1/namespaces/{ns}/pods/{name}/exec",
            get(exec).post(exec),
        )
        .fallback(|| async {
            status(
                404,
                "NotFound",
                "the server could not find the requested resource",
                None,
            )
        })
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth_and_log,
        ))
        .with_state(state)
}

async fn auth_and_log(
    State(state): St,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let line = format!(
        "{} {}",
        req.method(),
        req.uri().path_and_query().map(|p| p.as_str()).unwrap_or("")
    );
    state
        .inner
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .requests
        .push(line);
    let want = format!("Bearer {}", state.opts.token);
    let ok = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v == want);
    if !ok {
        return status(401, "Unauthorized", "Unauthorized", None);
    }
    next.run(req).await
}

async fn version() -> Response {
    ok_json(
        StatusCode::OK,
        &json!({
            "major": "1", "minor": "33", "gitVersion": "v1.33.0-double",
            "gitCommit": "0000000000000000000000000000000000000000", "gitTreeState": "clean",
            "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.24", "compiler": "gc",
            "platform": "linux/amd64"
        }),
    )
}

async fn access_review(State(state): St, body: Bytes) -> Response {
    let Ok(mut review) = serde_json::from_slice::<Value>(&body) else {
        return status(400, "BadRequest", "invalid SelfSubjectAccessReview", None);
    };
    let attrs = &review["spec"]["resourceAttributes"];
    let s = |k: &str| attrs[k].as_str().unwrap_or("").to_string();
    let key = (s("namespace"), s("resource"), s("subresource"), s("verb"));
    let denied = state
        .inner
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .denied
        .contains(&key);
    review["status"] = if denied {
        json!({"allowed": false, "reason": "denied by the test double"})
    } else {
        json!({"allowed": true, "reason": "allowed by the test double"})
    };
    review["metadata"] = json!({"creationTimestamp": null});
    ok_json(StatusCode::CREATED, &review)
}

fn check_ns(state: &Shared, ns: &str) -> Result<(), Response> {
    if state.opts.namespaces.iter().any(|n| n == ns) {
        Ok(())
    } else {
        Err(status(
            404,
            "NotFound",
            format!("namespaces \"{ns}\" not found"),
            Some(json!({"name": ns, "kind": "namespaces"})),
        ))
    }
}

// ---------------------------------------------------------------------------------------
// Create and the simulated lifecycle

async fn create(
    State(state): St,
    Path(ns): Path<String>,
    Query(q): Query<HashMap<String, String>>,
    body: Bytes,
) -> Response {
    if let Err(r) = check_ns(&state, &ns) {
        return r;
    }
    let mut pod: Pod = match serde_json::from_slice(&body) {
        Ok(p) => p,
        Err(e) => return status(400, "BadRequest", format!("invalid Pod: {e}"), None),
    };
    // Validation, as the API server's: containers with names and images.
    let invalid = |field: &str, msg: &str| {
        status(
            422,
            "Invalid",
            format!(
                "Pod \"{}\" is invalid: {field}: {msg}",
                pod.metadata.name.clone().unwrap_or_default()
            ),
            Some(
                json!({"kind": "Pod", "causes": [{"reason": "FieldValueRequired", "message": msg, "field": field}]}),
            ),
        )
    };
    let Some(spec) = &pod.spec else {
        return invalid("spec.containers", "Required value");
    };
    if spec.containers.is_empty() {
        return invalid("spec.containers", "Required value");
    }
    for (i, c) in spec.containers.iter().enumerate() {
        if c.name.is_empty() {
            return invalid(&format!("spec.containers[{i}].name"), "Required value");
        }
        if c.image.as_deref().unwrap_or("").is_empty() {
            return invalid(&format!("spec.containers[{i}].image"), "Required value");
        }
    }
    let dry_run = q.get("dryRun").is_some_and(|v| v == "All");
    let mut inner = state.inner.lock().unwrap_or_else(|e| e.into_inner());
    let name = match (&pod.metadata.name, &pod.metadata.generate_name) {
        (Some(n), _) if !n.is_empty() => n.clone(),
        (_, Some(prefix)) => {
            inner.uid += 1;
            format!("{prefix}{}", suffix(inner.uid))
        }
        _ => return invalid("metadata.name", "name or generateName is required"),
    };
    if inner.pods.contains_key(&(ns.clone(), name.clone())) {
        return status(
            409,
            "AlreadyExists",
            format!("pods \"{name}\" already exists"),
            Some(json!({"name": name, "kind": "pods"})),
        );
    }
    inner.uid += 1;
    let uid = format!("00000000-0000-4000-8000-{:012}", inner.uid);
    pod.metadata.name = Some(name.clone());
    pod.metadata.namespace = Some(ns.clone());
    pod.metadata.uid = Some(uid);
    pod.metadata.creation_timestamp = Some(Time(Timestamp::now()));
    pod.status = Some(PodStatus {
        phase: Some("Pending".into()),
        qos_class: Some("BestEffort".into()),
        ..Default::default()
    });
    if dry_run {
        return ok_json(StatusCode::CREATED, &pod);
    }
    let rv = inner.next_rv();
    pod.metadata.resource_version = Some(rv.to_string());
    inner.pods.insert((ns.clone(), name.clone()), pod.clone());
    inner.created.push(pod.clone());
    let kill = state.stop.child_token();
    inner.kill.insert((ns.clone(), name.clone()), kill.clone());
    publish(&state, &mut inner, "ADDED", pod.clone(), rv);
    drop(inner);
    tokio::spawn(lifecycle(state.clone(), ns, name, kill));
    ok_json(StatusCode::CREATED, &pod)
}

fn suffix(n: u64) -> String {
    const A: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut x = n.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5bd1_e995;
    (0..5)
        .map(|_| {
            let c = A[(x % A.len() as u64) as usize] as char;
            x /= A.len() as u64;
            c
        })
        .collect()
}

/// Applies `f` to the stored pod (if still there) and publishes MODIFIED.
fn modify(state: &Shared, ns: &str, name: &str, f: impl FnOnce(&mut Pod)) -> bool {
    let mut inner = state.inner.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut pod) = inner.pods.get(&(ns.to_string(), name.to_string())).cloned() else {
        return false;
    };
    f(&mut pod);
    let rv = inner.next_rv();
    pod.metadata.resource_version = Some(rv.to_string());
    inner
        .pods
        .insert((ns.to_string(), name.to_string()), pod.clone());
    publish(state, &mut inner, "MODIFIED", pod, rv);
    true
}

fn condition(
    type_: &str,
    status: &str,
    reason: Option<&str>,
    message: Option<&str>,
) -> PodCondition {
    PodCondition {
        type_: type_.into(),
        status: status.into(),
        reason: reason.map(Into::into),
        message: message.map(Into::into),
        last_transition_time: Some(Time(Timestamp::now())),
        ..Default::default()
    }
}

fn container_status(pod: &Pod, state: ContainerState, ready: bool) -> Vec<ContainerStatus> {
    pod.spec
        .iter()
        .flat_map(|s| s.containers.iter())
        .map(|c| ContainerStatus {
            name: c.name.clone(),
            image: c.image.clone().unwrap_or_default(),
            image_id: String::new(),
            ready,
            restart_count: 0,
            started: Some(state.running.is_some()),
            state: Some(state.clone()),
            ..Default::default()
        })
        .collect()
}

fn waiting(reason: &str, message: Option<String>) -> ContainerState {
    ContainerState {
        waiting: Some(ContainerStateWaiting {
            reason: Some(reason.into()),
            message,
        }),
        ..Default::default()
    }
}

async fn lifecycle(state: Arc<Shared>, ns: String, name: String, kill: CancellationToken) {
    let step = state.opts.step_delay;
    let node = state.opts.node_name.clone();
    let Some(pod) = state
        .inner
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .pods
        .get(&(ns.clone(), name.clone()))
        .cloned()
    else {
        return;
    };
    let spec = pod.spec.clone().unwrap_or_default();
    let image = spec
        .containers
        .first()
        .and_then(|c| c.image.clone())
        .unwrap_or_default();
    if let Some(deadline) = spec.active_deadline_seconds {
        let (st, ns2, n2, k2) = (state.clone(), ns.clone(), name.clone(), kill.clone());
        tokio::spawn(async move {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(deadline.max(0) as u64)) => {}
                _ = k2.cancelled() => return,
            }
            k2.cancel();
            modify(&st, &ns2, &n2, |p| {
                let s = p.status.get_or_insert_default();
                s.phase = Some("Failed".into());
                s.reason = Some("DeadlineExceeded".into());
                s.message =
                    Some("Pod was active on the node longer than the specified deadline".into());
            });
        });
    }
    let pause = || async {
        tokio::select! {
            _ = tokio::time::sleep(step) => true,
            _ = kill.cancelled() => false,
        }
    };
    if !pause().await {
        return;
    }
    let node_labels: BTreeMap<String, String> = [
        ("kubernetes.io/hostname".to_string(), node.clone()),
        ("kubernetes.io/os".to_string(), "linux".to_string()),
    ]
    .into();
    let fits = spec
        .node_selector
        .iter()
        .flatten()
        .all(|(k, v)| node_labels.get(k) == Some(v));
    if !fits {
        modify(&state, &ns, &name, |p| {
            p.status.get_or_insert_default().conditions = Some(vec![condition(
                "PodScheduled",
                "False",
                Some("Unschedulable"),
                Some(
                    "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector. preemption: 0/1 nodes are available: 1 Preemption is not helpful for scheduling.",
                ),
            )]);
        });
        return;
    }
    modify(&state, &ns, &name, |p| {
        p.spec.get_or_insert_default().node_name = Some(node.clone());
        let s = p.status.get_or_insert_default();
        s.conditions = Some(vec![condition("PodScheduled", "True", None, None)]);
        s.host_ip = Some("10.0.0.1".into());
        let cs = container_status(p, waiting("ContainerCreating", None), false);
        p.status.get_or_insert_default().container_statuses = Some(cs);
    });
    if !pause().await {
        return;
    }
    if image.contains("never-starts") {
        return;
    }
    if image.contains("pull-error") {
        let msg = format!(
            "failed to pull and unpack image \"{image}\": failed to resolve reference \"{image}\": not found"
        );
        modify(&state, &ns, &name, |p| {
            let cs = container_status(p, waiting("ErrImagePull", Some(msg.clone())), false);
            p.status.get_or_insert_default().container_statuses = Some(cs);
        });
        if !pause().await {
            return;
        }
        modify(&state, &ns, &name, |p| {
            let cs = container_status(
                p,
                waiting(
                    "ImagePullBackOff",
                    Some(format!("Back-off pulling image \"{image}\"")),
                ),
                false,
            );
            p.status.get_or_insert_default().container_statuses = Some(cs);
        });
        return;
    }
    if image.contains("config-error") {
        modify(&state, &ns, &name, |p| {
            let cs = container_status(
                p,
                waiting(
                    "CreateContainerConfigError",
                    Some("secret \"missing\" not found".into()),
                ),
                false,
            );
            p.status.get_or_insert_default().container_statuses = Some(cs);
        });
        return;
    }
    modify(&state, &ns, &name, |p| {
        let running = ContainerState {
            running: Some(ContainerStateRunning {
                started_at: Some(Time(Timestamp::now())),
            }),
            ..Default::default()
        };
        let cs = container_status(p, running, true);
        let s = p.status.get_or_insert_default();
        s.phase = Some("Running".into());
        s.pod_ip = Some("10.244.0.10".into());
        s.start_time = Some(Time(Timestamp::now()));
        s.container_statuses = Some(cs);
        s.conditions = Some(vec![
            condition("PodScheduled", "True", None, None),
            condition("Initialized", "True", None, None),
            condition("ContainersReady", "True", None, None),
            condition("Ready", "True", None, None),
        ]);
    });
}

// ---------------------------------------------------------------------------------------
// Get, list, watch

async fn get_pod(State(state): St, Path((ns, name)): Path<(String, String)>) -> Response {
    if let Err(r) = check_ns(&state, &ns) {
        return r;
    }
    match state
        .inner
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .pods
        .get(&(ns, name.clone()))
    {
        Some(p) => ok_json(StatusCode::OK, p),
        None => not_found(&name),
    }
}

/// One requirement of a label or field selector.
#[derive(Debug, Clone)]
enum Req {
    Eq(String, String),
    Ne(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

/// Splits on commas outside parentheses.
fn split_top(s: &str) -> Vec<String> {
    let (mut out, mut cur, mut depth) = (Vec::new(), String::new(), 0);
    for c in s.chars() {
        match c {
            '(' => {
                depth += 1;
                cur.push(c)
            }
            ')' => {
                depth -= 1;
                cur.push(c)
            }
            ',' if depth == 0 => out.push(std::mem::take(&mut cur)),
            _ => cur.push(c),
        }
    }
    if !cur.trim().is_empty() {
        out.push(cur);
    }
    out
}

fn parse_selector(s: &str) -> Result<Vec<Req>, String> {
    let set = |v: &str| -> Result<Vec<String>, String> {
        let v = v.trim();
        let inner = v
            .strip_prefix('(')
            .and_then(|v| v.strip_suffix(')'))
            .ok_or_else(|| format!("invalid set {v:?}"))?;
        Ok(inner.split(',').map(|x| x.trim().to_string()).collect())
    };
    let mut reqs = Vec::new();
    for part in split_top(s) {
        let p = part.trim();
        if p.is_empty() {
            continue;
        }
        if let Some((k, v)) = p.split_once("!=") {
            reqs.push(Req::Ne(k.trim().into(), v.trim().into()));
        } else if let Some((k, v)) = p.split_once("==") {
            reqs.push(Req::Eq(k.trim().into(), v.trim().into()));
        } else if let Some((k, v)) = p.split_once('=') {
            reqs.push(Req::Eq(k.trim().into(), v.trim().into()));
        } else if let Some((k, v)) = p.split_once(" notin ") {
            reqs.push(Req::NotIn(k.trim().into(), set(v)?));
        } else if let Some((k, v)) = p.split_once(" in ") {
            reqs.push(Req::In(k.trim().into(), set(v)?));
        } else if let Some(k) = p.strip_prefix('!') {
            reqs.push(Req::NotExists(k.trim().into()));
        } else if p
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
        {
            reqs.push(Req::Exists(p.into()));
        } else {
            return Err(format!("unable to parse requirement: {p:?}"));
        }
    }
    Ok(reqs)
}

fn matches(reqs: &[Req], get: impl Fn(&str) -> Option<String>) -> bool {
    reqs.iter().all(|r| match r {
        Req::Eq(k, v) => get(k).as_deref() == Some(v.as_str()),
        Req::Ne(k, v) => get(k).as_deref() != Some(v.as_str()),
        Req::In(k, vs) => get(k).is_some_and(|x| vs.contains(&x)),
        Req::NotIn(k, vs) => get(k).is_none_or(|x| !vs.contains(&x)),
        Req::Exists(k) => get(k).is_some(),
        Req::NotExists(k) => get(k).is_none(),
    })
}

struct Filter {
    labels: Vec<Req>,
    fields: Vec<Req>,
}

impl Filter {
    fn parse(q: &HashMap<String, String>) -> Result<Filter, Response> {
        let bad = |e: String| status(400, "BadRequest", e, None);
        let labels = parse_selector(q.get("labelSelector").map(String::as_str).unwrap_or(""))
            .map_err(bad)?;
        let fields = parse_selector(q.get("fieldSelector").map(String::as_str).unwrap_or(""))
            .map_err(bad)?;
        for f in &fields {
            let (Req::Eq(k, _) | Req::Ne(k, _)) = f else {
                return Err(status(
                    400,
                    "BadRequest",
                    "field selectors support only =, == and !=",
                    None,
                ));
            };
            if ![
                "metadata.name",
                "metadata.namespace",
                "status.phase",
                "spec.nodeName",
            ]
            .contains(&k.as_str())
            {
                return Err(status(
                    400,
                    "BadRequest",
                    format!("field label not supported: {k}"),
                    None,
                ));
            }
        }
        Ok(Filter { labels, fields })
    }

    fn accepts(&self, p: &Pod) -> bool {
        let labels = p.metadata.labels.clone().unwrap_or_default();
        matches(&self.labels, |k| labels.get(k).cloned())
            && matches(&self.fields, |k| match k {
                "metadata.name" => p.metadata.name.clone(),
                "metadata.namespace" => p.metadata.namespace.clone(),
                "status.phase" => p.status.as_ref().and_then(|s| s.phase.clone()),
                "spec.nodeName" => Some(
                    p.spec
                        .as_ref()
                        .and_then(|s| s.node_name.clone())
                        .unwrap_or_default(),
                ),
                _ => None,
            })
    }
}

async fn list_or_watch(
    State(state): St,
    Path(ns): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    if let Err(r) = check_ns(&state, &ns) {
        return r;
    }
    let filter = match Filter::parse(&q) {
        Ok(f) => f,
        Err(r) => return r,
    };
    if q.get("watch").is_some_and(|w| w == "true" || w == "1") {
        return watch(state, ns, filter, q);
    }
    let inner = state.inner.lock().unwrap_or_else(|e| e.into_inner());
    let items: Vec<&Pod> = inner
        .pods
        .iter()
        .filter(|((n, _), p)| *n == ns && filter.accepts(p))
        .map(|(_, p)| p)
        .collect();
    ok_json(
        StatusCode::OK,
        &json!({
            "kind": "PodList",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": inner.rv.to_string()},
            "items": items,
        }),
    )
}

fn watch(state: Arc<Shared>, ns: String, filter: Filter, q: HashMap<String, String>) -> Response {
    let timeout = q
        .get("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .unwrap_or(1800);
    let bookmarks = q.get("allowWatchBookmarks").is_some_and(|b| b == "true");
    let from: Option<u64> = q
        .get("resourceVersion")
        .filter(|v| !v.is_empty() && *v != "0")
        .and_then(|v| v.parse().ok());
    // Subscribe before reading the history, so that nothing falls between the two.
    let mut rx = state.events.subscribe();
    let (initial, mut last, expired) = {
        let inner = state.inner.lock().unwrap_or_else(|e| e.into_inner());
        match from {
            None => {
                let items: Vec<WatchEvent> = inner
                    .pods
                    .iter()
                    .filter(|((n, _), _)| *n == ns)
                    .map(|(_, p)| WatchEvent {
                        rv: inner.rv,
                        kind: "ADDED",
                        pod: p.clone(),
                        prev: None,
                    })
                    .collect();
                (items, inner.rv, false)
            }
            Some(rv) => {
                let oldest = inner.history.front().map(|e| e.rv).unwrap_or(inner.rv + 1);
                if rv + 1 < oldest && rv < inner.rv {
                    (Vec::new(), rv, true)
                } else {
                    let items = inner
                        .history
                        .iter()
                        .filter(|e| e.rv > rv)
                        .cloned()
                        .collect();
                    (items, rv, false)
                }
            }
        }
    };
    let (tx, body_rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(64);
    let stop = state.stop.clone();
    tokio::spawn(async move {
        // What this watch sees of an event: nothing when the object neither matches now nor
        // did before; DELETED when it stopped matching; ADDED when it started.
        let seen = |ev: &WatchEvent| -> Option<Bytes> {
            if ev.pod.metadata.namespace.as_deref() != Some(ns.as_str()) {
                return None;
            }
            let now = filter.accepts(&ev.pod);
            let before = ev.prev.as_ref().is_some_and(|p| filter.accepts(p));
            let kind = match (ev.kind, before, now) {
                ("MODIFIED", true, false) => "DELETED",
                ("MODIFIED", false, true) => "ADDED",
                (_, _, false) if ev.kind != "MODIFIED" => return None,
                ("MODIFIED", false, false) => return None,
                (k, _, _) => k,
            };
            let mut s = json!({"type": kind, "object": ev.pod}).to_string();
            s.push('\n');
            Some(Bytes::from(s))
        };
        if expired {
            let s = json!({"type": "ERROR", "object": {
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": format!("too old resource version: {last}"), "reason": "Expired", "code": 410
            }});
            let _ = tx.send(Ok(Bytes::from(format!("{s}\n")))).await;
            return;
        }
        for ev in &initial {
            if let Some(l) = seen(ev)
                && tx.send(Ok(l)).await.is_err()
            {
                return;
            }
            last = last.max(ev.rv);
        }
        let end = tokio::time::sleep(Duration::from_secs(timeout));
        tokio::pin!(end);
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = &mut end => return,
                _ = stop.cancelled() => return,
                _ = tick.tick(), if bookmarks => {
                    let b = json!({"type": "BOOKMARK", "object": {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": last.to_string()}}});
                    if tx.send(Ok(Bytes::from(format!("{b}\n")))).await.is_err() {
                        return;
                    }
                }
                ev = rx.recv() => match ev {
                    Ok(ev) => {
                        if ev.rv <= last {
                            continue;
                        }
                        last = ev.rv;
                        if let Some(l) = seen(&ev)
                            && tx.send(Ok(l)).await.is_err()
                        {
                            return;
                        }
                    }
                    // A watcher that fell behind is ended, as the API server does; the
                    // client resumes from its last resourceVersion.
                    Err(_) => return,
                }
            }
        }
    });
    let body = axum::body::Body::from_stream(tokio_stream_from(body_rx));
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        body,
    )
        .into_response()
}

fn tokio_stream_from<T: Send + 'static>(
    mut rx: tokio::sync::mpsc::Receiver<T>,
) -> impl futures_util::Stream<Item = T> + Send {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

// ---------------------------------------------------------------------------------------
// Delete and patch

async fn delete_pod(
    State(state): St,
    Path((ns, name)): Path<(String, String)>,
    Query(q): Query<HashMap<String, String>>,
    body: Bytes,
) -> Response {
    if let Err(r) = check_ns(&state, &ns) {
        return r;
    }
    let opts: Value = if body.is_empty() {
        json!({})
    } else {
        match serde_json::from_slice(&body) {
            Ok(v) => v,
            Err(e) => {
                return status(
                    400,
                    "BadRequest",
                    format!("invalid DeleteOptions: {e}"),
                    None,
                );
            }
        }
    };
    let grace = opts["gracePeriodSeconds"]
        .as_i64()
        .or_else(|| q.get("gracePeriodSeconds").and_then(|g| g.parse().ok()));
    let key = (ns.clone(), name.clone());
    let mut inner = state.inner.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut pod) = inner.pods.get(&key).cloned() else {
        return not_found(&name);
    };
    if let Some(uid) = opts["preconditions"]["uid"].as_str()
        && pod.metadata.uid.as_deref() != Some(uid)
    {
        return conflict(
            &name,
            &format!(
                "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                pod.metadata.uid.clone().unwrap_or_default()
            ),
        );
    }
    if let Some(rv) = opts["preconditions"]["resourceVersion"].as_str()
        && pod.metadata.resource_version.as_deref() != Some(rv)
    {
        return conflict(
            &name,
            "the object has been modified; please apply your changes to the latest version and try again",
        );
    }
    if let Some(k) = inner.kill.remove(&key) {
        k.cancel();
    }
    inner.deletions.push(key.clone());
    pod.metadata.deletion_timestamp = Some(Time(Timestamp::now()));
    let grace = grace
        .or_else(|| {
            pod.spec
                .as_ref()
                .and_then(|s| s.termination_grace_period_seconds)
        })
        .unwrap_or(30);
    pod.metadata.deletion_grace_period_seconds = Some(grace);
    let rv = inner.next_rv();
    pod.metadata.resource_version = Some(rv.to_string());
    if grace <= 0
        || pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_ref())
            .is_none()
    {
        inner.pods.remove(&key);
        publish(&state, &mut inner, "DELETED", pod.clone(), rv);
    } else {
        inner.pods.insert(key.clone(), pod.clone());
        publish(&state, &mut inner, "MODIFIED", pod.clone(), rv);
        let st = state.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(grace as u64)).await;
            let mut inner = st.inner.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(p) = inner.pods.remove(&key) {
                let rv = inner.next_rv();
                publish(&st, &mut inner, "DELETED", p, rv);
            }
        });
    }
    ok_json(StatusCode::OK, &pod)
}

/// RFC 7386 JSON merge patch.
fn merge_patch(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(p) => {
            if !target.is_object() {
                *target = json!({});
            }
            let t = target.as_object_mut().expect("object");
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        other => *target = other.clone(),
    }
}

async fn patch_pod(
    State(state): St,
    Path((ns, name)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Err(r) = check_ns(&state, &ns) {
        return r;
    }
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if !ct.starts_with("application/merge-patch+json")
        && !ct.starts_with("application/strategic-merge-patch+json")
    {
        return status(
            415,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format - accepted media types include: application/merge-patch+json, application/strategic-merge-patch+json (got {ct:?})"
            ),
            None,
        );
    }
    let patch: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return status(400, "BadRequest", format!("invalid patch: {e}"), None),
    };
    let key = (ns.clone(), name.clone());
    let mut inner = state.inner.lock().unwrap_or_else(|e| e.into_inner());
    let Some(pod) = inner.pods.get(&key).cloned() else {
        return not_found(&name);
    };
    if let Some(rv) = patch["metadata"]["resourceVersion"].as_str()
        && pod.metadata.resource_version.as_deref() != Some(rv)
    {
        return conflict(
            &name,
            "the object has been modified; please apply your changes to the latest version and try again",
        );
    }
    let mut v = serde_json::to_value(&pod).unwrap_or_default();
    merge_patch(&mut v, &patch);
    let mut patched: Pod = match serde_json::from_value(v) {
        Ok(p) => p,
        Err(e) => {
            return status(
                422,
                "Invalid",
                format!("Pod \"{name}\" is invalid: {e}"),
                None,
            );
        }
    };
    // Identity fields cannot change.
    patched.metadata.name = pod.metadata.name.clone();
    patched.metadata.namespace = pod.metadata.namespace.clone();
    patched.metadata.uid = pod.metadata.uid.clone();
    patched.metadata.creation_timestamp = pod.metadata.creation_timestamp.clone();
    let rv = inner.next_rv();
    patched.metadata.resource_version = Some(rv.to_string());
    inner.pods.insert(key, patched.clone());
    publish(&state, &mut inner, "MODIFIED", patched.clone(), rv);
    ok_json(StatusCode::OK, &patched)
}

// ---------------------------------------------------------------------------------------
// Exec

const STDIN: u8 = 0;
const STDOUT: u8 = 1;
const STDERR: u8 = 2;
const STATUS: u8 = 3;
const CLOSE: u8 = 255;

async fn exec(
    State(state): St,
    Path((ns, name)): Path<(String, String)>,
    RawQuery(query): RawQuery,
    ws: Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> Response {
    if let Err(r) = check_ns(&state, &ns) {
        return r;
    }
    // Repeated `command` parameters are the argv.
    let mut command = Vec::new();
    let mut container = None;
    let (mut stdin, mut stdout, mut stderr, mut tty) = (false, false, false, false);
    for (k, v) in url_pairs(query.as_deref().unwrap_or("")) {
        let on = v == "true" || v == "1";
        match k.as_str() {
            "command" => command.push(v),
            "container" => container = Some(v),
            "stdin" => stdin = on,
            "stdout" => stdout = on,
            "stderr" => stderr = on,
            "tty" => tty = on,
            _ => {}
        }
    }
    let (pod, kill) = {
        let inner = state.inner.lock().unwrap_or_else(|e| e.into_inner());
        let key = (ns.clone(), name.clone());
        let Some(pod) = inner.pods.get(&key).cloned() else {
            return not_found(&name);
        };
        (pod, inner.kill.get(&key).cloned())
    };
    let spec = pod.spec.clone().unwrap_or_default();
    let container_name = container.unwrap_or_else(|| {
        spec.containers
            .first()
            .map(|c| c.name.clone())
            .unwrap_or_default()
    });
    let Some(c) = spec
        .containers
        .iter()
        .find(|c| c.name == container_name)
        .cloned()
    else {
        return status(
            400,
            "BadRequest",
            format!("container {container_name} is not valid for pod {name}"),
            None,
        );
    };
    if spec.node_name.is_none() {
        return status(
            400,
            "BadRequest",
            format!("pod {name} does not have a host assigned"),
            None,
        );
    }
    let running = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.iter().find(|s| s.name == container_name))
        .and_then(|s| s.state.as_ref())
        .is_some_and(|s| s.running.is_some());
    let Some(kill) = kill.filter(|_| running) else {
        return status(
            400,
            "BadRequest",
            format!("unable to upgrade connection: container not found (\"{container_name}\")"),
            None,
        );
    };
    if command.is_empty() {
        return status(
            400,
            "BadRequest",
            "you must specify at least 1 command",
            None,
        );
    }
    if !stdout && !stderr && !stdin {
        return status(
            400,
            "BadRequest",
            "you must specify at least 1 of stdin, stdout, stderr",
            None,
        );
    }
    if tty && stderr {
        return status(
            400,
            "BadRequest",
            "tty and stderr cannot both be true",
            None,
        );
    }
    let Ok(mut ws) = ws else {
        return status(400, "BadRequest", "Upgrade request required", None);
    };
    let offered: Vec<String> = ws
        .requested_protocols()
        .filter_map(|p| p.to_str().ok().map(str::to_string))
        .collect();
    let Some(protocol) = offered
        .iter()
        .find(|p| state.opts.exec_protocols.contains(p))
        .cloned()
    else {
        return status(
            400,
            "BadRequest",
            format!(
                "unable to upgrade connection: unable to negotiate protocol: client supports {offered:?}, server supports {:?}",
                state.opts.exec_protocols
            ),
            None,
        );
    };
    if let Ok(v) = axum::http::HeaderValue::from_str(&protocol) {
        ws.set_selected_protocol(v);
    }
    let env: Vec<(String, String)> = c
        .env
        .iter()
        .flatten()
        .filter_map(|e| e.value.clone().map(|v| (e.name.clone(), v)))
        .collect();
    let cwd = c.working_dir.clone().unwrap_or_else(|| "/".into());
    let v5 = protocol.starts_with("v5.");
    ws.on_upgrade(move |socket| {
        run_exec(
            state,
            socket,
            command,
            env,
            cwd,
            Streams {
                stdin,
                stdout,
                stderr,
            },
            v5,
            kill,
        )
    })
}

fn url_pairs(q: &str) -> Vec<(String, String)> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}

fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                let h = std::str::from_utf8(&b[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match h {
                    Some(x) => {
                        out.push(x);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            x => out.push(x),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

struct Streams {
    stdin: bool,
    stdout: bool,
    stderr: bool,
}

/// The Status the kubelet writes on channel 3.
fn exit_status(code: i32, argv: &[String]) -> Value {
    if code == 0 {
        return json!({"metadata": {}, "status": "Success"});
    }
    json!({
        "metadata": {},
        "status": "Failure",
        "message": format!("command terminated with non-zero exit code: error executing command {argv:?}, exit status {code}"),
        "reason": "NonZeroExitCode",
        "details": {"causes": [{"reason": "ExitCode", "message": code.to_string()}]}
    })
}

fn internal_error(message: String) -> Value {
    json!({
        "metadata": {},
        "status": "Failure",
        "message": format!("Internal error occurred: {message}"),
        "reason": "InternalError",
        "details": {"causes": [{"message": message}]},
        "code": 500
    })
}

#[allow(clippy::too_many_arguments)]
async fn run_exec(
    state: Arc<Shared>,
    socket: WebSocket,
    argv: Vec<String>,
    env: Vec<(String, String)>,
    cwd: String,
    streams: Streams,
    v5: bool,
    kill: CancellationToken,
) {
    use std::os::unix::process::ExitStatusExt as _;
    let (mut tx, mut rx) = socket.split();
    // The API server opens each channel with a one-byte frame.
    for ch in [STDOUT, STDERR, STATUS] {
        if tx
            .send(Message::Binary(Bytes::from(vec![ch])))
            .await
            .is_err()
        {
            return;
        }
    }
    let path = std::env::var("PATH").unwrap_or_else(|_| "/usr/bin:/bin".into());
    let mut cmd = tokio::process::Command::new(&argv[0]);
    cmd.args(&argv[1..])
        .env_clear()
        .env("PATH", &path)
        .envs(env)
        .current_dir(&cwd)
        .process_group(0)
        .kill_on_drop(true)
        .stdin(if streams.stdin {
            std::process::Stdio::piped()
        } else {
            std::process::Stdio::null()
        })
        .stdout(if streams.stdout {
            std::process::Stdio::piped()
        } else {
            std::process::Stdio::null()
        })
        .stderr(if streams.stderr {
            std::process::Stdio::piped()
        } else {
            std::process::Stdio::null()
        });
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            let why = match e.kind() {
                std::io::ErrorKind::NotFound if argv[0].contains('/') => {
                    format!(
                        "exec: \"{}\": stat {}: no such file or directory",
                        argv[0], argv[0]
                    )
                }
                std::io::ErrorKind::NotFound => {
                    format!("exec: \"{}\": executable file not found in $PATH", argv[0])
                }
                std::io::ErrorKind::PermissionDenied => {
                    format!("exec: \"{}\": permission denied", argv[0])
                }
                _ => format!("exec: \"{}\": {e}", argv[0]),
            };
            let msg = format!(
                "error executing command in container: failed to exec in container: failed to start exec \"double\": OCI runtime exec failed: exec failed: unable to start container process: {why}: unknown"
            );
            let mut frame = vec![STATUS];
            frame.extend(internal_error(msg).to_string().into_bytes());
            let _ = tx.send(Message::Binary(frame.into())).await;
            let _ = tx.close().await;
            return;
        }
    };
    state.inner.lock().unwrap_or_else(|e| e.into_inner()).execs += 1;
    let pgid = child.id().map(|p| p as i32);
    let kill_group = || {
        if let Some(p) = pgid {
            let _ =
                nix::sys::signal::killpg(nix::unistd::Pid::from_raw(p), nix::sys::signal::SIGKILL);
        }
    };
    let mut stdin = child.stdin.take();
    let mut out = child.stdout.take();
    let mut err = child.stderr.take();
    let (mut out_buf, mut err_buf) = (vec![0u8; 32 * 1024], vec![0u8; 32 * 1024]);
    let mut exit = None;
    let mut client_gone = false;
    async fn read_some(
        pipe: &mut Option<impl tokio::io::AsyncRead + Unpin>,
        buf: &mut [u8],
    ) -> std::io::Result<usize> {
        match pipe {
            Some(p) => p.read(buf).await,
            None => std::future::pending().await,
        }
    }
    while exit.is_none() || out.is_some() || err.is_some() {
        tokio::select! {
            _ = kill.cancelled(), if exit.is_none() => {
                kill_group();
            }
            n = read_some(&mut out, &mut out_buf) => match n {
                Ok(0) | Err(_) => out = None,
                Ok(n) => {
                    let mut f = Vec::with_capacity(n + 1);
                    f.push(STDOUT);
                    f.extend_from_slice(&out_buf[..n]);
                    if tx.send(Message::Binary(f.into())).await.is_err() {
                        client_gone = true;
                        break;
                    }
                }
            },
            n = read_some(&mut err, &mut err_buf) => match n {
                Ok(0) | Err(_) => err = None,
                Ok(n) => {
                    let mut f = Vec::with_capacity(n + 1);
                    f.push(STDERR);
                    f.extend_from_slice(&err_buf[..n]);
                    if tx.send(Message::Binary(f.into())).await.is_err() {
                        client_gone = true;
                        break;
                    }
                }
            },
            m = rx.next() => match m {
                Some(Ok(Message::Binary(b))) if !b.is_empty() => match b[0] {
                    STDIN => {
                        if let Some(w) = stdin.as_mut() {
                            use tokio::io::AsyncWriteExt as _;
                            if w.write_all(&b[1..]).await.is_err() {
                                stdin = None;
                            }
                        }
                    }
                    CLOSE if v5 && b.get(1) == Some(&STDIN) => stdin = None,
                    _ => {}
                },
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => {
                    client_gone = true;
                    break;
                }
                Some(Ok(_)) => {}
            },
            s = child.wait(), if exit.is_none() => {
                exit = Some(s);
                // What the command left behind dies with it, as when the exec's process
                // group ends in a container.
                kill_group();
            }
        }
    }
    if client_gone {
        kill_group();
        let _ = child.wait().await;
    } else {
        let code = match exit {
            Some(Ok(s)) => s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(9)),
            _ => 137,
        };
        let mut frame = vec![STATUS];
        frame.extend(exit_status(code, &argv).to_string().into_bytes());
        let _ = tx.send(Message::Binary(frame.into())).await;
        let _ = tx.close().await;
    }
    let mut inner = state.inner.lock().unwrap_or_else(|e| e.into_inner());
    inner.execs = inner.execs.saturating_sub(1);
}

//! # API-server test double
//!
//! An in-process fake Kubernetes API server for the kube backend's tests, written to the
//! documented behaviour of the API (API conventions, the core/v1 pods API, apimachinery
//! `Status` objects, watch semantics, the `remotecommand` exec WebSocket protocol), not to what
//! any particular client sends. Each pod is backed by local processes: `pods/exec` runs the
//! command on this machine.
//!
//! `KubeDouble::start()` serves HTTPS on `127.0.0.1:0` (its own CA, `tls/`, in the
//! kubeconfig's `certificate-authority-data`; ALPN h2 and http/1.1; see `tls.rs`) from its own
//! thread and tokio runtime, so that tests may block (for example on `std::process::Command`)
//! without starving it. `kubeconfig()` is a file with cluster `double` (server = `url()`), a user with a bearer
//! token that every request must carry (401 `Unauthorized` Status otherwise), and current
//! context `double` with namespace `default`. Dropping the double stops it and kills every exec
//! process.
//!
//! ## Served
//! - `GET /version`, `/livez`, `/readyz`, `/healthz`, `/api`, `/apis`, `/api/v1`,
//!   `/apis/authorization.k8s.io/v1` (minimal discovery, enough for kubectl).
//! - discovery.k8s.io/v1 EndpointSlices (get, list, watch, create, delete; kubectl's Table),
//!   which tests put and remove as the EndpointSlice controller would
//!   (`put_endpoint_slice`, `remove_endpoint_slice`): what replica discovery watches
//!   (`endpointslices.rs`).
//! - Bodies are JSON; a protobuf body is 415 `UnsupportedMediaType`, except kubectl's protobuf
//!   SelfSubjectAccessReview, which is read (`protobuf.rs`).
//! - `kubectl get` without `-o` asks for server-side printing: pods are then answered as a
//!   `meta.k8s.io/v1` `Table` (get, list and watch) with the API server's pod columns and
//!   STATUS (`table.rs`).
//! - Namespaced pods (`/api/v1/namespaces/{ns}/pods[/{name}]`) and all-namespace list/watch
//!   (`/api/v1/pods`):
//!   * `POST`: `generateName` gets a random 5-character suffix from the API server's alphabet;
//!     `uid`, `resourceVersion` (one global counter), `creationTimestamp` and the usual spec
//!     defaults are set, `status.phase` is `Pending`. 409 `AlreadyExists` for a duplicate name,
//!     422 `Invalid` without a name/generateName, without containers, or for a container
//!     without name or image, 404 for a namespace not in `DoubleOptions::namespaces`.
//!     `dryRun=All` validates and answers without storing. 201 with the object.
//!   * `GET` (404 `pods "x" not found`), list with `labelSelector` (`=`, `==`, `!=`, `in`,
//!     `notin`, `key`, `!key`) and `fieldSelector` (`metadata.name`, `metadata.namespace`,
//!     `status.phase`, `spec.nodeName`, ...); `limit`/`continue` are ignored, the list's
//!     `metadata.resourceVersion` is set.
//!   * watch (`watch=true|1`): events after `resourceVersion`; unset or `"0"` first sends a
//!     synthetic `ADDED` per current object. Selectors apply, and an object that stops (starts)
//!     matching is sent as `DELETED` (`ADDED`). `timeoutSeconds` ends the stream,
//!     `allowWatchBookmarks` adds `BOOKMARK` events, a resourceVersion older than the kept
//!     history (`DoubleOptions::history`) gets an `ERROR` event with a 410 `Expired` Status.
//!     `sendInitialEvents=true` (streaming lists) sends the current objects, then a `BOOKMARK`
//!     annotated `k8s.io/initial-events-end`.
//!   * `DELETE` (object or collection with selectors): preconditions (`uid`, `resourceVersion`
//!     → 409 `Conflict`), `dryRun`, `gracePeriodSeconds` (from the query or the DeleteOptions
//!     body). Grace 0, an unscheduled pod, or a finished pod is removed at once; otherwise
//!     `deletionTimestamp`/`deletionGracePeriodSeconds` are set and the pod is removed when the
//!     grace period ends, as for a container whose main process ignores SIGTERM (the kubelet
//!     deletes the object once it has killed the containers). Exec processes are killed
//!     (SIGKILL) when the containers are: when the pod goes, except that a running pod deleted
//!     with grace 0 (force) is removed at once while its containers and exec processes live
//!     on for `DoubleOptions::force_kill_delay`, as on a real node. 200 with the object;
//!     `DELETED` to watchers.
//!   * `PATCH` (`application/merge-patch+json`; `application/strategic-merge-patch+json` is
//!     applied as a JSON merge patch, so lists are replaced and `$patch` directives are not
//!     understood) and `PUT`. A `metadata.resourceVersion` in the patch or body is a
//!     precondition (409 `Conflict` when stale). Only labels, annotations, owner references,
//!     finalizers, container images and `activeDeadlineSeconds` may change; other spec
//!     changes are 422 as for a real pod. Status changes through the main resource are
//!     ignored.
//! - Namespaced PersistentVolumeClaims (`/api/v1/namespaces/{ns}/persistentvolumeclaims[/{name}]`):
//!   create, get, list and watch with selectors, merge patch and delete with preconditions,
//!   binding and pvc-protection; a pod's claims are mounted at its mount paths (`pvcs.rs`).
//! - `POST /apis/authorization.k8s.io/v1/selfsubjectaccessreviews`: allowed unless
//!   `KubeDouble::deny` named the (namespace, resource, subresource, verb).
//! - `pods/exec` (`GET` upgraded to WebSocket): see below.
//! - Anything else: 404 Status `the server could not find the requested resource`.
//!
//! ## Pod lifecycle
//! Every step waits `DoubleOptions::step_delay`, bumps the resourceVersion and sends
//! `MODIFIED`: (1) scheduled: `spec.nodeName`, condition `PodScheduled=True`; (2) the kubelet
//! takes it: `hostIP`, `startTime`, containers waiting `ContainerCreating`; (3) containers
//! running: `state.running.startedAt`, `ready`, phase `Running`, `podIP`, `Ready=True`.
//! Failure injection:
//! - an image containing `pull-error`: waiting `ErrImagePull`, then `ImagePullBackOff`
//!   (`Back-off pulling image "IMAGE"`), phase stays `Pending`;
//! - an image containing `config-error`: waiting `CreateContainerConfigError`;
//! - an image containing `never-starts`: waiting `ContainerCreating` forever;
//! - an image containing `cannot-run`: the container terminated, reason `ContainerCannotRun`
//!   (Docker's word), exit code 128, the runtime's mount error as message;
//! - a `spec.nodeSelector` that the node's labels (`kubernetes.io/hostname=<node_name>`,
//!   `kubernetes.io/os=linux`, `DoubleOptions::node_labels`) do not satisfy: `PodScheduled=False`,
//!   reason `Unschedulable`, the scheduler's message;
//! - `spec.activeDeadlineSeconds`: that long after `startTime` the pod becomes `Failed`,
//!   reason `DeadlineExceeded`, containers terminated, exec processes killed.
//!
//! ## Exec
//! `GET /api/v1/namespaces/{ns}/pods/{name}/exec?command=..&container=..&stdin=..&stdout=..
//! &stderr=..&tty=..`, upgraded to a WebSocket. Subprotocols: `v5.channel.k8s.io` is chosen
//! whenever offered (the API server translates it itself); otherwise the first offered of
//! `v4.channel.k8s.io`, `v4.base64.channel.k8s.io`, `channel.k8s.io`, `base64.channel.k8s.io`
//! (kubelet order is the client's), limited to `DoubleOptions::exec_protocols` (without v5 the
//! double is a cluster before 1.30); no protocol offered = binary `channel.k8s.io` without a
//! protocol header; offered but none supported = 403. Binary frames start with the channel
//! byte (0 stdin, 1 stdout, 2 stderr, 3 error/status, 4 resize; v5 adds 255 = close the
//! stream in the next byte); base64 protocols use text frames with an ASCII channel digit.
//! Like the kubelet, the server first sends an empty frame on the lowest writable channel.
//! Client pings are counted (`exec_pings`); with `DoubleOptions::idle_timeout` a load
//! balancer cuts a session with no frame either way for that long.
//!
//! The command runs as a local process: argv exactly as given (no shell), environment = the
//! container's `env[].value`s plus `PATH` (the double's own unless the container sets it),
//! except in imitated images: an image containing `busybox-applets` has exactly Debian's
//! busybox applets (`/usr/bin/busybox`: `PATH` is a directory with one link per applet, and
//! `/bin/X`, `/usr/bin/X`, `/sbin/X`, `/usr/sbin/X` are applet X), an image containing
//! `no-shell` has no program at all (its keep-alive is not checked);
//! cwd = the container's `workingDir` or `/`, its own process group. stdout/stderr frames are
//! sent as output arrives, reading the pipe only as fast as frames are sent. On exit, channel
//! 3 carries (v4/v5) `{"metadata":{},"status":"Success"}`, or a `Failure` with reason
//! `NonZeroExitCode` and cause `{"reason":"ExitCode","message":"N"}`; a signal N is exit
//! code 128+N (as containerd reports it). A command that cannot be started is a 500
//! `InternalError` worded as containerd/runc word it (`Internal error occurred: error
//! executing command in container: failed to exec in container: failed to start exec "ID":
//! OCI runtime exec failed: exec failed: unable to start container process: exec: "NAME":
//! executable file not found in $PATH: unknown`, likewise `permission denied`); with
//! `DoubleOptions::runtime` a missing program is worded as Kata's agent words it, or in words
//! no client knows (`Runtime::Opaque`). The messages
//! differ by path as in a real cluster: v4 is the kubelet's (CRI streaming server) Status,
//! `command terminated with non-zero exit code: error executing command [ARGV], exit code
//! N`; v5 is written by the API server's stream translator after its SPDY client decoded the
//! kubelet's Status: `command terminated with non-zero exit code: command terminated with
//! exit code N`, and start failures wrapped once more (`Internal error occurred: Internal
//! error occurred: ...`). Pre-v4 protocols send the kubelet's plain message instead of a
//! Status, and nothing on success. Then the server closes the socket (1000). A client that
//! closes the socket gets its process group killed. When the pod goes (deleted, or failed by
//! its deadline) the process group is killed and the status reports exit code 137.
//!
//! Errors before the upgrade (`Status` bodies, as the API server's exec handler answers): 404
//! for a missing pod, 400 `pod NAME does not have a host assigned` for an unscheduled pod,
//! 400 `container C is not valid for pod P`, 400 `a container name must be specified ...` for
//! several containers without `container`, 400 `you must specify at least 1 of stdin, stdout,
//! stderr`, 400 `Upgrade request required` without a WebSocket upgrade. A container that is
//! not running is refused by the kubelet: for v5 the socket is upgraded first (by the API
//! server's stream translator) and channel 3 carries a 500 `InternalError` `unable to upgrade
//! connection: container not found ("C")`; for the other protocols the kubelet's plain-text
//! 500 `container not found ("C")` is passed through. An offered but unsupported protocol
//! list is a plain-text 403 (the kubelet's WebSocket handshake). `tty=true` is accepted but no
//! terminal is allocated: as with the kubelet there is no stderr stream then, the process's
//! stderr goes to the stdout channel.
//!
//! ## Test hooks
//! `pods`/`pod`/`pod_names` (current state), `created_pods` (as stored at creation),
//! `insert_pod` (stored as given, no lifecycle: stale pods for reaper tests), `deletions`
//! (every successful DELETE), `requests` (`"METHOD path?query"`), `deny` (SSAR answers no),
//! `running_execs`, `resource_version`, `peak_pods` (the most pods with containers at once),
//! `exec_pings`, `delete_log` (each DELETE with its preconditions and answer), `set_labels`
//! (another client's label patch), `kill_container_later` (OOM or eviction whose status the
//! kubelet writes `lag` after the exec processes died), `too_many_sent` (the 429s of
//! `Faults::too_many`, API Priority and Fairness's plain-text answers with `Retry-After`,
//! per verb), `DoubleOptions::min_deletion` (a kubelet slow to remove a deleted pod); for claims `pvcs`, `pvc_mounts`, `pvc_deletions`,
//! `insert_pvc`, `annotate_pvc` (`pvcs.rs`).
#![allow(dead_code)]
// ApiError carries a whole Status (message, details): test code favours plain `Result`s over
// boxing it.
#![allow(clippy::result_large_err)]

mod admission;
mod delete;
mod endpointslices;
mod exec;
mod kubelet;
pub mod podman;
mod pods;
pub mod protobuf;
mod pvcs;
mod selector;
mod server;
mod status;
mod table;
pub mod tls;
mod watch;

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use serde_json::Value;
use tokio::sync::broadcast;

#[allow(unused_imports)]
pub use exec::BUSYBOX;
#[allow(unused_imports)]
pub use status::ApiError;

/// How the double behaves.
#[derive(Debug, Clone)]
pub struct DoubleOptions {
    /// Namespaces that exist (creating a pod elsewhere is a 404).
    pub namespaces: Vec<String>,
    /// The single node's name (`spec.nodeName`, label `kubernetes.io/hostname`).
    pub node_name: String,
    /// Extra node labels besides `kubernetes.io/hostname` and `kubernetes.io/os=linux`.
    pub node_labels: BTreeMap<String, String>,
    /// Delay of each simulated lifecycle step.
    pub step_delay: Duration,
    /// The bearer token every request must carry.
    pub token: String,
    /// How many watch events are kept for `resourceVersion` resumption (older → 410).
    pub history: usize,
    /// Interval of BOOKMARK events for watches that allow them.
    pub bookmark_interval: Duration,
    /// The exec subprotocols served. Without `v5.channel.k8s.io` the double is a cluster
    /// older than 1.30 (no stream translator in the API server).
    pub exec_protocols: Vec<String>,
    /// Labels of the namespaces (for example `pod-security.kubernetes.io/enforce=restricted`,
    /// which Pod Security admission enforces).
    pub namespace_labels: BTreeMap<String, BTreeMap<String, String>>,
    /// How long the containers (and exec processes) of a pod deleted with grace 0 outlive its
    /// object: the API server removes a force-deleted pod at once and the kubelet kills the
    /// containers when it notices (a real one takes at least 2 s for a main process that
    /// ignores SIGTERM; shorter here to keep tests quick).
    pub force_kill_delay: Duration,
    /// A load balancer in front of the API server that cuts an exec WebSocket after this
    /// long without a frame either way (pings count): the socket is dropped without a close
    /// frame and the process is killed, as when the client goes. `None`: no cut.
    pub idle_timeout: Option<Duration>,
    /// Whose words a failed exec start is reported in.
    pub runtime: Runtime,
    /// Pods as real containers (podman and runc, see `podman.rs`): the runner container of
    /// a running pod is a busybox container and execs run in it. Check
    /// `podman::available()` first.
    pub containers: bool,
    /// A graceful deletion removes the pod no sooner than this, whatever its grace period:
    /// a real kubelet takes 2 s or more to stop the containers, unmount volumes and report.
    pub min_deletion: Duration,
    /// Like a kubelet, when the double runs as root: exec'd processes run as the
    /// container's (else the pod's) `runAsUser`/`runAsGroup`, and `emptyDir` mounts are
    /// created 0777 on first use (see `exec::pod_user`). Off by default: most tests run
    /// commands in directories only root can enter.
    pub run_as_pod_user: bool,
    /// Like a real kubelet (CRI streaming): an exec's processes keep running when its client
    /// goes away; only the container's end kills them. Off by default: the double then
    /// kills the exec's process group on disconnect.
    pub exec_survives_disconnect: bool,
}

/// The container runtime whose wording an exec of a missing program comes back in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Runtime {
    /// containerd with runc: `exec: "NAME": executable file not found in $PATH`.
    #[default]
    Runc,
    /// Kata Containers' agent, as kata-containers issue 8026 shows it: `rpc status: code:
    /// INTERNAL message: "the file NAME was not found"` inside the shim's error chain.
    Kata,
    /// Words no client knows (a future or unusual runtime): `exec of "NAME" refused`.
    Opaque,
}

impl Default for DoubleOptions {
    fn default() -> Self {
        DoubleOptions {
            namespaces: vec!["default".into(), "kube-system".into()],
            node_name: "double-node-1".into(),
            node_labels: BTreeMap::new(),
            step_delay: Duration::from_millis(20),
            token: "double-token".into(),
            history: 1000,
            bookmark_interval: Duration::from_secs(1),
            exec_protocols: [
                "v5.channel.k8s.io",
                "v4.channel.k8s.io",
                "v4.base64.channel.k8s.io",
                "channel.k8s.io",
                "base64.channel.k8s.io",
            ]
            .map(String::from)
            .to_vec(),
            namespace_labels: BTreeMap::new(),
            force_kill_delay: Duration::from_millis(300),
            idle_timeout: None,
            min_deletion: Duration::ZERO,
            containers: false,
            runtime: Runtime::Runc,
            run_as_pod_user: false,
            exec_survives_disconnect: false,
        }
    }
}

/// A watch event as stored in the history and broadcast to watchers.
#[derive(Debug, Clone)]
pub(crate) struct Event {
    pub rv: u64,
    pub kind: EventKind,
    pub namespace: String,
    pub object: Value,
    /// The object before a MODIFIED, for selector transitions.
    pub old: Option<Value>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EventKind {
    Added,
    Modified,
    Deleted,
}

impl EventKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Added => "ADDED",
            EventKind::Modified => "MODIFIED",
            EventKind::Deleted => "DELETED",
        }
    }
}

#[derive(Debug)]
pub(crate) struct ExecEntry {
    pub namespace: String,
    pub pod: String,
    pub pgid: i32,
}

#[derive(Default)]
pub(crate) struct State {
    pub rv: u64,
    pub pods: BTreeMap<(String, String), Pod>,
    pub history: VecDeque<Arc<Event>>,
    /// The resourceVersion of the newest event dropped from the history (0: none).
    pub compacted: u64,
    pub deletions: Vec<(String, String)>,
    /// Every pod created through the API, as stored at creation.
    pub created: Vec<Pod>,
    pub requests: Vec<String>,
    pub denied: HashSet<(String, String, String, String)>,
    pub execs: BTreeMap<u64, ExecEntry>,
    pub next_exec: u64,
    pub next_ip: u32,
    /// Faults injected by tests, consumed as they fire.
    pub faults: Faults,
    /// Pods created through the API whose containers may still run (uid): from creation
    /// until the object is gone, or, after a force deletion, until the kubelet killed them.
    pub with_containers: HashSet<String>,
    /// The most pods with containers at once.
    pub peak_pods: usize,
    /// WebSocket pings received from exec clients.
    pub exec_pings: usize,
    /// Every DELETE of one pod, with its options and answer.
    pub delete_log: Vec<DeleteRecord>,
    /// PersistentVolumeClaims (pvcs.rs).
    pub pvcs: pvcs::PvcStore,
    /// EndpointSlices (endpointslices.rs).
    pub slices: endpointslices::SliceStore,
    /// OOM kills seen per real container (pod uid), `podman.rs`.
    pub oom_kills: std::collections::HashMap<String, u64>,
}

/// One DELETE of a pod as the double received it.
#[derive(Debug, Clone)]
pub struct DeleteRecord {
    pub namespace: String,
    pub name: String,
    pub grace: Option<i64>,
    /// `preconditions.uid`.
    pub uid: Option<String>,
    /// `preconditions.resourceVersion`.
    pub resource_version: Option<String>,
    /// The answer's status code (409 for a failed precondition).
    pub code: u16,
}

/// Faults the next requests meet (see `KubeDouble::inject`).
#[derive(Default)]
pub struct Faults {
    /// Answers of the next pod creates, in order (429 with Retry-After, 500, ...).
    pub create: VecDeque<ApiError>,
    /// Pod creates that fail with 500 after storing the pod (the answer is lost).
    pub create_lost_answers: usize,
    /// Watch connections to break after their initial events.
    pub watch_cuts: usize,
    /// Resumed watches (with a resourceVersion) to answer with 410 Gone.
    pub gone_on_resume: usize,
    /// New pods stay Unschedulable this long before the scheduler binds them.
    pub unschedulable_for: Option<Duration>,
    /// Image pulls of new pods fail (ErrImagePull, a registry rate limit) this many times
    /// before they succeed.
    pub pull_failures: usize,
    /// Exec upgrades are answered this late.
    pub exec_delay: Option<Duration>,
    /// Each live watch event waits this long before it is sent (a lagging watch cache or a
    /// slow connection): what a client's cache shows falls behind. Not consumed.
    pub watch_delay: Option<Duration>,
    /// API Priority and Fairness rejecting requests: per verb (`create`, `get`, `list`,
    /// `watch`, `delete`, `patch`, `exec`, `ssar`), how many of the next requests are
    /// answered 429 as the API server's filter answers them: plain text `Too many
    /// requests, please try again later.` with a `Retry-After` header, no Status.
    pub too_many: BTreeMap<String, usize>,
    /// The `Retry-After` of those 429s, in seconds.
    pub too_many_retry_after: u64,
    /// Every 429 sent for `too_many`: (verb, when).
    pub too_many_sent: Vec<(String, std::time::Instant)>,
}

pub(crate) struct Shared {
    pub opts: DoubleOptions,
    /// Names this double's containers (`podman::owner_label`).
    pub owner: String,
    /// The imitated images' program directories (`exec::image_fs`): made on first use.
    pub image_dirs: std::sync::OnceLock<(tempfile::TempDir, PathBuf, PathBuf)>,
    pub state: Mutex<State>,
    pub events: broadcast::Sender<Arc<Event>>,
}

impl Shared {
    /// Locks the state; a panic elsewhere must not turn every later request into a panic.
    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Kills the process groups of the exec sessions of one pod (or of all pods).
    pub fn kill_execs(&self, pod: Option<(&str, &str)>) {
        let st = self.lock();
        for e in st.execs.values() {
            if pod.is_none_or(|(ns, name)| e.namespace == ns && e.pod == name) {
                let _ = nix::sys::signal::killpg(
                    nix::unistd::Pid::from_raw(e.pgid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
    }
}

impl State {
    /// Bumps the global resourceVersion and returns it.
    pub fn next_rv(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    /// Records an event in the bounded history and sends it to the live watchers. Called with
    /// the state locked, so that a watcher that subscribes under the same lock sees no gap.
    pub fn emit(&mut self, shared_tx: &broadcast::Sender<Arc<Event>>, limit: usize, ev: Event) {
        let ev = Arc::new(ev);
        self.history.push_back(ev.clone());
        while self.history.len() > limit {
            if let Some(old) = self.history.pop_front() {
                self.compacted = old.rv;
            }
        }
        let _ = shared_tx.send(ev);
    }
}

/// A running fake API server; dropping it shuts it down and kills every exec process.
pub struct KubeDouble {
    shared: Arc<Shared>,
    addr: std::net::SocketAddr,
    dir: tempfile::TempDir,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl KubeDouble {
    pub fn start() -> KubeDouble {
        Self::start_with(DoubleOptions::default())
    }

    pub fn start_with(opts: DoubleOptions) -> KubeDouble {
        let (tx, _) = broadcast::channel(4096);
        static DOUBLES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let owner = format!(
            "{}-{}",
            std::process::id(),
            DOUBLES.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let shared = Arc::new(Shared {
            opts,
            owner,
            image_dirs: Default::default(),
            state: Mutex::new(State {
                next_ip: 10,
                ..State::default()
            }),
            events: tx,
        });
        let listener =
            std::net::TcpListener::bind("127.0.0.1:0").expect("kube double: bind 127.0.0.1:0");
        listener
            .set_nonblocking(true)
            .expect("kube double: nonblocking listener");
        let addr = listener.local_addr().expect("kube double: local addr");
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name("kube-double".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .expect("kube double: tokio runtime");
                rt.block_on(async move {
                    let listener = tokio::net::TcpListener::from_std(listener)
                        .expect("kube double: tokio listener");
                    let app = server::router(sh);
                    let serve = axum::serve(tls::TlsListener::new(listener), app);
                    tokio::select! {
                        r = serve => { if let Err(e) = r { eprintln!("kube double: serve: {e}"); } }
                        _ = stop_rx => {}
                    }
                });
                rt.shutdown_timeout(Duration::from_secs(2));
            })
            .expect("kube double: thread");
        let dir = tempfile::tempdir().expect("kube double: temp dir");
        let double = KubeDouble {
            shared,
            addr,
            dir,
            shutdown: Some(stop_tx),
            thread: Some(thread),
        };
        std::fs::write(double.kubeconfig(), double.kubeconfig_text())
            .expect("kube double: write kubeconfig");
        double
    }

    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    /// The listening address (for raw TLS clients: see [`tls::connect`]).
    pub fn addr(&self) -> std::net::SocketAddr {
        self.addr
    }

    /// The CA that signed the double's certificate, PEM.
    pub fn ca_pem(&self) -> &'static str {
        tls::CA_PEM
    }

    pub fn options(&self) -> &DoubleOptions {
        &self.shared.opts
    }

    /// The kubeconfig file (written at start).
    pub fn kubeconfig(&self) -> PathBuf {
        self.dir.path().join("kubeconfig")
    }

    fn kubeconfig_text(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: double\n  cluster:\n    server: {}\n    certificate-authority-data: {}\n\
             users:\n- name: double\n  user:\n    token: {}\n\
             contexts:\n- name: double\n  context:\n    cluster: double\n    user: double\n    namespace: default\n\
             current-context: double\n",
            self.url(),
            base64_simd::STANDARD.encode_to_string(tls::CA_PEM),
            self.shared.opts.token
        )
    }

    pub fn pods(&self, namespace: &str) -> Vec<Pod> {
        let st = self.shared.lock();
        st.pods
            .iter()
            .filter(|((ns, _), _)| ns == namespace)
            .map(|(_, p)| p.clone())
            .collect()
    }

    pub fn pod(&self, namespace: &str, name: &str) -> Option<Pod> {
        let st = self.shared.lock();
        st.pods
            .get(&(namespace.to_string(), name.to_string()))
            .cloned()
    }

    pub fn pod_names(&self, namespace: &str) -> Vec<String> {
        let st = self.shared.lock();
        st.pods
            .keys()
            .filter(|(ns, _)| ns == namespace)
            .map(|(_, n)| n.clone())
            .collect()
    }

    /// Stores a pod as given (timestamps, labels, status kept), e.g. a stale pod for reaper
    /// tests. Only the namespace default, uid and a new resourceVersion are filled in. No
    /// lifecycle runs for it.
    pub fn insert_pod(&self, mut pod: Pod) {
        let mut st = self.shared.lock();
        let rv = st.next_rv();
        let ns = pod
            .metadata
            .namespace
            .get_or_insert_with(|| "default".into())
            .clone();
        let name = pod.metadata.name.clone().unwrap_or_default();
        pod.metadata.resource_version = Some(rv.to_string());
        if pod.metadata.uid.is_none() {
            pod.metadata.uid = Some(pods::new_uid());
        }
        let object = serde_json::to_value(&pod).unwrap_or(Value::Null);
        st.pods.insert((ns.clone(), name), pod);
        let limit = self.shared.opts.history;
        st.emit(
            &self.shared.events,
            limit,
            Event {
                rv,
                kind: EventKind::Added,
                namespace: ns,
                object,
                old: None,
            },
        );
    }

    /// Every pod created through the API (not `insert_pod`), as it was stored at creation.
    pub fn created_pods(&self) -> Vec<Pod> {
        self.shared.lock().created.clone()
    }

    /// Every successful DELETE of a pod, in order (namespace, name).
    pub fn deletions(&self) -> Vec<(String, String)> {
        self.shared.lock().deletions.clone()
    }

    /// Every request as `"METHOD path?query"`.
    pub fn requests(&self) -> Vec<String> {
        self.shared.lock().requests.clone()
    }

    /// Makes SelfSubjectAccessReview answer "not allowed" for this attribute set.
    pub fn deny(&self, namespace: &str, resource: &str, subresource: &str, verb: &str) {
        self.shared.lock().denied.insert((
            namespace.into(),
            resource.into(),
            subresource.into(),
            verb.into(),
        ));
    }

    /// Exec processes that are still running.
    pub fn running_execs(&self) -> usize {
        self.shared.lock().execs.len()
    }

    /// Changes the faults the next requests meet.
    pub fn inject(&self, f: impl FnOnce(&mut Faults)) {
        f(&mut self.shared.lock().faults);
    }

    /// Deletes a pod at once and kills its containers with it, as a force deletion whose
    /// containers the kubelet stops at the same moment: its exec processes
    /// die with it (137 on their status channels).
    pub fn delete_pod(&self, namespace: &str, name: &str) {
        let mut st = self.shared.lock();
        pods::remove_locked(&self.shared, &mut st, namespace, name);
        drop(st);
        self.shared.kill_execs(Some((namespace, name)));
    }

    /// Ends a pod's container as the kubelet does when it is OOM-killed (or evicted, with
    /// `evicted`): terminated with exit 137, the pod Failed, its exec processes killed.
    pub fn kill_container(&self, namespace: &str, name: &str, evicted: bool) {
        mark_killed(&self.shared, namespace, name, evicted);
        self.shared.kill_execs(Some((namespace, name)));
    }

    /// Like [`KubeDouble::kill_container`], with a real kubelet's timing: the exec
    /// processes are killed now (their status channels report 137, or the stream breaks),
    /// and the pod's status says why only `lag` later (the kubelet's relist).
    pub fn kill_container_later(&self, namespace: &str, name: &str, evicted: bool, lag: Duration) {
        self.shared.kill_execs(Some((namespace, name)));
        let shared = self.shared.clone();
        let (ns, name) = (namespace.to_string(), name.to_string());
        std::thread::spawn(move || {
            std::thread::sleep(lag);
            mark_killed(&shared, &ns, &name, evicted);
        });
    }

    /// The most pods that had containers at once (`State::with_containers`): what a
    /// `max_concurrent_pods` limit must bound.
    pub fn peak_pods(&self) -> usize {
        self.shared.lock().peak_pods
    }

    /// Every DELETE of one pod, in order, with its preconditions and answer.
    pub fn delete_log(&self) -> Vec<DeleteRecord> {
        self.shared.lock().delete_log.clone()
    }

    /// Sets labels on a stored pod as another client's merge patch would (new
    /// resourceVersion, MODIFIED to watchers): for example another gateway replica claiming
    /// a warm pod.
    pub fn set_labels(&self, namespace: &str, name: &str, labels: &[(&str, &str)]) {
        let mut st = self.shared.lock();
        pods::modify_locked(&self.shared, &mut st, namespace, name, |p| {
            let l = p.metadata.labels.get_or_insert_with(Default::default);
            for (k, v) in labels {
                l.insert(k.to_string(), v.to_string());
            }
        });
    }

    /// Every 429 sent for `Faults::too_many`, with its verb and when.
    pub fn too_many_sent(&self) -> Vec<(String, std::time::Instant)> {
        self.shared.lock().faults.too_many_sent.clone()
    }

    /// WebSocket pings received from exec clients, over all sessions.
    pub fn exec_pings(&self) -> usize {
        self.shared.lock().exec_pings
    }

    /// The current global resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.shared.lock().rv
    }
}

/// The pod's status after the kubelet found its container OOM-killed (or the pod evicted):
/// terminated with exit 137, the pod Failed.
pub(crate) fn mark_killed(shared: &Arc<Shared>, namespace: &str, name: &str, evicted: bool) {
    let mut st = shared.lock();
    pods::modify_locked(shared, &mut st, namespace, name, |p| {
        let s = p.status.get_or_insert_with(Default::default);
        s.phase = Some("Failed".into());
        if evicted {
            s.reason = Some("Evicted".into());
            s.message = Some(
                "The node was low on resource: memory. Threshold quantity: 100Mi, available: 90Mi."
                    .into(),
            );
        }
        for c in s.container_statuses.iter_mut().flatten() {
            c.ready = false;
            c.state = Some(k8s_openapi::api::core::v1::ContainerState {
                terminated: Some(k8s_openapi::api::core::v1::ContainerStateTerminated {
                    exit_code: 137,
                    reason: Some(
                        if evicted {
                            "ContainerStatusUnknown"
                        } else {
                            "OOMKilled"
                        }
                        .into(),
                    ),
                    finished_at: Some(pods::now()),
                    ..Default::default()
                }),
                ..Default::default()
            });
        }
    });
}

impl Drop for KubeDouble {
    fn drop(&mut self) {
        self.shared.kill_execs(None);
        if self.shared.opts.containers {
            podman::remove_all(&self.shared.owner);
        }
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

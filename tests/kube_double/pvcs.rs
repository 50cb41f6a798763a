//! core/v1 PersistentVolumeClaims, as the API server and a node serve them (what the
//! gateway's cache volumes use):
//! - `POST`: 422 without a name, access modes or a storage request; 409 `AlreadyExists` for a
//!   duplicate name; the default StorageClass (`standard`) filled in as the
//!   DefaultStorageClass admission does, the `kubernetes.io/pvc-protection` finalizer added,
//!   `status.phase` `Pending`, then `Bound` (capacity = request) one step later.
//! - `GET` one (404), list with label and field selectors, watch (initial `ADDED`s, or the
//!   events after a `resourceVersion`; 410 `Expired` before the kept history), selectors
//!   applied as for pods. The resourceVersion is the double's one global counter.
//! - `PATCH` (merge patch; a `metadata.resourceVersion` in it is a precondition: 409
//!   `Conflict` when stale) changing metadata only (the spec of a bound claim is immutable
//!   but for a storage request: 422 otherwise).
//! - `DELETE` with `uid`/`resourceVersion` preconditions (409). A claim that a pod which has
//!   not finished uses is kept, terminating (`deletionTimestamp`), until no such pod is
//!   left, as the pvc-protection controller does.
//!
//! Storage: each claim is a directory of the double's. The double's "containers" are local
//! processes, so a mount is a symlink at the mount path to the claim's directory, made when
//! the kubelet starts the pod's containers (`mount`). A mount path is the same host path for
//! every pod: two live pods mounting different claims at one path cannot both have it, and
//! the second stays `ContainerCreating` with a message that says so (a limit of the double
//! that concurrent tests of different claims must avoid; a real node has no such limit).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::{Path as FsPath, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use serde_json::{Value, json};
use tokio::sync::broadcast;

use super::pods::{Res, dry_run, key, merge_patch, new_uid, now, valid_name};
use super::selector::Selector;
use super::server::{first, flag, parse_query};
use super::status::{ApiError, json_response};
use super::watch::{event_line, list_item, translate};
use super::{Event, EventKind, KubeDouble, Shared, State as St};

const FINALIZER: &str = "kubernetes.io/pvc-protection";

/// The claims, their watch history and their storage.
#[derive(Default)]
pub(crate) struct PvcStore {
    pub claims: BTreeMap<(String, String), PersistentVolumeClaim>,
    history: VecDeque<Arc<Event>>,
    compacted: u64,
    tx: Option<broadcast::Sender<Arc<Event>>>,
    storage: Option<tempfile::TempDir>,
    /// The directory of each claim, by uid.
    backing: HashMap<String, PathBuf>,
    /// Which pod mounted which claim (uid) at a path.
    mounts: HashMap<PathBuf, (String, String, String)>,
    /// Every mount, in order: (pod, claim).
    pub mount_log: Vec<(String, String)>,
    /// Every accepted DELETE, in order (claim names).
    pub deletions: Vec<String>,
}

impl PvcStore {
    fn sender(&mut self) -> broadcast::Sender<Arc<Event>> {
        self.tx
            .get_or_insert_with(|| broadcast::channel(1024).0)
            .clone()
    }

    fn emit(&mut self, limit: usize, ev: Event) {
        let ev = Arc::new(ev);
        self.history.push_back(ev.clone());
        while self.history.len() > limit {
            if let Some(old) = self.history.pop_front() {
                self.compacted = old.rv;
            }
        }
        let _ = self.sender().send(ev);
    }

    fn backing_dir(&mut self, uid: &str) -> std::io::Result<PathBuf> {
        if let Some(p) = self.backing.get(uid) {
            return Ok(p.clone());
        }
        if self.storage.is_none() {
            self.storage = Some(tempfile::tempdir()?);
        }
        let dir = self
            .storage
            .as_ref()
            .map(|s| s.path().join(uid))
            .unwrap_or_default();
        std::fs::create_dir_all(&dir)?;
        self.backing.insert(uid.to_string(), dir.clone());
        Ok(dir)
    }
}

fn to_value(p: &PersistentVolumeClaim) -> Value {
    serde_json::to_value(p).unwrap_or(Value::Null)
}

fn emit(shared: &Shared, st: &mut St, kind: EventKind, ns: &str, obj: Value, old: Option<Value>) {
    let rv = obj
        .pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
        .and_then(|r| r.parse().ok())
        .unwrap_or(st.rv);
    st.pvcs.emit(
        shared.opts.history,
        Event {
            rv,
            kind,
            namespace: ns.to_string(),
            object: obj,
            old,
        },
    );
}

fn modify(
    shared: &Shared,
    st: &mut St,
    ns: &str,
    name: &str,
    f: impl FnOnce(&mut PersistentVolumeClaim),
) -> Option<PersistentVolumeClaim> {
    let old = st.pvcs.claims.get(&key(ns, name))?.clone();
    let mut new = old.clone();
    f(&mut new);
    let rv = st.next_rv();
    new.metadata.resource_version = Some(rv.to_string());
    st.pvcs.claims.insert(key(ns, name), new.clone());
    emit(
        shared,
        st,
        EventKind::Modified,
        ns,
        to_value(&new),
        Some(to_value(&old)),
    );
    Some(new)
}

fn remove(shared: &Shared, st: &mut St, ns: &str, name: &str) -> Option<PersistentVolumeClaim> {
    let mut p = st.pvcs.claims.remove(&key(ns, name))?;
    let rv = st.next_rv();
    p.metadata.resource_version = Some(rv.to_string());
    if let Some(dir) = p
        .metadata
        .uid
        .as_ref()
        .and_then(|u| st.pvcs.backing.remove(u))
    {
        let _ = std::fs::remove_dir_all(dir);
    }
    emit(shared, st, EventKind::Deleted, ns, to_value(&p), None);
    Some(p)
}

/// Pods that use a claim and have not finished.
fn users(st: &St, ns: &str, claim: &str) -> Vec<String> {
    st.pods
        .iter()
        .filter(|((pns, _), _)| pns == ns)
        .filter(|(_, p)| {
            !matches!(
                p.status.as_ref().and_then(|s| s.phase.as_deref()),
                Some("Succeeded" | "Failed")
            )
        })
        .filter(|(_, p)| {
            p.spec
                .as_ref()
                .and_then(|s| s.volumes.as_ref())
                .into_iter()
                .flatten()
                .any(|v| {
                    v.persistent_volume_claim
                        .as_ref()
                        .is_some_and(|c| c.claim_name == claim)
                })
        })
        .map(|((_, n), _)| n.clone())
        .collect()
}

// ---------------------------------------------------------------------------------------------
// REST

pub async fn create(
    State(shared): State<Arc<Shared>>,
    Path(ns): Path<String>,
    RawQuery(raw): RawQuery,
    body: Bytes,
) -> Res {
    let q = parse_query(raw.as_deref());
    let dry = dry_run(&q)?;
    let mut pvc: PersistentVolumeClaim = serde_json::from_slice(&body).map_err(|e| {
        ApiError::bad_request(format!(
            "the object provided is unrecognized (must be of type PersistentVolumeClaim): {e}"
        ))
    })?;
    let name = pvc.metadata.name.clone().unwrap_or_default();
    let mut causes = Vec::new();
    if name.is_empty() {
        causes.push((
            "FieldValueRequired",
            "metadata.name".to_string(),
            "Required value: name or generateName is required".to_string(),
        ));
    } else if !valid_name(&name) {
        causes.push((
            "FieldValueInvalid",
            "metadata.name".into(),
            format!("Invalid value: \"{name}\": a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.'"),
        ));
    }
    let spec = pvc.spec.clone().unwrap_or_default();
    if spec.access_modes.as_ref().is_none_or(Vec::is_empty) {
        causes.push((
            "FieldValueRequired",
            "spec.accessModes".into(),
            "Required value: at least 1 access mode is required".into(),
        ));
    }
    let storage = spec
        .resources
        .as_ref()
        .and_then(|r| r.requests.as_ref())
        .and_then(|r| r.get("storage"))
        .cloned();
    if storage.is_none() {
        causes.push((
            "FieldValueRequired",
            "spec.resources[storage]".into(),
            "Required value".into(),
        ));
    }
    if !causes.is_empty() {
        return Err(ApiError::invalid("PersistentVolumeClaim", &name, &causes));
    }
    if !shared.opts.namespaces.contains(&ns) {
        return Err(ApiError::not_found("namespaces", &ns));
    }
    let m = &mut pvc.metadata;
    m.namespace = Some(ns.clone());
    m.uid = Some(new_uid());
    m.creation_timestamp = Some(now());
    m.deletion_timestamp = None;
    m.finalizers = Some(vec![FINALIZER.into()]);
    m.managed_fields = None;
    if let Some(s) = pvc.spec.as_mut() {
        s.storage_class_name
            .get_or_insert_with(|| "standard".into());
        s.volume_mode.get_or_insert_with(|| "Filesystem".into());
    }
    pvc.status = Some(k8s_openapi::api::core::v1::PersistentVolumeClaimStatus {
        phase: Some("Pending".into()),
        ..Default::default()
    });
    if dry {
        return Ok(json_response(StatusCode::CREATED, &to_value(&pvc)));
    }
    let mut st = shared.lock();
    if st.pvcs.claims.contains_key(&key(&ns, &name)) {
        return Err(ApiError::already_exists("persistentvolumeclaims", &name));
    }
    let rv = st.next_rv();
    pvc.metadata.resource_version = Some(rv.to_string());
    st.pvcs.claims.insert(key(&ns, &name), pvc.clone());
    emit(
        &shared,
        &mut st,
        EventKind::Added,
        &ns,
        to_value(&pvc),
        None,
    );
    drop(st);
    // The provisioner binds it a step later.
    let sh = shared.clone();
    let (bns, bname, uid) = (ns.clone(), name.clone(), pvc.metadata.uid.clone());
    tokio::spawn(async move {
        tokio::time::sleep(sh.opts.step_delay).await;
        let mut st = sh.lock();
        let same = st
            .pvcs
            .claims
            .get(&key(&bns, &bname))
            .is_some_and(|p| p.metadata.uid == uid);
        if same {
            modify(&sh, &mut st, &bns, &bname, |p| {
                let modes = p.spec.as_ref().and_then(|s| s.access_modes.clone());
                p.status = Some(k8s_openapi::api::core::v1::PersistentVolumeClaimStatus {
                    phase: Some("Bound".into()),
                    access_modes: modes,
                    capacity: storage.map(|s| [("storage".to_string(), s)].into()),
                    ..Default::default()
                });
                if let Some(s) = p.spec.as_mut() {
                    s.volume_name = Some(format!("pvc-{}", uid.clone().unwrap_or_default()));
                }
            });
        }
    });
    Ok(json_response(StatusCode::CREATED, &to_value(&pvc)))
}

pub async fn get(
    State(shared): State<Arc<Shared>>,
    Path((ns, name)): Path<(String, String)>,
) -> Res {
    let st = shared.lock();
    match st.pvcs.claims.get(&key(&ns, &name)) {
        Some(p) => Ok(json_response(StatusCode::OK, &to_value(p))),
        None => Err(ApiError::not_found("persistentvolumeclaims", &name)),
    }
}

pub async fn patch(
    State(shared): State<Arc<Shared>>,
    Path((ns, name)): Path<(String, String)>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
    body: Bytes,
) -> Res {
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_string();
    if ct != "application/merge-patch+json" && ct != "application/strategic-merge-patch+json" {
        return Err(ApiError::unsupported_media_type(&ct));
    }
    let patch: Value = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))?;
    let dry = dry_run(&parse_query(raw.as_deref()))?;
    let mut st = shared.lock();
    let Some(current) = st.pvcs.claims.get(&key(&ns, &name)).cloned() else {
        return Err(ApiError::not_found("persistentvolumeclaims", &name));
    };
    if let Some(want) = patch
        .pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
        && Some(want) != current.metadata.resource_version.as_deref()
    {
        return Err(ApiError::conflict_modified("persistentvolumeclaims", &name));
    }
    let mut v = to_value(&current);
    merge_patch(&mut v, &patch);
    let mut new: PersistentVolumeClaim = serde_json::from_value(v)
        .map_err(|e| ApiError::bad_request(format!("the patched object is invalid: {e}")))?;
    let without_request = |p: &PersistentVolumeClaim| {
        let mut s = p.spec.clone().unwrap_or_default();
        s.resources = None;
        s
    };
    if without_request(&new) != without_request(&current) {
        return Err(ApiError::invalid(
            "PersistentVolumeClaim",
            &name,
            &[(
                "FieldValueForbidden",
                "spec".into(),
                "Forbidden: spec is immutable after creation except resources.requests and volumeAttributesClassName for bound claims".into(),
            )],
        ));
    }
    // Identity and status are the server's.
    new.metadata.uid = current.metadata.uid.clone();
    new.metadata.creation_timestamp = current.metadata.creation_timestamp.clone();
    new.metadata.deletion_timestamp = current.metadata.deletion_timestamp.clone();
    new.metadata.name = current.metadata.name.clone();
    new.metadata.namespace = current.metadata.namespace.clone();
    new.status = current.status.clone();
    if dry {
        return Ok(json_response(StatusCode::OK, &to_value(&new)));
    }
    let stored = modify(&shared, &mut st, &ns, &name, |p| *p = new);
    Ok(json_response(
        StatusCode::OK,
        &stored.map(|p| to_value(&p)).unwrap_or(Value::Null),
    ))
}

pub async fn delete(
    State(shared): State<Arc<Shared>>,
    Path((ns, name)): Path<(String, String)>,
    RawQuery(raw): RawQuery,
    body: Bytes,
) -> Res {
    let q = parse_query(raw.as_deref());
    let mut dry = dry_run(&q)?;
    let (mut uid, mut rv) = (None, None);
    if !body.iter().all(u8::is_ascii_whitespace) {
        let v: Value = serde_json::from_slice(&body).map_err(|e| {
            ApiError::bad_request(format!(
                "the object provided is unrecognized (must be of type DeleteOptions): {e}"
            ))
        })?;
        uid = v
            .pointer("/preconditions/uid")
            .and_then(Value::as_str)
            .map(str::to_string);
        rv = v
            .pointer("/preconditions/resourceVersion")
            .and_then(Value::as_str)
            .map(str::to_string);
        dry |= v
            .get("dryRun")
            .and_then(Value::as_array)
            .is_some_and(|d| d.iter().any(|x| x == "All"));
    }
    let mut st = shared.lock();
    let Some(current) = st.pvcs.claims.get(&key(&ns, &name)).cloned() else {
        return Err(ApiError::not_found("persistentvolumeclaims", &name));
    };
    if let Some(u) = &uid
        && Some(u) != current.metadata.uid.as_ref()
    {
        return Err(ApiError::conflict(
            "persistentvolumeclaims",
            &name,
            &format!(
                "Precondition failed: UID in precondition: {u}, UID in object meta: {}",
                current.metadata.uid.as_deref().unwrap_or("")
            ),
        ));
    }
    if let Some(r) = &rv
        && Some(r) != current.metadata.resource_version.as_ref()
    {
        return Err(ApiError::conflict(
            "persistentvolumeclaims",
            &name,
            &format!(
                "Precondition failed: ResourceVersion in precondition: {r}, ResourceVersion in object meta: {}",
                current.metadata.resource_version.as_deref().unwrap_or("")
            ),
        ));
    }
    if dry {
        return Ok(json_response(StatusCode::OK, &to_value(&current)));
    }
    st.pvcs.deletions.push(name.clone());
    if users(&st, &ns, &name).is_empty() {
        let gone = remove(&shared, &mut st, &ns, &name);
        return Ok(json_response(
            StatusCode::OK,
            &gone.map(|p| to_value(&p)).unwrap_or(Value::Null),
        ));
    }
    // In use: terminating until its last pod is gone (the pvc-protection finalizer).
    let marked = modify(&shared, &mut st, &ns, &name, |p| {
        p.metadata.deletion_timestamp.get_or_insert_with(now);
        p.metadata.deletion_grace_period_seconds = Some(0);
    });
    drop(st);
    let sh = shared.clone();
    let uid = current.metadata.uid.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(20)).await;
            let mut st = sh.lock();
            let same = st
                .pvcs
                .claims
                .get(&key(&ns, &name))
                .is_some_and(|p| p.metadata.uid == uid);
            if !same {
                return;
            }
            if users(&st, &ns, &name).is_empty() {
                remove(&sh, &mut st, &ns, &name);
                return;
            }
        }
    });
    Ok(json_response(
        StatusCode::OK,
        &marked.map(|p| to_value(&p)).unwrap_or(Value::Null),
    ))
}

// ---------------------------------------------------------------------------------------------
// list / watch

pub async fn list(
    State(shared): State<Arc<Shared>>,
    Path(ns): Path<String>,
    RawQuery(raw): RawQuery,
) -> Res {
    let q = parse_query(raw.as_deref());
    let sel = Selector::parse(first(&q, "labelSelector"), first(&q, "fieldSelector"))?;
    if flag(&q, "watch") {
        return watch(shared, ns, sel, &q);
    }
    let st = shared.lock();
    let items: Vec<Value> = matching(&st, &ns, &sel)
        .into_iter()
        .map(list_item)
        .collect();
    Ok(json_response(
        StatusCode::OK,
        &json!({
            "kind": "PersistentVolumeClaimList",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": st.rv.to_string()},
            "items": items
        }),
    ))
}

fn matching(st: &St, ns: &str, sel: &Selector) -> Vec<Value> {
    st.pvcs
        .claims
        .iter()
        .filter(|((pns, _), _)| pns == ns)
        .map(|(_, p)| to_value(p))
        .filter(|v| sel.matches(v))
        .collect()
}

fn watch(shared: Arc<Shared>, ns: String, sel: Selector, q: &[(String, String)]) -> Res {
    let timeout = match first(q, "timeoutSeconds") {
        Some(t) => Duration::from_secs(t.parse::<u64>().map_err(|_| {
            ApiError::bad_request(format!("invalid value for timeoutSeconds: {t:?}"))
        })?),
        None => Duration::from_secs(1800),
    };
    let mut initial = Vec::new();
    let mut rx = {
        let mut st = shared.lock();
        let rx = st.pvcs.sender().subscribe();
        let requested = first(q, "resourceVersion").unwrap_or("");
        if requested.is_empty() || requested == "0" || flag(q, "sendInitialEvents") {
            for v in matching(&st, &ns, &sel) {
                initial.push(event_line("ADDED", &v));
            }
            if flag(q, "sendInitialEvents") {
                initial.push(event_line(
                    "BOOKMARK",
                    &json!({"kind": "PersistentVolumeClaim", "apiVersion": "v1", "metadata": {
                        "resourceVersion": st.rv.to_string(),
                        "annotations": {"k8s.io/initial-events-end": "true"}}}),
                ));
            }
        } else {
            let rv: u64 = requested.parse().map_err(|_| {
                ApiError::bad_request(format!("invalid resource version: {requested:?}"))
            })?;
            if st.pvcs.compacted > rv {
                let gone = ApiError::new(
                    410,
                    "Expired",
                    format!("too old resource version: {rv} ({})", st.pvcs.compacted),
                );
                initial.push(Bytes::from(format!(
                    "{{\"type\":\"ERROR\",\"object\":{}}}\n",
                    gone.to_status()
                )));
                return Ok(stream(initial, None, timeout, Some(ns), sel));
            }
            for ev in st.pvcs.history.iter().filter(|e| e.rv > rv) {
                if let Some((kind, obj)) = translate(ev, Some(&ns), &sel) {
                    initial.push(event_line(kind, obj));
                }
            }
        }
        rx
    };
    // Events sent between the subscription and now are in `initial` already.
    while rx.try_recv().is_ok() {}
    Ok(stream(initial, Some(rx), timeout, Some(ns), sel))
}

/// A watch's chunked body: `initial`, then what `rx` broadcasts that `ns` and `sel` select
/// (also the EndpointSlices' watch).
pub(super) fn stream(
    initial: Vec<Bytes>,
    rx: Option<broadcast::Receiver<Arc<Event>>>,
    timeout: Duration,
    ns: Option<String>,
    sel: Selector,
) -> Response {
    let (tx, mut out) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(16);
    tokio::spawn(async move {
        for line in initial {
            if tx.send(Ok(line)).await.is_err() {
                return;
            }
        }
        let Some(mut rx) = rx else { return };
        let deadline = tokio::time::sleep(timeout);
        tokio::pin!(deadline);
        loop {
            let line = tokio::select! {
                _ = &mut deadline => return,
                _ = tx.closed() => return,
                ev = rx.recv() => match ev {
                    Ok(ev) => match translate(&ev, ns.as_deref(), &sel) {
                        Some((kind, obj)) => event_line(kind, obj),
                        None => continue,
                    },
                    Err(_) => return,
                },
            };
            if tx.send(Ok(line)).await.is_err() {
                return;
            }
        }
    });
    let body = futures_util::stream::poll_fn(move |cx| out.poll_recv(cx));
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        Body::from_stream(body),
    )
        .into_response()
}

// ---------------------------------------------------------------------------------------------
// the node's side

/// Mounts a pod's claims (symlinks at the mount paths, see the module's documentation), as
/// the kubelet does before it starts the containers. `Err` says why it cannot (the pod then
/// stays `ContainerCreating`).
pub(super) fn mount(shared: &Shared, pod: &Pod) -> Result<(), String> {
    let Some(spec) = pod.spec.as_ref() else {
        return Ok(());
    };
    let ns = pod.metadata.namespace.clone().unwrap_or_default();
    let pod_name = pod.metadata.name.clone().unwrap_or_default();
    let mut st = shared.lock();
    for v in spec.volumes.iter().flatten() {
        let Some(src) = &v.persistent_volume_claim else {
            continue;
        };
        let claim = match st.pvcs.claims.get(&key(&ns, &src.claim_name)) {
            Some(c) if c.metadata.deletion_timestamp.is_none() => c.clone(),
            Some(_) => {
                return Err(format!(
                    "persistentvolumeclaim \"{}\" is being deleted",
                    src.claim_name
                ));
            }
            None => {
                return Err(format!(
                    "persistentvolumeclaim \"{}\" not found",
                    src.claim_name
                ));
            }
        };
        let uid = claim.metadata.uid.clone().unwrap_or_default();
        let backing = st
            .pvcs
            .backing_dir(&uid)
            .map_err(|e| format!("double: cannot make the claim's storage: {e}"))?;
        for m in spec
            .containers
            .iter()
            .flat_map(|c| c.volume_mounts.iter().flatten())
            .filter(|m| m.name == v.name)
        {
            let path = PathBuf::from(&m.mount_path);
            if let Some((mns, mpod, muid)) = st.pvcs.mounts.get(&path)
                && *muid != uid
                && (mns, mpod) != (&ns, &pod_name)
                && st.pods.get(&key(mns, mpod)).is_some_and(|p| {
                    !matches!(
                        p.status.as_ref().and_then(|s| s.phase.as_deref()),
                        Some("Succeeded" | "Failed")
                    )
                })
            {
                return Err(format!(
                    "double: mount path {} is in use by pod {mpod} with another claim (the double's mounts are host paths)",
                    m.mount_path
                ));
            }
            link(&backing, &path)?;
            st.pvcs
                .mounts
                .insert(path, (ns.clone(), pod_name.clone(), uid.clone()));
            st.pvcs
                .mount_log
                .push((pod_name.clone(), src.claim_name.clone()));
        }
    }
    Ok(())
}

fn link(backing: &FsPath, path: &FsPath) -> Result<(), String> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => {
            std::fs::remove_file(path).map_err(|e| format!("double: {e}"))?;
        }
        Ok(_) => {
            return Err(format!(
                "double: {} exists on the host and is not a mount of the double's",
                path.display()
            ));
        }
        Err(_) => {}
    }
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| format!("double: {e}"))?;
    }
    std::os::unix::fs::symlink(backing, path).map_err(|e| format!("double: {e}"))
}

// ---------------------------------------------------------------------------------------------
// test hooks

impl KubeDouble {
    /// The claims of a namespace.
    pub fn pvcs(&self, namespace: &str) -> Vec<PersistentVolumeClaim> {
        let st = self.shared.lock();
        st.pvcs
            .claims
            .iter()
            .filter(|((ns, _), _)| ns == namespace)
            .map(|(_, p)| p.clone())
            .collect()
    }

    /// Every mount of a claim into a pod, in order: (pod, claim).
    pub fn pvc_mounts(&self) -> Vec<(String, String)> {
        self.shared.lock().pvcs.mount_log.clone()
    }

    /// Stores a claim as given (annotations and timestamps kept), for sweeper tests.
    pub fn insert_pvc(&self, mut pvc: PersistentVolumeClaim) {
        let mut st = self.shared.lock();
        let rv = st.next_rv();
        let ns = pvc
            .metadata
            .namespace
            .get_or_insert_with(|| "default".into())
            .clone();
        let name = pvc.metadata.name.clone().unwrap_or_default();
        pvc.metadata.resource_version = Some(rv.to_string());
        pvc.metadata.uid.get_or_insert_with(new_uid);
        st.pvcs.claims.insert(key(&ns, &name), pvc.clone());
        emit(
            &self.shared,
            &mut st,
            EventKind::Added,
            &ns,
            to_value(&pvc),
            None,
        );
    }

    /// Changes a claim's annotations as another client's patch would.
    pub fn annotate_pvc(&self, namespace: &str, name: &str, annotations: &[(&str, Option<&str>)]) {
        let mut st = self.shared.lock();
        modify(&self.shared, &mut st, namespace, name, |p| {
            let a = p.metadata.annotations.get_or_insert_with(BTreeMap::new);
            for (k, v) in annotations {
                match v {
                    Some(v) => a.insert(k.to_string(), v.to_string()),
                    None => a.remove(*k),
                };
            }
        });
    }

    /// Names of the claims deleted through the API (successful DELETEs), in order.
    pub fn pvc_deletions(&self) -> Vec<String> {
        self.shared.lock().pvcs.deletions.clone()
    }
}

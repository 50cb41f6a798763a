//! core/v1 pods: create, get, list, watch, delete, patch, update, and the simulated lifecycle
//! (scheduler + kubelet) with its failure injection.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateRunning, ContainerStateTerminated, ContainerStateWaiting,
    ContainerStatus, HostIP, Pod, PodCondition, PodIP, PodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use rand::Rng;
use serde_json::{Value, json};
use tokio::sync::broadcast::error::RecvError;

use super::selector::Selector;
use super::server::{first, flag, parse_query};
use super::status::{ApiError, json_response};
use super::{Event, EventKind, Shared, State as St};

type Res = Result<Response, ApiError>;

pub fn now() -> Time {
    Time(k8s_openapi::jiff::Timestamp::now())
}

/// A random RFC 4122 version-4 UUID, as the API server assigns.
pub fn new_uid() -> String {
    let mut b: [u8; 16] = rand::rng().random();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// `generateName` suffix: 5 characters from apimachinery's `utilrand` alphabet (no vowels,
/// no confusable characters).
fn name_suffix() -> String {
    const ALPHANUMS: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut rng = rand::rng();
    (0..5)
        .map(|_| ALPHANUMS[rng.random_range(0..ALPHANUMS.len())] as char)
        .collect()
}

pub fn to_value(pod: &Pod) -> Value {
    serde_json::to_value(pod).unwrap_or(Value::Null)
}

fn key(ns: &str, name: &str) -> (String, String) {
    (ns.to_string(), name.to_string())
}

fn pod_response(code: StatusCode, pod: &Pod) -> Response {
    json_response(code, &to_value(pod))
}

/// RFC 1123 subdomain, as `ValidateObjectMeta` requires for pod names.
fn valid_name(n: &str) -> bool {
    n.len() <= 253
        && n.split('.').all(|l| {
            !l.is_empty()
                && l.bytes()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        })
}

fn validate(pod: &Pod, name: &str) -> Result<(), ApiError> {
    let mut causes: Vec<(&'static str, String, String)> = Vec::new();
    if name.is_empty() {
        causes.push((
            "FieldValueRequired",
            "metadata.name".into(),
            "Required value: name or generateName is required".into(),
        ));
    } else if !valid_name(name) {
        causes.push((
            "FieldValueInvalid",
            "metadata.name".into(),
            format!("Invalid value: \"{name}\": a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"),
        ));
    }
    let containers = pod.spec.as_ref().map(|s| &s.containers[..]).unwrap_or(&[]);
    if containers.is_empty() {
        causes.push((
            "FieldValueRequired",
            "spec.containers".into(),
            "Required value".into(),
        ));
    }
    for (i, c) in containers.iter().enumerate() {
        if c.name.is_empty() {
            causes.push((
                "FieldValueRequired",
                format!("spec.containers[{i}].name"),
                "Required value".into(),
            ));
        }
        if c.image.as_deref().unwrap_or("").is_empty() {
            causes.push((
                "FieldValueRequired",
                format!("spec.containers[{i}].image"),
                "Required value".into(),
            ));
        }
    }
    if causes.is_empty() {
        Ok(())
    } else {
        Err(ApiError::invalid("Pod", name, &causes))
    }
}

/// The defaults the API server fills in on create (a subset that clients look at).
fn apply_defaults(pod: &mut Pod) {
    if let Some(spec) = pod.spec.as_mut() {
        spec.restart_policy.get_or_insert_with(|| "Always".into());
        spec.dns_policy.get_or_insert_with(|| "ClusterFirst".into());
        spec.scheduler_name
            .get_or_insert_with(|| "default-scheduler".into());
        spec.termination_grace_period_seconds.get_or_insert(30);
        spec.enable_service_links.get_or_insert(true);
        spec.service_account_name
            .get_or_insert_with(|| "default".into());
        spec.priority.get_or_insert(0);
        for c in &mut spec.containers {
            let image = c.image.clone().unwrap_or_default();
            let tag_latest = {
                let last = image.rsplit('/').next().unwrap_or("");
                !last.contains(':') && !last.contains('@') || last.ends_with(":latest")
            };
            c.image_pull_policy
                .get_or_insert_with(|| if tag_latest { "Always" } else { "IfNotPresent" }.into());
            c.termination_message_path
                .get_or_insert_with(|| "/dev/termination-log".into());
            c.termination_message_policy
                .get_or_insert_with(|| "File".into());
        }
    }
}

fn body_pod(body: &Bytes) -> Result<Pod, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!(
            "the object provided is unrecognized (must be of type Pod): {e}"
        ))
    })
}

fn dry_run(q: &[(String, String)]) -> Result<bool, ApiError> {
    match first(q, "dryRun") {
        None | Some("") => Ok(false),
        Some("All") => Ok(true),
        Some(other) => Err(ApiError::bad_request(format!(
            "Invalid dry run value: {other:?}"
        ))),
    }
}

// ---------------------------------------------------------------------------------------------
// create / get / list

pub async fn create(
    State(shared): State<Arc<Shared>>,
    Path(ns): Path<String>,
    RawQuery(raw): RawQuery,
    body: Bytes,
) -> Res {
    let q = parse_query(raw.as_deref());
    let dry = dry_run(&q)?;
    let mut pod = body_pod(&body)?;
    if let Some(body_ns) = pod.metadata.namespace.as_deref()
        && !body_ns.is_empty()
        && body_ns != ns
    {
        return Err(ApiError::bad_request(
            "the namespace of the provided object does not match the namespace sent on the request",
        ));
    }
    let name = match (&pod.metadata.name, &pod.metadata.generate_name) {
        (Some(n), _) if !n.is_empty() => n.clone(),
        (_, Some(g)) if !g.is_empty() => format!("{g}{}", name_suffix()),
        _ => String::new(),
    };
    validate(&pod, &name)?;
    if !shared.opts.namespaces.contains(&ns) {
        return Err(ApiError::not_found("namespaces", &ns));
    }
    apply_defaults(&mut pod);
    let m = &mut pod.metadata;
    m.name = Some(name.clone());
    m.namespace = Some(ns.clone());
    m.uid = Some(new_uid());
    m.creation_timestamp = Some(now());
    m.deletion_timestamp = None;
    m.deletion_grace_period_seconds = None;
    m.generation = Some(1);
    m.managed_fields = None;
    pod.status = Some(PodStatus {
        phase: Some("Pending".into()),
        qos_class: Some("BestEffort".into()),
        ..PodStatus::default()
    });
    if dry {
        return Ok(pod_response(StatusCode::CREATED, &pod));
    }
    let mut st = shared.lock();
    if st.pods.contains_key(&key(&ns, &name)) {
        return Err(ApiError::already_exists("pods", &name));
    }
    let rv = st.next_rv();
    pod.metadata.resource_version = Some(rv.to_string());
    st.pods.insert(key(&ns, &name), pod.clone());
    st.created.push(pod.clone());
    st.emit(
        &shared.events,
        shared.opts.history,
        Event {
            rv,
            kind: EventKind::Added,
            namespace: ns.clone(),
            object: to_value(&pod),
            old: None,
        },
    );
    drop(st);
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    tokio::spawn(lifecycle(shared.clone(), ns, name, uid));
    Ok(pod_response(StatusCode::CREATED, &pod))
}

pub async fn get(
    State(shared): State<Arc<Shared>>,
    Path((ns, name)): Path<(String, String)>,
) -> Res {
    let st = shared.lock();
    match st.pods.get(&key(&ns, &name)) {
        Some(p) => Ok(pod_response(StatusCode::OK, p)),
        None => Err(ApiError::not_found("pods", &name)),
    }
}

pub async fn list(
    State(shared): State<Arc<Shared>>,
    Path(ns): Path<String>,
    RawQuery(raw): RawQuery,
) -> Res {
    list_or_watch(shared, Some(ns), raw)
}

pub async fn list_all(State(shared): State<Arc<Shared>>, RawQuery(raw): RawQuery) -> Res {
    list_or_watch(shared, None, raw)
}

fn list_or_watch(shared: Arc<Shared>, ns: Option<String>, raw: Option<String>) -> Res {
    let q = parse_query(raw.as_deref());
    let sel = Selector::parse(first(&q, "labelSelector"), first(&q, "fieldSelector"))?;
    if flag(&q, "watch") {
        return watch(shared, ns, sel, &q);
    }
    let st = shared.lock();
    let items: Vec<Value> = matching(&st, ns.as_deref(), &sel)
        .into_iter()
        .map(list_item)
        .collect();
    Ok(json_response(
        StatusCode::OK,
        &json!({
            "kind": "PodList",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": st.rv.to_string()},
            "items": items
        }),
    ))
}

/// List items carry no `kind`/`apiVersion` in the API server's answers.
fn list_item(mut v: Value) -> Value {
    if let Some(o) = v.as_object_mut() {
        o.remove("kind");
        o.remove("apiVersion");
    }
    v
}

fn matching(st: &St, ns: Option<&str>, sel: &Selector) -> Vec<Value> {
    st.pods
        .iter()
        .filter(|((pns, _), _)| ns.is_none_or(|n| n == pns))
        .map(|(_, p)| to_value(p))
        .filter(|v| sel.matches(v))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// watch

fn event_line(kind: &str, object: &Value) -> Bytes {
    let mut s = json!({"type": kind, "object": object}).to_string();
    s.push('\n');
    Bytes::from(s)
}

fn bookmark_line(rv: u64, initial_end: bool) -> Bytes {
    let mut meta = json!({"resourceVersion": rv.to_string()});
    if initial_end {
        meta["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    event_line(
        "BOOKMARK",
        &json!({"kind": "Pod", "apiVersion": "v1", "metadata": meta}),
    )
}

/// How a stored event looks to a watcher with this namespace and selector: objects that start
/// (stop) matching are ADDED (DELETED), as the watch cache reports them.
fn translate<'a>(
    ev: &'a Event,
    ns: Option<&str>,
    sel: &Selector,
) -> Option<(&'static str, &'a Value)> {
    if ns.is_some_and(|n| n != ev.namespace) {
        return None;
    }
    let now = sel.matches(&ev.object);
    match ev.kind {
        EventKind::Added | EventKind::Deleted => now.then_some((ev.kind.as_str(), &ev.object)),
        EventKind::Modified => {
            let before = ev.old.as_ref().is_some_and(|o| sel.matches(o));
            match (before, now) {
                (true, true) => Some(("MODIFIED", &ev.object)),
                (false, true) => Some(("ADDED", &ev.object)),
                (true, false) => Some(("DELETED", &ev.object)),
                (false, false) => None,
            }
        }
    }
}

fn watch(shared: Arc<Shared>, ns: Option<String>, sel: Selector, q: &[(String, String)]) -> Res {
    let timeout = match first(q, "timeoutSeconds") {
        Some(t) => Duration::from_secs(t.parse::<u64>().map_err(|_| {
            ApiError::bad_request(format!("invalid value for timeoutSeconds: {t:?}"))
        })?),
        None => Duration::from_secs(1800),
    };
    let bookmarks = flag(q, "allowWatchBookmarks");
    let send_initial = flag(q, "sendInitialEvents");
    let mut initial: Vec<Bytes> = Vec::new();
    let (rx, start_rv) = {
        let st = shared.lock();
        let rx = shared.events.subscribe();
        let requested = first(q, "resourceVersion").unwrap_or("");
        if requested.is_empty() || requested == "0" || send_initial {
            for v in matching(&st, ns.as_deref(), &sel) {
                initial.push(event_line("ADDED", &v));
            }
            if send_initial {
                initial.push(bookmark_line(st.rv, true));
            }
        } else {
            let rv: u64 = requested.parse().map_err(|_| {
                ApiError::bad_request(format!("invalid resource version: {requested:?}"))
            })?;
            let oldest = st.history.front().map(|e| e.rv).unwrap_or(st.rv + 1);
            if rv + 1 < oldest && st.compacted > rv {
                let gone = ApiError::new(
                    410,
                    "Expired",
                    format!("too old resource version: {rv} ({})", oldest - 1),
                );
                let mut line = format!("{{\"type\":\"ERROR\",\"object\":{}}}", gone.to_status());
                line.push('\n');
                return Ok(stream_response(vec![Bytes::from(line)], None));
            }
            for ev in st.history.iter().filter(|e| e.rv > rv) {
                if let Some((kind, obj)) = translate(ev, ns.as_deref(), &sel) {
                    initial.push(event_line(kind, obj));
                }
            }
        }
        (rx, st.rv)
    };
    let live = LiveWatch {
        shared,
        rx,
        ns,
        sel,
        timeout,
        bookmarks,
        last_rv: start_rv,
    };
    Ok(stream_response(initial, Some(live)))
}

struct LiveWatch {
    shared: Arc<Shared>,
    rx: tokio::sync::broadcast::Receiver<Arc<Event>>,
    ns: Option<String>,
    sel: Selector,
    timeout: Duration,
    bookmarks: bool,
    last_rv: u64,
}

/// A chunked JSON stream: the initial lines, then live events until the timeout, the client
/// going away, or the watcher falling behind the broadcast (the client re-watches).
fn stream_response(initial: Vec<Bytes>, live: Option<LiveWatch>) -> Response {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Result<Bytes, Infallible>>(16);
    tokio::spawn(async move {
        for line in initial {
            if tx.send(Ok(line)).await.is_err() {
                return;
            }
        }
        let Some(mut w) = live else { return };
        let deadline = tokio::time::sleep(w.timeout);
        tokio::pin!(deadline);
        let mut tick = tokio::time::interval(w.shared.opts.bookmark_interval);
        tick.tick().await;
        loop {
            let line = tokio::select! {
                _ = &mut deadline => return,
                _ = tx.closed() => return,
                _ = tick.tick(), if w.bookmarks => {
                    let rv = w.shared.lock().rv.max(w.last_rv);
                    bookmark_line(rv, false)
                }
                ev = w.rx.recv() => match ev {
                    Ok(ev) => {
                        w.last_rv = ev.rv;
                        match translate(&ev, w.ns.as_deref(), &w.sel) {
                            Some((kind, obj)) => event_line(kind, obj),
                            None => continue,
                        }
                    }
                    Err(RecvError::Lagged(_)) | Err(RecvError::Closed) => return,
                },
            };
            if tx.send(Ok(line)).await.is_err() {
                return;
            }
        }
    });
    let stream = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx));
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        Body::from_stream(stream),
    )
        .into_response()
}

// ---------------------------------------------------------------------------------------------
// delete

#[derive(Default)]
struct DeleteOpts {
    grace: Option<i64>,
    uid: Option<String>,
    rv: Option<String>,
    dry: bool,
}

fn delete_opts(q: &[(String, String)], body: &Bytes) -> Result<DeleteOpts, ApiError> {
    let mut o = DeleteOpts {
        dry: dry_run(q)?,
        ..DeleteOpts::default()
    };
    if let Some(g) = first(q, "gracePeriodSeconds") {
        o.grace = Some(g.parse().map_err(|_| {
            ApiError::bad_request(format!("invalid value for gracePeriodSeconds: {g:?}"))
        })?);
    }
    if !body.iter().all(u8::is_ascii_whitespace) {
        let v: Value = serde_json::from_slice(body).map_err(|e| {
            ApiError::bad_request(format!(
                "the object provided is unrecognized (must be of type DeleteOptions): {e}"
            ))
        })?;
        if let Some(g) = v.get("gracePeriodSeconds").and_then(Value::as_i64) {
            o.grace = Some(g);
        }
        if let Some(p) = v.get("preconditions") {
            o.uid = p.get("uid").and_then(Value::as_str).map(str::to_string);
            o.rv = p
                .get("resourceVersion")
                .and_then(Value::as_str)
                .map(str::to_string);
        }
        if let Some(d) = v.get("dryRun").and_then(Value::as_array) {
            o.dry |= d.iter().any(|x| x == "All");
        }
        if let Some(p) = v.get("propagationPolicy").and_then(Value::as_str)
            && !["Orphan", "Background", "Foreground"].contains(&p)
        {
            return Err(ApiError::invalid(
                "DeleteOptions",
                "",
                &[(
                    "FieldValueNotSupported",
                    "propagationPolicy".into(),
                    format!(
                        "Unsupported value: \"{p}\": supported values: \"Foreground\", \"Background\", \"Orphan\", \"nil\""
                    ),
                )],
            ));
        }
    }
    Ok(o)
}

pub async fn delete(
    State(shared): State<Arc<Shared>>,
    Path((ns, name)): Path<(String, String)>,
    RawQuery(raw): RawQuery,
    body: Bytes,
) -> Res {
    let q = parse_query(raw.as_deref());
    let opts = delete_opts(&q, &body)?;
    let pod = delete_one(&shared, &ns, &name, &opts)?;
    Ok(pod_response(StatusCode::OK, &pod))
}

pub async fn delete_collection(
    State(shared): State<Arc<Shared>>,
    Path(ns): Path<String>,
    RawQuery(raw): RawQuery,
    body: Bytes,
) -> Res {
    let q = parse_query(raw.as_deref());
    let sel = Selector::parse(first(&q, "labelSelector"), first(&q, "fieldSelector"))?;
    let opts = delete_opts(&q, &body)?;
    let names: Vec<String> = {
        let st = shared.lock();
        st.pods
            .iter()
            .filter(|((pns, _), p)| *pns == ns && sel.matches(&to_value(p)))
            .map(|((_, n), _)| n.clone())
            .collect()
    };
    let mut items = Vec::new();
    for n in names {
        // A pod that disappeared meanwhile is simply not part of the answer.
        if let Ok(p) = delete_one(&shared, &ns, &n, &opts) {
            items.push(list_item(to_value(&p)));
        }
    }
    let rv = shared.lock().rv;
    Ok(json_response(
        StatusCode::OK,
        &json!({"kind": "PodList", "apiVersion": "v1",
                "metadata": {"resourceVersion": rv.to_string()}, "items": items}),
    ))
}

fn delete_one(
    shared: &Arc<Shared>,
    ns: &str,
    name: &str,
    opts: &DeleteOpts,
) -> Result<Pod, ApiError> {
    let mut st = shared.lock();
    let Some(pod) = st.pods.get(&key(ns, name)).cloned() else {
        return Err(ApiError::not_found("pods", name));
    };
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let rv = pod.metadata.resource_version.clone().unwrap_or_default();
    if let Some(want) = &opts.uid
        && *want != uid
    {
        return Err(ApiError::conflict(
            "pods",
            name,
            &format!("Precondition failed: UID in precondition: {want}, UID in object meta: {uid}"),
        ));
    }
    if let Some(want) = &opts.rv
        && *want != rv
    {
        return Err(ApiError::conflict(
            "pods",
            name,
            &format!(
                "Precondition failed: ResourceVersion in precondition: {want}, ResourceVersion in meta: {rv}"
            ),
        ));
    }
    if opts.dry {
        return Ok(pod);
    }
    let scheduled = pod.spec.as_ref().is_some_and(|s| s.node_name.is_some());
    let phase = pod
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("");
    let grace = opts.grace.unwrap_or_else(|| {
        pod.spec
            .as_ref()
            .and_then(|s| s.termination_grace_period_seconds)
            .unwrap_or(30)
    });
    st.deletions.push(key(ns, name));
    // Unscheduled and finished pods have nothing to stop: the registry deletes them at once.
    let immediate = grace <= 0 || !scheduled || phase == "Succeeded" || phase == "Failed";
    if immediate {
        // The registry stamps the object before removing it: the DELETED event and the answer
        // carry `deletionTimestamp` and `deletionGracePeriodSeconds: 0`.
        if let Some(p) = st.pods.get_mut(&key(ns, name)) {
            p.metadata.deletion_timestamp.get_or_insert_with(now);
            p.metadata.deletion_grace_period_seconds = Some(0);
        }
        let gone = remove_locked(shared, &mut st, ns, name);
        drop(st);
        shared.kill_execs(Some((ns, name)));
        return Ok(gone.unwrap_or(pod));
    }
    if pod.metadata.deletion_timestamp.is_some() {
        return Ok(pod);
    }
    let updated = modify_locked(shared, &mut st, ns, name, |p| {
        let at = k8s_openapi::jiff::Timestamp::now()
            .checked_add(k8s_openapi::jiff::SignedDuration::from_secs(grace))
            .unwrap_or_else(|_| k8s_openapi::jiff::Timestamp::now());
        p.metadata.deletion_timestamp = Some(Time(at));
        p.metadata.deletion_grace_period_seconds = Some(grace);
    })
    .unwrap_or(pod);
    drop(st);
    let (sh, ns2, name2) = (shared.clone(), ns.to_string(), name.to_string());
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(grace as u64)).await;
        finish_graceful(&sh, &ns2, &name2, &uid);
    });
    Ok(updated)
}

/// The end of a grace period: the kubelet has killed the containers; the pod goes.
fn finish_graceful(shared: &Arc<Shared>, ns: &str, name: &str, uid: &str) {
    shared.kill_execs(Some((ns, name)));
    let mut st = shared.lock();
    let same = st
        .pods
        .get(&key(ns, name))
        .is_some_and(|p| p.metadata.uid.as_deref() == Some(uid));
    if same {
        remove_locked(shared, &mut st, ns, name);
    }
}

/// Removes a pod, sending DELETED with a new resourceVersion.
fn remove_locked(shared: &Shared, st: &mut St, ns: &str, name: &str) -> Option<Pod> {
    let mut pod = st.pods.remove(&key(ns, name))?;
    let rv = st.next_rv();
    pod.metadata.resource_version = Some(rv.to_string());
    st.emit(
        &shared.events,
        shared.opts.history,
        Event {
            rv,
            kind: EventKind::Deleted,
            namespace: ns.to_string(),
            object: to_value(&pod),
            old: None,
        },
    );
    Some(pod)
}

/// Changes a stored pod, bumping its resourceVersion and sending MODIFIED.
fn modify_locked(
    shared: &Shared,
    st: &mut St,
    ns: &str,
    name: &str,
    f: impl FnOnce(&mut Pod),
) -> Option<Pod> {
    let old = st.pods.get(&key(ns, name))?.clone();
    let mut new = old.clone();
    f(&mut new);
    let rv = st.next_rv();
    new.metadata.resource_version = Some(rv.to_string());
    st.pods.insert(key(ns, name), new.clone());
    st.emit(
        &shared.events,
        shared.opts.history,
        Event {
            rv,
            kind: EventKind::Modified,
            namespace: ns.to_string(),
            object: to_value(&new),
            old: Some(to_value(&old)),
        },
    );
    Some(new)
}

/// Lifecycle steps only touch the pod they were started for (same uid), and not once the
/// pod is terminating or finished.
fn step(shared: &Shared, ns: &str, name: &str, uid: &str, f: impl FnOnce(&mut Pod)) -> bool {
    let mut st = shared.lock();
    let live = st.pods.get(&key(ns, name)).is_some_and(|p| {
        p.metadata.uid.as_deref() == Some(uid)
            && p.metadata.deletion_timestamp.is_none()
            && !matches!(
                p.status.as_ref().and_then(|s| s.phase.as_deref()),
                Some("Failed" | "Succeeded")
            )
    });
    live && modify_locked(shared, &mut st, ns, name, f).is_some()
}

// ---------------------------------------------------------------------------------------------
// patch / update

/// RFC 7386 JSON merge patch.
fn merge_patch(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(p) => {
            if !target.is_object() {
                *target = json!({});
            }
            if let Some(t) = target.as_object_mut() {
                for (k, v) in p {
                    if v.is_null() {
                        t.remove(k);
                    } else {
                        merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
                    }
                }
            }
        }
        other => *target = other.clone(),
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
    let q = parse_query(raw.as_deref());
    let dry = dry_run(&q)?;
    update(&shared, &ns, &name, dry, |current| {
        let mut v = to_value(current);
        merge_patch(&mut v, &patch);
        let precondition = patch
            .pointer("/metadata/resourceVersion")
            .and_then(Value::as_str)
            .map(str::to_string);
        Ok((v, precondition))
    })
}

pub async fn replace(
    State(shared): State<Arc<Shared>>,
    Path((ns, name)): Path<(String, String)>,
    RawQuery(raw): RawQuery,
    body: Bytes,
) -> Res {
    let q = parse_query(raw.as_deref());
    let dry = dry_run(&q)?;
    let v: Value = serde_json::from_slice(&body).map_err(|e| {
        ApiError::bad_request(format!(
            "the object provided is unrecognized (must be of type Pod): {e}"
        ))
    })?;
    if v.pointer("/metadata/name").and_then(Value::as_str) != Some(name.as_str()) {
        return Err(ApiError::bad_request(
            "the name of the object does not match the name on the URL",
        ));
    }
    update(&shared, &ns, &name, dry, |_| {
        let precondition = v
            .pointer("/metadata/resourceVersion")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .map(str::to_string);
        Ok((v.clone(), precondition))
    })
}

/// The spec with the fields a pod update may change blanked out, for comparison.
fn frozen_spec(pod: &Pod) -> Value {
    let mut s = serde_json::to_value(&pod.spec).unwrap_or(Value::Null);
    if let Some(o) = s.as_object_mut() {
        o.remove("activeDeadlineSeconds");
        o.remove("tolerations");
        if let Some(cs) = o.get_mut("containers").and_then(Value::as_array_mut) {
            for c in cs {
                if let Some(c) = c.as_object_mut() {
                    c.remove("image");
                }
            }
        }
    }
    s
}

fn update(
    shared: &Arc<Shared>,
    ns: &str,
    name: &str,
    dry: bool,
    build: impl FnOnce(&Pod) -> Result<(Value, Option<String>), ApiError>,
) -> Res {
    let mut st = shared.lock();
    let Some(current) = st.pods.get(&key(ns, name)).cloned() else {
        return Err(ApiError::not_found("pods", name));
    };
    let (new_value, precondition) = build(&current)?;
    let current_rv = current
        .metadata
        .resource_version
        .clone()
        .unwrap_or_default();
    if precondition.is_some_and(|p| p != current_rv) {
        return Err(ApiError::conflict_modified("pods", name));
    }
    let mut new: Pod = serde_json::from_value(new_value).map_err(|e| {
        ApiError::bad_request(format!(
            "the object provided is unrecognized (must be of type Pod): {e}"
        ))
    })?;
    if new.metadata.name.as_deref() != Some(name) {
        return Err(ApiError::bad_request(
            "the name of the object does not match the name on the URL",
        ));
    }
    validate(&new, name)?;
    if frozen_spec(&new) != frozen_spec(&current) {
        return Err(ApiError::invalid(
            "Pod",
            name,
            &[(
                "FieldValueForbidden",
                "spec".into(),
                "Forbidden: pod updates may not change fields other than `spec.containers[*].image`,`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions to existing tolerations),`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was previously negative)".into(),
            )],
        ));
    }
    // System-owned metadata and status cannot be changed through the main resource.
    let m = &mut new.metadata;
    m.uid = current.metadata.uid.clone();
    m.namespace = current.metadata.namespace.clone();
    m.creation_timestamp = current.metadata.creation_timestamp.clone();
    m.deletion_timestamp = current.metadata.deletion_timestamp.clone();
    m.deletion_grace_period_seconds = current.metadata.deletion_grace_period_seconds;
    m.generation = current.metadata.generation;
    m.resource_version = current.metadata.resource_version.clone();
    new.status = current.status.clone();
    if dry {
        return Ok(pod_response(StatusCode::OK, &new));
    }
    if serde_json::to_value(&new).ok() == serde_json::to_value(&current).ok() {
        // A no-op update keeps the resourceVersion and sends no event.
        return Ok(pod_response(StatusCode::OK, &current));
    }
    let updated = modify_locked(shared, &mut st, ns, name, |p| *p = new)
        .ok_or_else(|| ApiError::not_found("pods", name))?;
    Ok(pod_response(StatusCode::OK, &updated))
}

// ---------------------------------------------------------------------------------------------
// lifecycle (scheduler + kubelet)

fn cond(type_: &str, status: bool, reason: Option<&str>, message: Option<String>) -> PodCondition {
    PodCondition {
        type_: type_.into(),
        status: if status { "True" } else { "False" }.into(),
        reason: reason.map(str::to_string),
        message,
        last_transition_time: Some(now()),
        last_probe_time: None,
        observed_generation: None,
    }
}

fn set_cond(status: &mut PodStatus, c: PodCondition) {
    let conds = status.conditions.get_or_insert_with(Vec::new);
    match conds.iter_mut().find(|x| x.type_ == c.type_) {
        Some(x) if x.status == c.status && x.reason == c.reason && x.message == c.message => {}
        Some(x) => *x = c,
        None => conds.push(c),
    }
}

fn waiting(reason: &str, message: Option<String>) -> ContainerState {
    ContainerState {
        waiting: Some(ContainerStateWaiting {
            reason: Some(reason.into()),
            message,
        }),
        ..ContainerState::default()
    }
}

fn images(pod: &Pod) -> Vec<(String, String)> {
    pod.spec
        .as_ref()
        .map(|s| {
            s.containers
                .iter()
                .map(|c| (c.name.clone(), c.image.clone().unwrap_or_default()))
                .collect()
        })
        .unwrap_or_default()
}

fn pull_message(image: &str) -> String {
    format!(
        "rpc error: code = NotFound desc = failed to pull and unpack image \"{image}\": failed to resolve reference \"{image}\": {image}: not found"
    )
}

fn unready(names: &[String]) -> String {
    format!("containers with unready status: [{}]", names.join(" "))
}

/// What the node's labels say about a nodeSelector.
fn node_matches(shared: &Shared, pod: &Pod) -> bool {
    let mut labels: BTreeMap<String, String> = shared.opts.node_labels.clone();
    labels.insert(
        "kubernetes.io/hostname".into(),
        shared.opts.node_name.clone(),
    );
    labels.insert("kubernetes.io/os".into(), "linux".into());
    labels.insert(
        "kubernetes.io/arch".into(),
        std::env::consts::ARCH
            .replace("x86_64", "amd64")
            .replace("aarch64", "arm64"),
    );
    pod.spec
        .as_ref()
        .and_then(|s| s.node_selector.as_ref())
        .is_none_or(|sel| sel.iter().all(|(k, v)| labels.get(k) == Some(v)))
}

async fn lifecycle(shared: Arc<Shared>, ns: String, name: String, uid: String) {
    let delay = shared.opts.step_delay;
    let node = shared.opts.node_name.clone();
    tokio::time::sleep(delay).await;

    // 1. The scheduler binds the pod (or says why it cannot).
    let Some(pod) = shared.lock().pods.get(&key(&ns, &name)).cloned() else {
        return;
    };
    let preassigned = pod.spec.as_ref().is_some_and(|s| s.node_name.is_some());
    if !preassigned {
        if !node_matches(&shared, &pod) {
            step(&shared, &ns, &name, &uid, |p| {
                let s = p.status.get_or_insert_with(PodStatus::default);
                set_cond(s, cond("PodScheduled", false, Some("Unschedulable"), Some(
                    "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector. preemption: 0/1 nodes are available: 1 Preemption is not helpful for scheduling.".into())));
            });
            return;
        }
        if !step(&shared, &ns, &name, &uid, |p| {
            if let Some(s) = p.spec.as_mut() {
                s.node_name = Some(node.clone());
            }
            let s = p.status.get_or_insert_with(PodStatus::default);
            set_cond(s, cond("PodScheduled", true, None, None));
        }) {
            return;
        }
        tokio::time::sleep(delay).await;
    }

    // 2. The kubelet admits it: sandbox being created, containers waiting.
    let names: Vec<String> = images(&pod).into_iter().map(|(n, _)| n).collect();
    let started = now();
    if !step(&shared, &ns, &name, &uid, |p| {
        let imgs = images(p);
        let s = p.status.get_or_insert_with(PodStatus::default);
        s.host_ip = Some("172.18.0.2".into());
        s.host_ips = Some(vec![HostIP {
            ip: "172.18.0.2".into(),
        }]);
        s.start_time = Some(started.clone());
        set_cond(s, cond("PodReadyToStartContainers", false, None, None));
        set_cond(s, cond("Initialized", true, None, None));
        set_cond(
            s,
            cond(
                "Ready",
                false,
                Some("ContainersNotReady"),
                Some(unready(&names)),
            ),
        );
        set_cond(
            s,
            cond(
                "ContainersReady",
                false,
                Some("ContainersNotReady"),
                Some(unready(&names)),
            ),
        );
        set_cond(s, cond("PodScheduled", true, None, None));
        s.container_statuses = Some(
            imgs.iter()
                .map(|(n, i)| ContainerStatus {
                    name: n.clone(),
                    image: i.clone(),
                    image_id: String::new(),
                    ready: false,
                    restart_count: 0,
                    started: Some(false),
                    state: Some(waiting("ContainerCreating", None)),
                    ..ContainerStatus::default()
                })
                .collect(),
        );
    }) {
        return;
    }
    if let Some(secs) = pod.spec.as_ref().and_then(|s| s.active_deadline_seconds) {
        tokio::spawn(deadline(
            shared.clone(),
            ns.clone(),
            name.clone(),
            uid.clone(),
            secs,
        ));
    }
    if images(&pod).iter().any(|(_, i)| i.contains("never-starts")) {
        return;
    }
    tokio::time::sleep(delay).await;

    // 3. Containers start, or fail to.
    let ip = {
        let mut st = shared.lock();
        st.next_ip += 1;
        format!("10.244.0.{}", st.next_ip % 250 + 2)
    };
    let mut pulling = false;
    step(&shared, &ns, &name, &uid, |p| {
        let imgs = images(p);
        let s = p.status.get_or_insert_with(PodStatus::default);
        let mut statuses = Vec::new();
        let mut not_ready = Vec::new();
        for (n, i) in &imgs {
            let mut cs = ContainerStatus {
                name: n.clone(),
                image: i.clone(),
                ready: false,
                started: Some(false),
                ..ContainerStatus::default()
            };
            if i.contains("pull-error") {
                pulling = true;
                cs.state = Some(waiting("ErrImagePull", Some(pull_message(i))));
            } else if i.contains("config-error") {
                cs.state = Some(waiting(
                    "CreateContainerConfigError",
                    Some("secret \"double-config-error\" not found".into()),
                ));
            } else {
                cs.ready = true;
                cs.started = Some(true);
                cs.image_id = format!("{i}@sha256:{}", "0".repeat(64));
                cs.container_id = Some(format!("containerd://{}", new_uid().replace('-', "")));
                cs.state = Some(ContainerState {
                    running: Some(ContainerStateRunning {
                        started_at: Some(now()),
                    }),
                    ..ContainerState::default()
                });
            }
            if !cs.ready {
                not_ready.push(n.clone());
            }
            statuses.push(cs);
        }
        s.container_statuses = Some(statuses);
        set_cond(s, cond("PodReadyToStartContainers", true, None, None));
        s.pod_ip = Some(ip.clone());
        s.pod_ips = Some(vec![PodIP { ip: ip.clone() }]);
        if not_ready.is_empty() {
            s.phase = Some("Running".into());
            set_cond(s, cond("Ready", true, None, None));
            set_cond(s, cond("ContainersReady", true, None, None));
        } else {
            set_cond(
                s,
                cond(
                    "Ready",
                    false,
                    Some("ContainersNotReady"),
                    Some(unready(&not_ready)),
                ),
            );
            set_cond(
                s,
                cond(
                    "ContainersReady",
                    false,
                    Some("ContainersNotReady"),
                    Some(unready(&not_ready)),
                ),
            );
        }
    });
    if !pulling {
        return;
    }
    tokio::time::sleep(delay).await;
    // 4. The kubelet backs off from pulling.
    step(&shared, &ns, &name, &uid, |p| {
        let Some(cs) = p
            .status
            .as_mut()
            .and_then(|s| s.container_statuses.as_mut())
        else {
            return;
        };
        for c in cs.iter_mut().filter(|c| c.image.contains("pull-error")) {
            let img = c.image.clone();
            c.state = Some(waiting(
                "ImagePullBackOff",
                Some(format!(
                    "Back-off pulling image \"{img}\": ErrImagePull: {}",
                    pull_message(&img)
                )),
            ));
        }
    });
}

/// `activeDeadlineSeconds`: the kubelet fails the pod and kills its containers.
async fn deadline(shared: Arc<Shared>, ns: String, name: String, uid: String, secs: i64) {
    tokio::time::sleep(Duration::from_secs(secs.max(0) as u64)).await;
    let failed = step(&shared, &ns, &name, &uid, |p| {
        let s = p.status.get_or_insert_with(PodStatus::default);
        s.phase = Some("Failed".into());
        s.reason = Some("DeadlineExceeded".into());
        s.message = Some("Pod was active on the node longer than the specified deadline".into());
        let mut names = Vec::new();
        for c in s.container_statuses.iter_mut().flatten() {
            names.push(c.name.clone());
            let started_at = c
                .state
                .as_ref()
                .and_then(|st| st.running.as_ref())
                .and_then(|r| r.started_at.clone());
            c.ready = false;
            c.started = Some(false);
            c.state = Some(ContainerState {
                terminated: Some(ContainerStateTerminated {
                    exit_code: 137,
                    reason: Some("Error".into()),
                    started_at,
                    finished_at: Some(now()),
                    container_id: c.container_id.clone(),
                    ..ContainerStateTerminated::default()
                }),
                ..ContainerState::default()
            });
        }
        set_cond(s, cond("Ready", false, Some("PodFailed"), None));
        set_cond(s, cond("ContainersReady", false, Some("PodFailed"), None));
        set_cond(s, cond("PodReadyToStartContainers", false, None, None));
    });
    if failed {
        shared.kill_execs(Some((&ns, &name)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_patch_follows_rfc7386() {
        let mut t = json!({"a": "b", "c": {"d": "e", "f": "g"}});
        merge_patch(&mut t, &json!({"a": "z", "c": {"f": null}}));
        assert_eq!(t, json!({"a": "z", "c": {"d": "e"}}));
    }

    #[test]
    fn uid_and_suffix_shapes() {
        let u = new_uid();
        assert_eq!(u.len(), 36);
        assert_eq!(&u[14..15], "4");
        let s = name_suffix();
        assert_eq!(s.len(), 5);
        assert!(
            s.bytes()
                .all(|c| b"bcdfghjklmnpqrstvwxz2456789".contains(&c))
        );
    }

    #[test]
    fn names_are_rfc1123_subdomains() {
        assert!(valid_name("run-abc12.x"));
        assert!(!valid_name("Run"));
        assert!(!valid_name("-a"));
        assert!(!valid_name(""));
    }
}

//! core/v1 pods, the REST half: create, get, patch, update, and the store helpers every
//! writer uses (remove, modify, lifecycle step). Lists and watches are in `watch.rs`,
//! deletion in `delete.rs`, the simulated scheduler and kubelet in `kubelet.rs`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::Response;
use k8s_openapi::api::core::v1::{Pod, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use rand::RngExt as _;
use serde_json::{Value, json};

use super::admission;
use super::kubelet::lifecycle;
use super::server::{first, parse_query};
use super::status::{ApiError, json_response};
use super::{Event, EventKind, Shared, State as St};

pub(super) type Res = Result<Response, ApiError>;

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
pub(super) fn name_suffix() -> String {
    const ALPHANUMS: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut rng = rand::rng();
    (0..5)
        .map(|_| ALPHANUMS[rng.random_range(0..ALPHANUMS.len())] as char)
        .collect()
}

pub fn to_value(pod: &Pod) -> Value {
    serde_json::to_value(pod).unwrap_or(Value::Null)
}

pub(super) fn key(ns: &str, name: &str) -> (String, String) {
    (ns.to_string(), name.to_string())
}

pub(super) fn pod_response(code: StatusCode, pod: &Pod) -> Response {
    json_response(code, &to_value(pod))
}

/// RFC 1123 subdomain, as `ValidateObjectMeta` requires for pod names.
pub(super) fn valid_name(n: &str) -> bool {
    n.len() <= 253
        && n.split('.').all(|l| {
            !l.is_empty()
                && l.bytes()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        })
}

pub(super) fn validate(pod: &Pod, name: &str) -> Result<(), ApiError> {
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
pub(super) fn apply_defaults(pod: &mut Pod) {
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

pub(super) fn body_pod(body: &Bytes) -> Result<Pod, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!(
            "the object provided is unrecognized (must be of type Pod): {e}"
        ))
    })
}

pub(super) fn dry_run(q: &[(String, String)]) -> Result<bool, ApiError> {
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
    if let Some(fault) = shared.lock().faults.create.pop_front() {
        return Err(fault);
    }
    let labels = shared.opts.namespace_labels.get(&ns);
    let label = |k: &str| labels.and_then(|l| l.get(k)).map(String::as_str);
    admission::admit(
        &pod,
        &name,
        label(admission::ENFORCE_LABEL),
        label(admission::VERSION_LABEL),
    )?;
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
    st.with_containers
        .insert(pod.metadata.uid.clone().unwrap_or_default());
    st.peak_pods = st.peak_pods.max(st.with_containers.len());
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
    let lost = st.faults.create_lost_answers > 0;
    if lost {
        st.faults.create_lost_answers -= 1;
    }
    drop(st);
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    tokio::spawn(lifecycle(shared.clone(), ns, name, uid));
    if lost {
        // Stored, but the answer is lost: an etcd timeout after the write.
        return Err(ApiError::internal("etcdserver: request timed out"));
    }
    Ok(pod_response(StatusCode::CREATED, &pod))
}

pub async fn get(
    State(shared): State<Arc<Shared>>,
    Path((ns, name)): Path<(String, String)>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Res {
    let st = shared.lock();
    let Some(p) = st.pods.get(&key(&ns, &name)) else {
        return Err(ApiError::not_found("pods", &name));
    };
    let q = parse_query(raw.as_deref());
    match super::table::requested(&headers, &q) {
        Some(include) => Ok(json_response(
            StatusCode::OK,
            &super::table::table(&[to_value(p)], include, None, true),
        )),
        None => Ok(pod_response(StatusCode::OK, p)),
    }
}

/// Removes a pod, sending DELETED with a new resourceVersion.
pub(super) fn remove_locked(shared: &Shared, st: &mut St, ns: &str, name: &str) -> Option<Pod> {
    let mut pod = st.pods.remove(&key(ns, name))?;
    if let Some(uid) = &pod.metadata.uid {
        st.with_containers.remove(uid);
        if shared.opts.containers {
            super::podman::remove(uid);
        }
    }
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
pub(super) fn modify_locked(
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
pub(super) fn step(
    shared: &Shared,
    ns: &str,
    name: &str,
    uid: &str,
    f: impl FnOnce(&mut Pod),
) -> bool {
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
pub(super) fn merge_patch(target: &mut Value, patch: &Value) {
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
pub(super) fn frozen_spec(pod: &Pod) -> Value {
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

pub(super) fn update(
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

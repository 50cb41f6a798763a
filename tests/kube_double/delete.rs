//! core/v1 pods: delete (one or a collection) with preconditions and grace periods.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::{Value, json};

use super::Shared;
use super::pods::{Res, dry_run, key, modify_locked, now, pod_response, remove_locked, to_value};
use super::selector::Selector;
use super::server::{first, parse_query};
use super::status::{ApiError, json_response};
use super::watch::list_item;
// ---------------------------------------------------------------------------------------------
// delete

#[derive(Default)]
pub(super) struct DeleteOpts {
    grace: Option<i64>,
    uid: Option<String>,
    rv: Option<String>,
    dry: bool,
}

pub(super) fn delete_opts(q: &[(String, String)], body: &Bytes) -> Result<DeleteOpts, ApiError> {
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
    let result = delete_one(&shared, &ns, &name, &opts);
    shared.lock().delete_log.push(super::DeleteRecord {
        namespace: ns,
        name,
        grace: opts.grace,
        uid: opts.uid.clone(),
        resource_version: opts.rv.clone(),
        code: result.as_ref().map_or_else(|e| e.code, |_| 200),
    });
    Ok(pod_response(StatusCode::OK, &result?))
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

pub(super) fn delete_one(
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
        let forced = grace <= 0 && scheduled && phase != "Succeeded" && phase != "Failed";
        if !forced {
            drop(st);
            shared.kill_execs(Some((ns, name)));
            return Ok(gone.unwrap_or(pod));
        }
        // Force deletion: the object is gone, its containers are not yet. The kubelet kills
        // them when it notices.
        st.with_containers.insert(uid.clone());
        drop(st);
        let (sh, ns2, name2) = (shared.clone(), ns.to_string(), name.to_string());
        tokio::spawn(async move {
            tokio::time::sleep(sh.opts.force_kill_delay).await;
            sh.kill_execs(Some((&ns2, &name2)));
            sh.lock().with_containers.remove(&uid);
        });
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
        tokio::time::sleep(Duration::from_secs(grace as u64).max(sh.opts.min_deletion)).await;
        finish_graceful(&sh, &ns2, &name2, &uid);
    });
    Ok(updated)
}

/// The end of a grace period: the kubelet has killed the containers; the pod goes.
pub(super) fn finish_graceful(shared: &Arc<Shared>, ns: &str, name: &str, uid: &str) {
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

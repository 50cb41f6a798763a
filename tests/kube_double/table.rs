//! Server-side printing: `meta.k8s.io/v1` `Table` answers for pods, as kubectl asks for them
//! (`Accept: application/json;as=Table;v=v1;g=meta.k8s.io, ...`) in `kubectl get` without
//! `-o`. Columns and cells follow the API server's pod printer (pkg/printers/internalversion:
//! NAME, READY, STATUS, RESTARTS, AGE; with priority 1 IP, NODE, NOMINATED NODE, READINESS
//! GATES), STATUS as it derives it from the phase, the containers' states and the deletion
//! timestamp. `includeObject` is `Metadata` (default), `Object` or `None`. In a watch only the
//! first event carries the column definitions.

use axum::http::{HeaderMap, header};
use k8s_openapi::jiff::Timestamp;
use serde_json::{Value, json};

use super::server::first;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Include {
    None,
    Metadata,
    Object,
}

/// Whether the request asks for a Table (and what each row carries).
pub fn requested(headers: &HeaderMap, q: &[(String, String)]) -> Option<Include> {
    let accept = headers.get(header::ACCEPT)?.to_str().ok()?;
    // The first acceptable media type wins; a Table is asked for with its own parameters.
    let wants = accept.split(',').map(str::trim).find_map(|m| {
        let params: Vec<&str> = m.split(';').map(str::trim).collect();
        let json = params.first().is_some_and(|t| *t == "application/json");
        if !json {
            return None;
        }
        let table = params.contains(&"as=Table") && params.contains(&"g=meta.k8s.io");
        Some(table)
    })?;
    if !wants {
        return None;
    }
    Some(match first(q, "includeObject") {
        Some("None") => Include::None,
        Some("Object") => Include::Object,
        _ => Include::Metadata,
    })
}

fn columns() -> Value {
    let col = |name: &str, format: &str, description: &str, priority: u8| {
        json!({"name": name, "type": "string", "format": format, "description": description,
               "priority": priority})
    };
    json!([
        col(
            "Name",
            "name",
            "Name must be unique within a namespace. Is required when creating resources, although some resources may allow a client to request the generation of an appropriate name automatically. Name is primarily intended for creation idempotence and configuration definition. Cannot be updated. More info: https://kubernetes.io/docs/concepts/overview/working-with-objects/names#names",
            0
        ),
        col(
            "Ready",
            "",
            "The aggregate readiness state of this pod for accepting traffic.",
            0
        ),
        col(
            "Status",
            "",
            "The aggregate status of the containers in this pod.",
            0
        ),
        col(
            "Restarts",
            "",
            "The number of times the containers in this pod have been restarted and when the last container in this pod has restarted.",
            0
        ),
        col(
            "Age",
            "",
            "CreationTimestamp is a timestamp representing the server time when this object was created. It is not guaranteed to be set in happens-before order across separate operations. Clients may not set this value. It is represented in RFC3339 form and is in UTC.\n\nPopulated by the system. Read-only. Null for lists. More info: https://git.k8s.io/community/contributors/devel/sig-architecture/api-conventions.md#metadata",
            0
        ),
        col(
            "IP",
            "",
            "podIP is the IP address allocated to the pod. Routable at least within the cluster. Empty if not yet allocated.",
            1
        ),
        col(
            "Node",
            "",
            "nodeName indicates in which node this pod is scheduled. If empty, this pod is a candidate for scheduling by the scheduler defined in schedulerName. Once this field is set, the kubelet for this node becomes responsible for the lifecycle of this pod. This field should not be used to express a desire for the pod to be scheduled on a specific node. https://kubernetes.io/docs/concepts/scheduling-eviction/assign-pod-node/#nodename",
            1
        ),
        col(
            "Nominated Node",
            "",
            "nominatedNodeName is set only when this pod preempts other pods on the node, but it cannot be scheduled right away as preemption victims receive their graceful termination periods. This field does not guarantee that the pod will be scheduled on this node. Scheduler may decide to place the pod elsewhere if other nodes become available sooner. Scheduler may also decide to give the resources on this node to a higher priority pod that is created after preemption. As a result, this field may be different than PodSpec.nodeName when the pod is scheduled.",
            1
        ),
        col(
            "Readiness Gates",
            "",
            "If specified, all readiness gates will be evaluated for pod readiness. A pod is ready when all its containers are ready AND all conditions specified in the readiness gates have status equal to \"True\" More info: https://git.k8s.io/enhancements/keps/sig-network/580-pod-readiness-gates",
            1
        ),
    ])
}

/// `duration.HumanDuration` of apimachinery, as the AGE column shows it.
pub fn human_duration(secs: i64) -> String {
    if secs < -1 {
        return "<invalid>".into();
    }
    if secs < 0 {
        return "0s".into();
    }
    if secs < 120 {
        return format!("{secs}s");
    }
    let minutes = secs / 60;
    if minutes < 10 {
        let s = secs % 60;
        return if s == 0 {
            format!("{minutes}m")
        } else {
            format!("{minutes}m{s}s")
        };
    }
    if minutes < 180 {
        return format!("{minutes}m");
    }
    let hours = secs / 3600;
    if hours < 8 {
        let m = minutes % 60;
        return if m == 0 {
            format!("{hours}h")
        } else {
            format!("{hours}h{m}m")
        };
    }
    if hours < 48 {
        return format!("{hours}h");
    }
    if hours < 24 * 8 {
        let h = hours % 24;
        return if h == 0 {
            format!("{}d", hours / 24)
        } else {
            format!("{}d{h}h", hours / 24)
        };
    }
    if hours < 24 * 365 * 2 {
        return format!("{}d", hours / 24);
    }
    if hours < 24 * 365 * 8 {
        let d = (hours / 24) % 365;
        return if d == 0 {
            format!("{}y", hours / 24 / 365)
        } else {
            format!("{}y{d}d", hours / 24 / 365)
        };
    }
    format!("{}y", hours / 24 / 365)
}

fn s<'a>(v: &'a Value, ptr: &str) -> &'a str {
    v.pointer(ptr).and_then(Value::as_str).unwrap_or("")
}

/// The printer's STATUS and READY cells.
fn status_and_ready(pod: &Value) -> (String, String) {
    let total = pod
        .pointer("/spec/containers")
        .and_then(Value::as_array)
        .map_or(0, Vec::len);
    let mut reason = s(pod, "/status/phase").to_string();
    if !s(pod, "/status/reason").is_empty() {
        reason = s(pod, "/status/reason").to_string();
    }
    let mut ready = 0;
    let mut has_running = false;
    let statuses = pod
        .pointer("/status/containerStatuses")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    for c in statuses.iter().rev() {
        let waiting = s(c, "/state/waiting/reason");
        let terminated = c.pointer("/state/terminated");
        if !waiting.is_empty() {
            reason = waiting.to_string();
        } else if let Some(t) = terminated {
            let r = s(t, "/reason");
            reason = if !r.is_empty() {
                r.to_string()
            } else if let Some(sig) = t.get("signal").and_then(Value::as_i64).filter(|s| *s != 0) {
                format!("Signal:{sig}")
            } else {
                format!(
                    "ExitCode:{}",
                    t.get("exitCode").and_then(Value::as_i64).unwrap_or(0)
                )
            };
        } else if c.get("ready") == Some(&json!(true)) && c.pointer("/state/running").is_some() {
            has_running = true;
            ready += 1;
        }
    }
    if reason == "Completed" && has_running {
        let pod_ready = pod
            .pointer("/status/conditions")
            .and_then(Value::as_array)
            .is_some_and(|cs| {
                cs.iter()
                    .any(|c| s(c, "/type") == "Ready" && s(c, "/status") == "True")
            });
        reason = if pod_ready { "Running" } else { "NotReady" }.into();
    }
    let phase = s(pod, "/status/phase");
    if pod
        .pointer("/metadata/deletionTimestamp")
        .is_some_and(|t| !t.is_null())
    {
        if s(pod, "/status/reason") == "NodeLost" {
            reason = "Unknown".into();
        } else if phase != "Failed" && phase != "Succeeded" {
            reason = "Terminating".into();
        }
    }
    if reason.is_empty() {
        reason = "Pending".into();
    }
    (reason, format!("{ready}/{total}"))
}

fn row(pod: &Value, include: Include, now: Timestamp) -> Value {
    let (status, ready) = status_and_ready(pod);
    let restarts: i64 = pod
        .pointer("/status/containerStatuses")
        .and_then(Value::as_array)
        .map_or(0, |cs| {
            cs.iter()
                .filter_map(|c| c.get("restartCount").and_then(Value::as_i64))
                .sum()
        });
    let age = s(pod, "/metadata/creationTimestamp")
        .parse::<Timestamp>()
        .map(|t| human_duration(now.duration_since(t).as_secs()))
        .unwrap_or_else(|_| "<unknown>".into());
    let or_none = |v: &str| {
        if v.is_empty() {
            "<none>".to_string()
        } else {
            v.to_string()
        }
    };
    let mut r = json!({
        "cells": [
            s(pod, "/metadata/name"),
            ready,
            status,
            restarts.to_string(),
            age,
            or_none(s(pod, "/status/podIP")),
            or_none(s(pod, "/spec/nodeName")),
            or_none(s(pod, "/status/nominatedNodeName")),
            "<none>",
        ]
    });
    match include {
        Include::None => {}
        Include::Metadata => {
            r["object"] = json!({"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                                 "metadata": pod.get("metadata").cloned().unwrap_or(json!({}))});
        }
        Include::Object => {
            let mut o = pod.clone();
            o["kind"] = json!("Pod");
            o["apiVersion"] = json!("v1");
            r["object"] = o;
        }
    }
    r
}

/// A Table of these pods; `headers` false leaves out the column definitions (watch events
/// after the first).
pub fn table(pods: &[Value], include: Include, rv: Option<u64>, headers: bool) -> Value {
    let now = Timestamp::now();
    let mut meta = json!({});
    if let Some(rv) = rv {
        meta["resourceVersion"] = json!(rv.to_string());
    }
    json!({
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": meta,
        "columnDefinitions": if headers { columns() } else { Value::Null },
        "rows": pods.iter().map(|p| row(p, include, now)).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_as_kubectl_shows_them() {
        for (secs, want) in [
            (0, "0s"),
            (119, "119s"),
            (125, "2m5s"),
            (600, "10m"),
            (3 * 3600 + 60, "3h1m"),
            (30 * 3600, "30h"),
            (3 * 86400 + 3600, "3d1h"),
            (400 * 86400, "400d"),
        ] {
            assert_eq!(human_duration(secs), want, "{secs}");
        }
    }

    #[test]
    fn status_follows_the_printer() {
        let pod = |status: Value, deleting: bool| {
            let mut p = json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c"}]},
                               "status": status});
            if deleting {
                p["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
            }
            p
        };
        let waiting = json!({"phase": "Pending", "containerStatuses": [
            {"name": "c", "ready": false, "state": {"waiting": {"reason": "ContainerCreating"}}}]});
        assert_eq!(
            status_and_ready(&pod(waiting, false)),
            ("ContainerCreating".into(), "0/1".into())
        );
        let running = json!({"phase": "Running", "containerStatuses": [
            {"name": "c", "ready": true, "state": {"running": {}}}]});
        assert_eq!(
            status_and_ready(&pod(running.clone(), false)),
            ("Running".into(), "1/1".into())
        );
        assert_eq!(status_and_ready(&pod(running, true)).0, "Terminating");
        assert_eq!(status_and_ready(&pod(json!({}), false)).0, "Pending");
    }
}

//! discovery.k8s.io/v1 EndpointSlices, as the API server serves them (what the gateway's
//! replica discovery watches, `server.peer_service`):
//! - `GET` one (404), list (label and field selectors, `resourceVersion` of the double's one
//!   global counter) and watch (initial `ADDED`s, or the events after a `resourceVersion`;
//!   410 `Expired` before the kept history; bookmarks are not sent), and the all-namespaces
//!   list. kubectl's `Table` has the API server's columns (NAME, ADDRESSTYPE, PORTS,
//!   ENDPOINTS, AGE).
//! - `POST` (422 without a name or an `addressType`, 409 `AlreadyExists`) and `DELETE` (404).
//! - Tests play the EndpointSlice controller: `put_endpoint_slice` creates or replaces a
//!   slice (ADDED or MODIFIED), `remove_endpoint_slice` deletes it.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use serde_json::{Value, json};
use tokio::sync::broadcast;

use super::pods::{Res, dry_run, key, new_uid, now, valid_name};
use super::selector::Selector;
use super::server::{first, flag, parse_query};
use super::status::{ApiError, json_response};
use super::watch::{event_line, list_item, translate};
use super::{Event, EventKind, KubeDouble, Shared, State as St};

const RESOURCE: &str = "endpointslices.discovery.k8s.io";

/// The slices and their watch history.
#[derive(Default)]
pub(crate) struct SliceStore {
    slices: BTreeMap<(String, String), Value>,
    history: VecDeque<Arc<Event>>,
    compacted: u64,
    tx: Option<broadcast::Sender<Arc<Event>>>,
}

impl SliceStore {
    fn sender(&mut self) -> broadcast::Sender<Arc<Event>> {
        self.tx
            .get_or_insert_with(|| broadcast::channel(256).0)
            .clone()
    }
}

/// Stores `obj` (new or replacing `old`) with the next resourceVersion and tells watchers.
fn store(shared: &Shared, st: &mut St, ns: &str, mut obj: Value, old: Option<Value>) -> Value {
    let rv = st.next_rv();
    obj["apiVersion"] = json!("discovery.k8s.io/v1");
    obj["kind"] = json!("EndpointSlice");
    obj["metadata"]["namespace"] = json!(ns);
    obj["metadata"]["resourceVersion"] = json!(rv.to_string());
    let meta = &mut obj["metadata"];
    if meta.get("uid").is_none() {
        meta["uid"] = json!(new_uid());
        meta["creationTimestamp"] = serde_json::to_value(now()).unwrap_or(Value::Null);
    }
    let name = obj["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    st.slices.slices.insert(key(ns, &name), obj.clone());
    let kind = if old.is_some() {
        EventKind::Modified
    } else {
        EventKind::Added
    };
    emit(shared, st, kind, ns, obj.clone(), old);
    obj
}

fn emit(
    shared: &Shared,
    st: &mut St,
    kind: EventKind,
    ns: &str,
    object: Value,
    old: Option<Value>,
) {
    let rv = object["metadata"]["resourceVersion"]
        .as_str()
        .and_then(|r| r.parse().ok())
        .unwrap_or(st.rv);
    let ev = Arc::new(Event {
        rv,
        kind,
        namespace: ns.to_owned(),
        object,
        old,
    });
    let s = &mut st.slices;
    s.history.push_back(ev.clone());
    while s.history.len() > shared.opts.history {
        if let Some(old) = s.history.pop_front() {
            s.compacted = old.rv;
        }
    }
    let _ = s.sender().send(ev);
}

fn remove(shared: &Shared, st: &mut St, ns: &str, name: &str) -> Option<Value> {
    let mut gone = st.slices.slices.remove(&key(ns, name))?;
    gone["metadata"]["resourceVersion"] = json!(st.next_rv().to_string());
    emit(shared, st, EventKind::Deleted, ns, gone.clone(), None);
    Some(gone)
}

pub async fn create(
    State(shared): State<Arc<Shared>>,
    Path(ns): Path<String>,
    RawQuery(raw): RawQuery,
    body: Bytes,
) -> Res {
    let q = parse_query(raw.as_deref());
    let dry = dry_run(&q)?;
    let obj: Value = serde_json::from_slice(&body)
        .ok()
        .filter(Value::is_object)
        .ok_or_else(|| {
            ApiError::bad_request(
                "the object provided is unrecognized (must be of type EndpointSlice)",
            )
        })?;
    let name = obj["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
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
    let types = ["IPv4", "IPv6", "FQDN"];
    match obj["addressType"].as_str() {
        Some(t) if types.contains(&t) => {}
        None => causes.push((
            "FieldValueRequired",
            "addressType".into(),
            "Required value".into(),
        )),
        Some(t) => causes.push((
            "FieldValueNotSupported",
            "addressType".into(),
            format!("Unsupported value: \"{t}\": supported values: \"FQDN\", \"IPv4\", \"IPv6\""),
        )),
    }
    if !causes.is_empty() {
        return Err(ApiError::invalid("EndpointSlice", &name, &causes));
    }
    let mut st = shared.lock();
    if st.slices.slices.contains_key(&key(&ns, &name)) {
        return Err(ApiError::already_exists(RESOURCE, &name));
    }
    if dry {
        return Ok(json_response(StatusCode::CREATED, &obj));
    }
    let stored = store(&shared, &mut st, &ns, obj, None);
    Ok(json_response(StatusCode::CREATED, &stored))
}

pub async fn get(
    State(shared): State<Arc<Shared>>,
    Path((ns, name)): Path<(String, String)>,
    headers: HeaderMap,
) -> Res {
    let st = shared.lock();
    match st.slices.slices.get(&key(&ns, &name)) {
        Some(s) => Ok(answer(&headers, &[], vec![s.clone()], None)),
        None => Err(ApiError::not_found(RESOURCE, &name)),
    }
}

pub async fn delete(
    State(shared): State<Arc<Shared>>,
    Path((ns, name)): Path<(String, String)>,
) -> Res {
    let mut st = shared.lock();
    match remove(&shared, &mut st, &ns, &name) {
        Some(gone) => Ok(json_response(StatusCode::OK, &gone)),
        None => Err(ApiError::not_found(RESOURCE, &name)),
    }
}

pub async fn list_all(
    State(shared): State<Arc<Shared>>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Res {
    list_in(shared, None, raw, headers)
}

pub async fn list(
    State(shared): State<Arc<Shared>>,
    Path(ns): Path<String>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Res {
    list_in(shared, Some(ns), raw, headers)
}

fn list_in(
    shared: Arc<Shared>,
    ns: Option<String>,
    raw: Option<String>,
    headers: HeaderMap,
) -> Res {
    let q = parse_query(raw.as_deref());
    let sel = Selector::parse(first(&q, "labelSelector"), first(&q, "fieldSelector"))?;
    if flag(&q, "watch") {
        return watch(shared, ns, sel, &q);
    }
    let st = shared.lock();
    Ok(answer(
        &headers,
        &q,
        matching(&st, ns.as_deref(), &sel),
        Some(st.rv),
    ))
}

/// One object (`rv` `None`) or a list, as JSON or as kubectl's Table.
fn answer(
    headers: &HeaderMap,
    q: &[(String, String)],
    items: Vec<Value>,
    rv: Option<u64>,
) -> axum::response::Response {
    if let Some(include) = super::table::requested(headers, q) {
        return json_response(StatusCode::OK, &table(&items, include, rv));
    }
    match rv {
        None => json_response(
            StatusCode::OK,
            &items.into_iter().next().unwrap_or_default(),
        ),
        Some(rv) => json_response(
            StatusCode::OK,
            &json!({
                "kind": "EndpointSliceList",
                "apiVersion": "discovery.k8s.io/v1",
                "metadata": {"resourceVersion": rv.to_string()},
                "items": items.into_iter().map(list_item).collect::<Vec<_>>()
            }),
        ),
    }
}

fn matching(st: &St, ns: Option<&str>, sel: &Selector) -> Vec<Value> {
    st.slices
        .slices
        .iter()
        .filter(|((sns, _), _)| ns.is_none_or(|n| n == sns))
        .map(|(_, s)| s.clone())
        .filter(|v| sel.matches(v))
        .collect()
}

fn watch(shared: Arc<Shared>, ns: Option<String>, sel: Selector, q: &[(String, String)]) -> Res {
    let timeout = match first(q, "timeoutSeconds") {
        Some(t) => std::time::Duration::from_secs(t.parse::<u64>().map_err(|_| {
            ApiError::bad_request(format!("invalid value for timeoutSeconds: {t:?}"))
        })?),
        None => std::time::Duration::from_secs(1800),
    };
    let mut initial = Vec::new();
    let mut rx = {
        let mut st = shared.lock();
        let rx = st.slices.sender().subscribe();
        let requested = first(q, "resourceVersion").unwrap_or("");
        if requested.is_empty() || requested == "0" || flag(q, "sendInitialEvents") {
            for v in matching(&st, ns.as_deref(), &sel) {
                initial.push(event_line("ADDED", &v));
            }
            if flag(q, "sendInitialEvents") {
                initial.push(event_line(
                    "BOOKMARK",
                    &json!({"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1", "metadata": {
                        "resourceVersion": st.rv.to_string(),
                        "annotations": {"k8s.io/initial-events-end": "true"}}}),
                ));
            }
        } else {
            let rv: u64 = requested.parse().map_err(|_| {
                ApiError::bad_request(format!("invalid resource version: {requested:?}"))
            })?;
            if st.slices.compacted > rv {
                let gone = ApiError::new(
                    410,
                    "Expired",
                    format!("too old resource version: {rv} ({})", st.slices.compacted),
                );
                initial.push(Bytes::from(format!(
                    "{{\"type\":\"ERROR\",\"object\":{}}}\n",
                    gone.to_status()
                )));
                return Ok(super::pvcs::stream(initial, None, timeout, ns, sel));
            }
            for ev in st.slices.history.iter().filter(|e| e.rv > rv) {
                if let Some((kind, obj)) = translate(ev, ns.as_deref(), &sel) {
                    initial.push(event_line(kind, obj));
                }
            }
        }
        rx
    };
    // Events sent between the subscription and now are in `initial` already.
    while rx.try_recv().is_ok() {}
    Ok(super::pvcs::stream(initial, Some(rx), timeout, ns, sel))
}

/// The API server's EndpointSlice printer (pkg/printers/internalversion).
fn table(items: &[Value], include: super::table::Include, rv: Option<u64>) -> Value {
    let col = |name: &str, format: &str, description: &str| json!({"name": name, "type": "string", "format": format, "description": description, "priority": 0});
    let rows: Vec<Value> = items
        .iter()
        .map(|s| {
            let ports: Vec<String> = s["ports"]
                .as_array()
                .map(|ps| {
                    ps.iter()
                        .filter_map(|p| p["port"].as_i64().map(|n| n.to_string()))
                        .collect()
                })
                .unwrap_or_default();
            let addrs: Vec<&str> = s["endpoints"]
                .as_array()
                .map(|es| {
                    es.iter()
                        .flat_map(|e| e["addresses"].as_array().into_iter().flatten())
                        .filter_map(Value::as_str)
                        .collect()
                })
                .unwrap_or_default();
            let endpoints = match addrs.len() {
                0 => "<unset>".to_owned(),
                n if n > 3 => format!("{} + {} more...", addrs[..3].join(","), n - 3),
                _ => addrs.join(","),
            };
            let ports = if ports.is_empty() {
                "<unset>".to_owned()
            } else {
                ports.join(",")
            };
            let object = match include {
                super::table::Include::None => Value::Null,
                super::table::Include::Metadata => json!({
                    "kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                    "metadata": s["metadata"].clone()}),
                super::table::Include::Object => s.clone(),
            };
            json!({
                "cells": [s["metadata"]["name"], s["addressType"], ports, endpoints, age(s)],
                "object": object
            })
        })
        .collect();
    let mut meta = json!({});
    if let Some(rv) = rv {
        meta["resourceVersion"] = json!(rv.to_string());
    }
    json!({
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": meta,
        "columnDefinitions": [
            col("Name", "name", "Name must be unique within a namespace."),
            col("AddressType", "", "addressType specifies the type of address carried by this EndpointSlice."),
            col("Ports", "", "ports specifies the list of network ports exposed by each endpoint in this slice."),
            col("Endpoints", "", "endpoints is a list of unique endpoints in this slice."),
            col("Age", "", "CreationTimestamp is a timestamp representing the server time when this object was created."),
        ],
        "rows": rows
    })
}

fn age(s: &Value) -> String {
    let secs = s["metadata"]["creationTimestamp"]
        .as_str()
        .and_then(|t| t.parse::<k8s_openapi::jiff::Timestamp>().ok())
        .map(|t| (k8s_openapi::jiff::Timestamp::now().as_second() - t.as_second()).max(0))
        .unwrap_or(0);
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s => format!("{}h", s / 3600),
    }
}

impl KubeDouble {
    /// Creates or replaces the EndpointSlice `slice` (its `metadata.name`) in `namespace`, as
    /// the EndpointSlice controller does when a Service's pods change.
    pub fn put_endpoint_slice(&self, namespace: &str, slice: Value) {
        let shared = &self.shared;
        let mut st = shared.lock();
        let name = slice["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let old = st.slices.slices.get(&key(namespace, &name)).cloned();
        let mut slice = slice;
        if let Some(old) = &old {
            slice["metadata"]["uid"] = old["metadata"]["uid"].clone();
            slice["metadata"]["creationTimestamp"] = old["metadata"]["creationTimestamp"].clone();
        }
        store(shared, &mut st, namespace, slice, old);
    }

    /// Deletes an EndpointSlice (the Service is gone).
    pub fn remove_endpoint_slice(&self, namespace: &str, name: &str) {
        let shared = &self.shared;
        let mut st = shared.lock();
        remove(shared, &mut st, namespace, name);
    }
}

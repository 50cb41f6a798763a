//! core/v1 pods: list and watch (resourceVersion resumption, selectors, bookmarks,
//! streaming lists).

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::broadcast::error::RecvError;

use super::pods::{Res, to_value};
use super::selector::Selector;
use super::server::{first, flag, parse_query};
use super::status::{ApiError, json_response};
use super::{Event, EventKind, Shared, State as St, table};
pub async fn list(
    State(shared): State<Arc<Shared>>,
    Path(ns): Path<String>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Res {
    list_or_watch(shared, Some(ns), raw, &headers)
}

pub async fn list_all(
    State(shared): State<Arc<Shared>>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Res {
    list_or_watch(shared, None, raw, &headers)
}

pub(super) fn list_or_watch(
    shared: Arc<Shared>,
    ns: Option<String>,
    raw: Option<String>,
    headers: &HeaderMap,
) -> Res {
    let q = parse_query(raw.as_deref());
    let sel = Selector::parse(first(&q, "labelSelector"), first(&q, "fieldSelector"))?;
    let table = table::requested(headers, &q);
    if flag(&q, "watch") {
        return watch(shared, ns, sel, &q, table);
    }
    let st = shared.lock();
    let items = matching(&st, ns.as_deref(), &sel);
    if let Some(include) = table {
        return Ok(json_response(
            StatusCode::OK,
            &table::table(&items, include, Some(st.rv), true),
        ));
    }
    let items: Vec<Value> = items.into_iter().map(list_item).collect();
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
pub(super) fn list_item(mut v: Value) -> Value {
    if let Some(o) = v.as_object_mut() {
        o.remove("kind");
        o.remove("apiVersion");
    }
    v
}

pub(super) fn matching(st: &St, ns: Option<&str>, sel: &Selector) -> Vec<Value> {
    st.pods
        .iter()
        .filter(|((pns, _), _)| ns.is_none_or(|n| n == pns))
        .map(|(_, p)| to_value(p))
        .filter(|v| sel.matches(v))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// watch

/// Renders watch events as objects, or as Tables for `kubectl get -w` (column definitions in
/// the first event only).
pub(super) struct Printer {
    table: Option<table::Include>,
    headers_sent: bool,
}

impl Printer {
    fn line(&mut self, kind: &str, object: &Value) -> Bytes {
        let Some(include) = self.table else {
            return event_line(kind, object);
        };
        let rv = object
            .pointer("/metadata/resourceVersion")
            .and_then(Value::as_str)
            .and_then(|r| r.parse().ok());
        let t = table::table(
            std::slice::from_ref(object),
            include,
            rv,
            !self.headers_sent,
        );
        self.headers_sent = true;
        event_line(kind, &t)
    }

    fn bookmark(&mut self, rv: u64, initial_end: bool) -> Bytes {
        match self.table {
            None => bookmark_line(rv, initial_end),
            Some(include) => {
                let mut t = table::table(&[], include, Some(rv), false);
                if initial_end {
                    t["metadata"]["annotations"] = json!({"k8s.io/initial-events-end": "true"});
                }
                event_line("BOOKMARK", &t)
            }
        }
    }
}

pub(super) fn event_line(kind: &str, object: &Value) -> Bytes {
    let mut s = json!({"type": kind, "object": object}).to_string();
    s.push('\n');
    Bytes::from(s)
}

pub(super) fn bookmark_line(rv: u64, initial_end: bool) -> Bytes {
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
pub(super) fn translate<'a>(
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

pub(super) fn watch(
    shared: Arc<Shared>,
    ns: Option<String>,
    sel: Selector,
    q: &[(String, String)],
    table: Option<table::Include>,
) -> Res {
    let mut printer = Printer {
        table,
        headers_sent: false,
    };
    let timeout = match first(q, "timeoutSeconds") {
        Some(t) => Duration::from_secs(t.parse::<u64>().map_err(|_| {
            ApiError::bad_request(format!("invalid value for timeoutSeconds: {t:?}"))
        })?),
        None => Duration::from_secs(1800),
    };
    let bookmarks = flag(q, "allowWatchBookmarks");
    let send_initial = flag(q, "sendInitialEvents");
    let mut initial: Vec<Bytes> = Vec::new();
    let (rx, start_rv, cut) = {
        let mut st = shared.lock();
        let rx = shared.events.subscribe();
        let requested = first(q, "resourceVersion").unwrap_or("");
        // Fault injection: a resumed watch answered with 410, as after a compaction.
        if st.faults.gone_on_resume > 0 && !requested.is_empty() && requested != "0" {
            st.faults.gone_on_resume -= 1;
            let gone = ApiError::new(
                410,
                "Expired",
                format!("too old resource version: {requested} ({})", st.rv),
            );
            let mut line = format!("{{\"type\":\"ERROR\",\"object\":{}}}", gone.to_status());
            line.push('\n');
            return Ok(stream_response(vec![Bytes::from(line)], None, false));
        }
        // Fault injection: the connection breaks (a load balancer's idle cut, an API server
        // rollout) after the initial events.
        let cut = st.faults.watch_cuts > 0;
        if cut {
            st.faults.watch_cuts -= 1;
        }
        if requested.is_empty() || requested == "0" || send_initial {
            for v in matching(&st, ns.as_deref(), &sel) {
                initial.push(printer.line("ADDED", &v));
            }
            if send_initial {
                initial.push(printer.bookmark(st.rv, true));
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
                return Ok(stream_response(vec![Bytes::from(line)], None, false));
            }
            for ev in st.history.iter().filter(|e| e.rv > rv) {
                if let Some((kind, obj)) = translate(ev, ns.as_deref(), &sel) {
                    initial.push(printer.line(kind, obj));
                }
            }
        }
        (rx, st.rv, cut)
    };
    let live = LiveWatch {
        shared,
        rx,
        ns,
        sel,
        timeout,
        bookmarks,
        last_rv: start_rv,
        printer,
    };
    Ok(stream_response(initial, Some(live), cut))
}

pub(super) struct LiveWatch {
    shared: Arc<Shared>,
    rx: tokio::sync::broadcast::Receiver<Arc<Event>>,
    ns: Option<String>,
    sel: Selector,
    timeout: Duration,
    bookmarks: bool,
    last_rv: u64,
    printer: Printer,
}

/// A chunked JSON stream: the initial lines, then live events until the timeout, the client
/// going away, or the watcher falling behind the broadcast (the client re-watches).
pub(super) fn stream_response(initial: Vec<Bytes>, live: Option<LiveWatch>, cut: bool) -> Response {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(16);
    tokio::spawn(async move {
        for line in initial {
            if tx.send(Ok(line)).await.is_err() {
                return;
            }
        }
        if cut {
            // An error item aborts the chunked body: the client sees a broken connection.
            let _ = tx
                .send(Err(std::io::Error::other(
                    "connection cut by fault injection",
                )))
                .await;
            return;
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
                    w.printer.bookmark(rv, false)
                }
                ev = w.rx.recv() => match ev {
                    Ok(ev) => {
                        let delay = w.shared.lock().faults.watch_delay;
                        if let Some(d) = delay {
                            tokio::time::sleep(d).await;
                        }
                        w.last_rv = ev.rv;
                        match translate(&ev, w.ns.as_deref(), &w.sel) {
                            Some((kind, obj)) => w.printer.line(kind, obj),
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

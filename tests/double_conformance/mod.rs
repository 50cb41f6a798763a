//! Conformance of the Kubernetes API-server test double (tests/kube_double) with the
//! documented API behaviour, driven with kube-rs and with a raw WebSocket client. Split along
//! the double's seams: REST (`rest`), watch (`watch`), the simulated kubelet (`lifecycle`),
//! exec over WebSocket (`exec`, `exec_errors`, with the raw client in `ws`), and the
//! PersistentVolumeClaims of cache volumes (`pvcs`).

use crate::kube_double;

mod exec;
mod exec_errors;
mod faults;
mod lifecycle;
mod pvcs;
mod rest;
mod watch;
mod ws;

use std::time::Duration;

use futures_util::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, AttachParams, DeleteParams, ListParams, PostParams, WatchEvent, WatchParams};
use kube::runtime::wait::{await_condition, conditions};
use kube_double::{DoubleOptions, KubeDouble};
use serde_json::{Value, json};
use tokio::io::AsyncReadExt;

async fn client(d: &KubeDouble) -> kube::Client {
    let kc = kube::config::Kubeconfig::read_from(d.kubeconfig()).expect("kubeconfig");
    let cfg = kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
        .await
        .expect("config");
    assert_eq!(cfg.default_namespace, "default");
    kube::Client::try_from(cfg).expect("client")
}

fn pod(name: &str, image: &str) -> Pod {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "t"}},
        "spec": {"containers": [{"name": "main", "image": image,
                 "env": [{"name": "GREETING", "value": "hi"}]}]}
    }))
    .expect("pod json")
}

async fn running(api: &Api<Pod>, name: &str) -> Pod {
    tokio::time::timeout(
        Duration::from_secs(10),
        await_condition(api.clone(), name, conditions::is_pod_running()),
    )
    .await
    .expect("pod running in time")
    .expect("watch")
    .expect("pod exists")
}

/// A plain HTTP request to the double (with or without the token): (status, JSON body).
async fn http(
    d: &KubeDouble,
    method: &str,
    path: &str,
    body: Option<(&str, Value)>,
    token: bool,
) -> (u16, Value) {
    let c = kube_double::tls::reqwest_client();
    let mut rb = c.request(
        method.parse().expect("method"),
        format!("{}{}", d.url(), path),
    );
    if token {
        rb = rb.bearer_auth(&d.options().token);
    }
    if let Some((ct, b)) = body {
        rb = rb.header("content-type", ct).body(b.to_string());
    }
    let r = rb.send().await.expect("request");
    let code = r.status().as_u16();
    let text = r.text().await.expect("body");
    (
        code,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

fn api_error(e: kube::Error) -> kube::core::Status {
    match e {
        kube::Error::Api(s) => *s,
        other => panic!("expected an API error, got {other:?}"),
    }
}

fn status_of(p: &Pod) -> (String, Option<String>, Option<String>) {
    let s = p.status.clone().unwrap_or_default();
    let w = s
        .container_statuses
        .as_ref()
        .and_then(|c| c.first())
        .and_then(|c| c.state.as_ref())
        .and_then(|st| st.waiting.clone());
    (
        s.phase.unwrap_or_default(),
        w.as_ref().and_then(|w| w.reason.clone()),
        w.and_then(|w| w.message),
    )
}

async fn wait_for(api: &Api<Pod>, name: &str, cond: impl Fn(&Pod) -> bool) -> Pod {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(p) = api.get(name).await
            && cond(&p)
        {
            return p;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "condition on {name} not reached"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

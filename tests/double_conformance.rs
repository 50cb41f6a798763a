//! The API-server test double (tests/kube_double) checked against the Kubernetes API's
//! documented behaviour with clients that are not mcp-run: kube-rs used directly, and a raw
//! WebSocket client speaking the exec subprotocols byte by byte.

mod kube_double;

use std::time::Duration;

use futures_util::{SinkExt as _, StreamExt as _};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{
    Api, AttachParams, DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchEvent,
    WatchParams,
};
use kube::runtime::wait::{await_condition, conditions};
use kube_double::{DoubleOptions, KubeDouble};
use serde_json::json;
use tokio::io::AsyncReadExt as _;
use tokio_tungstenite::tungstenite::{Message, client::IntoClientRequest as _};

async fn client(double: &KubeDouble) -> kube::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let kc = kube::config::Kubeconfig::read_from(double.kubeconfig()).unwrap();
    let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .unwrap();
    kube::Client::try_from(cfg).unwrap()
}

fn pod(name: &str, image: &str, labels: serde_json::Value) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "main", "image": image, "command": ["sleep", "60"],
                                  "env": [{"name": "GREETING", "value": "hi there"}]}]}
    }))
    .unwrap()
}

fn api_code(e: kube::Error) -> (u16, String) {
    match e {
        kube::Error::Api(s) => (s.code, s.reason),
        other => panic!("not an API error: {other}"),
    }
}

async fn running(pods: &Api<Pod>, name: &str) {
    tokio::time::timeout(
        Duration::from_secs(10),
        await_condition(pods.clone(), name, conditions::is_pod_running()),
    )
    .await
    .expect("running in time")
    .unwrap();
}

#[tokio::test]
async fn pods_crud_errors_and_preconditions() {
    let double = KubeDouble::start();
    let pods: Api<Pod> = Api::namespaced(client(&double).await, "default");
    let created = pods
        .create(
            &PostParams::default(),
            &pod("a", "busybox", json!({"app": "x", "tier": "1"})),
        )
        .await
        .unwrap();
    assert!(created.metadata.uid.is_some() && created.metadata.resource_version.is_some());
    assert_eq!(created.status.unwrap().phase.as_deref(), Some("Pending"));
    assert_eq!(
        api_code(
            pods.create(&PostParams::default(), &pod("a", "busybox", json!({})))
                .await
                .unwrap_err()
        ),
        (409, "AlreadyExists".into())
    );
    let bad: Pod =
        serde_json::from_value(json!({"metadata": {"name": "bad"}, "spec": {"containers": []}}))
            .unwrap();
    assert_eq!(
        api_code(pods.create(&PostParams::default(), &bad).await.unwrap_err()),
        (422, "Invalid".into())
    );
    assert_eq!(
        api_code(pods.get("nope").await.unwrap_err()),
        (404, "NotFound".into())
    );
    let other_ns: Api<Pod> = Api::namespaced(client(&double).await, "elsewhere");
    assert_eq!(
        api_code(other_ns.list(&ListParams::default()).await.unwrap_err()).0,
        404
    );
    pods.create(
        &PostParams::default(),
        // Never starts: the phase selector below then sees exactly one Running pod.
        &pod("b", "r.example/never-starts:1", json!({"app": "y"})),
    )
    .await
    .unwrap();
    running(&pods, "a").await;
    let names = |l: kube::core::ObjectList<Pod>| {
        l.items
            .into_iter()
            .filter_map(|p| p.metadata.name)
            .collect::<Vec<_>>()
    };
    for (sel, want) in [
        ("app=x", vec!["a"]),
        ("app!=x", vec!["b"]),
        ("app in (x,y)", vec!["a", "b"]),
        ("app notin (x)", vec!["b"]),
        ("tier", vec!["a"]),
        ("!tier", vec!["b"]),
        ("app==x,tier=1", vec!["a"]),
    ] {
        assert_eq!(
            names(pods.list(&ListParams::default().labels(sel)).await.unwrap()),
            want,
            "{sel}"
        );
    }
    assert_eq!(
        names(
            pods.list(&ListParams::default().fields("metadata.name=b"))
                .await
                .unwrap()
        ),
        ["b"]
    );
    assert_eq!(
        names(
            pods.list(&ListParams::default().fields("status.phase=Running"))
                .await
                .unwrap()
        ),
        ["a"]
    );

    // Optimistic concurrency: a patch carrying a stale resourceVersion is refused.
    let a = pods.get("a").await.unwrap();
    let rv = a.metadata.resource_version.clone().unwrap();
    let patch =
        |rv: &str, v: &str| json!({"metadata": {"resourceVersion": rv, "labels": {"claimed": v}}});
    let patched = pods
        .patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(&patch(&rv, "1")),
        )
        .await
        .unwrap();
    assert_eq!(patched.metadata.labels.unwrap()["claimed"], "1");
    assert_eq!(
        api_code(
            pods.patch(
                "a",
                &PatchParams::default(),
                &Patch::Merge(&patch(&rv, "2"))
            )
            .await
            .unwrap_err()
        ),
        (409, "Conflict".into())
    );

    // Delete: preconditions, then 200 with the object, then 404.
    let wrong = DeleteParams::default().preconditions(kube::api::Preconditions {
        uid: Some("other".into()),
        resource_version: None,
    });
    assert_eq!(api_code(pods.delete("a", &wrong).await.unwrap_err()).0, 409);
    pods.delete("a", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    assert_eq!(api_code(pods.get("a").await.unwrap_err()).0, 404);
    assert_eq!(
        api_code(
            pods.delete("a", &DeleteParams::default())
                .await
                .unwrap_err()
        )
        .0,
        404
    );
    assert_eq!(
        double.deletions(),
        [("default".to_string(), "a".to_string())]
    );
}

#[tokio::test]
async fn watch_resumes_and_follows_selectors() {
    let double = KubeDouble::start();
    let pods: Api<Pod> = Api::namespaced(client(&double).await, "default");
    let created = pods
        .create(
            &PostParams::default(),
            &pod("w", "busybox", json!({"state": "idle"})),
        )
        .await
        .unwrap();
    let rv = created.metadata.resource_version.unwrap();
    running(&pods, "w").await;
    // From the create's resourceVersion: the lifecycle's MODIFIED events, in order.
    let mut events = pods
        .watch(&WatchParams::default().labels("state=idle").timeout(5), &rv)
        .await
        .unwrap()
        .boxed();
    let mut phases = Vec::new();
    while let Some(ev) = events.next().await {
        match ev.unwrap() {
            WatchEvent::Modified(p) => {
                phases.push(p.status.unwrap().phase.unwrap());
                if phases.last().map(String::as_str) == Some("Running") {
                    break;
                }
            }
            WatchEvent::Bookmark(_) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(phases.last().map(String::as_str), Some("Running"));
    // An object that stops matching the selector is DELETED for that watch.
    let now = pods
        .get("w")
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    let mut events = pods
        .watch(
            &WatchParams::default().labels("state=idle").timeout(5),
            &now,
        )
        .await
        .unwrap()
        .boxed();
    pods.patch(
        "w",
        &PatchParams::default(),
        &Patch::Merge(&json!({"metadata": {"labels": {"state": "claimed"}}})),
    )
    .await
    .unwrap();
    loop {
        match events.next().await.unwrap().unwrap() {
            WatchEvent::Bookmark(_) => continue,
            WatchEvent::Deleted(p) => {
                assert_eq!(p.metadata.labels.unwrap()["state"], "claimed");
                break;
            }
            other => panic!("expected DELETED, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn failure_injection_states() {
    let double = KubeDouble::start();
    let pods: Api<Pod> = Api::namespaced(client(&double).await, "default");
    pods.create(
        &PostParams::default(),
        &pod("p", "r.example/pull-error:1", json!({})),
    )
    .await
    .unwrap();
    let reason = |p: &Pod| {
        p.status.as_ref()?.container_statuses.as_ref()?[0]
            .state
            .as_ref()?
            .waiting
            .as_ref()?
            .reason
            .clone()
    };
    tokio::time::timeout(
        Duration::from_secs(5),
        await_condition(pods.clone(), "p", |p: Option<&Pod>| {
            p.and_then(reason).as_deref() == Some("ImagePullBackOff")
        }),
    )
    .await
    .unwrap()
    .unwrap();
    let mut s: Pod = pod("s", "busybox", json!({}));
    s.spec.as_mut().unwrap().node_selector =
        Some([("kubernetes.io/arch".to_string(), "s390x".to_string())].into());
    pods.create(&PostParams::default(), &s).await.unwrap();
    tokio::time::timeout(
        Duration::from_secs(5),
        await_condition(pods.clone(), "s", |p: Option<&Pod>| {
            p.and_then(|p| p.status.as_ref()?.conditions.as_ref()?.first().cloned())
                .is_some_and(|c| {
                    c.type_ == "PodScheduled"
                        && c.status == "False"
                        && c.reason.as_deref() == Some("Unschedulable")
                })
        }),
    )
    .await
    .unwrap()
    .unwrap();
    // Exec into a pod whose container is not running: 400.
    let e = pods
        .exec("s", ["true"], &AttachParams::default())
        .await
        .err()
        .expect("refused");
    assert!(
        e.to_string().contains("400") || e.to_string().contains("host assigned"),
        "{e}"
    );
}

/// Exec through kube-rs: output, environment, and the status channel for every ending.
#[tokio::test]
async fn exec_with_kube_rs() {
    let double = KubeDouble::start();
    let pods: Api<Pod> = Api::namespaced(client(&double).await, "default");
    pods.create(&PostParams::default(), &pod("e", "busybox", json!({})))
        .await
        .unwrap();
    running(&pods, "e").await;
    let run = |argv: Vec<&'static str>| {
        let pods = pods.clone();
        async move {
            let mut p = pods
                .exec("e", argv, &AttachParams::default().stderr(true))
                .await
                .unwrap();
            let (mut out, mut err) = (p.stdout().unwrap(), p.stderr().unwrap());
            let status = p.take_status().unwrap();
            let (mut o, mut e) = (Vec::new(), Vec::new());
            let (r1, r2) = tokio::join!(out.read_to_end(&mut o), err.read_to_end(&mut e));
            r1.unwrap();
            r2.unwrap();
            (
                String::from_utf8(o).unwrap(),
                String::from_utf8(e).unwrap(),
                status.await.unwrap(),
            )
        }
    };
    let (o, e, s) = run(vec!["sh", "-c", "printf '%s' \"$GREETING\"; echo err >&2"]).await;
    assert_eq!(
        (o.as_str(), e.as_str(), s.status.as_deref()),
        ("hi there", "err\n", Some("Success"))
    );
    let (_, _, s) = run(vec!["sh", "-c", "exit 3"]).await;
    assert_eq!(s.reason.as_deref(), Some("NonZeroExitCode"));
    let cause = &s.details.unwrap().causes.unwrap()[0];
    assert_eq!(
        (cause.reason.as_deref(), cause.message.as_deref()),
        (Some("ExitCode"), Some("3"))
    );
    let (_, _, s) = run(vec!["sh", "-c", "kill -TERM $$"]).await;
    assert_eq!(
        s.details.unwrap().causes.unwrap()[0].message.as_deref(),
        Some("143"),
        "128+SIGTERM"
    );
    let (_, _, s) = run(vec!["no-such-program"]).await;
    assert_eq!(
        (s.status.as_deref(), s.reason.as_deref(), s.code),
        (Some("Failure"), Some("InternalError"), Some(500))
    );
    assert!(
        s.message
            .unwrap()
            .contains("exec: \"no-such-program\": executable file not found in $PATH")
    );
}

fn ws_request(
    double: &KubeDouble,
    query: &str,
    protocols: &str,
) -> tokio_tungstenite::tungstenite::handshake::client::Request {
    let url = format!(
        "{}/api/v1/namespaces/default/pods/e/exec?{query}",
        double.url().replace("http://", "ws://")
    );
    let mut req = url.into_client_request().unwrap();
    let h = req.headers_mut();
    h.insert("Authorization", "Bearer double-token".parse().unwrap());
    if !protocols.is_empty() {
        h.insert("Sec-WebSocket-Protocol", protocols.parse().unwrap());
    }
    req
}

/// The exec WebSocket protocol byte by byte: negotiation, channel frames, the status frame,
/// and v5's stdin close.
#[tokio::test]
async fn exec_websocket_protocol() {
    let double = KubeDouble::start_with(DoubleOptions::default());
    let pods: Api<Pod> = Api::namespaced(client(&double).await, "default");
    pods.create(&PostParams::default(), &pod("e", "busybox", json!({})))
        .await
        .unwrap();
    running(&pods, "e").await;

    // The client's first supported protocol wins.
    let q = "command=sh&command=-c&command=echo%20out%3B%20exit%204&stdout=true&stderr=true";
    let (mut ws, resp) = tokio_tungstenite::connect_async(ws_request(
        &double,
        q,
        "v4.channel.k8s.io, v5.channel.k8s.io",
    ))
    .await
    .unwrap();
    assert_eq!(
        resp.headers()["sec-websocket-protocol"],
        "v4.channel.k8s.io"
    );
    let mut frames = Vec::new();
    while let Some(Ok(m)) = ws.next().await {
        if let Message::Binary(b) = m {
            frames.push(b.to_vec());
        }
    }
    assert!(
        frames.iter().take(3).all(|f| f.len() == 1),
        "channels open with one-byte frames"
    );
    assert!(frames.contains(&b"\x01out\n".to_vec()));
    let status = frames
        .iter()
        .find(|f| f[0] == 3 && f.len() > 1)
        .expect("status frame");
    let v: serde_json::Value = serde_json::from_slice(&status[1..]).unwrap();
    assert_eq!(v["status"], "Failure");
    assert_eq!(v["reason"], "NonZeroExitCode");
    assert_eq!(
        v["details"]["causes"][0],
        json!({"reason": "ExitCode", "message": "4"})
    );

    // No supported protocol: 400 before any upgrade.
    let e = tokio_tungstenite::connect_async(ws_request(&double, q, "base64.channel.k8s.io"))
        .await
        .unwrap_err();
    match e {
        tokio_tungstenite::tungstenite::Error::Http(r) => assert_eq!(r.status(), 400),
        other => panic!("{other}"),
    }

    // v5: stdin data, then [255, 0] closes stdin; cat ends with exit 0.
    let q = "command=cat&stdin=true&stdout=true&stderr=true";
    let (mut ws, resp) =
        tokio_tungstenite::connect_async(ws_request(&double, q, "v5.channel.k8s.io"))
            .await
            .unwrap();
    assert_eq!(
        resp.headers()["sec-websocket-protocol"],
        "v5.channel.k8s.io"
    );
    ws.send(Message::Binary(b"\x00ping".to_vec().into()))
        .await
        .unwrap();
    ws.send(Message::Binary(vec![255u8, 0].into()))
        .await
        .unwrap();
    let mut out = Vec::new();
    let mut status = None;
    while let Some(Ok(m)) = ws.next().await {
        if let Message::Binary(b) = m {
            match b.first() {
                Some(1) => out.extend_from_slice(&b[1..]),
                Some(3) if b.len() > 1 => {
                    status = Some(serde_json::from_slice::<serde_json::Value>(&b[1..]).unwrap())
                }
                _ => {}
            }
        }
    }
    assert_eq!(out, b"ping");
    assert_eq!(status.unwrap()["status"], "Success");
}

#[tokio::test]
async fn requests_without_the_token_are_401() {
    let double = KubeDouble::start();
    let r = reqwest::Client::builder()
        .build()
        .unwrap()
        .get(format!("{}/api/v1/namespaces/default/pods", double.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(
        (v["kind"].as_str(), v["reason"].as_str(), v["code"].as_u64()),
        (Some("Status"), Some("Unauthorized"), Some(401))
    );
}

//! Conformance of the Kubernetes API-server test double (tests/kube_double) with the
//! documented API behaviour, driven with kube-rs and with a raw WebSocket client.

mod kube_double;

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

#[tokio::test]
async fn create_run_exec_delete_with_kube_rs() {
    let d = KubeDouble::start();
    let c = client(&d).await;
    let api: Api<Pod> = Api::default_namespaced(c);
    let created = api
        .create(&PostParams::default(), &pod("p1", "busybox:1.36"))
        .await
        .expect("create");
    assert_eq!(created.status.unwrap().phase.as_deref(), Some("Pending"));
    assert!(created.metadata.uid.is_some());
    let p = running(&api, "p1").await;
    assert_eq!(p.spec.unwrap().node_name.as_deref(), Some("double-node-1"));

    let mut at = api
        .exec(
            "p1",
            [
                "sh",
                "-c",
                "printf out; printf err >&2; echo $GREETING; exit 3",
            ],
            &AttachParams::default().stderr(true),
        )
        .await
        .expect("exec");
    let mut out = at.stdout().expect("stdout");
    let mut err = at.stderr().expect("stderr");
    let status = at.take_status().expect("status");
    let (mut o, mut e) = (String::new(), String::new());
    let (r1, r2) = tokio::join!(out.read_to_string(&mut o), err.read_to_string(&mut e));
    r1.expect("read stdout");
    r2.expect("read stderr");
    let st = status.await.expect("status arrives");
    assert_eq!(o, "outhi\n");
    assert_eq!(e, "err");
    assert_eq!(st.status.as_deref(), Some("Failure"));
    assert_eq!(st.reason.as_deref(), Some("NonZeroExitCode"));
    let causes = st.details.unwrap().causes.unwrap();
    assert_eq!(causes[0].reason.as_deref(), Some("ExitCode"));
    assert_eq!(causes[0].message.as_deref(), Some("3"));
    at.join().await.expect("join");

    let gone = api
        .delete("p1", &DeleteParams::default().grace_period(0))
        .await
        .expect("delete")
        .left()
        .expect("the deleted object");
    assert_eq!(gone.metadata.deletion_grace_period_seconds, Some(0));
    assert!(gone.metadata.deletion_timestamp.is_some());
    assert!(d.pod_names("default").is_empty());
    assert_eq!(
        d.deletions(),
        vec![("default".to_string(), "p1".to_string())]
    );
    let err = api.get("p1").await.expect_err("gone");
    match err {
        kube::Error::Api(s) => {
            assert_eq!(s.code, 404);
            assert_eq!(s.reason, "NotFound");
            assert_eq!(s.message, "pods \"p1\" not found");
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[tokio::test]
async fn watch_sees_the_lifecycle() {
    let d = KubeDouble::start();
    let api: Api<Pod> = Api::default_namespaced(client(&d).await);
    let list = api.list(&ListParams::default()).await.expect("list");
    let rv = list.metadata.resource_version.clone().expect("list rv");
    let mut w = api
        .watch(&WatchParams::default().timeout(5), &rv)
        .await
        .expect("watch")
        .boxed();
    api.create(&PostParams::default(), &pod("w1", "busybox"))
        .await
        .expect("create");
    let mut phases = Vec::new();
    while let Some(ev) = w.try_next().await.expect("event") {
        match ev {
            WatchEvent::Added(p) => {
                phases.push(format!("ADDED {}", p.status.unwrap().phase.unwrap()))
            }
            WatchEvent::Modified(p) => {
                let ph = p.status.unwrap().phase.unwrap();
                phases.push(format!("MODIFIED {ph}"));
                if ph == "Running" {
                    break;
                }
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(phases.first().map(String::as_str), Some("ADDED Pending"));
    assert_eq!(phases.last().map(String::as_str), Some("MODIFIED Running"));
    assert!(phases.len() >= 4, "{phases:?}");
}

/// A plain HTTP request to the double (with or without the token): (status, JSON body).
async fn http(
    d: &KubeDouble,
    method: &str,
    path: &str,
    body: Option<(&str, Value)>,
    token: bool,
) -> (u16, Value) {
    let c = reqwest::Client::new();
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

#[tokio::test]
async fn requests_without_the_right_token_are_unauthorized() {
    let d = KubeDouble::start();
    let (code, body) = http(&d, "GET", "/api/v1/namespaces/default/pods", None, false).await;
    assert_eq!(code, 401);
    assert_eq!(
        body,
        json!({"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure",
               "message":"Unauthorized","reason":"Unauthorized","code":401})
    );
    let (code, body) = http(&d, "GET", "/api/v1/namespaces/default/pods", None, true).await;
    assert_eq!(code, 200);
    assert_eq!(body["kind"], "PodList");
    assert!(body["metadata"]["resourceVersion"].is_string());
}

#[tokio::test]
async fn version_and_unknown_paths() {
    let d = KubeDouble::start();
    let c = client(&d).await;
    let v = c.apiserver_version().await.expect("version");
    assert_eq!((v.major.as_str(), v.minor.as_str()), ("1", "33"));
    let (code, body) = http(&d, "GET", "/api/v1/namespaces/default/secrets", None, true).await;
    assert_eq!(code, 404);
    assert_eq!(body["reason"], "NotFound");
    assert_eq!(
        body["message"],
        "the server could not find the requested resource"
    );
    let (code, body) = http(
        &d,
        "POST",
        "/api/v1/namespaces/default/pods/x",
        Some(("application/json", json!({}))),
        true,
    )
    .await;
    assert_eq!(code, 405);
    assert_eq!(body["reason"], "MethodNotAllowed");
}

#[tokio::test]
async fn create_errors_are_status_objects() {
    let d = KubeDouble::start();
    let api: Api<Pod> = Api::default_namespaced(client(&d).await);
    api.create(&PostParams::default(), &pod("dup", "busybox"))
        .await
        .expect("create");
    let e = api_error(
        api.create(&PostParams::default(), &pod("dup", "busybox"))
            .await
            .expect_err("duplicate"),
    );
    assert_eq!((e.code, e.reason.as_str()), (409, "AlreadyExists"));
    assert_eq!(e.message, "pods \"dup\" already exists");

    let mut bad = pod("bad", "busybox");
    bad.spec.as_mut().unwrap().containers[0].image = None;
    let e = api_error(
        api.create(&PostParams::default(), &bad)
            .await
            .expect_err("invalid"),
    );
    assert_eq!((e.code, e.reason.as_str()), (422, "Invalid"));
    assert_eq!(
        e.message,
        "Pod \"bad\" is invalid: spec.containers[0].image: Required value"
    );
    let mut empty = pod("empty", "busybox");
    empty.spec.as_mut().unwrap().containers.clear();
    let e = api_error(
        api.create(&PostParams::default(), &empty)
            .await
            .expect_err("no containers"),
    );
    assert_eq!(e.code, 422);

    let other: Api<Pod> = Api::namespaced(client(&d).await, "nowhere");
    let e = api_error(
        other
            .create(&PostParams::default(), &pod("x", "busybox"))
            .await
            .expect_err("no ns"),
    );
    assert_eq!(
        (e.code, e.message.as_str()),
        (404, "namespaces \"nowhere\" not found")
    );

    // dryRun validates and answers, but stores nothing.
    let dry = api
        .create(
            &PostParams {
                dry_run: true,
                ..PostParams::default()
            },
            &pod("dry", "busybox"),
        )
        .await
        .expect("dry run");
    assert_eq!(dry.metadata.name.as_deref(), Some("dry"));
    assert!(d.pod("default", "dry").is_none());

    // generateName: five characters from the API server's alphabet.
    let mut g = pod("", "busybox");
    g.metadata.name = None;
    g.metadata.generate_name = Some("run-".into());
    let made = api
        .create(&PostParams::default(), &g)
        .await
        .expect("generateName");
    let name = made.metadata.name.unwrap();
    assert_eq!(name.len(), 9, "{name}");
    assert!(name.starts_with("run-"));
    assert!(d.pod("default", &name).is_some());
}

#[tokio::test]
async fn list_with_label_and_field_selectors() {
    let d = KubeDouble::start();
    let api: Api<Pod> = Api::default_namespaced(client(&d).await);
    for (n, tier) in [("a", "web"), ("b", "db"), ("c", "web")] {
        let mut p = pod(n, "busybox");
        p.metadata
            .labels
            .as_mut()
            .unwrap()
            .insert("tier".into(), tier.into());
        if n == "c" {
            p.metadata.labels.as_mut().unwrap().remove("app");
        }
        api.create(&PostParams::default(), &p)
            .await
            .expect("create");
    }
    let names = |l: kube::core::ObjectList<Pod>| -> Vec<String> {
        l.items
            .into_iter()
            .map(|p| p.metadata.name.unwrap())
            .collect()
    };
    let q = |s: &str| ListParams::default().labels(s);
    assert_eq!(names(api.list(&q("tier=web")).await.unwrap()), ["a", "c"]);
    assert_eq!(names(api.list(&q("tier!=web")).await.unwrap()), ["b"]);
    assert_eq!(names(api.list(&q("tier in (db, x)")).await.unwrap()), ["b"]);
    assert_eq!(
        names(api.list(&q("tier notin (db)")).await.unwrap()),
        ["a", "c"]
    );
    assert_eq!(names(api.list(&q("!app")).await.unwrap()), ["c"]);
    assert_eq!(names(api.list(&q("app,tier==web")).await.unwrap()), ["a"]);
    let f = |s: &str| ListParams::default().fields(s);
    assert_eq!(names(api.list(&f("metadata.name=b")).await.unwrap()), ["b"]);
    assert_eq!(
        names(
            api.list(&f("metadata.namespace=default,metadata.name!=b"))
                .await
                .unwrap()
        ),
        ["a", "c"]
    );
    for n in ["a", "b", "c"] {
        running(&api, n).await;
    }
    assert_eq!(
        names(
            api.list(&f("status.phase=Running,spec.nodeName=double-node-1"))
                .await
                .unwrap()
        )
        .len(),
        3
    );
    assert!(names(api.list(&f("status.phase=Pending")).await.unwrap()).is_empty());
    let e = api_error(
        api.list(&f("spec.image=x"))
            .await
            .expect_err("unsupported field"),
    );
    assert_eq!(e.code, 400);
    let all: Api<Pod> = Api::all(client(&d).await);
    assert_eq!(names(all.list(&q("tier=db")).await.unwrap()), ["b"]);
}

#[tokio::test]
async fn patch_and_replace_with_resource_version_preconditions() {
    let d = KubeDouble::start();
    let api: Api<Pod> = Api::default_namespaced(client(&d).await);
    let p = api
        .create(&PostParams::default(), &pod("lock", "busybox"))
        .await
        .expect("create");
    let rv0 = p.metadata.resource_version.clone().unwrap();
    let current = running(&api, "lock").await;
    let rv = current.metadata.resource_version.clone().unwrap();
    assert_ne!(rv, rv0);

    // A stale resourceVersion in a merge patch is an optimistic-lock conflict.
    let stale = json!({"metadata": {"resourceVersion": rv0, "labels": {"claimed": "yes"}}});
    let e = api_error(
        api.patch(
            "lock",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&stale),
        )
        .await
        .expect_err("stale"),
    );
    assert_eq!((e.code, e.reason.as_str()), (409, "Conflict"));
    assert_eq!(
        e.message,
        "Operation cannot be fulfilled on pods \"lock\": the object has been modified; please apply your changes to the latest version and try again"
    );
    let fresh =
        json!({"metadata": {"resourceVersion": rv, "labels": {"claimed": "yes", "app": null}}});
    let claimed = api
        .patch(
            "lock",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&fresh),
        )
        .await
        .expect("fresh patch");
    let labels = claimed.metadata.labels.clone().unwrap();
    assert_eq!(labels.get("claimed").map(String::as_str), Some("yes"));
    assert!(!labels.contains_key("app"));
    assert_ne!(
        claimed.metadata.resource_version.as_deref(),
        Some(rv.as_str())
    );
    // The same claim again (now stale) loses.
    let e = api_error(
        api.patch(
            "lock",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&fresh),
        )
        .await
        .expect_err("second claim"),
    );
    assert_eq!(e.code, 409);
    // Strategic merge patches are applied to metadata like merge patches.
    let s = json!({"metadata": {"annotations": {"a": "b"}}});
    let p2 = api
        .patch(
            "lock",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Strategic(&s),
        )
        .await
        .expect("strategic");
    assert_eq!(
        p2.metadata
            .annotations
            .unwrap()
            .get("a")
            .map(String::as_str),
        Some("b")
    );
    // PUT with a stale resourceVersion conflicts, with the current one succeeds.
    let mut old = claimed.clone();
    old.metadata
        .labels
        .as_mut()
        .unwrap()
        .insert("x".into(), "y".into());
    let e = api_error(
        api.replace("lock", &PostParams::default(), &old)
            .await
            .expect_err("stale put"),
    );
    assert_eq!(e.code, 409);
    let mut cur = api.get("lock").await.expect("get");
    cur.metadata
        .labels
        .as_mut()
        .unwrap()
        .insert("x".into(), "y".into());
    let put = api
        .replace("lock", &PostParams::default(), &cur)
        .await
        .expect("put");
    assert_eq!(
        put.metadata.labels.unwrap().get("x").map(String::as_str),
        Some("y")
    );
    assert_eq!(put.status.unwrap().phase.as_deref(), Some("Running"));
    // Changing the pod spec beyond what a pod update allows is Invalid.
    let change = json!({"spec": {"restartPolicy": "Never"}});
    let e = api_error(
        api.patch(
            "lock",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&change),
        )
        .await
        .expect_err("spec change"),
    );
    assert_eq!(e.code, 422);
}

#[tokio::test]
async fn delete_preconditions_grace_and_not_found() {
    let d = KubeDouble::start();
    let api: Api<Pod> = Api::default_namespaced(client(&d).await);
    api.create(&PostParams::default(), &pod("del", "busybox"))
        .await
        .expect("create");
    running(&api, "del").await;
    let wrong = DeleteParams::default().preconditions(kube::api::Preconditions {
        uid: Some("00000000-0000-4000-8000-000000000000".into()),
        resource_version: None,
    });
    let e = api_error(
        api.delete("del", &wrong)
            .await
            .expect_err("uid precondition"),
    );
    assert_eq!((e.code, e.reason.as_str()), (409, "Conflict"));
    assert!(
        e.message
            .contains("Precondition failed: UID in precondition"),
        "{}",
        e.message
    );
    assert!(d.deletions().is_empty());

    // A graceful delete marks the pod, then it goes when the grace period ends.
    let marked = api
        .delete("del", &DeleteParams::default().grace_period(1))
        .await
        .expect("delete");
    let marked = marked.left().expect("object returned");
    assert!(marked.metadata.deletion_timestamp.is_some());
    assert_eq!(marked.metadata.deletion_grace_period_seconds, Some(1));
    assert!(d.pod("default", "del").is_some());
    let gone = tokio::time::timeout(
        Duration::from_secs(5),
        await_condition(
            api.clone(),
            "del",
            conditions::is_deleted(marked.metadata.uid.as_deref().unwrap()),
        ),
    )
    .await;
    assert!(matches!(gone, Ok(Ok(_))), "{gone:?}");
    assert!(d.pod("default", "del").is_none());

    let e = api_error(
        api.delete("del", &DeleteParams::default())
            .await
            .expect_err("absent"),
    );
    assert_eq!(
        (e.code, e.message.as_str()),
        (404, "pods \"del\" not found")
    );

    // Collection delete by label.
    for n in ["c1", "c2"] {
        api.create(&PostParams::default(), &pod(n, "busybox"))
            .await
            .expect("create");
    }
    let mut other = pod("keep", "busybox");
    other.metadata.labels = None;
    api.create(&PostParams::default(), &other)
        .await
        .expect("create");
    api.delete_collection(
        &DeleteParams::default().grace_period(0),
        &ListParams::default().labels("app=t"),
    )
    .await
    .expect("delete collection");
    assert_eq!(d.pod_names("default"), ["keep"]);
}

#[tokio::test]
async fn runtime_watcher_and_watch_bookmarks() {
    let d = KubeDouble::start_with(DoubleOptions {
        bookmark_interval: Duration::from_millis(100),
        ..DoubleOptions::default()
    });
    let api: Api<Pod> = Api::default_namespaced(client(&d).await);
    api.create(&PostParams::default(), &pod("pre", "busybox"))
        .await
        .expect("create");
    let mut s = kube::runtime::watcher(
        api.clone(),
        kube::runtime::watcher::Config::default().labels("app=t"),
    )
    .boxed();
    let mut seen_pre = false;
    let mut seen_new_deleted = false;
    let api2 = api.clone();
    let driver = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        api2.create(&PostParams::default(), &pod("new", "busybox"))
            .await
            .expect("create");
        tokio::time::sleep(Duration::from_millis(200)).await;
        api2.delete("new", &DeleteParams::default().grace_period(0))
            .await
            .expect("delete");
    });
    let r = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(ev) = s.try_next().await.expect("watcher") {
            match ev {
                kube::runtime::watcher::Event::InitApply(p)
                    if p.metadata.name.as_deref() == Some("pre") =>
                {
                    seen_pre = true
                }
                kube::runtime::watcher::Event::Delete(p)
                    if p.metadata.name.as_deref() == Some("new") =>
                {
                    seen_new_deleted = true;
                    break;
                }
                _ => {}
            }
        }
    })
    .await;
    driver.await.expect("driver");
    assert!(r.is_ok(), "watcher timed out");
    assert!(seen_pre && seen_new_deleted);

    // Bookmarks when allowed, with the current resourceVersion.
    let mut w = api
        .watch(
            &WatchParams {
                bookmarks: true,
                ..WatchParams::default().timeout(2)
            },
            &d.resource_version().to_string(),
        )
        .await
        .expect("watch")
        .boxed();
    let mut bookmark = None;
    while let Some(ev) = w.try_next().await.expect("event") {
        if let WatchEvent::Bookmark(b) = ev {
            bookmark = Some(b.metadata.resource_version);
            break;
        }
    }
    assert_eq!(bookmark, Some(d.resource_version().to_string()));
}

#[tokio::test]
async fn watch_from_an_expired_resource_version_is_gone() {
    let d = KubeDouble::start_with(DoubleOptions {
        history: 3,
        ..DoubleOptions::default()
    });
    let api: Api<Pod> = Api::default_namespaced(client(&d).await);
    for n in ["g1", "g2", "g3"] {
        api.create(&PostParams::default(), &pod(n, "busybox"))
            .await
            .expect("create");
    }
    for n in ["g1", "g2", "g3"] {
        running(&api, n).await;
    }
    let mut w = api
        .watch(&WatchParams::default().timeout(2), "1")
        .await
        .expect("watch")
        .boxed();
    match w.try_next().await.expect("event") {
        Some(WatchEvent::Error(e)) => {
            assert_eq!((e.code, e.reason.as_str()), (410, "Expired"));
            assert!(
                e.message.starts_with("too old resource version: 1 ("),
                "{}",
                e.message
            );
        }
        other => panic!("expected a 410 ERROR event, got {other:?}"),
    }
    // A recent resourceVersion replays what came after it.
    let rv = d.resource_version();
    api.delete("g1", &DeleteParams::default().grace_period(0))
        .await
        .expect("delete");
    let mut w = api
        .watch(&WatchParams::default().timeout(1), &rv.to_string())
        .await
        .expect("watch")
        .boxed();
    match w.try_next().await.expect("event") {
        Some(WatchEvent::Deleted(p)) => assert_eq!(p.metadata.name.as_deref(), Some("g1")),
        other => panic!("expected DELETED g1, got {other:?}"),
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

#[tokio::test]
async fn failure_injection_states() {
    let d = KubeDouble::start();
    let api: Api<Pod> = Api::default_namespaced(client(&d).await);
    for (n, img) in [
        ("pull", "example.com/pull-error:1"),
        ("cfg", "busybox-config-error"),
        ("slow", "never-starts"),
    ] {
        api.create(&PostParams::default(), &pod(n, img))
            .await
            .expect("create");
    }
    let mut unsched = pod("unsched", "busybox");
    unsched.spec.as_mut().unwrap().node_selector = Some(
        [(
            "kubernetes.io/hostname".to_string(),
            "elsewhere".to_string(),
        )]
        .into(),
    );
    api.create(&PostParams::default(), &unsched)
        .await
        .expect("create");
    let mut fits = pod("fits", "busybox");
    fits.spec.as_mut().unwrap().node_selector =
        Some([("kubernetes.io/os".to_string(), "linux".to_string())].into());
    api.create(&PostParams::default(), &fits)
        .await
        .expect("create");

    let p = wait_for(&api, "pull", |p| {
        status_of(p).1.as_deref() == Some("ImagePullBackOff")
    })
    .await;
    let (phase, _, msg) = status_of(&p);
    assert_eq!(phase, "Pending");
    assert!(
        msg.unwrap()
            .starts_with("Back-off pulling image \"example.com/pull-error:1\"")
    );
    let p = wait_for(&api, "cfg", |p| {
        status_of(p).1.is_some_and(|r| r != "ContainerCreating")
    })
    .await;
    assert_eq!(
        status_of(&p).1.as_deref(),
        Some("CreateContainerConfigError")
    );
    assert_eq!(status_of(&p).0, "Pending");
    let p = wait_for(&api, "unsched", |p| {
        p.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| !c.is_empty())
    })
    .await;
    let c = &p.status.unwrap().conditions.unwrap()[0];
    assert_eq!(
        (c.type_.as_str(), c.status.as_str(), c.reason.as_deref()),
        ("PodScheduled", "False", Some("Unschedulable"))
    );
    assert!(c.message.as_deref().unwrap().starts_with(
        "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector."
    ));
    running(&api, "fits").await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let p = api.get("slow").await.expect("get");
    assert_eq!(
        status_of(&p),
        (
            "Pending".to_string(),
            Some("ContainerCreating".to_string()),
            None
        )
    );
    assert!(p.spec.unwrap().node_name.is_some());
    let p = api.get("unsched").await.expect("get");
    assert!(p.spec.unwrap().node_name.is_none());
}

#[tokio::test]
async fn active_deadline_fails_the_pod_and_kills_execs() {
    let d = KubeDouble::start();
    let api: Api<Pod> = Api::default_namespaced(client(&d).await);
    let mut p = pod("dl", "busybox");
    p.spec.as_mut().unwrap().active_deadline_seconds = Some(1);
    api.create(&PostParams::default(), &p)
        .await
        .expect("create");
    running(&api, "dl").await;
    let mut at = api
        .exec("dl", ["sleep", "30"], &AttachParams::default())
        .await
        .expect("exec");
    let status = at.take_status().expect("status");
    let st = tokio::time::timeout(Duration::from_secs(5), status)
        .await
        .expect("killed in time")
        .expect("status");
    assert_eq!(st.reason.as_deref(), Some("NonZeroExitCode"));
    assert_eq!(
        st.details.unwrap().causes.unwrap()[0].message.as_deref(),
        Some("137")
    );
    let p = api.get("dl").await.expect("get");
    let s = p.status.unwrap();
    assert_eq!(
        (s.phase.as_deref(), s.reason.as_deref()),
        (Some("Failed"), Some("DeadlineExceeded"))
    );
    assert_eq!(d.running_execs(), 0);
}

#[tokio::test]
async fn deleting_the_pod_kills_its_exec() {
    let d = KubeDouble::start();
    let api: Api<Pod> = Api::default_namespaced(client(&d).await);
    api.create(&PostParams::default(), &pod("k", "busybox"))
        .await
        .expect("create");
    running(&api, "k").await;
    let mut at = api
        .exec("k", ["sleep", "30"], &AttachParams::default())
        .await
        .expect("exec");
    let status = at.take_status().expect("status");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while d.running_execs() == 0 {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    api.delete("k", &DeleteParams::default().grace_period(0))
        .await
        .expect("delete");
    let st = tokio::time::timeout(Duration::from_secs(5), status)
        .await
        .expect("ended")
        .expect("status");
    assert_eq!(
        st.details.unwrap().causes.unwrap()[0].message.as_deref(),
        Some("137")
    );
    assert_eq!(d.running_execs(), 0);
}

#[tokio::test]
async fn self_subject_access_review() {
    let d = KubeDouble::start();
    let c = client(&d).await;
    use k8s_openapi::api::authorization::v1::{
        ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
    };
    let review = |sub: Option<&str>| SelfSubjectAccessReview {
        spec: SelfSubjectAccessReviewSpec {
            resource_attributes: Some(ResourceAttributes {
                namespace: Some("default".into()),
                resource: Some("pods".into()),
                subresource: sub.map(str::to_string),
                verb: Some("create".into()),
                ..ResourceAttributes::default()
            }),
            ..SelfSubjectAccessReviewSpec::default()
        },
        ..SelfSubjectAccessReview::default()
    };
    let api: Api<SelfSubjectAccessReview> = Api::all(c);
    let r = api
        .create(&PostParams::default(), &review(Some("exec")))
        .await
        .expect("ssar");
    assert!(r.status.unwrap().allowed);
    d.deny("default", "pods", "exec", "create");
    let r = api
        .create(&PostParams::default(), &review(Some("exec")))
        .await
        .expect("ssar");
    assert!(!r.status.unwrap().allowed);
    let r = api
        .create(&PostParams::default(), &review(None))
        .await
        .expect("ssar");
    assert!(r.status.unwrap().allowed);
}

// ---------------------------------------------------------------------------------------------
// Raw WebSocket exec: subprotocol negotiation, channel bytes, status frames.

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;
use tokio_tungstenite::tungstenite::{self, Message, client::IntoClientRequest};

/// Connects to `pods/{pod}/exec?{query}` offering `protocols`; returns the socket and the
/// protocol the server selected.
async fn ws_exec(
    d: &KubeDouble,
    pod: &str,
    query: &str,
    protocols: Option<&str>,
) -> Result<(Ws, Option<String>), tungstenite::Error> {
    let url = format!(
        "ws://{}/api/v1/namespaces/default/pods/{pod}/exec?{query}",
        d.url().trim_start_matches("http://")
    );
    let mut req = url.into_client_request()?;
    let h = req.headers_mut();
    h.insert(
        "authorization",
        format!("Bearer {}", d.options().token).parse().unwrap(),
    );
    if let Some(p) = protocols {
        h.insert("sec-websocket-protocol", p.parse().unwrap());
    }
    let (ws, resp) = tokio_tungstenite::connect_async(req).await?;
    let proto = resp
        .headers()
        .get("sec-websocket-protocol")
        .map(|v| v.to_str().unwrap().to_string());
    Ok((ws, proto))
}

/// Every data frame as (channel, bytes) until the server closes, and the close code.
async fn frames(ws: &mut Ws) -> (Vec<(u8, Vec<u8>)>, Option<u16>) {
    let mut out = Vec::new();
    let r = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(m) = ws.next().await {
            match m.expect("frame") {
                Message::Binary(b) => out.push((b[0], b[1..].to_vec())),
                Message::Text(t) => {
                    use base64::Engine;
                    let ch = t.as_bytes()[0] - b'0';
                    let data = base64::engine::general_purpose::STANDARD
                        .decode(&t.as_bytes()[1..])
                        .expect("base64");
                    out.push((ch, data));
                }
                Message::Close(c) => return c.map(|c| u16::from(c.code)),
                _ => {}
            }
        }
        None
    })
    .await
    .expect("stream ended in time");
    (out, r)
}

fn q(cmd: &[&str], extra: &str) -> String {
    let mut s: Vec<String> = cmd
        .iter()
        .map(|c| {
            let enc: String = c
                .bytes()
                .map(|b| {
                    if b.is_ascii_alphanumeric() || b"-_./".contains(&b) {
                        (b as char).to_string()
                    } else {
                        format!("%{b:02X}")
                    }
                })
                .collect();
            format!("command={enc}")
        })
        .collect();
    s.push(extra.to_string());
    s.join("&")
}

fn joined(frames: &[(u8, Vec<u8>)], ch: u8) -> Vec<u8> {
    frames
        .iter()
        .filter(|(c, _)| *c == ch)
        .flat_map(|(_, d)| d.clone())
        .collect()
}

async fn running_pod(d: &KubeDouble, name: &str, tweak: impl FnOnce(&mut Pod)) -> Api<Pod> {
    let api: Api<Pod> = Api::default_namespaced(client(d).await);
    let mut p = pod(name, "busybox");
    tweak(&mut p);
    api.create(&PostParams::default(), &p)
        .await
        .expect("create");
    running(&api, name).await;
    api
}

const OUT_ERR: &str = "stdout=true&stderr=true";

#[tokio::test]
async fn ws_v5_is_preferred_and_frames_carry_channel_bytes() {
    let d = KubeDouble::start();
    running_pod(&d, "ws", |_| {}).await;
    let (mut ws, proto) = ws_exec(
        &d,
        "ws",
        &q(
            &["sh", "-c", "printf a; printf b >&2; printf '\\000\\377'"],
            OUT_ERR,
        ),
        Some("v4.channel.k8s.io, v5.channel.k8s.io"),
    )
    .await
    .expect("connect");
    assert_eq!(proto.as_deref(), Some("v5.channel.k8s.io"));
    let (f, close) = frames(&mut ws).await;
    assert_eq!(
        f[0],
        (1, vec![]),
        "the kubelet's empty first frame on stdout"
    );
    assert_eq!(joined(&f, 1), b"a\x00\xff");
    assert_eq!(joined(&f, 2), b"b");
    assert_eq!(
        f.last().unwrap(),
        &(3, br#"{"metadata":{},"status":"Success"}"#.to_vec())
    );
    assert_eq!(close, Some(1000));
    // v5 statuses are the API server's stream translator's.
    let (mut ws, _) = ws_exec(
        &d,
        "ws",
        &q(&["sh", "-c", "exit 3"], OUT_ERR),
        Some("v5.channel.k8s.io"),
    )
    .await
    .expect("connect");
    let (f, _) = frames(&mut ws).await;
    let s: Value = serde_json::from_slice(&f.last().unwrap().1).expect("status");
    assert_eq!(
        s["message"],
        "command terminated with non-zero exit code: command terminated with exit code 3"
    );
    assert_eq!(
        s["details"]["causes"][0],
        json!({"reason": "ExitCode", "message": "3"})
    );
    let (mut ws, _) = ws_exec(
        &d,
        "ws",
        &q(&["no-such-binary-xyz"], OUT_ERR),
        Some("v5.channel.k8s.io"),
    )
    .await
    .expect("connect");
    let (f, _) = frames(&mut ws).await;
    let s: Value = serde_json::from_slice(&f.last().unwrap().1).expect("status");
    assert_eq!(
        (s["reason"].as_str(), s["code"].as_i64()),
        (Some("InternalError"), Some(500))
    );
    let m = s["message"].as_str().unwrap();
    assert!(m.starts_with("Internal error occurred: Internal error occurred: error executing command in container: "), "{m}");
    assert!(
        m.ends_with("executable file not found in $PATH: unknown"),
        "{m}"
    );
}

#[tokio::test]
async fn ws_v4_status_frames_for_exit_codes_signals_and_start_failures() {
    let d = KubeDouble::start();
    running_pod(&d, "st", |_| {}).await;
    let status = |f: &[(u8, Vec<u8>)]| -> Value {
        let s: Vec<_> = f.iter().filter(|(c, _)| *c == 3).collect();
        assert_eq!(s.len(), 1, "one status frame: {f:?}");
        serde_json::from_slice(&s[0].1).expect("status json")
    };
    let run = |cmd: &'static [&'static str]| {
        let d = &d;
        async move {
            let (mut ws, proto) = ws_exec(d, "st", &q(cmd, OUT_ERR), Some("v4.channel.k8s.io"))
                .await
                .expect("connect");
            assert_eq!(proto.as_deref(), Some("v4.channel.k8s.io"));
            frames(&mut ws).await.0
        }
    };
    let f = run(&["sh", "-c", "exit 3"]).await;
    assert_eq!(
        std::str::from_utf8(&f.last().unwrap().1).unwrap(),
        r#"{"metadata":{},"status":"Failure","message":"command terminated with non-zero exit code: error executing command [sh -c exit 3], exit code 3","reason":"NonZeroExitCode","details":{"causes":[{"reason":"ExitCode","message":"3"}]}}"#
    );
    let s = status(&run(&["sh", "-c", "kill -9 $$"]).await);
    assert_eq!(s["reason"], "NonZeroExitCode");
    assert_eq!(s["details"]["causes"][0]["message"], "137");
    let s = status(&run(&["no-such-binary-xyz", "arg"]).await);
    assert_eq!(
        (
            s["status"].as_str(),
            s["reason"].as_str(),
            s["code"].as_i64()
        ),
        (Some("Failure"), Some("InternalError"), Some(500))
    );
    let m = s["message"].as_str().unwrap();
    assert!(m.starts_with("Internal error occurred: error executing command in container: failed to exec in container: failed to start exec \""), "{m}");
    assert!(m.ends_with("OCI runtime exec failed: exec failed: unable to start container process: exec: \"no-such-binary-xyz\": executable file not found in $PATH: unknown"), "{m}");
    let s = status(&run(&["/etc/passwd"]).await);
    assert!(
        s["message"]
            .as_str()
            .unwrap()
            .ends_with("exec: \"/etc/passwd\": permission denied: unknown"),
        "{s}"
    );
}

#[tokio::test]
async fn ws_v5_closing_stdin_ends_input() {
    let d = KubeDouble::start();
    running_pod(&d, "in", |_| {}).await;
    let (mut ws, _) = ws_exec(
        &d,
        "in",
        &q(&["cat"], "stdin=true&stdout=true"),
        Some("v5.channel.k8s.io"),
    )
    .await
    .expect("connect");
    use futures_util::SinkExt;
    ws.send(Message::binary(b"\x00hello ".to_vec()))
        .await
        .expect("stdin");
    ws.send(Message::binary(b"\x00world".to_vec()))
        .await
        .expect("stdin");
    ws.send(Message::binary(vec![255, 0]))
        .await
        .expect("close stdin");
    let (f, _) = frames(&mut ws).await;
    assert_eq!(joined(&f, 1), b"hello world");
    assert_eq!(
        f.last().unwrap(),
        &(3, br#"{"metadata":{},"status":"Success"}"#.to_vec())
    );
}

#[tokio::test]
async fn ws_legacy_protocols_and_unsupported_ones() {
    let d = KubeDouble::start();
    running_pod(&d, "old", |_| {}).await;
    // No protocol offered: binary channel.k8s.io, no protocol header, bare error text.
    let (mut ws, proto) = ws_exec(
        &d,
        "old",
        &q(&["sh", "-c", "echo x; exit 3"], OUT_ERR),
        None,
    )
    .await
    .expect("connect");
    assert_eq!(proto, None);
    let (f, _) = frames(&mut ws).await;
    assert_eq!(joined(&f, 1), b"x\n");
    assert_eq!(
        joined(&f, 3),
        b"command terminated with non-zero exit code: error executing command [sh -c echo x; exit 3], exit code 3"
    );
    let (mut ws, proto) = ws_exec(&d, "old", &q(&["true"], OUT_ERR), Some("channel.k8s.io"))
        .await
        .expect("connect");
    assert_eq!(proto.as_deref(), Some("channel.k8s.io"));
    let (f, _) = frames(&mut ws).await;
    assert!(
        joined(&f, 3).is_empty(),
        "no status on success before v4: {f:?}"
    );
    // base64: text frames, ASCII channel digit.
    let (mut ws, proto) = ws_exec(
        &d,
        "old",
        &q(&["printf", "\\001z"], OUT_ERR),
        Some("base64.channel.k8s.io, v4.channel.k8s.io"),
    )
    .await
    .expect("connect");
    assert_eq!(proto.as_deref(), Some("base64.channel.k8s.io"));
    let (f, _) = frames(&mut ws).await;
    assert_eq!(joined(&f, 1), b"\x01z");
    match ws_exec(&d, "old", &q(&["true"], OUT_ERR), Some("chat")).await {
        Err(tungstenite::Error::Http(r)) => assert_eq!(r.status(), 403),
        other => panic!("expected 403, got {:?}", other.map(|x| x.1)),
    }
}

#[tokio::test]
async fn ws_exec_errors_before_the_upgrade() {
    let d = KubeDouble::start();
    let api = running_pod(&d, "ok", |_| {}).await;
    let err_of = |r: Result<(Ws, Option<String>), tungstenite::Error>| -> (u16, Value) {
        match r {
            Err(tungstenite::Error::Http(resp)) => (
                resp.status().as_u16(),
                serde_json::from_slice(resp.body().as_deref().unwrap_or_default())
                    .expect("Status body"),
            ),
            other => panic!("expected an HTTP error, got {:?}", other.map(|x| x.1)),
        }
    };
    let (code, s) = err_of(
        ws_exec(
            &d,
            "missing",
            &q(&["true"], OUT_ERR),
            Some("v5.channel.k8s.io"),
        )
        .await,
    );
    assert_eq!(
        (code, s["message"].as_str()),
        (404, Some("pods \"missing\" not found"))
    );
    let (code, s) = err_of(
        ws_exec(
            &d,
            "ok",
            &q(&["true"], "container=other&stdout=true"),
            Some("v5.channel.k8s.io"),
        )
        .await,
    );
    assert_eq!(
        (code, s["message"].as_str()),
        (400, Some("container other is not valid for pod ok"))
    );
    let (code, s) = err_of(ws_exec(&d, "ok", &q(&["true"], ""), Some("v5.channel.k8s.io")).await);
    assert_eq!(
        (code, s["message"].as_str()),
        (
            400,
            Some("you must specify at least 1 of stdin, stdout, stderr")
        )
    );
    let mut p = pod("stuck", "never-starts");
    p.metadata.labels = None;
    api.create(&PostParams::default(), &p)
        .await
        .expect("create");
    wait_for(&api, "stuck", |p| {
        p.spec.as_ref().is_some_and(|s| s.node_name.is_some())
    })
    .await;
    // Container not running: v5 is upgraded, then refused on the status channel; v4 gets the
    // kubelet's plain-text 500.
    let (mut ws, proto) = ws_exec(
        &d,
        "stuck",
        &q(&["true"], OUT_ERR),
        Some("v5.channel.k8s.io"),
    )
    .await
    .expect("v5 upgrade");
    assert_eq!(proto.as_deref(), Some("v5.channel.k8s.io"));
    let (f, close) = frames(&mut ws).await;
    assert_eq!(f.first(), Some(&(1, vec![])));
    let s: Value = serde_json::from_slice(&f.last().unwrap().1).expect("status");
    assert_eq!(
        (s["reason"].as_str(), s["code"].as_i64()),
        (Some("InternalError"), Some(500))
    );
    assert_eq!(
        s["message"],
        "Internal error occurred: unable to upgrade connection: container not found (\"main\")"
    );
    assert_eq!(close, Some(1000));
    match ws_exec(
        &d,
        "stuck",
        &q(&["true"], OUT_ERR),
        Some("v4.channel.k8s.io"),
    )
    .await
    {
        Err(tungstenite::Error::Http(r)) => {
            assert_eq!(r.status(), 500);
            assert_eq!(
                r.body().as_deref(),
                Some(&b"container not found (\"main\")"[..])
            );
        }
        other => panic!("expected 500, got {:?}", other.map(|x| x.1)),
    }
    assert_eq!(d.running_execs(), 0);
    let mut p = pod("nohost", "busybox");
    p.spec.as_mut().unwrap().node_selector = Some([("disk".to_string(), "ssd".to_string())].into());
    api.create(&PostParams::default(), &p)
        .await
        .expect("create");
    let (code, s) = err_of(
        ws_exec(
            &d,
            "nohost",
            &q(&["true"], OUT_ERR),
            Some("v5.channel.k8s.io"),
        )
        .await,
    );
    assert_eq!(
        (code, s["message"].as_str()),
        (400, Some("pod nohost does not have a host assigned"))
    );
    let (code, s) = http(
        &d,
        "GET",
        &format!(
            "/api/v1/namespaces/default/pods/ok/exec?{}",
            q(&["true"], OUT_ERR)
        ),
        None,
        true,
    )
    .await;
    assert_eq!(
        (code, s["message"].as_str()),
        (400, Some("Upgrade request required"))
    );
}

#[tokio::test]
async fn ws_client_going_away_kills_the_process() {
    let d = KubeDouble::start();
    running_pod(&d, "bye", |_| {}).await;
    let (ws, _) = ws_exec(
        &d,
        "bye",
        &q(&["sleep", "30"], OUT_ERR),
        Some("v5.channel.k8s.io"),
    )
    .await
    .expect("connect");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while d.running_execs() != 1 {
        assert!(tokio::time::Instant::now() < deadline, "exec never started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(ws);
    while d.running_execs() != 0 {
        assert!(tokio::time::Instant::now() < deadline, "process not killed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn ws_exec_gets_exactly_the_container_env_and_working_dir() {
    let d = KubeDouble::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let wd = dir.path().to_str().unwrap().to_string();
    running_pod(&d, "env", |p| {
        p.spec.as_mut().unwrap().containers[0].working_dir = Some(wd.clone());
    })
    .await;
    let (mut ws, _) = ws_exec(&d, "env", &q(&["env"], OUT_ERR), Some("v5.channel.k8s.io"))
        .await
        .expect("connect");
    let out = String::from_utf8(joined(&frames(&mut ws).await.0, 1)).unwrap();
    let mut keys: Vec<&str> = out.lines().map(|l| l.split('=').next().unwrap()).collect();
    keys.sort();
    assert_eq!(keys, ["GREETING", "PATH"], "{out}");
    assert!(out.contains("GREETING=hi\n"));
    // argv is not a shell string: `$HOME` and `;` reach the process verbatim.
    let (mut ws, _) = ws_exec(
        &d,
        "env",
        &q(&["printf", "%s|", "$HOME; x", "*"], OUT_ERR),
        Some("v5.channel.k8s.io"),
    )
    .await
    .expect("connect");
    assert_eq!(joined(&frames(&mut ws).await.0, 1), b"$HOME; x|*|");
    let (mut ws, _) = ws_exec(&d, "env", &q(&["pwd"], OUT_ERR), Some("v5.channel.k8s.io"))
        .await
        .expect("connect");
    let pwd = String::from_utf8(joined(&frames(&mut ws).await.0, 1)).unwrap();
    assert_eq!(
        std::fs::canonicalize(pwd.trim()).unwrap(),
        std::fs::canonicalize(&wd).unwrap()
    );
}

#[tokio::test]
async fn ws_output_is_back_pressured_and_byte_exact() {
    let d = KubeDouble::start();
    running_pod(&d, "bp", |_| {}).await;
    const SIZE: usize = 64 << 20;
    let (mut ws, _) = ws_exec(
        &d,
        "bp",
        &q(
            &["head", "-c", &SIZE.to_string(), "/dev/zero"],
            "stdout=true",
        ),
        Some("v5.channel.k8s.io"),
    )
    .await
    .expect("connect");
    // A client that does not read: the producer must block instead of being drained into
    // memory (64 MiB is far beyond the socket buffers).
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(
        d.running_execs(),
        1,
        "the writer finished although nobody read"
    );
    let (f, close) = frames(&mut ws).await;
    let out = joined(&f, 1);
    assert_eq!(out.len(), SIZE);
    assert!(out.iter().all(|b| *b == 0));
    assert_eq!(f.last().unwrap().0, 3);
    assert_eq!(close, Some(1000));
}

#[tokio::test]
async fn streaming_list_watcher_insert_pod_and_request_log() {
    let d = KubeDouble::start();
    let api: Api<Pod> = Api::default_namespaced(client(&d).await);
    let mut stale = pod("stale", "busybox");
    stale.metadata.creation_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        "2020-01-01T00:00:00Z".parse().unwrap(),
    ));
    d.insert_pod(stale);
    let p = api.get("stale").await.expect("inserted pod is served");
    assert_eq!(
        p.metadata.creation_timestamp.unwrap().0.to_string(),
        "2020-01-01T00:00:00Z"
    );
    assert_eq!(
        p.metadata.labels.unwrap().get("app").map(String::as_str),
        Some("t")
    );
    assert!(p.status.is_none(), "no lifecycle for inserted pods");

    let cfg = kube::runtime::watcher::Config::default().streaming_lists();
    let mut s = kube::runtime::watcher(api.clone(), cfg).boxed();
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(ev) = s.try_next().await.expect("watcher") {
            match ev {
                kube::runtime::watcher::Event::InitApply(p) => got.push(p.metadata.name.unwrap()),
                kube::runtime::watcher::Event::InitDone => break,
                _ => {}
            }
        }
    })
    .await
    .expect("initial events end with a bookmark");
    assert_eq!(got, ["stale"]);
    let log = d.requests();
    assert!(
        log.iter()
            .any(|l| l.starts_with("GET /api/v1/namespaces/default/pods?")
                && l.contains("sendInitialEvents=true")),
        "{log:?}"
    );
    assert!(
        log.contains(&"GET /api/v1/namespaces/default/pods/stale".to_string()),
        "{log:?}"
    );
}

#[tokio::test]
async fn ws_tty_has_no_stderr_stream() {
    let d = KubeDouble::start();
    running_pod(&d, "tty", |_| {}).await;
    let (mut ws, _) = ws_exec(
        &d,
        "tty",
        &q(
            &["sh", "-c", "printf e >&2"],
            "stdout=true&stderr=true&tty=true",
        ),
        Some("v5.channel.k8s.io"),
    )
    .await
    .expect("connect");
    let (f, _) = frames(&mut ws).await;
    assert_eq!(joined(&f, 1), b"e");
    assert!(f.iter().all(|(c, _)| *c != 2));
}

#[tokio::test]
async fn a_cluster_without_v5_serves_kube_rs_over_v4() {
    let d = KubeDouble::start_with(DoubleOptions {
        exec_protocols: vec!["v4.channel.k8s.io".into()],
        ..DoubleOptions::default()
    });
    let api = running_pod(&d, "old", |_| {}).await;
    assert_eq!(d.created_pods().len(), 1);
    assert_eq!(d.created_pods()[0].metadata.name.as_deref(), Some("old"));
    let mut at = api
        .exec(
            "old",
            ["sh", "-c", "cat; exit 4"],
            &AttachParams::default().stdin(true),
        )
        .await
        .expect("exec over v4");
    let mut stdin = at.stdin().expect("stdin");
    let mut out = at.stdout().expect("stdout");
    let status = at.take_status().expect("status");
    use tokio::io::AsyncWriteExt;
    stdin.write_all(b"in").await.expect("write");
    drop(stdin);
    let mut buf = [0u8; 2];
    out.read_exact(&mut buf).await.expect("echo");
    assert_eq!(&buf, b"in");
    // v4 cannot close stdin: the command only ends when the client goes away or it is
    // killed; here the client aborts and the process group is killed.
    drop(out);
    drop(status);
    at.abort();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while d.running_execs() != 0 {
        assert!(tokio::time::Instant::now() < deadline, "process not killed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (_, proto) = ws_exec(
        &d,
        "old",
        &q(&["true"], OUT_ERR),
        Some("v5.channel.k8s.io, v4.channel.k8s.io"),
    )
    .await
    .expect("connect");
    assert_eq!(proto.as_deref(), Some("v4.channel.k8s.io"));
}

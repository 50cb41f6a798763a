//! The double's watches: lifecycle events, kube-runtime's watcher, bookmarks, expiry,
//! streaming lists.

use super::*;

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
    let mut deleting = false;
    // Each change is made once the watcher has seen the one before: the initial list, then
    // the new pod.
    let r = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(ev) = s.try_next().await.expect("watcher") {
            match ev {
                kube::runtime::watcher::Event::InitApply(p)
                    if p.metadata.name.as_deref() == Some("pre") =>
                {
                    seen_pre = true
                }
                kube::runtime::watcher::Event::InitDone => {
                    api.create(&PostParams::default(), &pod("new", "busybox"))
                        .await
                        .expect("create");
                }
                // Once: the kubelet's status updates come as further applies.
                kube::runtime::watcher::Event::Apply(p)
                    if p.metadata.name.as_deref() == Some("new") && !deleting =>
                {
                    deleting = true;
                    api.delete("new", &DeleteParams::default().grace_period(0))
                        .await
                        .expect("delete");
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

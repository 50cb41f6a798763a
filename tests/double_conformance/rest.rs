//! The double's REST surface: authentication, discovery, create, list, patch, delete,
//! access reviews.

use super::*;

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

/// `kubectl get` asks for server-side printed Tables: pod columns and STATUS as the API
/// server's printer makes them, for get, list and watch (definitions in the first event only).
#[tokio::test]
async fn tables_for_kubectl_get() {
    let d = KubeDouble::start();
    let api: Api<Pod> = Api::default_namespaced(client(&d).await);
    api.create(&PostParams::default(), &pod("tbl", "busybox"))
        .await
        .expect("create");
    running(&api, "tbl").await;
    let c = kube_double::tls::reqwest_client();
    let accept = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json;as=Table;v=v1beta1;g=meta.k8s.io,application/json";
    let get = |path: String| {
        c.get(format!("{}{path}", d.url()))
            .bearer_auth(&d.options().token)
            .header("accept", accept)
            .send()
    };
    let list: Value = get("/api/v1/namespaces/default/pods".into())
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["kind"], "Table");
    let names: Vec<&str> = list["columnDefinitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "Name",
            "Ready",
            "Status",
            "Restarts",
            "Age",
            "IP",
            "Node",
            "Nominated Node",
            "Readiness Gates"
        ]
    );
    let cells = &list["rows"][0]["cells"];
    assert_eq!(cells[0], "tbl");
    assert_eq!(cells[1], "1/1");
    assert_eq!(cells[2], "Running");
    assert_eq!(cells[6], "double-node-1");
    assert_eq!(list["rows"][0]["object"]["kind"], "PartialObjectMetadata");
    let one: Value = get("/api/v1/namespaces/default/pods/tbl?includeObject=Object".into())
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(one["rows"][0]["object"]["kind"], "Pod");
    assert_eq!(one["rows"][0]["object"]["status"]["phase"], "Running");
    // Without the Table media type first, plain objects as before.
    let plain: Value = c
        .get(format!("{}/api/v1/namespaces/default/pods/tbl", d.url()))
        .bearer_auth(&d.options().token)
        .header("accept", "application/json")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(plain["kind"], "Pod");

    // A watch: the first event has the column definitions, later ones do not.
    let mut w = get("/api/v1/namespaces/default/pods?watch=true".into())
        .await
        .unwrap()
        .bytes_stream();
    let mut buf = Vec::new();
    let first = loop {
        buf.extend_from_slice(&w.next().await.unwrap().unwrap());
        if let Some(i) = buf.iter().position(|b| *b == b'\n') {
            let line: Value = serde_json::from_slice(&buf[..i]).unwrap();
            buf.drain(..=i);
            break line;
        }
    };
    assert_eq!(first["type"], "ADDED");
    assert!(first["object"]["columnDefinitions"].is_array());
    api.delete("tbl", &DeleteParams::default().grace_period(1))
        .await
        .expect("delete");
    let next = loop {
        if let Some(i) = buf.iter().position(|b| *b == b'\n') {
            break serde_json::from_slice::<Value>(&buf[..i]).unwrap();
        }
        buf.extend_from_slice(&w.next().await.unwrap().unwrap());
    };
    assert_eq!(next["type"], "MODIFIED");
    assert!(next["object"]["columnDefinitions"].is_null());
    assert_eq!(next["object"]["rows"][0]["cells"][2], "Terminating");
}

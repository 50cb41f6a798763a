//! The double's PersistentVolumeClaims (what cache volumes use), driven with kube-rs: create
//! and its conflicts, binding, selectors, watch with resumption, preconditioned patches and
//! deletes, pvc-protection while a pod uses a claim, and the claim's storage at the pod's
//! mount path.

use super::*;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::api::{Patch, PatchParams, Preconditions};

fn claim(name: &str, cache: &str) -> PersistentVolumeClaim {
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"mcp-run.dev/cache": cache}},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}
    }))
    .expect("pvc json")
}

fn code(e: kube::Error) -> u16 {
    match e {
        kube::Error::Api(s) => s.code,
        other => panic!("not an API error: {other}"),
    }
}

#[tokio::test]
async fn claims_are_created_once_bound_selected_and_patched_with_preconditions() {
    let d = KubeDouble::start();
    let api: Api<PersistentVolumeClaim> = Api::default_namespaced(client(&d).await);
    let pp = PostParams::default();
    let c = api
        .create(&pp, &claim("c1", "cargo"))
        .await
        .expect("create");
    assert_eq!(c.status.unwrap().phase.as_deref(), Some("Pending"));
    assert_eq!(
        c.metadata.finalizers.as_deref(),
        Some(&["kubernetes.io/pvc-protection".to_string()][..])
    );
    assert_eq!(
        c.spec.unwrap().storage_class_name.as_deref(),
        Some("standard")
    );
    assert_eq!(
        code(api.create(&pp, &claim("c1", "cargo")).await.unwrap_err()),
        409
    );
    let no_size: PersistentVolumeClaim = serde_json::from_value(json!({
        "metadata": {"name": "c2"}, "spec": {"accessModes": ["ReadWriteOnce"]}
    }))
    .unwrap();
    assert_eq!(code(api.create(&pp, &no_size).await.unwrap_err()), 422);
    let bound = tokio::time::timeout(
        Duration::from_secs(10),
        await_condition(api.clone(), "c1", |c: Option<&PersistentVolumeClaim>| {
            c.and_then(|c| c.status.as_ref()?.phase.as_deref()) == Some("Bound")
        }),
    )
    .await
    .expect("bound in time")
    .expect("watch")
    .expect("exists");
    assert_eq!(bound.status.unwrap().capacity.unwrap()["storage"].0, "1Gi");
    api.create(&pp, &claim("c3", "npm")).await.expect("create");
    let by = |sel: &str| {
        let api = api.clone();
        let lp = ListParams::default().labels(sel);
        async move {
            api.list(&lp)
                .await
                .unwrap()
                .items
                .into_iter()
                .map(|c| c.metadata.name.unwrap())
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(by("mcp-run.dev/cache=cargo").await, ["c1"]);
    assert_eq!(by("mcp-run.dev/cache in (cargo,npm)").await, ["c1", "c3"]);
    assert!(by("mcp-run.dev/cache=pip").await.is_empty());

    // A merge patch preconditioned on the resourceVersion: once, then stale.
    let current = api.get("c1").await.unwrap();
    let take = json!({"metadata": {
        "resourceVersion": current.metadata.resource_version,
        "annotations": {"mcp-run.dev/held-by": "a"}}});
    let taken = api
        .patch("c1", &PatchParams::default(), &Patch::Merge(&take))
        .await
        .expect("first patch");
    assert_ne!(
        taken.metadata.resource_version,
        current.metadata.resource_version
    );
    assert_eq!(
        code(
            api.patch("c1", &PatchParams::default(), &Patch::Merge(&take))
                .await
                .unwrap_err()
        ),
        409
    );
    // The spec is immutable (but for the storage request).
    let spec = json!({"spec": {"accessModes": ["ReadWriteMany"]}});
    assert_eq!(
        code(
            api.patch("c1", &PatchParams::default(), &Patch::Merge(&spec))
                .await
                .unwrap_err()
        ),
        422
    );
    // Deletes: preconditions that do not hold are 409 and change nothing.
    let stale = DeleteParams {
        preconditions: Some(Preconditions {
            uid: None,
            resource_version: current.metadata.resource_version.clone(),
        }),
        ..DeleteParams::default()
    };
    assert_eq!(code(api.delete("c1", &stale).await.unwrap_err()), 409);
    let fresh = DeleteParams {
        preconditions: Some(Preconditions {
            uid: taken.metadata.uid.clone(),
            resource_version: taken.metadata.resource_version.clone(),
        }),
        ..DeleteParams::default()
    };
    api.delete("c1", &fresh).await.expect("delete");
    assert_eq!(code(api.get("c1").await.unwrap_err()), 404);
    assert_eq!(d.pvc_deletions(), ["c1"]);
}

#[tokio::test]
async fn a_watch_resumes_from_a_resource_version() {
    let d = KubeDouble::start();
    let api: Api<PersistentVolumeClaim> = Api::default_namespaced(client(&d).await);
    let c = api
        .create(&PostParams::default(), &claim("w1", "cargo"))
        .await
        .unwrap();
    let rv = c.metadata.resource_version.unwrap();
    api.patch(
        "w1",
        &PatchParams::default(),
        &Patch::Merge(&json!({"metadata": {"annotations": {"x": "1"}}})),
    )
    .await
    .unwrap();
    let mut events = api
        .watch(&WatchParams::default().fields("metadata.name=w1"), &rv)
        .await
        .unwrap()
        .boxed();
    // What happened since `rv`: the binding and the patch, in order.
    let mut seen = Vec::new();
    while seen.len() < 2 {
        match tokio::time::timeout(Duration::from_secs(5), events.try_next()).await {
            Ok(Ok(Some(WatchEvent::Modified(c)))) => seen.push(c),
            Ok(Ok(Some(WatchEvent::Bookmark(_)))) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(seen.iter().any(|c| {
        c.metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a["x"] == "1")
    }));
    api.delete("w1", &DeleteParams::default()).await.unwrap();
    match tokio::time::timeout(Duration::from_secs(5), events.try_next()).await {
        Ok(Ok(Some(WatchEvent::Deleted(c)))) => assert_eq!(c.metadata.name.as_deref(), Some("w1")),
        other => panic!("unexpected {other:?}"),
    }
}

#[tokio::test]
async fn a_claim_in_use_is_protected_and_its_storage_is_at_the_mount_path() {
    let d = KubeDouble::start();
    let c = client(&d).await;
    let claims: Api<PersistentVolumeClaim> = Api::default_namespaced(c.clone());
    let pods: Api<Pod> = Api::default_namespaced(c);
    claims
        .create(&PostParams::default(), &claim("data", "cargo"))
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mount = dir.path().join("cache");
    let p: Pod = serde_json::from_value(json!({
        "metadata": {"name": "user"},
        "spec": {
            "containers": [{"name": "main", "image": "busybox:1.36",
                            "volumeMounts": [{"name": "d", "mountPath": mount}]}],
            "volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": "data"}}]
        }
    }))
    .unwrap();
    pods.create(&PostParams::default(), &p).await.unwrap();
    running(&pods, "user").await;
    let mut at = pods
        .exec(
            "user",
            ["sh", "-c", &format!("echo kept > {}/f", mount.display())],
            &AttachParams::default(),
        )
        .await
        .unwrap();
    at.take_status().unwrap().await;
    assert_eq!(d.pvc_mounts(), [("user".to_string(), "data".to_string())]);
    // Deleted while the pod uses it: terminating, not gone.
    claims
        .delete("data", &DeleteParams::default())
        .await
        .unwrap();
    let c = claims.get("data").await.expect("still there");
    assert!(c.metadata.deletion_timestamp.is_some());
    // A second pod cannot mount a terminating claim: it stays ContainerCreating, saying why.
    let mut second = p.clone();
    second.metadata.name = Some("late".into());
    pods.create(&PostParams::default(), &second).await.unwrap();
    let waiting = tokio::time::timeout(
        Duration::from_secs(10),
        await_condition(pods.clone(), "late", |p: Option<&Pod>| {
            p.and_then(|p| {
                p.status
                    .as_ref()?
                    .container_statuses
                    .as_ref()?
                    .first()?
                    .state
                    .as_ref()?
                    .waiting
                    .as_ref()?
                    .message
                    .clone()
            })
            .is_some_and(|m| m.contains("is being deleted"))
        }),
    )
    .await;
    assert!(waiting.is_ok(), "the late pod says why it waits");
    pods.delete("late", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    // The storage was the claim's: what the pod wrote is there while the claim is.
    assert_eq!(std::fs::read_to_string(mount.join("f")).unwrap(), "kept\n");
    // The last user goes: so does the claim.
    pods.delete("user", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    tokio::time::timeout(
        Duration::from_secs(10),
        await_condition(
            claims.clone(),
            "data",
            |c: Option<&PersistentVolumeClaim>| c.is_none(),
        ),
    )
    .await
    .expect("gone in time")
    .expect("watch");
}

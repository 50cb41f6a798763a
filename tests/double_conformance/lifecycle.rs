//! The double's simulated scheduler and kubelet: failure injection, deadlines, deletion.

use super::*;

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
    // A negative check (the pod must not start), so inherently a wait: the kubelet started a
    // pod created after it, and 200 ms more pass without it starting.
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

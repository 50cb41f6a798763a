//! Admission and fault injection: Pod Security per namespace label with the plugin's texts,
//! JSON only (415 for protobuf, but for kubectl's protobuf SelfSubjectAccessReview), text frames read like binary ones, broken watches, and
//! containers that cannot start.

use super::ws::*;
use super::*;

fn restricted() -> KubeDouble {
    let mut opts = DoubleOptions::default();
    opts.namespace_labels.insert(
        "default".into(),
        [(
            "pod-security.kubernetes.io/enforce".to_string(),
            "restricted".to_string(),
        )]
        .into(),
    );
    KubeDouble::start_with(opts)
}

#[tokio::test]
async fn pod_security_restricted_refuses_with_the_plugins_text() {
    let d = restricted();
    let api: Api<Pod> = Api::default_namespaced(client(&d).await);
    let e = api_error(
        api.create(&PostParams::default(), &pod("bare", "busybox"))
            .await
            .expect_err("refused"),
    );
    assert_eq!((e.code, e.reason.as_str()), (403, "Forbidden"));
    assert_eq!(
        e.message,
        "pods \"bare\" is forbidden: violates PodSecurity \"restricted:latest\": allowPrivilegeEscalation != false (container \"main\" must set securityContext.allowPrivilegeEscalation=false), unrestricted capabilities (container \"main\" must set securityContext.capabilities.drop=[\"ALL\"]), runAsNonRoot != true (pod or container \"main\" must set securityContext.runAsNonRoot=true), seccompProfile (pod or container \"main\" must set securityContext.seccompProfile.type to \"RuntimeDefault\" or \"Localhost\")"
    );
    let mut ok = pod("hardened", "busybox");
    ok.spec.as_mut().unwrap().security_context = Some(
        serde_json::from_value(json!({"runAsNonRoot": true, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}})).unwrap(),
    );
    ok.spec.as_mut().unwrap().containers[0].security_context = Some(
        serde_json::from_value(
            json!({"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}}),
        )
        .unwrap(),
    );
    api.create(&PostParams::default(), &ok)
        .await
        .expect("admitted");
    // Other namespaces are not labelled.
    let other = pod("elsewhere", "busybox");
    let ks: Api<Pod> = Api::namespaced(client(&d).await, "kube-system");
    ks.create(&PostParams::default(), &other)
        .await
        .expect("not enforced there");
}

#[tokio::test]
async fn protobuf_bodies_are_415() {
    let d = KubeDouble::start();
    let (code, body) = http(
        &d,
        "POST",
        "/api/v1/namespaces/default/pods",
        Some(("application/vnd.kubernetes.protobuf", json!({}))),
        true,
    )
    .await;
    assert_eq!(code, 415, "{body}");
    assert_eq!(body["reason"], "UnsupportedMediaType");
}

/// kubectl (`auth can-i`) sends its SelfSubjectAccessReview as protobuf, which a real API
/// server reads: so does the double, for that one type.
#[tokio::test]
async fn kubectls_protobuf_access_review_is_read() {
    let d = KubeDouble::start();
    d.deny("default", "pods", "exec", "create");
    let c = kube_double::tls::reqwest_client();
    for (sub, allowed) in [("exec", false), ("", true)] {
        let mut attrs = vec![(1, "default"), (2, "create"), (5, "pods")];
        if !sub.is_empty() {
            attrs.push((6, sub));
        }
        let r = c
            .post(format!(
                "{}/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
                d.url()
            ))
            .bearer_auth(&d.options().token)
            .header("content-type", "application/vnd.kubernetes.protobuf")
            .header("accept", "application/vnd.kubernetes.protobuf, */*")
            .body(kube_double::protobuf::encode_ssar(&attrs))
            .send()
            .await
            .expect("request");
        assert_eq!(r.status().as_u16(), 201);
        let v: Value = r.json().await.expect("JSON answer");
        assert_eq!(v["status"]["allowed"], allowed, "{sub}: {v}");
        assert_eq!(v["spec"]["resourceAttributes"]["resource"], "pods");
    }
    // Garbage in the envelope is a 400, not a guess.
    let r = c
        .post(format!(
            "{}/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
            d.url()
        ))
        .bearer_auth(&d.options().token)
        .header("content-type", "application/vnd.kubernetes.protobuf")
        .body(b"k8s\0\x12\x7f".to_vec())
        .send()
        .await
        .expect("request");
    assert_eq!(r.status().as_u16(), 400);
}

#[tokio::test]
async fn text_frames_are_read_like_binary_ones() {
    let d = KubeDouble::start();
    running_pod(&d, "txt", |_| {}).await;
    let (mut ws, _) = ws_exec(
        &d,
        "txt",
        &q(&["cat"], "stdin=true&stdout=true"),
        Some("v5.channel.k8s.io"),
    )
    .await
    .expect("connect");
    use futures_util::SinkExt;
    ws.send(Message::text("\u{0}as text")).await.expect("stdin");
    ws.send(Message::binary(vec![255, 0])).await.expect("close");
    let (f, _) = frames(&mut ws).await;
    assert_eq!(joined(&f, 1), b"as text");
}

#[tokio::test]
async fn kube_runtime_watchers_resume_after_cuts() {
    let d = KubeDouble::start_with(DoubleOptions {
        step_delay: Duration::from_millis(150),
        ..Default::default()
    });
    let api: Api<Pod> = Api::default_namespaced(client(&d).await);
    d.inject(|f| f.watch_cuts = 2);
    api.create(&PostParams::default(), &pod("w", "busybox"))
        .await
        .expect("create");
    // watch_object with a backoff resumes from its resourceVersion after each cut.
    use kube::runtime::WatchStreamExt;
    let mut events = kube::runtime::watcher::watch_object(api.clone(), "w")
        .default_backoff()
        .boxed();
    tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match events.next().await {
                Some(Ok(Some(p)))
                    if p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running") =>
                {
                    return;
                }
                _ => {}
            }
        }
    })
    .await
    .expect("running in time");
    let watches = d
        .requests()
        .iter()
        .filter(|r| r.contains("watch=true"))
        .count();
    assert!(
        watches >= 3,
        "the watch was cut and resumed: {:#?}",
        d.requests()
    );
}

#[tokio::test]
async fn a_missing_keepalive_command_is_start_error_and_faults_heal() {
    let d = KubeDouble::start();
    let api: Api<Pod> = Api::default_namespaced(client(&d).await);
    let mut p = pod("nokeep", "busybox");
    p.spec.as_mut().unwrap().containers[0].command = Some(vec!["no-such-keepalive".into()]);
    api.create(&PostParams::default(), &p)
        .await
        .expect("create");
    let p = wait_for(&api, "nokeep", |p| {
        p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Failed")
    })
    .await;
    let t = p.status.unwrap().container_statuses.unwrap()[0]
        .state
        .clone()
        .unwrap()
        .terminated
        .unwrap();
    assert_eq!(
        (t.reason.as_deref(), t.exit_code),
        (Some("StartError"), 128)
    );
    assert!(
        t.message
            .unwrap()
            .contains("\"no-such-keepalive\": executable file not found in $PATH")
    );

    d.inject(|f| {
        f.create
            .push_back(kube_double::ApiError::too_many_requests(3));
        f.pull_failures = 2;
    });
    // kube-rs's client retries a 429 after its Retry-After, as client-go does.
    let t = std::time::Instant::now();
    api.create(&PostParams::default(), &pod("later", "busybox"))
        .await
        .expect("create after the 429");
    assert!(
        t.elapsed() >= Duration::from_secs(3),
        "Retry-After honoured"
    );
    let p = running(&api, "later").await;
    assert!(p.status.unwrap().container_statuses.unwrap()[0].ready);
}

/// The kubelet's runAsNonRoot check: an image whose user is root (an image named
/// `root-user`) with `runAsNonRoot: true` and no UID never starts
/// (`CreateContainerConfigError`, the kubelet's text); with a non-zero `runAsUser` it runs.
#[tokio::test]
async fn run_as_non_root_with_a_root_image_is_a_config_error() {
    let d = KubeDouble::start();
    let api: Api<Pod> = Api::default_namespaced(client(&d).await);
    let mut p = pod("rootimg", "registry.example/root-user:1");
    p.spec.as_mut().unwrap().security_context =
        Some(serde_json::from_value(json!({"runAsNonRoot": true})).unwrap());
    let created = api
        .create(&PostParams::default(), &p)
        .await
        .expect("create");
    let uid = created.metadata.uid.unwrap();
    let p = wait_for(&api, "rootimg", |p| {
        status_of(p).1.is_some_and(|r| r != "ContainerCreating")
    })
    .await;
    let (phase, reason, message) = status_of(&p);
    assert_eq!(
        (phase.as_str(), reason.as_deref()),
        ("Pending", Some("CreateContainerConfigError"))
    );
    assert_eq!(
        message.as_deref(),
        Some(
            format!(
                "container has runAsNonRoot and image will run as root (pod: \"rootimg_default({uid})\", container: main)"
            )
            .as_str()
        )
    );
    let mut ok = pod("rootuid", "registry.example/root-user:1");
    ok.spec.as_mut().unwrap().security_context =
        Some(serde_json::from_value(json!({"runAsNonRoot": true, "runAsUser": 1000})).unwrap());
    api.create(&PostParams::default(), &ok)
        .await
        .expect("create");
    running(&api, "rootuid").await;
}

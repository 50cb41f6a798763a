//! Exec requests refused before (or right after) the WebSocket upgrade.

use super::*;

use super::ws::*;

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

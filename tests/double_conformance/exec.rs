//! Exec over WebSocket: protocols, frames, status channel, stdin, back-pressure.

use super::*;

use super::ws::*;

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
    // memory (64 MiB is far beyond the socket buffers). A negative check (the writer must not
    // finish), so inherently a wait.
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

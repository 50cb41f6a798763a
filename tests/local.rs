//! The local backend through the real binaries: the shared behavioural suite, plus what only
//! a local gateway lets a test observe (processes, signals, the gateway's own environment).

use crate::support;

use std::io::Write;
use std::time::{Duration, Instant};

use serde_json::json;
use support::{Gateway, config_file, http, pid_alive, raw, wait_until};

support::suite::behavioural_suite!(Gateway::start(&[]));

#[tokio::test]
async fn health_and_unknown_paths() {
    let gw = Gateway::start(&[]);
    let c = http();
    assert_eq!(
        c.get(gw.url("/healthz")).send().await.unwrap().status(),
        200
    );
    let ready = c.get(gw.url("/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 200);
    let body: serde_json::Value = ready.json().await.unwrap();
    assert_eq!(body["backend"], "local");
    let nf = c.get(gw.url("/nope")).send().await.unwrap();
    assert_eq!(nf.status(), 404);
    let body: serde_json::Value = nf.json().await.unwrap();
    assert_eq!(body["error"]["code"], "not_found");
    let na = c.get(gw.url("/raw")).send().await.unwrap();
    assert_eq!(na.status(), 405);
    let body: serde_json::Value = na.json().await.unwrap();
    assert_eq!(body["error"]["code"], "method_not_allowed");
}

/// A client that goes away mid-stream gets its whole process group killed within 1 s.
#[tokio::test]
async fn disconnect_kills_the_process_group() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let gw = Gateway::start(&[]);
    // A plain socket, so that the test controls exactly when the connection closes.
    let mut sock = tokio::net::TcpStream::connect(gw.base.trim_start_matches("http://"))
        .await
        .unwrap();
    let body =
        json!({"executable": "sh", "args": ["-c", "sleep 300 & echo $$ $!; wait"]}).to_string();
    let req = format!(
        "POST /raw HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    sock.write_all(req.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    let pids: Vec<i32> = loop {
        let mut chunk = [0u8; 4096];
        let n = sock.read(&mut chunk).await.unwrap();
        assert!(
            n > 0,
            "connection closed early: {}",
            String::from_utf8_lossy(&buf)
        );
        buf.extend_from_slice(&chunk[..n]);
        let text = String::from_utf8_lossy(&buf).to_string();
        if let Some(line) = text.lines().find(|l| l.starts_with("{\"type\":\"stdout\"")) {
            let ev: mcp_run::contract::Event = serde_json::from_str(line).unwrap();
            let mcp_run::contract::Event::Stdout { data } = ev else {
                unreachable!()
            };
            break String::from_utf8_lossy(&data)
                .split_whitespace()
                .map(|p| p.parse().unwrap())
                .collect();
        }
    };
    assert_eq!(pids.len(), 2);
    assert!(pids.iter().all(|&p| pid_alive(p)));
    let t = Instant::now();
    drop(sock);
    assert!(
        wait_until(Duration::from_secs(1), || pids
            .iter()
            .all(|&p| !pid_alive(p))),
        "processes {pids:?} still alive after {:?}",
        t.elapsed()
    );
}

/// 50 MB of random bytes from a local file through `run-remote -- cat`, compared by hash.
#[test]
fn run_remote_cat_is_byte_exact() {
    use sha2::Digest;
    let gw = Gateway::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let (path, data) = support::random_file(dir.path(), 50 * 1024 * 1024 + 7);
    let out = gw
        .run_remote()
        .arg("--")
        .arg("cat")
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.stdout.len(), data.len());
    assert_eq!(
        sha2::Sha256::digest(&out.stdout),
        sha2::Sha256::digest(&data)
    );
}

#[tokio::test]
async fn keepalive_while_silent() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config_file(&dir, "server:\n  keepalive_secs: 1\n");
    let gw = Gateway::start(&["--config", cfg.to_str().unwrap()]);
    let r = raw(
        &gw,
        json!({"executable": "sh", "args": ["-c", "sleep 2.5; echo done"]}),
    )
    .await;
    let keepalives = r
        .events
        .iter()
        .filter(|e| matches!(e, mcp_run::contract::Event::Keepalive))
        .count();
    assert!(keepalives >= 2, "{:?}", r.events);
    assert_eq!(r.stdout_str(), "done\n");
}

#[tokio::test]
async fn gateway_environment_does_not_leak() {
    let gw = Gateway::start_with_env(&[], &[("MCP_RUN_GATEWAY_SECRET", "hunter2")]);
    let r = raw(&gw, json!({"executable": "env"})).await;
    assert!(!r.stdout_str().contains("hunter2"), "{}", r.stdout_str());
    assert!(
        r.stdout_str().contains("PATH="),
        "PATH is inherited so that programs are found"
    );
}

/// run-remote's own failures all exit 125 (docs/protocol.md) with one line on stderr that says
/// which failure it was, so that a script tells them from the command's own codes.
#[test]
fn run_remote_own_failures_have_documented_codes() {
    let gw = Gateway::start(&[]);
    let one_line_125 = |out: &std::process::Output, what: &str| -> String {
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(125), "{what}: {err}");
        assert!(
            err.starts_with("run-remote: ") && err.lines().count() == 1,
            "{what}: {err}"
        );
        err
    };
    // A --keep-env variable that is unset: fail before sending, naming every missing one.
    let out = gw
        .run_remote()
        .env("B", "1")
        .args([
            "--keep-env",
            "A",
            "--keep-env",
            "B",
            "--keep-env",
            "C",
            "--",
            "true",
        ])
        .output()
        .unwrap();
    assert!(one_line_125(&out, "keep-env").contains("A, C"));
    // Missing `--`: the synopsis is the hint.
    let out = gw.run_remote().args(["echo", "hi"]).output().unwrap();
    let err = one_line_125(&out, "missing --");
    assert!(
        err.contains("'echo'") && err.contains("run-remote [OPTIONS] -- COMMAND [ARGS...]"),
        "{err}"
    );
    // RUN_REMOTE_SERVER unset or not a full URL; a bad --server is named as --server.
    let out = gw
        .run_remote()
        .env_remove("RUN_REMOTE_SERVER")
        .args(["--", "true"])
        .output()
        .unwrap();
    assert!(one_line_125(&out, "unset").contains("RUN_REMOTE_SERVER"));
    let out = gw
        .run_remote()
        .env("RUN_REMOTE_SERVER", "127.0.0.1:8080")
        .args(["--", "true"])
        .output()
        .unwrap();
    assert!(one_line_125(&out, "not a URL").starts_with("run-remote: RUN_REMOTE_SERVER: "));
    let out = gw
        .run_remote()
        .args(["--server", "127.0.0.1:8080", "--", "true"])
        .output()
        .unwrap();
    assert!(one_line_125(&out, "bad --server").starts_with("run-remote: --server: "));
    // Nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let out = gw
        .run_remote()
        .env("RUN_REMOTE_SERVER", format!("http://127.0.0.1:{port}/raw"))
        .args(["--", "true"])
        .output()
        .unwrap();
    assert!(one_line_125(&out, "unreachable").contains("gateway_unreachable"));
    // A URL that is not /raw: the hint says so.
    let out = gw
        .run_remote()
        .env("RUN_REMOTE_SERVER", gw.url("/"))
        .args(["--", "true"])
        .output()
        .unwrap();
    assert!(one_line_125(&out, "not /raw").contains("/raw endpoint"));
    // Rejected by the gateway: the server's message is printed.
    let out = gw
        .run_remote()
        .args(["--timeout", "999999999", "--", "true"])
        .output()
        .unwrap();
    assert!(one_line_125(&out, "rejected").contains("server maximum"));
    // The remote command's own 125 (a directory it cannot enter) is mirrored, with its
    // message from the runner.
    let out = gw
        .run_remote()
        .args(["--cwd", "/nonexistent-dir", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(125));
    assert!(String::from_utf8_lossy(&out.stderr).starts_with("mcp-run: cannot change directory"));
    // --help and --version succeed.
    assert_eq!(
        gw.run_remote()
            .arg("--help")
            .output()
            .unwrap()
            .status
            .code(),
        Some(0)
    );
    assert_eq!(
        gw.run_remote()
            .arg("--version")
            .output()
            .unwrap()
            .status
            .code(),
        Some(0)
    );
}

/// SIGTERM: running commands get the grace period, then are killed; the gateway exits and
/// leaves no process behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_kills_after_grace() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config_file(&dir, "server:\n  shutdown_grace_secs: 1\n");
    let gw = Gateway::start(&["--config", cfg.to_str().unwrap()]);
    let pidfile = dir.path().join("pid");
    let body = json!({"executable": "sh", "args": ["-c", format!("echo $$ > {}; sleep 300", pidfile.display())]});
    let gw_url = gw.raw_url();
    let run = tokio::spawn(async move {
        http()
            .post(gw_url)
            .json(&body)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    });
    assert!(wait_until(Duration::from_secs(10), || {
        std::fs::read_to_string(&pidfile).is_ok_and(|s| s.ends_with('\n'))
    }));
    let pid: i32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let t = Instant::now();
    let status = support::terminate(gw).await;
    assert!(
        status.0.is_some_and(|s| s.success()),
        "gateway exits cleanly: {:?}",
        status.0
    );
    assert!(
        t.elapsed() >= Duration::from_millis(900),
        "the command got its grace period"
    );
    assert!(!pid_alive(pid), "the command was killed");
    // The stream says why the command ended (not a bare SIGKILL, which reads like an OOM kill).
    let text = run.await.unwrap();
    let last = text.lines().last().unwrap_or_default();
    assert!(
        last.contains("\"type\":\"error\"") && last.contains("\"code\":\"shutting_down\""),
        "{text}"
    );
}

/// A command that finishes within the grace period is not cut short.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_lets_short_commands_finish() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config_file(&dir, "server:\n  shutdown_grace_secs: 20\n");
    let gw = Gateway::start(&["--config", cfg.to_str().unwrap()]);
    let url = gw.raw_url();
    let started = dir.path().join("started");
    let script = format!(": > '{}'; sleep 1; echo finished", started.display());
    let run = tokio::spawn(async move {
        http()
            .post(url)
            .json(&json!({"executable": "sh", "args": ["-c", script]}))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    });
    assert!(
        wait_until(Duration::from_secs(10), || started.exists()),
        "the command started"
    );
    let (status, _) = support::terminate(gw).await;
    assert!(status.is_some_and(|s| s.success()));
    let text = run.await.unwrap();
    assert!(text.contains("\"code\":0"), "{text}");
    let _ = std::io::stderr().flush();
}

/// The `remote` backend (what run-remote and `mcp-run stdio --backend remote` use): dropping
/// an execution closes the connection, and the gateway kills the command.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_backend_cancel_kills_the_remote_command() {
    use mcp_run::contract::{Event, RunRequest};
    let gw = Gateway::start(&[]);
    let remote = mcp_run::RemoteExecutor::new(&gw.raw_url(), None).unwrap();
    let req = RunRequest {
        executable: "sh".into(),
        args: vec!["-c".into(), "echo $$; exec sleep 300".into()],
        ..Default::default()
    };
    let mut execution = remote
        .run(&req, tokio_util::sync::CancellationToken::new())
        .await
        .unwrap();
    let pid: i32 = match execution.next().await {
        Some(Event::Stdout { data }) => String::from_utf8_lossy(&data).trim().parse().unwrap(),
        other => panic!("unexpected {other:?}"),
    };
    assert!(pid_alive(pid));
    drop(execution);
    assert!(
        tokio::task::spawn_blocking(move || wait_until(Duration::from_secs(2), || !pid_alive(pid)))
            .await
            .unwrap(),
        "remote command {pid} still alive"
    );
}

/// A client that stops reading stops the command: the gateway reads the pipes only as fast
/// as the client reads the response, so memory stays bounded whatever the output size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_client_back_pressures_the_command() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let gw = Gateway::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("finished");
    let script = format!("head -c 200000000 /dev/zero; touch {}", marker.display());
    let body = json!({"executable": "sh", "args": ["-c", script]}).to_string();
    let mut sock = tokio::net::TcpStream::connect(gw.base.trim_start_matches("http://"))
        .await
        .unwrap();
    let req = format!(
        "POST /raw HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    sock.write_all(req.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 64 * 1024];
    let mut total = 0usize;
    while total < 1024 * 1024 {
        total += sock.read(&mut buf).await.unwrap();
    }
    // The client pauses: the command must be blocked on its pipe, far from done. A negative
    // check (the command must not finish), so inherently a wait.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        !marker.exists(),
        "the command ran ahead of a client that stopped reading"
    );
    // Reading on lets it finish.
    let t = Instant::now();
    let mut tail = Vec::new();
    loop {
        // `Connection: close`: the server closes the connection after the last event.
        let n = tokio::time::timeout(Duration::from_secs(60), sock.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        if n == 0 {
            break;
        }
        total += n;
        tail.extend_from_slice(&buf[..n]);
        let keep = tail.len().saturating_sub(256);
        tail.drain(..keep);
        assert!(t.elapsed() < Duration::from_secs(120));
    }
    assert!(
        String::from_utf8_lossy(&tail).contains("\"type\":\"exit\",\"code\":0"),
        "ends with exit 0"
    );
    assert!(
        total > 200_000_000,
        "all output arrived ({total} bytes with framing)"
    );
    assert!(wait_until(Duration::from_secs(5), || marker.exists()));
}

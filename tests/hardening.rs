//! Issue 15, through the real binary: what an adversarial client must not get from the
//! gateway (foreign hosts, policy bypass through the environment, protocol edges).

use crate::support;

use std::process::{Command, Stdio};

use support::wire::{self, exchange, post_raw, request};
use support::{Gateway, config_file, gateway_bin};

/// A command that leaves a mark when it runs.
fn touch_body(mark: &std::path::Path) -> String {
    serde_json::json!({"executable": "touch", "args": [mark]}).to_string()
}

#[test]
fn foreign_hosts_and_origins_are_refused_on_every_endpoint() {
    let gw = Gateway::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let mark = dir.path().join("ran");

    // DNS rebinding: the page's origin resolves to 127.0.0.1 but the browser sends its name.
    let a = exchange(
        &gw,
        &post_raw("rebind.attacker.example", &touch_body(&mark)),
    );
    assert_eq!(
        (a.status, a.code()),
        (403, "forbidden_host".into()),
        "{}",
        a.text()
    );
    assert!(!mark.exists(), "the command ran for a foreign Host");

    let a = exchange(
        &gw,
        &request(
            "POST",
            "/raw",
            "127.0.0.1",
            &[
                "Content-Type: application/json",
                "Origin: http://evil.example",
            ],
            touch_body(&mark).as_bytes(),
        ),
    );
    assert_eq!(
        (a.status, a.code()),
        (403, "forbidden_host".into()),
        "{}",
        a.text()
    );
    assert!(!mark.exists(), "the command ran for a foreign Origin");

    for (method, path) in [("GET", "/capabilities"), ("POST", "/mcp"), ("GET", "/nope")] {
        let a = exchange(&gw, &request(method, path, "evil.example:80", &[], b""));
        assert_eq!(
            (a.status, a.code()),
            (403, "forbidden_host".into()),
            "{path}"
        );
    }
    // The probes answer whatever the Host (the kubelet uses the pod IP).
    let a = exchange(&gw, &request("GET", "/healthz", "10.1.2.3:8080", &[], b""));
    assert_eq!(a.status, 200, "{}", a.text());

    // Loopback names, with or without port, run.
    let a = exchange(&gw, &post_raw(&wire::addr(&gw), &touch_body(&mark)));
    assert_eq!(a.status, 200, "{}", a.text());
    assert!(mark.exists());
    let a = exchange(
        &gw,
        &request(
            "GET",
            "/capabilities",
            "localhost",
            &["Origin: http://localhost:3000"],
            b"",
        ),
    );
    assert_eq!(a.status, 200, "{}", a.text());
}

#[test]
fn configured_service_names_are_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config_file(
        &dir,
        "server:\n  allowed_hosts: [mcp-run.tools.svc, mcp-run.tools.svc.cluster.local]\n",
    );
    let gw = Gateway::start(&["--config", cfg.to_str().unwrap()]);
    let ok = exchange(
        &gw,
        &request("GET", "/capabilities", "mcp-run.tools.svc:8080", &[], b""),
    );
    assert_eq!(ok.status, 200, "{}", ok.text());
    let no = exchange(&gw, &request("GET", "/capabilities", "localhost", &[], b""));
    assert_eq!(no.code(), "forbidden_host");
}

/// Starts `mcp-run serve ARGS`; returns whether it came to listen, and its log so far.
fn serve_outcome(args: &[&str], env: &[(&str, &str)]) -> (bool, String) {
    use std::io::BufRead;
    let mut cmd = Command::new(gateway_bin());
    cmd.arg("serve")
        .args(args)
        .env_remove("MCP_RUN_AUTH_TOKENS")
        .env_remove("MCP_RUN_AUTH_TOKENS_FILE")
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("start");
    let stderr = child.stderr.take().unwrap();
    let mut log = String::new();
    let mut listening = false;
    // The gateway either says it listens or exits; a start that hangs fails the read below
    // only through the test harness, so the kill comes first.
    for line in std::io::BufReader::new(stderr).lines() {
        let Ok(line) = line else { break };
        log.push_str(&line);
        log.push('\n');
        if line.contains("listening") {
            listening = true;
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    (listening, log)
}

/// `serve` on a non-loopback address: refused without auth, allowed with a warning when the
/// operator says so.
#[test]
fn non_loopback_without_auth_needs_an_explicit_flag() {
    let (listening, log) = serve_outcome(&["--listen", "0.0.0.0:0"], &[]);
    assert!(!listening, "started without auth: {log}");
    assert!(log.contains("--insecure-no-auth"), "{log}");

    let (listening, log) = serve_outcome(&["--listen", "0.0.0.0:0", "--insecure-no-auth"], &[]);
    assert!(listening && log.contains("WITHOUT auth"), "{log}");

    let (listening, log) = serve_outcome(
        &["--listen", "0.0.0.0:0"],
        &[("MCP_RUN_AUTH_TOKENS", "ci:0123456789abcdef0123")],
    );
    assert!(listening && !log.contains("WITHOUT auth"), "{log}");
}

fn gateway_with(yaml: &str) -> (Gateway, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config_file(&dir, yaml);
    (Gateway::start(&["--config", cfg.to_str().unwrap()]), dir)
}

fn post(gw: &Gateway, body: &str) -> wire::Answer {
    exchange(gw, &post_raw(&wire::addr(gw), body))
}

#[test]
fn only_the_documented_object_is_a_request() {
    let gw = Gateway::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let mark = dir.path().join("ran");
    let body = serde_json::json!(["touch", [mark]]).to_string();
    let a = post(&gw, &body);
    assert_eq!(
        (a.status, a.code()),
        (400, "invalid_request".into()),
        "{}",
        a.text()
    );
    assert!(!mark.exists(), "an array body ran");
}

#[test]
fn arguments_too_big_for_the_os_are_the_clients_error() {
    let (gw, _dir) = gateway_with("server:\n  max_body_bytes: 8388608\n");
    let big = "x".repeat(200_000);
    let a = post(
        &gw,
        &serde_json::json!({"executable": "echo", "args": [big]}).to_string(),
    );
    assert_eq!(
        (a.status, a.code()),
        (400, "invalid_request".into()),
        "{}",
        a.text()
    );
    assert!(a.text().contains("args[0]"), "{}", a.text());
    // Together over ARG_MAX (2 MiB here), each under the one-string limit.
    let many: Vec<String> = (0..40).map(|_| "y".repeat(100_000)).collect();
    let a = post(
        &gw,
        &serde_json::json!({"executable": "echo", "args": many}).to_string(),
    );
    assert_eq!(
        (a.status, a.code()),
        (413, "payload_too_large".into()),
        "{}",
        a.text()
    );
}

#[test]
fn a_half_closed_request_still_gets_its_whole_answer() {
    let gw = Gateway::start(&[]);
    let mut s = wire::connect(&gw);
    let body = serde_json::json!({"executable": "sh", "args": ["-c", "sleep 1; echo done"]});
    std::io::Write::write_all(&mut s, &post_raw("localhost", &body.to_string())).unwrap();
    wire::half_close(&s);
    let a = wire::read_answer(&mut s);
    let text = a.text();
    assert!(
        text.contains(r#""type":"exit","code":0"#) && text.contains("ZG9uZQo="),
        "{text}"
    );
}

#[test]
fn new_requests_during_shutdown_get_503_shutting_down() {
    let (mut gw, dir) = gateway_with("server:\n  shutdown_grace_secs: 10\n");
    // A run that is still going when SIGTERM comes, read to its end on another thread.
    let mut running = wire::connect(&gw);
    let started = dir.path().join("started");
    let script = format!(": > '{}'; sleep 3; echo late", started.display());
    let body = serde_json::json!({"executable": "sh", "args": ["-c", script]});
    std::io::Write::write_all(&mut running, &post_raw("localhost", &body.to_string())).unwrap();
    let reader = std::thread::spawn(move || wire::read_answer(&mut running));
    assert!(
        support::wait_until(std::time::Duration::from_secs(10), || started.exists()),
        "the run started"
    );
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(gw.pid().unwrap() as i32),
        nix::sys::signal::SIGTERM,
    )
    .unwrap();
    assert!(support::wait_until(
        std::time::Duration::from_secs(5),
        || gw.log_text().contains("shutting down")
    ));
    let a = post(&gw, r#"{"executable":"true"}"#);
    assert_eq!(
        (a.status, a.code()),
        (503, "shutting_down".into()),
        "{}",
        a.text()
    );
    let first = reader.join().unwrap();
    assert!(first.text().contains("bGF0ZQo="), "{}", first.text());
    assert!(gw.terminate().is_some());
}

#[test]
fn huge_command_lines_and_bad_token_floods_do_not_flood_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config_file(&dir, "policy:\n  executables:\n    allow: [echo]\n");
    let mut gw = Gateway::start_with_env(
        &["--config", cfg.to_str().unwrap()],
        &[("MCP_RUN_AUTH_TOKENS", "ci:0123456789abcdef0123")],
    );
    let before = gw.log_text().len();
    let big = "z".repeat(500_000);
    let body = serde_json::json!({"executable": "cat", "args": [big]}).to_string();
    let a = exchange(
        &gw,
        &request(
            "POST",
            "/raw",
            "localhost",
            &[
                "Content-Type: application/json",
                "Authorization: Bearer 0123456789abcdef0123",
            ],
            body.as_bytes(),
        ),
    );
    assert_eq!(a.code(), "policy_violation");
    for _ in 0..100 {
        let a = exchange(
            &gw,
            &request(
                "GET",
                "/capabilities",
                "localhost",
                &["Authorization: Bearer wrong"],
                b"",
            ),
        );
        assert_eq!(a.status, 401);
    }
    // Every line of the flood is in the log once the gateway has stopped and its last line
    // ("stopped") has been read.
    assert!(gw.terminate().is_some());
    assert!(
        support::wait_until(std::time::Duration::from_secs(10), || gw
            .log_text()
            .lines()
            .any(|l| l.ends_with(" stopped"))),
        "{}",
        gw.log_text()
    );
    let log = gw.log_text();
    let grown = log.len() - before;
    assert!(grown < 30_000, "the log grew by {grown} bytes");
    let lines = log.matches("unauthorized").count();
    assert!(lines <= 25, "{lines} lines for refused tokens");
}

#[test]
fn secrets_do_not_leak_through_refusals_or_logs() {
    const SECRET: &str = "hunter2-s3cr3t-value";
    let dir = tempfile::tempdir().unwrap();
    let cfg = config_file(
        &dir,
        &format!("redaction:\n  secrets: [{SECRET}]\npolicy:\n  executables:\n    allow: [echo]\n"),
    );
    // Debug level: every crate's lines (rmcp logs tool arguments there) go through redaction.
    let gw = Gateway::start_with_env(
        &["--config", cfg.to_str().unwrap()],
        &[("RUST_LOG", "debug")],
    );
    for body in [
        serde_json::json!({"executable": SECRET}),
        serde_json::json!({"executable": "echo", "profile": SECRET}),
        serde_json::json!({"executable": "echo", "env": {format!("{SECRET}!"): "x"}}),
        serde_json::json!({"executable": "echo", "args": SECRET}),
        serde_json::json!({"executable": "echo", "timeout_secs": SECRET}),
    ] {
        let a = post(&gw, &body.to_string());
        assert!(a.status >= 400, "{}", a.text());
        assert!(
            !a.text().contains(SECRET),
            "leaked in the answer: {}",
            a.text()
        );
    }
    assert!(
        support::wait_until(std::time::Duration::from_secs(5), || gw
            .log_text()
            .contains("[REDACTED]")),
        "{}",
        gw.log_text()
    );
    let log = gw.log_text();
    assert!(!log.contains(SECRET), "leaked in the log: {log}");
}

#[test]
fn requests_hyper_cannot_parse_get_a_json_error_too() {
    let gw = Gateway::start(&[]);
    for bad in [&b"X-A: b\x01c"[..], b"X\x01A: b", b"no colon here"] {
        let mut req =
            b"GET /capabilities HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n".to_vec();
        req.extend_from_slice(bad);
        req.extend_from_slice(b"\r\n\r\n");
        let a = exchange(&gw, &req);
        assert_eq!(
            (a.status, a.code()),
            (400, "invalid_request".into()),
            "{}",
            a.text()
        );
    }
}

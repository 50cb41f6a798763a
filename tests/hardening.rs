//! Issue 15, through the real binary: what an adversarial client must not get from the
//! gateway (foreign hosts, policy bypass through the environment, protocol edges).

mod support;

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

//! Auth, the concurrency limit and the rate limit through the real gateway, `run-remote`
//! and an MCP client.

use crate::support;

use std::time::Duration;

use serde_json::json;
use support::{Gateway, config_file, gateway_bin, http, raw};

const TOKEN_CI: &str = "ci-token-0123456789abcdef";
const TOKEN_DEV: &str = "dev-token-0123456789abcdef";

fn with_tokens(yaml: &str) -> (Gateway, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, format!("# tokens\nci:{TOKEN_CI}\n")).unwrap();
    // Two identities on the local backend (they trust each other here).
    let config = config_file(
        &dir,
        &format!("local:\n  allow_multiple_identities: true\n{yaml}"),
    );
    let gw = Gateway::start_with_env(
        &["--config", config.to_str().unwrap()],
        &[
            ("MCP_RUN_AUTH_TOKENS_FILE", tokens.to_str().unwrap()),
            ("MCP_RUN_AUTH_TOKENS", &format!("dev:{TOKEN_DEV}")),
        ],
    );
    (gw, dir)
}

async fn post_raw(gw: &Gateway, token: Option<&str>, body: serde_json::Value) -> reqwest::Response {
    let mut r = http()
        .post(gw.raw_url())
        .header("content-type", "application/json")
        .body(body.to_string());
    if let Some(t) = token {
        r = r.bearer_auth(t);
    }
    r.send().await.unwrap()
}

#[tokio::test]
async fn auth_on_protects_raw_mcp_and_capabilities_but_not_probes() {
    let (gw, _dir) = with_tokens("");
    let body = json!({"executable": "echo", "args": ["hi"]});
    for token in [None, Some("wrong-token-0123456789"), Some("")] {
        let resp = post_raw(&gw, token, body.clone()).await;
        assert_eq!(resp.status(), 401, "{token:?}");
        assert_eq!(
            resp.headers()["www-authenticate"].to_str().unwrap(),
            "Bearer realm=\"mcp-run\""
        );
        let b: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(b["error"]["code"], "unauthorized", "{b}");
    }
    for token in [TOKEN_CI, TOKEN_DEV] {
        let resp = post_raw(&gw, Some(token), body.clone()).await;
        assert_eq!(resp.status(), 200);
        assert!(resp.text().await.unwrap().contains("\"exit\""));
    }
    let c = http();
    for open in ["/healthz", "/readyz", "/metrics"] {
        assert_eq!(
            c.get(gw.url(open)).send().await.unwrap().status(),
            200,
            "{open}"
        );
    }
    assert_eq!(
        c.get(gw.url("/capabilities"))
            .send()
            .await
            .unwrap()
            .status(),
        401
    );
    let caps = c
        .get(gw.url("/capabilities"))
        .bearer_auth(TOKEN_CI)
        .send()
        .await
        .unwrap();
    assert_eq!(caps.status(), 200);
    let mcp = c
        .post(gw.url("/mcp"))
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .body(r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{}}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(mcp.status(), 401);

    // MCP with the token: initialize, a call; the audit line names the identity.
    {
        use rmcp::ServiceExt as _;
        use rmcp::transport::StreamableHttpClientTransport;
        use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
        let _ = rustls::crypto::ring::default_provider().install_default();
        let transport = StreamableHttpClientTransport::from_config(
            StreamableHttpClientTransportConfig::with_uri(gw.url("/mcp")).auth_header(TOKEN_DEV),
        );
        let client = ().serve(transport).await.expect("MCP initialize with a token");
        let r = client
            .call_tool(
                rmcp::model::CallToolRequestParams::new("run_network_tool").with_arguments(
                    json!({"executable": "echo", "args": ["via-mcp"]})
                        .as_object()
                        .cloned()
                        .unwrap(),
                ),
            )
            .await
            .unwrap();
        assert_eq!(r.is_error, Some(false));
        client.cancel().await.ok();
    }

    // run-remote sends RUN_REMOTE_TOKEN; without it, it fails with 125 and says why.
    let out = gw
        .run_remote()
        .env("RUN_REMOTE_TOKEN", TOKEN_CI)
        .args(["--", "echo", "remote"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.stdout, b"remote\n");
    // A token read from a file or a Secret's key keeps its newline: still the token.
    let out = gw
        .run_remote()
        .env("RUN_REMOTE_TOKEN", format!("{TOKEN_CI}\n"))
        .args(["--", "echo", "remote"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let out = gw.run_remote().args(["--", "echo", "x"]).output().unwrap();
    assert_eq!(out.status.code(), Some(125));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("unauthorized") && err.contains("RUN_REMOTE_TOKEN"),
        "{err}"
    );
}

/// The whole behavioural suite (one test per check) through a gateway that asks for a token,
/// as the e2e suite meets a Helm-installed gateway (auth is on by default there): the harness
/// sends it on every request and to run-remote.
struct TokenHost {
    gw: Gateway,
    _dir: tempfile::TempDir,
}

impl support::suite::Host for TokenHost {
    fn gateway(&self) -> &Gateway {
        &self.gw
    }
}

fn token_host() -> TokenHost {
    let (mut gw, dir) = with_tokens("");
    gw.token = Some(TOKEN_CI.into());
    TokenHost { gw, _dir: dir }
}

support::suite::behavioural_suite!(token_host());

#[tokio::test]
async fn the_harness_is_refused_without_the_token() {
    let (gw, _dir) = with_tokens("");
    assert_eq!(raw(&gw, json!({"executable": "true"})).await.status, 401);
}

#[tokio::test]
async fn auth_off_needs_no_token() {
    let gw = Gateway::start(&[]);
    let r = raw(&gw, json!({"executable": "true"})).await;
    assert_eq!(r.status, 200);
    let out = gw.run_remote().args(["--", "true"]).output().unwrap();
    assert_eq!(out.status.code(), Some(0));
}

#[test]
fn auth_required_without_tokens_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let path = config_file(&dir, "auth:\n  required: true\n");
    let out = std::process::Command::new(gateway_bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--config"])
        .arg(&path)
        .env_remove("MCP_RUN_AUTH_TOKENS")
        .env_remove("MCP_RUN_AUTH_TOKENS_FILE")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("auth.required"), "{err}");
}

/// With `max_concurrent_executions: 2`, a third command while two run gets 429 with
/// `Retry-After`, and a slot frees when a command ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrency_burst_gets_429() {
    let dir = tempfile::tempdir().unwrap();
    let path = config_file(&dir, "limits:\n  max_concurrent_executions: 2\n");
    let gw = Gateway::start(&["--config", path.to_str().unwrap()]);
    let c = http();
    let caps = support::get_json(&gw, "/capabilities").await;
    assert!(
        caps["limitations"]
            .to_string()
            .contains("at most 2 commands run at once"),
        "{caps}"
    );
    let long = json!({"executable": "sleep", "args": ["3"]});
    let mut running = Vec::new();
    for _ in 0..2 {
        let resp = c
            .post(gw.raw_url())
            .header("content-type", "application/json")
            .body(long.to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        running.push(resp);
    }
    let burst =
        futures_util::future::join_all((0..5).map(|_| raw(&gw, json!({"executable": "true"}))))
            .await;
    for r in &burst {
        assert_eq!(r.status, 429, "{r:?}");
        let e = &r.rejection.as_ref().unwrap().error;
        assert_eq!(e.code.as_str(), "too_many_requests");
        assert!(
            e.message.contains("limits.max_concurrent_executions"),
            "{}",
            e.message
        );
    }
    let resp = post_raw(&gw, None, json!({"executable": "true"})).await;
    assert_eq!(resp.status(), 429);
    assert_eq!(resp.headers()["retry-after"], "1");
    // Dropping a stream kills its command and frees its slot.
    drop(running.pop());
    let mut ok = false;
    for _ in 0..50 {
        if raw(&gw, json!({"executable": "true"})).await.status == 200 {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(ok, "a slot did not free after a client went away");
}

/// The token bucket is per client: per identity with auth on (one token's burst does not
/// touch another's), per address without.
#[tokio::test]
async fn rate_limit_per_identity() {
    let (gw, _dir) = with_tokens("limits:\n  rate_limit: {per_minute: 6, burst: 3}\n");
    let body = json!({"executable": "true"});
    for _ in 0..3 {
        assert_eq!(
            post_raw(&gw, Some(TOKEN_CI), body.clone()).await.status(),
            200
        );
    }
    let limited = post_raw(&gw, Some(TOKEN_CI), body.clone()).await;
    assert_eq!(limited.status(), 429);
    // 6 per minute: one token every 10 s.
    let retry: u64 = limited.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=10).contains(&retry), "{retry}");
    let b: serde_json::Value = limited.json().await.unwrap();
    assert!(
        b["error"]["message"]
            .as_str()
            .unwrap()
            .contains("limits.rate_limit"),
        "{b}"
    );
    // The other identity has its own bucket.
    assert_eq!(
        post_raw(&gw, Some(TOKEN_DEV), body.clone()).await.status(),
        200
    );

    let dir = tempfile::tempdir().unwrap();
    let path = config_file(&dir, "limits:\n  rate_limit: {per_minute: 60, burst: 2}\n");
    let anon = Gateway::start(&["--config", path.to_str().unwrap()]);
    assert_eq!(raw(&anon, body.clone()).await.status, 200);
    assert_eq!(raw(&anon, body.clone()).await.status, 200);
    // Without auth the bucket is the address's; one token a second comes back (the refill
    // itself is checked on the clock in src/rate_limit.rs, not by waiting here).
    let limited = post_raw(&anon, None, body.clone()).await;
    assert_eq!(limited.status(), 429);
    assert_eq!(limited.headers()["retry-after"], "1");
}

#[test]
fn limit_config_errors_name_the_field() {
    for (yaml, field) in [
        (
            "limits:\n  max_concurrent_executions: 0\n",
            "limits.max_concurrent_executions",
        ),
        (
            "limits:\n  rate_limit: {per_minute: 0, burst: 1}\n",
            "limits.rate_limit.per_minute",
        ),
        (
            "limits:\n  rate_limit: {per_minute: 1, burst: 0}\n",
            "limits.rate_limit.burst",
        ),
        ("auth:\n  tokens: [x]\n", "tokens"),
    ] {
        let e = mcp_run::Config::parse(yaml, None).unwrap_err().to_string();
        assert!(e.contains(field), "{yaml}: {e}");
    }
}

/// `mcp-run stdio --backend remote` sends RUN_REMOTE_TOKEN to a gateway with auth on, for
/// `/capabilities` and `/raw`; the gateway's audit names the token's identity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_backend_sends_the_token() {
    use rmcp::ServiceExt as _;
    let (gw, _dir) = with_tokens("");
    let url = gw.raw_url();
    let start = |token: Option<&str>| {
        let mut cmd = tokio::process::Command::new(gateway_bin());
        cmd.args(["stdio", "--backend", "remote", "--server", &url])
            .env_remove("RUN_REMOTE_TOKEN");
        if let Some(t) = token {
            cmd.env("RUN_REMOTE_TOKEN", t);
        }
        rmcp::transport::TokioChildProcess::new(cmd).unwrap()
    };
    let call = rmcp::model::CallToolRequestParams::new("run_network_tool").with_arguments(
        json!({"executable": "echo", "args": ["remote-ok"]})
            .as_object()
            .cloned()
            .unwrap(),
    );

    let c = ().serve(start(Some(TOKEN_DEV))).await.expect("MCP over stdio");
    let info = c.peer_info().unwrap().clone();
    let runtime = &info.capabilities.experimental.as_ref().unwrap()["mcp-run/runtime"];
    assert_eq!(
        runtime["backend"], "local",
        "the gateway's capabilities were read"
    );
    let r = c.call_tool(call.clone()).await.unwrap();
    assert_eq!(r.is_error, Some(false));
    assert_eq!(
        r.structured_content.unwrap()["outputs"][0]["stdout"],
        "remote-ok\n"
    );
    c.cancel().await.ok();
    assert!(support::wait_until(Duration::from_secs(5), || {
        gw.log_text().contains("identity=dev@127.0.0.1")
    }));

    let c = ().serve(start(None)).await.expect("MCP over stdio");
    let r = c.call_tool(call).await.unwrap();
    assert_eq!(r.is_error, Some(true));
    let s = r.structured_content.unwrap();
    assert!(
        s["error"]
            .as_str()
            .unwrap_or_default()
            .starts_with("unauthorized"),
        "{s}"
    );
    c.cancel().await.ok();
}

/// A rotated tokens file (a Kubernetes Secret updated in place) is picked up without a
/// restart: the old token stops working, the new one works, the environment's stays.
#[tokio::test]
async fn rotated_tokens_file_is_reloaded() {
    let (gw, dir) = with_tokens("auth:\n  reload_secs: 1\n");
    let body = json!({"executable": "true"});
    assert_eq!(
        post_raw(&gw, Some(TOKEN_CI), body.clone()).await.status(),
        200
    );
    let rotated = "ci-rotated-token-0123456789";
    std::fs::write(dir.path().join("tokens"), format!("ci:{rotated}\n")).unwrap();
    let mut switched = false;
    for _ in 0..50 {
        if post_raw(&gw, Some(rotated), body.clone()).await.status() == 200 {
            switched = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        switched,
        "the new token was not accepted:\n{}",
        gw.log_text()
    );
    assert_eq!(
        post_raw(&gw, Some(TOKEN_CI), body.clone()).await.status(),
        401
    );
    assert_eq!(
        post_raw(&gw, Some(TOKEN_DEV), body.clone()).await.status(),
        200
    );
    assert!(gw.log_text().contains("tokens reloaded"));
}

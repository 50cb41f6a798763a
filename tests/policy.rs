//! The execution policy through the real gateway: every rule allowed and denied over `/raw`,
//! and configuration errors that name the field.

use crate::support;

use serde_json::{Value, json};
use support::{Gateway, config_file, gateway_bin, raw};

const POLICY: &str = r#"
profiles:
  default: {}
  wide: {}
policy:
  executables:
    allow: [echo, sh, true, /bin/echo, /usr/bin/env]
    deny: [rm]
  args:
    max_count: 3
    max_length: 16
  env:
    allow: ['APP_*', RUST_LOG]
    deny: [APP_SECRET]
  cwd:
    allow: [/tmp, /usr]
  timeout:
    default_secs: 20
    max_secs: 30
  profiles:
    wide:
      executables: {allow: [ls]}
      timeout: {max_secs: 100}
"#;

fn start() -> (Gateway, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let path = config_file(&dir, POLICY);
    let gw = Gateway::start(&["--config", path.to_str().unwrap()]);
    (gw, dir)
}

async fn expect_denied(gw: &Gateway, body: Value, rule: &str) {
    let r = raw(gw, body.clone()).await;
    assert_eq!(r.status, 403, "{body}: {r:?}");
    let e = r.rejection.unwrap().error;
    assert_eq!(e.code.as_str(), "policy_violation", "{body}");
    assert!(e.message.contains(rule), "{body}: {}", e.message);
}

async fn expect_ran(gw: &Gateway, body: Value) -> support::RawRun {
    let r = raw(gw, body.clone()).await;
    assert_eq!(r.status, 200, "{body}: {:?}", r.rejection);
    assert_eq!(r.code(), Some(0), "{body}: {}", r.stderr_str());
    r
}

#[tokio::test]
async fn every_rule_allowed_and_denied_over_raw() {
    let (gw, _dir) = start();

    // Executables: names, absolute paths (normalised), deny by file name.
    expect_ran(&gw, json!({"executable": "echo", "args": ["hi"]})).await;
    let r = expect_ran(
        &gw,
        json!({"executable": "/bin/../bin/echo", "args": ["p"]}),
    )
    .await;
    assert_eq!(r.stdout_str(), "p\n");
    expect_denied(
        &gw,
        json!({"executable": "cat"}),
        "policy.executables.allow",
    )
    .await;
    expect_denied(
        &gw,
        json!({"executable": "/tmp/echo"}),
        "policy.executables.allow",
    )
    .await;
    expect_denied(
        &gw,
        json!({"executable": "rm"}),
        "policy.executables.deny entry \"rm\"",
    )
    .await;
    expect_denied(
        &gw,
        json!({"executable": "/bin/rm"}),
        "policy.executables.deny",
    )
    .await;

    // Arguments.
    expect_ran(&gw, json!({"executable": "true", "args": ["a", "b", "c"]})).await;
    expect_denied(
        &gw,
        json!({"executable": "true", "args": ["a", "b", "c", "d"]}),
        "policy.args.max_count",
    )
    .await;
    expect_denied(
        &gw,
        json!({"executable": "true", "args": ["x".repeat(17)]}),
        "policy.args.max_length",
    )
    .await;

    // Environment.
    let r = expect_ran(
        &gw,
        json!({"executable": "sh", "args": ["-c", "echo $APP_X"], "env": {"APP_X": "1", "RUST_LOG": "d"}}),
    )
    .await;
    assert_eq!(r.stdout_str(), "1\n");
    expect_denied(
        &gw,
        json!({"executable": "true", "env": {"LD_PRELOAD": "/x.so"}}),
        "environment variable LD_PRELOAD is not in policy.env.allow",
    )
    .await;
    expect_denied(
        &gw,
        json!({"executable": "true", "env": {"APP_SECRET": "x"}}),
        "policy.env.deny entry \"APP_SECRET\"",
    )
    .await;

    // Working directory, with `..` normalised before the check and for the run.
    let r = expect_ran(
        &gw,
        json!({"executable": "sh", "args": ["-c", "pwd"], "cwd": "/usr/lib/.."}),
    )
    .await;
    assert_eq!(r.stdout_str(), "/usr\n");
    expect_denied(
        &gw,
        json!({"executable": "true", "cwd": "/tmp/../etc"}),
        "policy.cwd.allow",
    )
    .await;
    expect_denied(
        &gw,
        json!({"executable": "true", "cwd": "/"}),
        "policy.cwd.allow",
    )
    .await;
    expect_ran(&gw, json!({"executable": "true"})).await;

    // Timeouts: the policy maximum, and a profile that raises it and swaps the executables.
    expect_ran(&gw, json!({"executable": "true", "timeout_secs": 30})).await;
    let r = raw(&gw, json!({"executable": "true", "timeout_secs": 31})).await;
    assert_eq!(r.status, 400);
    let e = r.rejection.unwrap().error;
    assert!(
        e.message.contains("policy.timeout.max_secs"),
        "{}",
        e.message
    );
    expect_ran(
        &gw,
        json!({"executable": "ls", "profile": "wide", "timeout_secs": 100, "cwd": "/tmp"}),
    )
    .await;
    expect_denied(
        &gw,
        json!({"executable": "echo", "profile": "wide"}),
        "policy.profiles.wide.executables.allow",
    )
    .await;
}

#[test]
fn invalid_policy_stops_the_gateway_naming_the_field() {
    for (yaml, field) in [
        (
            "policy:\n  cwd:\n    allow: [relative]\n",
            "policy.cwd.allow[0]",
        ),
        (
            "policy:\n  executables:\n    deny: [bin/rm]\n",
            "policy.executables.deny[0]",
        ),
        (
            "policy:\n  profiles:\n    p:\n      timeout: {default_secs: 9, max_secs: 3}\n",
            "policy.profiles.p.timeout.default_secs",
        ),
        ("policy:\n  bogus: 1\n", "bogus"),
        (
            "policy:\n  profiles:\n    typo:\n      args: {max_count: 1}\n",
            "policy.profiles.typo",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let path = config_file(&dir, yaml);
        let out = std::process::Command::new(gateway_bin())
            .args(["serve", "--listen", "127.0.0.1:0", "--config"])
            .arg(&path)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{yaml}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(field) && err.contains("config.yaml"),
            "{yaml}: {err}"
        );
    }
}

/// Over MCP the same rules give an `isError` result carrying the same message, and the
/// capabilities document reports the policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_calls_meet_the_same_policy() {
    use rmcp::ServiceExt as _;
    use rmcp::model::CallToolRequestParams;
    let (gw, _dir) = start();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let transport = rmcp::transport::StreamableHttpClientTransport::from_uri(gw.url("/mcp"));
    let client = ().serve(transport).await.expect("MCP initialize");
    let call = |args: Value| {
        CallToolRequestParams::new("run_network_tool")
            .with_arguments(args.as_object().cloned().unwrap_or_default())
    };
    for (args, rule) in [
        (
            json!({"executable": "rm", "args": ["-rf", "/tmp/x"]}),
            "policy.executables.deny",
        ),
        (json!({"executable": "cat"}), "policy.executables.allow"),
        (
            json!({"executable": "true", "args": ["1", "2", "3", "4"]}),
            "policy.args.max_count",
        ),
        (
            json!({"executable": "true", "env": {"APP_SECRET": "s"}}),
            "policy.env.deny",
        ),
        (
            json!({"executable": "true", "cwd": "/etc"}),
            "policy.cwd.allow",
        ),
        (
            json!({"executable": "true", "args": ["x".repeat(17)]}),
            "policy.args.max_length",
        ),
        (
            json!({"executable": "true", "env": {"HOME": "/"}}),
            "policy.env.allow",
        ),
        (
            json!({"executable": "echo", "profile": "wide"}),
            "policy.profiles.wide.executables.allow",
        ),
    ] {
        let r = client
            .call_tool(call(args.clone()))
            .await
            .expect("tools/call");
        assert_eq!(r.is_error, Some(true), "{args}");
        let s = r.structured_content.clone().expect("structured content");
        let error = s["error"].as_str().unwrap_or_default();
        assert!(
            error.starts_with("policy_violation: ") && error.contains(rule),
            "{args}: {s}"
        );
    }
    // The timeout maximum is an invalid request, as on /raw.
    let r = client
        .call_tool(call(json!({"executable": "true", "timeout_secs": 31})))
        .await
        .expect("tools/call");
    assert_eq!(r.is_error, Some(true));
    let s = r.structured_content.clone().expect("structured content");
    let error = s["error"].as_str().unwrap_or_default();
    assert!(
        error.starts_with("invalid_request: ") && error.contains("policy.timeout.max_secs"),
        "{s}"
    );
    // Allowed: every rule met, and a profile's override.
    for args in [
        json!({"executable": "echo", "args": ["ok"], "cwd": "/usr/lib/..", "env": {"APP_X": "1"}, "timeout_secs": 30}),
        json!({"executable": "ls", "profile": "wide", "timeout_secs": 100}),
    ] {
        let r = client
            .call_tool(call(args.clone()))
            .await
            .expect("tools/call");
        assert_eq!(r.is_error, Some(false), "{args}: {r:?}");
    }
    client.cancel().await.ok();

    let caps = support::get_json(&gw, "/capabilities").await;
    let policy = &caps["policy"];
    assert_eq!(policy["default"]["executables"]["deny"], json!(["rm"]));
    assert_eq!(policy["default"]["max_timeout_secs"], 30);
    assert_eq!(
        policy["profiles"]["wide"]["executables"]["allow"],
        json!(["ls"])
    );
}

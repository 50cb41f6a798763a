//! Redaction and the audit log through the real gateway.

use crate::support;

use serde_json::json;
use support::{Gateway, config_file, raw};

const CONFIG: &str = r#"
redaction:
  secrets: [hunter2-password]
  secrets_env: [DEPLOY_KEY]
  patterns:
    - {regex: 'ghp_[A-Za-z0-9]{10}', max_len: 14}
"#;

const DEPLOY_KEY: &str = "dk-0123456789-abcdef";

fn start() -> (Gateway, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let path = config_file(&dir, CONFIG);
    let gw = Gateway::start_with_env(
        &["--config", path.to_str().unwrap()],
        &[("DEPLOY_KEY", DEPLOY_KEY)],
    );
    (gw, dir)
}

#[tokio::test]
async fn secrets_are_redacted_in_raw_streams_even_split_across_chunks() {
    let (gw, _dir) = start();
    let r = raw(
        &gw,
        json!({"executable": "sh", "args": ["-c",
            "echo pw=hunter2-password; echo key=$K >&2; echo tok=ghp_abcdefghij!"],
            "env": {"K": DEPLOY_KEY}}),
    )
    .await;
    assert_eq!(r.code(), Some(0));
    assert_eq!(r.stdout_str(), "pw=[REDACTED]\ntok=[REDACTED]!\n");
    assert_eq!(r.stderr_str(), "key=[REDACTED]\n");

    // The command writes half of each secret, sleeps (so the halves are separate chunks, and
    // separate events on the wire), then the rest.
    let r = raw(
        &gw,
        json!({"executable": "sh", "args": ["-c",
            "printf 'a hunter2-pa'; sleep 0.5; printf 'ssword b ghp_abcde'; sleep 0.5; printf 'fghij c'"]}),
    )
    .await;
    assert_eq!(r.code(), Some(0));
    assert_eq!(r.stdout_str(), "a [REDACTED] b [REDACTED] c");
    let chunks = r
        .events
        .iter()
        .filter(|e| matches!(e, mcp_run::contract::Event::Stdout { .. }))
        .count();
    assert!(chunks >= 2, "expected several output events, got {chunks}");
    for e in &r.events {
        if let mcp_run::contract::Event::Stdout { data } = e {
            let text = String::from_utf8_lossy(data);
            assert!(
                !text.contains("hunter2") && !text.contains("ssword") && !text.contains("fghij"),
                "a piece of a secret left in one event: {text:?}"
            );
        }
    }
}

#[tokio::test]
async fn secrets_are_redacted_in_run_remote_output() {
    let (gw, _dir) = start();
    let out = gw
        .run_remote()
        .args([
            "--",
            "sh",
            "-c",
            "printf 'x hunter2-'; sleep 0.3; printf 'password y\\n'",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "x [REDACTED] y\n");
}

/// One audit line per execution, with identity, argv (redacted), env names but not values,
/// backend, host, exit, duration and bytes; refusals are audited too.
#[tokio::test]
async fn audit_lines() {
    let (gw, _dir) = start();
    let r = raw(
        &gw,
        json!({"executable": "sh", "args": ["-c", "printf 12345; exit 3", "hunter2-password"],
               "env": {"SOME_VAR": "value-never-logged"}}),
    )
    .await;
    assert_eq!(r.code(), Some(3));
    let r = raw(&gw, json!({"executable": "true", "timeout_secs": 999999})).await;
    assert_eq!(r.status, 400);
    let mut log = String::new();
    assert!(support::wait_until(
        std::time::Duration::from_secs(5),
        || {
            log = gw.log_text();
            log.matches("mcp_run::audit").count() >= 2
        }
    ));
    let line = log
        .lines()
        .find(|l| l.contains("mcp_run::audit") && l.contains("outcome=\"exited\""))
        .unwrap_or_else(|| panic!("no audit line:\n{log}"));
    for field in [
        "identity=127.0.0.1",
        "backend=local",
        "exit_code=3",
        "bytes_out=5",
        "duration_ms=",
        "host=",
        "SOME_VAR",
        "[REDACTED]",
    ] {
        assert!(line.contains(field), "{field} missing: {line}");
    }
    assert!(
        !log.contains("value-never-logged"),
        "an env value was logged:\n{log}"
    );
    assert!(
        !log.contains("hunter2-password"),
        "a secret was logged:\n{log}"
    );
    assert!(
        log.lines()
            .any(|l| l.contains("mcp_run::audit") && l.contains("outcome=\"rejected\"")),
        "{log}"
    );
    // Also where the gateway logs a refused command line (the test log level is debug when
    // MCP_RUN_TEST_LOG=debug, which logs started command lines as well).
    let r = raw(
        &gw,
        json!({"executable": "echo", "args": ["hunter2-password"], "timeout_secs": 999999}),
    )
    .await;
    assert_eq!(r.status, 400);
    assert!(support::wait_until(
        std::time::Duration::from_secs(5),
        || { gw.log_text().matches("outcome=\"rejected\"").count() >= 2 }
    ));
    let log = gw.log_text();
    assert!(log.contains("rejected"), "{log}");
    assert!(
        !log.contains("hunter2-password"),
        "a secret was logged:\n{log}"
    );
}

#[test]
fn redaction_config_errors_name_the_field() {
    let e = mcp_run::Config::parse(
        "redaction:\n  patterns:\n    - {regex: '[', max_len: 4}\n",
        None,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("redaction.patterns[0].regex"), "{e}");
}

/// MCP results are built from the same events: redacted too, also when split.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_are_redacted_in_mcp_results() {
    use rmcp::ServiceExt as _;
    let (gw, _dir) = start();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let transport = rmcp::transport::StreamableHttpClientTransport::from_uri(gw.url("/mcp"));
    let client = ().serve(transport).await.expect("MCP initialize");
    let args = json!({"executable": "sh", "args": ["-c",
        "printf 'k=dk-0123'; sleep 0.3; printf '456789-abcdef\\n'; echo hunter2-password >&2"]});
    let r = client
        .call_tool(
            rmcp::model::CallToolRequestParams::new("run_network_tool")
                .with_arguments(args.as_object().cloned().unwrap()),
        )
        .await
        .unwrap();
    let s = r.structured_content.clone().unwrap();
    assert_eq!(s["outputs"][0]["stdout"], "k=[REDACTED]\n", "{s}");
    assert_eq!(s["outputs"][0]["stderr"], "[REDACTED]\n", "{s}");
    let all = serde_json::to_string(&r).unwrap();
    assert!(
        !all.contains(DEPLOY_KEY) && !all.contains("hunter2"),
        "{all}"
    );
    client.cancel().await.ok();
}

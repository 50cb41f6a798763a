//! Issue 15.5 and 15.9 at `/mcp`, through the real binary: sessions are bounded, errors are
//! JSON, malformed JSON-RPC gets a JSON-RPC error, and a reused request id is refused.

use crate::support;

use std::time::Duration;

use serde_json::{Value, json};
use support::wire::{self, exchange, request};
use support::{Gateway, config_file};

const ACCEPT: &str = "Accept: application/json, text/event-stream";
const JSON: &str = "Content-Type: application/json";

fn gateway_with(yaml: &str, env: &[(&str, &str)]) -> (Gateway, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config_file(&dir, yaml);
    (
        Gateway::start_with_env(&["--config", cfg.to_str().unwrap()], env),
        dir,
    )
}

/// POST /mcp with extra headers; the answer as is.
fn mcp_post(gw: &Gateway, headers: &[&str], body: &Value) -> wire::Answer {
    let mut h = vec![JSON, ACCEPT];
    h.extend_from_slice(headers);
    exchange(
        gw,
        &request("POST", "/mcp", "localhost", &h, body.to_string().as_bytes()),
    )
}

/// The JSON-RPC message of an answer, whether plain JSON or one SSE `data:` line.
fn rpc(a: &wire::Answer) -> Value {
    let text = a.text();
    let json = text
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or(text.trim())
        .to_string();
    serde_json::from_str(&json).unwrap_or_else(|e| panic!("{e}: {text}"))
}

fn session_of(a: &wire::Answer) -> Option<String> {
    a.head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case("mcp-session-id")
            .then(|| v.trim().to_string())
    })
}

fn initialize(gw: &Gateway, auth: &[&str]) -> wire::Answer {
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}});
    mcp_post(gw, auth, &init)
}

/// An initialized session's id.
fn open_session(gw: &Gateway, auth: &[&str]) -> String {
    let a = initialize(gw, auth);
    assert_eq!(a.status, 200, "{}", a.text());
    let sid = session_of(&a).expect("session id");
    let header = format!("Mcp-Session-Id: {sid}");
    let mut h = auth.to_vec();
    h.push(&header);
    let a = mcp_post(
        gw,
        &h,
        &json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
    );
    assert!(a.status < 300, "{}", a.text());
    sid
}

#[test]
fn mcp_errors_are_json_and_malformed_json_rpc_is_a_parse_error() {
    let gw = Gateway::start(&[]);
    let a = exchange(
        &gw,
        &request("POST", "/mcp", "localhost", &[JSON, ACCEPT], b"{not json"),
    );
    assert_eq!(a.status, 400, "{}", a.text());
    assert_eq!(a.json()["error"]["code"], -32700, "{}", a.text());
    assert_eq!(a.json()["jsonrpc"], "2.0");
    // rmcp's own refusals (no Accept header, unknown session) come as JSON error bodies.
    let a = exchange(&gw, &request("GET", "/mcp", "localhost", &[], b""));
    assert!(a.status >= 400, "{}", a.text());
    assert!(!a.code().is_empty(), "{}", a.text());
    let a = mcp_post(
        &gw,
        &["Mcp-Session-Id: nope"],
        &json!({"jsonrpc": "2.0", "id": 2, "method": "ping"}),
    );
    assert!(a.status >= 400, "{}", a.text());
    assert!(!a.code().is_empty(), "{}", a.text());
}

#[test]
fn a_reused_request_id_is_refused_while_the_first_runs() {
    let gw = Gateway::start(&[]);
    let sid = open_session(&gw, &[]);
    let header = format!("Mcp-Session-Id: {sid}");
    let dir = tempfile::tempdir().unwrap();
    let started = dir.path().join("started");
    let script = format!(": > '{}'; sleep 2", started.display());
    let call = json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "run_network_tool", "arguments": {"executable": "sh", "args": ["-c", script]}}});
    let first = {
        let (addr, header, call) = (wire::addr(&gw), header.clone(), call.clone());
        std::thread::spawn(move || {
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
            std::io::Write::write_all(
                &mut s,
                &request(
                    "POST",
                    "/mcp",
                    "localhost",
                    &[JSON, ACCEPT, &header],
                    call.to_string().as_bytes(),
                ),
            )
            .unwrap();
            wire::read_answer(&mut s)
        })
    };
    assert!(
        support::wait_until(Duration::from_secs(10), || started.exists()),
        "the first call runs"
    );
    let second = mcp_post(&gw, &[&header], &call);
    assert_eq!(second.status, 409, "{}", second.text());
    assert_eq!(second.json()["error"]["code"], -32600);
    assert_eq!(second.json()["id"], 7);
    let first = first.join().unwrap();
    assert_eq!(rpc(&first)["id"], 7, "{}", first.text());
    assert!(rpc(&first)["result"].is_object(), "{}", first.text());
    // Once answered, the id is free again.
    let quick = json!({"jsonrpc": "2.0", "id": 7, "method": "ping"});
    let again = mcp_post(&gw, &[&header], &quick);
    assert_eq!(again.status, 200, "{}", again.text());
}

#[test]
fn sessions_are_capped_in_total_and_per_client_and_expire() {
    let (gw, _dir) = gateway_with(
        "mcp:\n  max_sessions: 3\n  max_sessions_per_client: 2\nlocal:\n  allow_multiple_identities: true\n",
        &[(
            "MCP_RUN_AUTH_TOKENS",
            "a:aaaaaaaaaaaaaaaaaaaa,b:bbbbbbbbbbbbbbbbbbbb",
        )],
    );
    let a = ["Authorization: Bearer aaaaaaaaaaaaaaaaaaaa"];
    let b = ["Authorization: Bearer bbbbbbbbbbbbbbbbbbbb"];
    open_session(&gw, &a);
    open_session(&gw, &a);
    let over = initialize(&gw, &a);
    assert_eq!(
        (over.status, over.code()),
        (429, "too_many_requests".into()),
        "{}",
        over.text()
    );
    assert!(over.text().contains("per client"), "{}", over.text());
    open_session(&gw, &b);
    let over = initialize(&gw, &b);
    assert_eq!(
        (over.status, over.code()),
        (429, "too_many_requests".into()),
        "{}",
        over.text()
    );
    assert!(over.text().contains("mcp.max_sessions"), "{}", over.text());

    // Idle sessions expire and their slots come back.
    let (gw, _dir) = gateway_with(
        "mcp:\n  max_sessions_per_client: 1\n  session_idle_secs: 1\n",
        &[],
    );
    let sid = open_session(&gw, &[]);
    assert_eq!(initialize(&gw, &[]).status, 429);
    // Polled with new sessions, which do not touch the idle one.
    let freed = support::wait_until(Duration::from_secs(15), || {
        initialize(&gw, &[]).status == 200
    });
    assert!(freed, "the idle session did not expire");
    let header = format!("Mcp-Session-Id: {sid}");
    let old = mcp_post(
        &gw,
        &[&header],
        &json!({"jsonrpc": "2.0", "id": 3, "method": "ping"}),
    );
    assert!(old.status >= 400, "{}", old.text());
}

/// DELETE ends a session with 204, as the official Python SDK expects (200 or 204; rmcp's
/// own 202 made it warn on every close), and the session is gone afterwards.
#[test]
fn delete_ends_a_session_with_204() {
    let gw = Gateway::start(&[]);
    let sid = open_session(&gw, &[]);
    let header = format!("Mcp-Session-Id: {sid}");
    let version = "MCP-Protocol-Version: 2025-06-18";
    let a = exchange(
        &gw,
        &request("DELETE", "/mcp", "localhost", &[&header, version], b""),
    );
    assert_eq!(a.status, 204, "{}\n{}", a.head, a.text());
    assert!(a.body.is_empty());
    let a = mcp_post(
        &gw,
        &[&header, version],
        &json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"}),
    );
    assert_eq!(a.status, 404, "{}", a.text());
}

/// Issue 24.9: an MCP error that quotes the caller's arguments (serde's "invalid type:
/// string ...") or names an unknown tool or resource has configured secrets redacted, as
/// `/raw` does.
#[test]
fn mcp_errors_redact_configured_secrets() {
    const SECRET: &str = "hunter2-password-0123";
    let (gw, _dir) = gateway_with(&format!("redaction:\n  secrets: [{SECRET}]\n"), &[]);
    let sid = open_session(&gw, &[]);
    let header = format!("Mcp-Session-Id: {sid}");
    let calls = [
        json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "run_network_tool", "arguments": {"executable": "echo", "args": SECRET}}}),
        json!({"jsonrpc": "2.0", "id": 4, "method": "tools/call", "params": {"name": SECRET, "arguments": {}}}),
        json!({"jsonrpc": "2.0", "id": 5, "method": "resources/read", "params": {"uri": format!("mcp-run://{SECRET}")}}),
    ];
    for call in calls {
        let a = mcp_post(&gw, &[&header], &call);
        let text = a.text();
        assert!(
            text.contains("error") || text.contains("isError"),
            "not an error: {text}"
        );
        assert!(!text.contains(SECRET), "the secret came back: {text}");
        assert!(text.contains("[REDACTED]"), "{text}");
    }
    assert!(!gw.log_text().contains(SECRET), "the secret was logged");
}

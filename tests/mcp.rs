//! MCP through the real binaries, with rmcp's client: streamable HTTP at `/mcp` on the
//! gateway, `mcp-run stdio` as a child process, and `mcp-run stdio --backend remote` in
//! front of a gateway.

use crate::support;

use std::time::Duration;

use rmcp::ServiceExt as _;
use rmcp::model::{
    CallToolRequestParams, CallToolResult, ReadResourceRequestParams, ResourceContents,
};
use rmcp::service::{RoleClient, RunningService};
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess};
use serde_json::{Value, json};
use support::{Gateway, gateway_bin, http, pid_alive, wait_until};

type Client = RunningService<RoleClient, ()>;

async fn http_client(gw: &Gateway) -> Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let transport = StreamableHttpClientTransport::from_uri(gw.url("/mcp"));
    ().serve(transport).await.expect("MCP initialize over HTTP")
}

async fn stdio_client(args: &[&str]) -> Client {
    let mut cmd = tokio::process::Command::new(gateway_bin());
    cmd.arg("stdio").args(args);
    let transport = TokioChildProcess::new(cmd).expect("start mcp-run stdio");
    ().serve(transport)
        .await
        .expect("MCP initialize over stdio")
}

fn call(args: Value) -> CallToolRequestParams {
    CallToolRequestParams::new("run_network_tool")
        .with_arguments(args.as_object().cloned().unwrap_or_default())
}

async fn tool_call(c: &Client, args: Value) -> CallToolResult {
    c.call_tool(call(args)).await.expect("tools/call")
}

fn structured(r: &CallToolResult) -> Value {
    r.structured_content.clone().expect("structuredContent")
}

fn text(r: &CallToolResult) -> String {
    r.content
        .iter()
        .filter_map(|c| c.as_text().map(|t| t.text.clone()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_initialize_tools_and_calls() {
    let gw = Gateway::start(&[]);
    let c = http_client(&gw).await;

    // initialize: server info and the runtime document as an experimental capability.
    let info = c.peer_info().expect("server info").clone();
    assert_eq!(
        info.server_info.as_ref().map(|s| s.name.as_str()),
        Some("mcp-run")
    );
    let runtime = info
        .capabilities
        .experimental
        .as_ref()
        .and_then(|e| e.get("mcp-run/runtime"))
        .expect("mcp-run/runtime capability");
    assert_eq!(runtime["backend"], "local");
    assert_eq!(runtime["safety_level"], "host-process");
    assert_eq!(runtime["limits"]["stdin"], true);
    assert_eq!(runtime["profiles"][0]["name"], "default");

    // tools/list: valid schemas, annotations.
    let tools = c.list_tools(None).await.unwrap().tools;
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
    assert_eq!(names, ["run_network_tool", "end_session"]);
    let tool = &tools[0];
    assert_eq!(tool.name, "run_network_tool");
    let input = Value::Object((*tool.input_schema).clone());
    let output = Value::Object((*tool.output_schema.clone().expect("outputSchema")).clone());
    jsonschema::meta::validate(&input).expect("input schema is JSON Schema");
    jsonschema::meta::validate(&output).expect("output schema is JSON Schema");
    assert_eq!(input["properties"]["profile"]["enum"], json!(["default"]));
    let a = tool.annotations.clone().expect("annotations");
    assert_eq!(
        (a.read_only_hint, a.destructive_hint, a.open_world_hint),
        (Some(false), Some(true), Some(true))
    );
    let validator = jsonschema::validator_for(&output).unwrap();

    // Success.
    let r = tool_call(
        &c,
        json!({"executable": "sh", "args": ["-c", "echo out; echo err >&2"], "cwd": "/"}),
    )
    .await;
    assert_eq!(r.is_error, Some(false));
    let s = structured(&r);
    assert!(validator.is_valid(&s), "{s}");
    assert_eq!(s["success"], true);
    assert_eq!(s["outputs"][0]["stdout"], "out\n");
    assert_eq!(s["outputs"][0]["stderr"], "err\n");
    assert_eq!(s["outputs"][0]["exit_code"], 0);
    assert_eq!(s["context"]["backend"], "local");
    assert_eq!(s["context"]["cwd"], "/");
    assert!(text(&r).contains("**Status:** ✓ Success"), "{}", text(&r));

    // A non-zero exit, a command that does not exist, a bad request: isError, with reasons.
    let r = tool_call(&c, json!({"executable": "sh", "args": ["-c", "exit 7"]})).await;
    assert_eq!(r.is_error, Some(true));
    assert!(validator.is_valid(&structured(&r)));
    assert_eq!(structured(&r)["outputs"][0]["exit_code"], 7);
    assert!(text(&r).contains("**Exit Code:** 7"));
    let r = tool_call(&c, json!({"executable": "no-such-program-mcp-run"})).await;
    assert_eq!(r.is_error, Some(true));
    assert_eq!(structured(&r)["outputs"][0]["exit_code"], 127);
    let r = tool_call(&c, json!({"executable": "true", "timeout_secs": 99999999})).await;
    assert_eq!(r.is_error, Some(true));
    assert!(validator.is_valid(&structured(&r)));
    assert!(
        structured(&r)["error"]
            .as_str()
            .unwrap()
            .starts_with("invalid_request"),
        "{}",
        structured(&r)
    );
    let r = tool_call(&c, json!({"executable": "true", "shell": true})).await;
    assert_eq!(r.is_error, Some(true));
    // The message names every argument the tool takes, MCP's own too.
    let t = text(&r);
    assert!(t.contains(r#"unknown argument "shell""#), "{t}");
    for name in ["executable", "template", "stdin", "result_chars"] {
        assert!(t.contains(name), "{name} missing from {t}");
    }

    // The capabilities document as a resource, and over HTTP.
    let res = c
        .read_resource(ReadResourceRequestParams::new("mcp-run://capabilities"))
        .await
        .unwrap();
    let doc: Value = match &res.contents[0] {
        ResourceContents::TextResourceContents { text, .. } => serde_json::from_str(text).unwrap(),
        other => panic!("{other:?}"),
    };
    let runtime = Value::Object(runtime.clone());
    assert_eq!(doc, runtime);
    let over_http = support::get_json(&gw, "/capabilities").await;
    assert_eq!(over_http, runtime);
    c.cancel().await.unwrap();
}

/// `notifications/cancelled` for a running call kills its command.
#[tokio::test(flavor = "multi_thread")]
async fn cancellation_kills_the_command() {
    let gw = Gateway::start(&[]);
    let c = http_client(&gw).await;
    let dir = tempfile::tempdir().unwrap();
    let pidfile = dir.path().join("pid");
    let script = format!("echo $$ > {}; exec sleep 300", pidfile.display());
    // Dropping the call (here: at the timeout) makes the client send notifications/cancelled.
    let r = tokio::time::timeout(
        Duration::from_secs(2),
        c.call_tool(call(json!({"executable": "sh", "args": ["-c", script]}))),
    )
    .await;
    assert!(r.is_err(), "the call was still running");
    let pid: i32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(5), || !pid_alive(pid)),
        "process {pid} killed after cancellation"
    );
    // The session goes on.
    assert_eq!(
        tool_call(&c, json!({"executable": "true"})).await.is_error,
        Some(false)
    );
    c.cancel().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_calls_in_one_session() {
    let gw = Gateway::start(&[]);
    let c = http_client(&gw).await;
    let calls = (0..8).map(|i| {
        let c = &c;
        async move {
            let r = tool_call(
                c,
                json!({"executable": "sh", "args": ["-c", format!("sleep 0.5; echo call{i}")]}),
            )
            .await;
            assert_eq!(structured(&r)["outputs"][0]["stdout"], format!("call{i}\n"));
        }
    });
    let t = std::time::Instant::now();
    futures_util::future::join_all(calls).await;
    assert!(
        t.elapsed() < Duration::from_secs(4),
        "ran concurrently: {:?}",
        t.elapsed()
    );
    c.cancel().await.unwrap();
}

/// Sessions over MCP: the tool says when to pass one, calls share the runner, the caller's
/// sessions are a resource, and `end_session` ends one.
#[tokio::test(flavor = "multi_thread")]
async fn sessions_over_http() {
    let gw = Gateway::start(&[]);
    let c = http_client(&gw).await;
    let tools = c.list_tools(None).await.unwrap().tools;
    let run = &tools[0];
    assert!(
        run.description
            .as_deref()
            .unwrap()
            .contains("same `session` name")
    );
    assert!(
        run.input_schema["properties"]["session"]["description"]
            .as_str()
            .unwrap()
            .contains("edit-build-test loop")
    );
    let r = tool_call(
        &c,
        json!({"executable": "sh", "args": ["-c", "echo warm > state; pwd"], "session": "loop"}),
    )
    .await;
    assert_eq!(structured(&r)["context"]["session_call"], 1, "{}", text(&r));
    assert!(
        text(&r).contains("in session `loop` (opened by this call)"),
        "{}",
        text(&r)
    );
    let r = tool_call(
        &c,
        json!({"executable": "cat", "args": ["state"], "session": "loop"}),
    )
    .await;
    assert_eq!(structured(&r)["outputs"][0]["stdout"], "warm\n");
    assert_eq!(structured(&r)["context"]["session_call"], 2);
    let res = c
        .read_resource(ReadResourceRequestParams::new("mcp-run://sessions"))
        .await
        .unwrap();
    let list: Value = match &res.contents[0] {
        ResourceContents::TextResourceContents { text, .. } => serde_json::from_str(text).unwrap(),
        other => panic!("{other:?}"),
    };
    assert_eq!(list["sessions"][0]["name"], "loop");
    assert_eq!(list["sessions"][0]["calls"], 2);
    let end = CallToolRequestParams::new("end_session")
        .with_arguments(json!({"name": "loop"}).as_object().cloned().unwrap());
    let r = c.call_tool(end.clone()).await.unwrap();
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let r = c.call_tool(end).await.unwrap();
    assert_eq!(r.is_error, Some(true));
    assert!(text(&r).contains("no open session"), "{}", text(&r));
    c.cancel().await.unwrap();
}

/// Steps over MCP: one `outputs` entry per step that ran, a "Step N" section each, the run
/// stopped at the first failure unless `continue_on_error`.
#[tokio::test(flavor = "multi_thread")]
async fn steps_over_mcp() {
    let c = stdio_client(&[]).await;
    let r = tool_call(
        &c,
        json!({"steps": [
            {"executable": "sh", "args": ["-c", "echo built > out"]},
            {"executable": "sh", "args": ["-c", "cat out; echo bad >&2; exit 2"]},
            {"executable": "echo", "args": ["never"]}
        ]}),
    )
    .await;
    assert_eq!(r.is_error, Some(true));
    let s = structured(&r);
    assert_eq!(s["success"], false);
    assert_eq!(s["context"]["steps"], 3);
    assert_eq!(s["outputs"].as_array().unwrap().len(), 2, "{s}");
    assert_eq!(s["outputs"][1]["stdout"], "built\n");
    assert_eq!(s["outputs"][1]["stderr"], "bad\n");
    assert_eq!(s["outputs"][1]["exit_code"], 2);
    let md = text(&r);
    assert!(
        md.contains("### Step 1: `sh -c 'echo built > out'`"),
        "{md}"
    );
    assert!(md.contains("### Step 2:"), "{md}");
    assert!(!md.contains("Step 3"), "{md}");
    let r = tool_call(
        &c,
        json!({"steps": [{"executable": "false"}, {"executable": "echo", "args": ["after"]}],
               "continue_on_error": true}),
    )
    .await;
    let s = structured(&r);
    assert_eq!(s["outputs"].as_array().unwrap().len(), 2);
    assert_eq!(s["outputs"][1]["stdout"], "after\n");
    assert_eq!(s["success"], false);
    c.cancel().await.unwrap();
}

/// `mcp-run stdio --session NAME`: every call runs in one runner for the client's lifetime.
#[tokio::test(flavor = "multi_thread")]
async fn stdio_session_for_the_client_s_lifetime() {
    let c = stdio_client(&["--session", "agent"]).await;
    let r = tool_call(
        &c,
        json!({"executable": "sh", "args": ["-c", "echo x > f; pwd"]}),
    )
    .await;
    let home = structured(&r)["outputs"][0]["stdout"]
        .as_str()
        .unwrap()
        .trim()
        .to_owned();
    assert!(home.contains("mcp-run-session-"), "{home}");
    let r = tool_call(&c, json!({"executable": "cat", "args": ["f"]})).await;
    assert_eq!(structured(&r)["outputs"][0]["stdout"], "x\n");
    assert_eq!(structured(&r)["context"]["session"], "agent");
    c.cancel().await.unwrap();
    // The session ends with the client: its directory goes.
    assert!(wait_until(Duration::from_secs(20), || {
        !std::path::Path::new(&home).exists()
    }));
}

#[tokio::test(flavor = "multi_thread")]
async fn stdio_transport() {
    let c = stdio_client(&[]).await;
    let info = c.peer_info().unwrap().clone();
    assert_eq!(
        info.server_info.as_ref().map(|s| s.name.as_str()),
        Some("mcp-run")
    );
    let r = tool_call(&c, json!({"executable": "printf", "args": ["%s", "a b"]})).await;
    assert_eq!(structured(&r)["outputs"][0]["stdout"], "a b");
    c.cancel().await.unwrap();
}

/// `mcp-run stdio --backend remote`: the agent's machine keeps MCP local and runs commands on
/// a gateway.
#[tokio::test(flavor = "multi_thread")]
async fn stdio_remote_backend_uses_the_gateway() {
    let gw = Gateway::start(&[]);
    let url = gw.raw_url();
    let c = stdio_client(&["--backend", "remote", "--server", &url]).await;
    let info = c.peer_info().unwrap().clone();
    let runtime = &info.capabilities.experimental.as_ref().unwrap()["mcp-run/runtime"];
    assert_eq!(runtime["backend"], "local", "the gateway's backend");
    assert_eq!(runtime["gateway"], url);
    let r = tool_call(
        &c,
        json!({"executable": "sh", "args": ["-c", "echo $PPID; exit 2"]}),
    )
    .await;
    assert_eq!(r.is_error, Some(true));
    let s = structured(&r);
    assert_eq!(s["outputs"][0]["exit_code"], 2);
    assert_eq!(s["context"]["backend"], "local");
    // The command ran under the gateway process, not under the stdio server.
    let ppid: u32 = s["outputs"][0]["stdout"]
        .as_str()
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(Some(ppid), gw.pid());
    c.cancel().await.unwrap();
}

/// Host validation: a gateway on a workstation refuses `/mcp` requests for other hosts
/// (DNS rebinding); an empty allow list accepts any.
#[tokio::test]
async fn mcp_host_validation() {
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}});
    let post = |gw: &Gateway| {
        http()
            .post(gw.url("/mcp"))
            .header("host", "evil.example")
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .json(&init)
            .send()
    };
    let gw = Gateway::start(&[]);
    assert_eq!(post(&gw).await.unwrap().status(), 403);
    let dir = tempfile::tempdir().unwrap();
    let cfg = support::config_file(&dir, "mcp:\n  allowed_hosts: []\n");
    let open = Gateway::start(&["--config", cfg.to_str().unwrap()]);
    assert_eq!(post(&open).await.unwrap().status(), 200);
}

/// `run-remote --output-format json|markdown`: the structured result after the command
/// ends, the exit code still mirrored.
#[test]
fn run_remote_output_formats() {
    let gw = Gateway::start(&[]);
    let out = gw
        .run_remote()
        .args([
            "--output-format",
            "json",
            "--",
            "sh",
            "-c",
            "echo out; echo err >&2; exit 3",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    assert_eq!(v["outputs"][0]["stdout"], "out\n");
    assert_eq!(v["outputs"][0]["stderr"], "err\n");
    assert_eq!(v["outputs"][0]["exit_code"], 3);
    assert_eq!(v["context"]["tool"], "run-remote");
    assert_eq!(v["context"]["cwd"], "/");
    let out = gw
        .run_remote()
        .args([
            "--output-format",
            "markdown",
            "--",
            "sh",
            "-c",
            "echo hello",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let md = String::from_utf8(out.stdout).unwrap();
    assert!(
        md.contains("**Status:** ✓ Success") && md.contains("**Output:**\n```\nhello\n```"),
        "{md}"
    );
    // A refusal is rendered too, with run-remote's own exit code.
    let out = gw
        .run_remote()
        .args(["--output-format", "json", "--profile", "nope", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(125));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        v["error"].as_str().unwrap().starts_with("unknown_profile"),
        "{v}"
    );
}

/// A client that sends a progress token gets progress notifications with the latest
/// output line while the command runs.
#[tokio::test(flavor = "multi_thread")]
async fn progress_notifications_carry_the_latest_line() {
    use std::sync::{Arc, Mutex};
    #[derive(Clone, Default)]
    struct Progress(Arc<Mutex<Vec<String>>>);
    impl rmcp::ClientHandler for Progress {
        async fn on_progress(
            &self,
            params: rmcp::model::ProgressNotificationParam,
            _context: rmcp::service::NotificationContext<RoleClient>,
        ) {
            self.0
                .lock()
                .unwrap()
                .push(params.message.unwrap_or_default());
        }
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let gw = Gateway::start(&[]);
    let seen = Progress::default();
    let c = seen
        .clone()
        .serve(StreamableHttpClientTransport::from_uri(gw.url("/mcp")))
        .await
        .unwrap();
    let mut params = call(
        json!({"executable": "sh", "args": ["-c", "echo compiling step1; sleep 2.5; echo done"]}),
    );
    params.meta = Some({
        let mut m = rmcp::model::RequestMetaObject::default();
        m.set_progress_token(rmcp::model::ProgressToken(
            rmcp::model::NumberOrString::Number(7),
        ));
        m
    });
    let r = c.call_tool(params).await.unwrap();
    assert_eq!(r.is_error, Some(false));
    let messages = seen.0.lock().unwrap().clone();
    assert!(
        messages.iter().any(|m| m.contains("compiling step1")),
        "progress: {messages:?}"
    );
    c.cancel().await.unwrap();
}

/// An open MCP session (its server-to-client stream) does not hold the gateway's shutdown;
/// a stray RUN_REMOTE_SERVER does not stop a gateway that does not use it.
#[tokio::test(flavor = "multi_thread")]
async fn gateway_stops_with_an_open_session() {
    let gw = Gateway::start_with_env(&[], &[("RUN_REMOTE_SERVER", "not a url")]);
    let c = http_client(&gw).await;
    assert_eq!(
        tool_call(&c, json!({"executable": "true"})).await.is_error,
        Some(false)
    );
    let t = std::time::Instant::now();
    let (status, _) = support::terminate(gw).await;
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "stopped in {:?}",
        t.elapsed()
    );
    drop(c);
}

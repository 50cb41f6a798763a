//! Operator-declared CLI tools end to end: the real gateway with a `tools:` config, an rmcp
//! client over `/mcp`, and `mcp-run stdio`.

use crate::support;

use rmcp::ServiceExt as _;
use rmcp::model::{CallToolRequestParams, CallToolResult};
use rmcp::service::{RoleClient, RunningService};
use serde_json::{Value, json};
use support::{Gateway, config_file, gateway_bin};

const CONFIG: &str = r#"
policy:
  executables:
    deny: [rm]
redaction:
  secrets: [s3cr3t-value]
tools:
  - name: printer
    description: Prints its argv, one word a line.
    executable: sh
    command: ['-c', 'for a in "$@"; do echo "[$a]"; done; echo err >&2; exit ${EXIT:-0}', printer]
    flags:
      name: {type: string, description: A name, required: true}
      verbose: {type: bool}
      count: {type: number}
      tag: {type: array}
    args: {description: Extra words, max: 2}
  - name: failing
    description: Exits 3 after writing.
    executable: sh
    command: ['-c', 'echo out; echo s3cr3t-value; echo bad >&2; exit 3']
  - name: filtered
    description: Noisy output through the cargo-test template.
    executable: sh
    command: ['-c', 'for i in $(seq 1 40); do echo "noise $i"; echo; done; echo "test result: ok. 9 passed"']
    template: cargo-test
  - name: untemplated
    description: Names a template that does not exist.
    executable: 'true'
    template: no-such-template
  - name: remover
    description: Denied by the policy.
    executable: rm
"#;

type Client = RunningService<RoleClient, ()>;

fn call(name: &str, args: Value) -> CallToolRequestParams {
    CallToolRequestParams::new(name.to_owned())
        .with_arguments(args.as_object().cloned().unwrap_or_default())
}

fn text(r: &CallToolResult) -> String {
    r.content
        .iter()
        .filter_map(|c| c.as_text().map(|t| t.text.clone()))
        .collect()
}

async fn exercise(c: &Client) {
    // Each declared tool is listed with its own schemas next to the built-in tool.
    let tools = c.list_tools(None).await.unwrap().tools;
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
    assert_eq!(
        names,
        [
            "run_network_tool",
            "printer",
            "failing",
            "filtered",
            "untemplated",
            "remover",
            "end_session"
        ]
    );
    let printer = &tools[1];
    let schema = Value::Object((*printer.input_schema).clone());
    assert_eq!(
        schema["properties"]["flags"]["properties"]["verbose"]["type"],
        "boolean"
    );
    assert_eq!(schema["properties"]["flags"]["required"], json!(["name"]));
    assert_eq!(schema["properties"]["args"]["maxItems"], 2);
    let out_schema = Value::Object((*printer.output_schema.clone().unwrap()).clone());
    assert_eq!(
        out_schema["required"],
        json!(["stdout", "stderr", "exitCode"])
    );
    let validator = jsonschema::validator_for(&out_schema).unwrap();

    // Success: flags converted by the reference's rules, in name order, then args.
    let r = c
        .call_tool(call(
            "printer",
            json!({"flags": {"name": "a b", "verbose": true, "count": 2, "tag": ["x", "y"]}, "args": ["w1", "w 2"]}),
        ))
        .await
        .unwrap();
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let s = r.structured_content.clone().unwrap();
    assert!(validator.is_valid(&s), "{s}");
    assert_eq!(
        s["stdout"],
        "[--count]\n[2]\n[--name]\n[a b]\n[--tag]\n[x]\n[--tag]\n[y]\n[--verbose]\n[w1]\n[w 2]\n"
    );
    assert_eq!(s["stderr"], "err\n");
    assert_eq!(s["exitCode"], 0);

    // false, null and empty are omitted.
    let r = c
        .call_tool(call(
            "printer",
            json!({"flags": {"name": "n", "verbose": false, "count": null, "tag": []}}),
        ))
        .await
        .unwrap();
    assert_eq!(r.structured_content.unwrap()["stdout"], "[--name]\n[n]\n");

    // Command error: it ran and exited 3; the output is there, redacted.
    let r = c.call_tool(call("failing", json!({}))).await.unwrap();
    assert_eq!(r.is_error, Some(true));
    let s = r.structured_content.clone().unwrap();
    assert!(validator.is_valid(&s), "{s}");
    assert_eq!(
        s,
        json!({"stdout": "out\n[REDACTED]\n", "stderr": "bad\n", "exitCode": 3})
    );

    // A tool's template filters its output (long enough that the note and the kept lines
    // are shorter than it: an output is never made larger).
    let r = c.call_tool(call("filtered", json!({}))).await.unwrap();
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let out = r.structured_content.unwrap()["stdout"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(out.contains("test result: ok. 9 passed"), "{out}");
    assert!(!out.contains("noise 1\n"), "{out}");

    // Execution errors: nothing ran, no structured output, the reason in the text.
    for (name, args, reason) in [
        (
            "printer",
            json!({"flags": {"name": "n", "all": true}}),
            "undeclared flag \"all\"",
        ),
        (
            "printer",
            json!({"flags": {"name": 5}}),
            "\"name\" must be a string, got a number",
        ),
        ("printer", json!({"flags": {}}), "\"name\" is required"),
        (
            "printer",
            json!({"flags": {"name": "n"}, "args": ["--x"]}),
            "looks like a flag",
        ),
        ("remover", json!({}), "policy_violation"),
        (
            "untemplated",
            json!({}),
            "unknown template \"no-such-template\"",
        ),
    ] {
        let r = c.call_tool(call(name, args.clone())).await.unwrap();
        assert_eq!(r.is_error, Some(true), "{args}");
        assert!(r.structured_content.is_none(), "{args}");
        let t = text(&r);
        assert!(t.contains(reason), "{args}: {t}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declared_tools_over_http() {
    let dir = tempfile::tempdir().unwrap();
    let path = config_file(&dir, CONFIG);
    let gw = Gateway::start(&["--config", path.to_str().unwrap()]);
    let _ = rustls::crypto::ring::default_provider().install_default();
    let transport = rmcp::transport::StreamableHttpClientTransport::from_uri(gw.url("/mcp"));
    let client = ().serve(transport).await.expect("MCP initialize");
    exercise(&client).await;
    client.cancel().await.ok();
    // The audit names each tool run like any execution.
    assert!(support::wait_until(
        std::time::Duration::from_secs(5),
        || { gw.log_text().contains("exit_code=3") }
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declared_tools_over_stdio() {
    let dir = tempfile::tempdir().unwrap();
    let path = config_file(&dir, CONFIG);
    let mut cmd = tokio::process::Command::new(gateway_bin());
    cmd.arg("stdio").arg("--config").arg(&path);
    let transport = rmcp::transport::TokioChildProcess::new(cmd).unwrap();
    let client = ().serve(transport).await.expect("MCP initialize over stdio");
    exercise(&client).await;
    client.cancel().await.ok();
}

#[test]
fn tool_config_errors_name_the_field() {
    for (yaml, field) in [
        (
            "tools:\n  - {name: 'a b', description: d, executable: x}\n",
            "tools[0].name",
        ),
        (
            "tools:\n  - {name: a, description: d, executable: x}\n  - {name: a, description: d, executable: y}\n",
            "tools[1].name",
        ),
        (
            "tools:\n  - {name: a, description: d, executable: x, flags: {'-v': {type: bool}}}\n",
            "tools[0].flags.-v",
        ),
        (
            "tools:\n  - {name: a, description: d, executable: x, profile: nope}\n",
            "tools[0].profile",
        ),
        (
            "tools:\n  - {name: a, description: d, executable: x, flags: {v: {type: maybe}}}\n",
            "maybe",
        ),
    ] {
        let e = mcp_run::Config::parse(yaml, None).unwrap_err().to_string();
        assert!(e.contains(field), "{yaml}: {e}");
    }
}

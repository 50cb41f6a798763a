//! Workspaces over MCP with rmcp's client: `run_network_tool` with a `workspace` id over
//! streamable HTTP, and `mcp-run stdio --backend remote --workspace DIR`, which syncs DIR
//! before every call so that the agent's latest edits are what runs.

use crate::support;

use rmcp::ServiceExt as _;
use rmcp::model::{CallToolRequestParams, CallToolResult};
use rmcp::service::{RoleClient, RunningService};
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess};
use serde_json::{Value, json};
use support::{Gateway, config_file, gateway_bin};

type Client = RunningService<RoleClient, ()>;

fn gateway(dir: &tempfile::TempDir) -> Gateway {
    let cfg = config_file(
        dir,
        &format!(
            "workspaces:\n  local_dir: {}\n  cache_dir: {}\n",
            dir.path().join("runs").display(),
            dir.path().join("cache").display()
        ),
    );
    Gateway::start(&["--config", cfg.to_str().unwrap()])
}

async fn call(c: &Client, args: Value) -> CallToolResult {
    c.call_tool(
        CallToolRequestParams::new("run_network_tool")
            .with_arguments(args.as_object().cloned().unwrap_or_default()),
    )
    .await
    .expect("tools/call")
}

fn structured(r: &CallToolResult) -> Value {
    r.structured_content.clone().expect("structuredContent")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdio_syncs_the_directory_before_every_call() {
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&dir);
    let tree = tempfile::tempdir().unwrap();
    let root = tree.path().canonicalize().unwrap();
    std::fs::create_dir_all(root.join("sub")).unwrap();
    std::fs::write(root.join("sub/f.txt"), "one").unwrap();
    std::fs::write(root.join(".gitignore"), "*.tmp\n").unwrap();
    std::fs::write(root.join("x.tmp"), "ignored").unwrap();
    let mut cmd = tokio::process::Command::new(gateway_bin());
    cmd.args(["stdio", "--backend", "remote", "--server", &gw.raw_url()])
        .arg("--workspace")
        .arg(&root)
        .env("XDG_CACHE_HOME", dir.path());
    let c: Client = ().serve(TokioChildProcess::new(cmd).unwrap()).await.unwrap();
    let sub = root.join("sub");
    let args = json!({"executable": "sh", "args": ["-c", "pwd; cat f.txt; ls ..; test ! -e ../x.tmp"],
                      "cwd": sub.to_str().unwrap()});
    let r = structured(&call(&c, args.clone()).await);
    let out = r["outputs"][0]["stdout"].as_str().unwrap().to_owned();
    assert_eq!(r["outputs"][0]["exit_code"], 0, "{r}");
    assert!(out.contains("/sub\none"), "{out}");
    let first_version = r["context"]["workspace_version"].clone();
    assert!(first_version.is_string(), "{r}");
    // The agent edits the file: the next call runs on the edit, in a new version.
    std::fs::write(root.join("sub/f.txt"), "two").unwrap();
    let r = structured(&call(&c, args).await);
    let out = r["outputs"][0]["stdout"].as_str().unwrap();
    assert!(out.contains("/sub\ntwo"), "{out}");
    assert_ne!(r["context"]["workspace_version"], first_version);
    // A cwd outside the synced directory is refused.
    let r = call(&c, json!({"executable": "true", "cwd": "/"})).await;
    assert_eq!(r.is_error, Some(true));
    c.cancel().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_run_network_tool_takes_a_workspace_id() {
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&dir);
    let tree = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(tree.path().join("d")).unwrap();
    std::fs::write(tree.path().join("d/f"), "content").unwrap();
    // Upload with the library's client, as an agent's tooling would.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let remote = mcp_run::RemoteExecutor::new(&gw.raw_url(), None).unwrap();
    let synced = remote
        .workspace_client()
        .sync_dir(tree.path())
        .await
        .unwrap();
    let c: Client =
        ().serve(StreamableHttpClientTransport::from_uri(gw.url("/mcp")))
            .await
            .unwrap();
    let tools = c.list_tools(None).await.unwrap().tools;
    let schema = serde_json::to_value(&tools[0].input_schema).unwrap();
    assert!(schema["properties"]["workspace"].is_object(), "{schema}");
    let r = structured(
        &call(
            &c,
            json!({"executable": "cat", "args": ["f"], "workspace": synced.workspace, "cwd": "d"}),
        )
        .await,
    );
    assert_eq!(r["outputs"][0]["stdout"], "content", "{r}");
    assert_eq!(r["context"]["workspace"], synced.workspace.as_str());
    assert_eq!(r["context"]["workspace_version"], synced.version.as_str());
    let r = call(&c, json!({"executable": "true", "workspace": "ws_unknown"})).await;
    assert_eq!(r.is_error, Some(true));
    c.cancel().await.unwrap();
}

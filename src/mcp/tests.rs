//! The MCP service in process, over an in-memory pipe, in front of a fake backend that
//! reports start-up phases (as the Kubernetes backend does while a pod is scheduled and its
//! image pulled) and echoes its stdin.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use rmcp::model::{CallToolRequestParams, NumberOrString, ProgressToken, RequestMetaObject};
use rmcp::service::{NotificationContext, RoleClient};
use rmcp::{ClientHandler, ServiceExt};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::{McpConfig, McpService};
use crate::capabilities::Capabilities;
use crate::contract::{ErrorBody, Event, ExitInfo, Phase, RunContext};
use crate::exec::{ExecSpec, Execution, Executor, StartOptions};
use crate::runner::Runner;

struct Fake;

impl Executor for Fake {
    fn name(&self) -> &'static str {
        "fake"
    }

    fn start(
        &self,
        _spec: ExecSpec,
        mut opts: StartOptions,
    ) -> BoxFuture<'_, Result<Execution, ErrorBody>> {
        Box::pin(async move {
            for (phase, message) in [
                (
                    Phase::Scheduling,
                    Some("0/1 nodes are available".to_string()),
                ),
                (Phase::PullingImage, Some("pulling image rust:1".into())),
                (Phase::Running, None),
            ] {
                opts.progress.report(phase, message);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let (tx, rx) = tokio::sync::mpsc::channel(8);
            tokio::spawn(async move {
                let mut input = Vec::new();
                if let Some(stdin) = opts.stdin.as_mut() {
                    while let Some(chunk) = stdin.recv().await {
                        input.extend_from_slice(&chunk);
                    }
                }
                let _ = tx
                    .send(Event::Stdout {
                        data: format!("stdin: {}\n", String::from_utf8_lossy(&input)).into(),
                    })
                    .await;
                let _ = tx
                    .send(Event::Exit(ExitInfo {
                        code: Some(0),
                        signal: None,
                        duration_ms: 1,
                        timed_out: false,
                    }))
                    .await;
            });
            let context = RunContext {
                backend: "fake".into(),
                ..Default::default()
            };
            Ok(Execution::new(context, rx, CancellationToken::new()))
        })
    }
}

#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<String>>>);

impl ClientHandler for Recorder {
    async fn on_progress(
        &self,
        params: rmcp::model::ProgressNotificationParam,
        _context: NotificationContext<RoleClient>,
    ) {
        if let Ok(mut seen) = self.0.lock() {
            seen.push(params.message.unwrap_or_default());
        }
    }
}

async fn call(
    config: &McpConfig,
    args: Value,
    token: bool,
) -> (rmcp::model::CallToolResult, Vec<String>) {
    let runner = Arc::new(Runner::new(
        Arc::new(Fake),
        crate::limits::Limits::default(),
    ));
    let service = McpService::new(runner, Arc::new(Capabilities::default()), config);
    let (client_io, server_io) = tokio::io::duplex(1 << 16);
    tokio::spawn(async move {
        if let Ok(running) = service.serve(tokio::io::split(server_io)).await {
            let _ = running.waiting().await;
        }
    });
    let seen = Recorder::default();
    let client = seen
        .clone()
        .serve(tokio::io::split(client_io))
        .await
        .unwrap();
    let mut params = CallToolRequestParams::new(super::TOOL)
        .with_arguments(args.as_object().cloned().unwrap_or_default());
    if token {
        let mut m = RequestMetaObject::default();
        m.set_progress_token(ProgressToken(NumberOrString::Number(1)));
        params.meta = Some(m);
    }
    let r = client.call_tool(params).await.unwrap();
    client.cancel().await.unwrap();
    let seen = seen.0.lock().unwrap().clone();
    (r, seen)
}

#[tokio::test]
async fn phases_arrive_as_progress_notifications() {
    let (r, seen) = call(&McpConfig::default(), json!({"executable": "x"}), true).await;
    assert_eq!(r.is_error, Some(false));
    assert!(
        seen.iter()
            .any(|m| m == "scheduling: 0/1 nodes are available"),
        "{seen:?}"
    );
    assert!(
        seen.iter()
            .any(|m| m == "pulling_image: pulling image rust:1"),
        "{seen:?}"
    );
    assert!(seen.iter().any(|m| m == "running"), "{seen:?}");
}

#[tokio::test]
async fn stdin_reaches_the_backend_within_its_limit() {
    let config = McpConfig {
        max_stdin_bytes: 10,
        ..McpConfig::default()
    };
    let (r, _) = call(
        &config,
        json!({"executable": "cat", "stdin": "hello"}),
        false,
    )
    .await;
    let s = r.structured_content.unwrap();
    assert_eq!(s["outputs"][0]["stdout"], "stdin: hello\n");
    let (r, _) = call(&config, json!({"executable": "cat"}), false).await;
    assert_eq!(
        r.structured_content.unwrap()["outputs"][0]["stdout"],
        "stdin: \n"
    );
    let (r, _) = call(
        &config,
        json!({"executable": "cat", "stdin": "more than ten bytes"}),
        false,
    )
    .await;
    assert_eq!(r.is_error, Some(true));
    assert!(r.structured_content.is_none());
    let text = r.content[0].as_text().unwrap().text.clone();
    assert!(
        text.contains("stdin is 19 bytes, more than the 10"),
        "{text}"
    );
}

//! MCP over streamable HTTP on a gateway with the Kubernetes backend, against the API-server
//! double (tests/kube_double): while the runner pod starts, progress notifications carry its
//! real phases, as the double's pod goes through them, before the command's output.

use crate::kube_double;
use crate::support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube_double::{DoubleOptions, KubeDouble};
use rmcp::ServiceExt as _;
use rmcp::model::{CallToolRequestParams, ProgressNotificationParam, ProgressToken};
use rmcp::service::{NotificationContext, RoleClient};
use rmcp::transport::StreamableHttpClientTransport;
use serde_json::json;
use support::Gateway;

/// Every progress notification, in the order it arrived: (progress, message).
#[derive(Clone, Default)]
struct Progress(Arc<Mutex<Vec<(f64, String)>>>);

impl rmcp::ClientHandler for Progress {
    async fn on_progress(
        &self,
        params: ProgressNotificationParam,
        _context: NotificationContext<RoleClient>,
    ) {
        self.0
            .lock()
            .unwrap()
            .push((params.progress, params.message.unwrap_or_default()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn progress_carries_the_pod_phases_before_the_output() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    // Each lifecycle step of the double's pod takes this long, so every phase is a state the
    // gateway's watch sees (scheduled, then the image pull, then running).
    let double = KubeDouble::start_with(DoubleOptions {
        step_delay: Duration::from_millis(400),
        ..DoubleOptions::default()
    });
    let kubeconfig = double.kubeconfig();
    let gw = Gateway::start(&[
        "--backend",
        "kube",
        "--kubeconfig",
        kubeconfig.to_str().unwrap(),
    ]);
    let seen = Progress::default();
    let client = seen
        .clone()
        .serve(StreamableHttpClientTransport::from_uri(gw.url("/mcp")))
        .await
        .expect("MCP initialize over HTTP");
    let mut params = CallToolRequestParams::new("run_network_tool").with_arguments(
        json!({"executable": "sh", "args": ["-c", "echo first-line; sleep 2.5; echo done"]})
            .as_object()
            .cloned()
            .unwrap(),
    );
    params.meta = Some({
        let mut m = rmcp::model::RequestMetaObject::default();
        m.set_progress_token(ProgressToken(rmcp::model::NumberOrString::Number(3)));
        m
    });
    let result = client.call_tool(params).await.expect("tools/call");
    assert_eq!(result.is_error, Some(false), "{result:?}");
    let out = result.structured_content.expect("structuredContent");
    assert_eq!(
        out["outputs"][0]["stdout"].as_str(),
        Some("first-line\ndone\n"),
        "{out}"
    );

    let seen = seen.0.lock().unwrap().clone();
    let messages: Vec<&str> = seen.iter().map(|(_, m)| m.as_str()).collect();
    // The progress value increases with every notification (MCP requires it).
    assert!(
        seen.windows(2).all(|w| w[0].0 < w[1].0),
        "progress values: {seen:?}"
    );
    // Each phase the pod went through, in the order it went through them.
    let node = double.options().node_name.clone();
    let at = |prefix: &str| {
        messages
            .iter()
            .position(|m| m.starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix:?} progress in {messages:?}"))
    };
    let scheduling = at("scheduling: pod ");
    let scheduled = at(&format!("scheduled: {node}"));
    let pulling = at("pulling_image: ");
    // `running` alone: the phase (the ticks say `running for N s`).
    let running = messages
        .iter()
        .position(|m| *m == "running")
        .unwrap_or_else(|| panic!("no running phase in {messages:?}"));
    assert!(
        scheduling < scheduled && scheduled < pulling && pulling < running,
        "phases out of order: {messages:?}"
    );
    assert!(
        messages[pulling].contains("ContainerCreating"),
        "{messages:?}"
    );
    // The output comes after the phases: the latest line, once the command runs.
    let output = messages
        .iter()
        .position(|m| m.contains("first-line"))
        .unwrap_or_else(|| panic!("no output line in {messages:?}"));
    assert!(running < output, "output before the pod ran: {messages:?}");
    client.cancel().await.unwrap();
}

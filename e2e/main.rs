//! The behavioural suite against a real Kubernetes cluster: `cargo test --test e2e`.
//!
//! - The cluster comes from `KUBECONFIG` (or `~/.kube/config`). When none is reachable the
//!   run is reported as skipped, with why, and no test passes (so that `cargo test` stays
//!   green anywhere without claiming anything); but when `KUBECONFIG` or
//!   `MCP_RUN_E2E_GATEWAY` is set, a cluster is expected and its absence fails the run.
//! - Its own harness (`harness = false`): libtest cannot report a test skipped at run time.
//! - By default it starts the gateway itself, out of cluster: `mcp-run serve --backend kube
//!   --kubeconfig $KUBECONFIG` with a unique `kubernetes.instance`, runner image
//!   `MCP_RUN_E2E_IMAGE` (default `busybox:1.36`), namespace `MCP_RUN_E2E_NAMESPACE` (default:
//!   the context's).
//! - With `MCP_RUN_E2E_GATEWAY=http://host:port/raw` it tests an installed gateway instead
//!   (e2e/kind.sh does, through a port-forward to the Helm-installed Service), sending the
//!   bearer token `MCP_RUN_E2E_TOKEN` when set.
//! - It ends by checking that no runner pod of the gateway is left in the namespace.

// A test crate has no outside: `pub` here only shares helpers between its modules.
#![allow(unreachable_pub)]

#[path = "../tests/support/mod.rs"]
mod support;

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use support::{Gateway, config_file, raw};

const DEFAULT_IMAGE: &str = "busybox:1.36";

/// The cluster's client and default namespace, or why there is none.
async fn cluster() -> Result<(kube::Client, String), String> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let config = kube::Config::infer()
        .await
        .map_err(|e| format!("no kubeconfig: {e}"))?;
    let ns = config.default_namespace.clone();
    let client = kube::Client::try_from(config).map_err(|e| e.to_string())?;
    match tokio::time::timeout(Duration::from_secs(10), client.apiserver_version()).await {
        Ok(Ok(v)) => {
            eprintln!("e2e: cluster {}.{} ({})", v.major, v.minor, v.git_version);
            Ok((client, ns))
        }
        Ok(Err(e)) => Err(format!("the API server did not answer: {e}")),
        Err(_) => Err("the API server did not answer within 10 s".into()),
    }
}

const NAME: &str = "suite_against_a_real_cluster";

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("tokio runtime");
    println!("\nrunning 1 test");
    let expected = ["KUBECONFIG", "MCP_RUN_E2E_GATEWAY"]
        .into_iter()
        .find(|v| std::env::var_os(v).is_some_and(|s| !s.is_empty()));
    let cluster = match runtime.block_on(cluster()) {
        Ok(c) => c,
        Err(why) => {
            if let Some(var) = expected {
                println!("test {NAME} ... FAILED");
                eprintln!("e2e: {var} is set but no Kubernetes cluster answers: {why}");
                println!("\ntest result: FAILED. 0 passed; 1 failed; 0 skipped\n");
                std::process::exit(1);
            }
            println!("test {NAME} ... skipped: no Kubernetes cluster reachable ({why})");
            println!("\ntest result: ok. 0 passed; 0 failed; 1 skipped\n");
            return;
        }
    };
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        runtime.block_on(suite_against_a_real_cluster(cluster))
    }));
    match outcome {
        Ok(()) => {
            println!("test {NAME} ... ok");
            println!("\ntest result: ok. 1 passed; 0 failed; 0 skipped\n");
        }
        Err(_) => {
            println!("test {NAME} ... FAILED");
            println!("\ntest result: FAILED. 0 passed; 1 failed; 0 skipped\n");
            std::process::exit(101);
        }
    }
}

async fn suite_against_a_real_cluster((client, context_ns): (kube::Client, String)) {
    let image = std::env::var("MCP_RUN_E2E_IMAGE").unwrap_or_else(|_| DEFAULT_IMAGE.into());
    let dir = tempfile::tempdir().unwrap();
    let instance = format!("e2e-{}", std::process::id());
    let (gw, selector) = match std::env::var("MCP_RUN_E2E_GATEWAY") {
        Ok(url) => (
            {
                let mut gw = Gateway::external(&url, "kubernetes");
                // An installed gateway asks for a token when its auth is on (the chart's default).
                gw.token = std::env::var("MCP_RUN_E2E_TOKEN").ok();
                gw
            },
            "app.kubernetes.io/managed-by=mcp-run,app.kubernetes.io/component=runner".to_string(),
        ),
        Err(_) => {
            let ns = std::env::var("MCP_RUN_E2E_NAMESPACE").unwrap_or(context_ns);
            let cfg = config_file(
                &dir,
                &format!(
                    "kubernetes:\n  namespace: {ns}\n  instance: {instance}\n  max_concurrent_pods: 64\n  pod_start_timeout_secs: 300\nprofiles:\n  default:\n    image: {image}\n  cached:\n    image: {image}\n    caches:\n      - {{name: data, path: /cache, env: {{C: .}}, size: 64Mi}}\n"
                ),
            );
            let mut args = vec!["--backend", "kube", "--config", cfg.to_str().unwrap()];
            let kubeconfig = std::env::var("KUBECONFIG").ok();
            if let Some(k) = kubeconfig.as_deref().and_then(|k| k.split(':').next()) {
                args.extend(["--kubeconfig", k]);
            }
            (
                Gateway::start(&args),
                format!("app.kubernetes.io/managed-by=mcp-run,mcp-run.dev/instance={instance}"),
            )
        }
    };
    // Where runner pods go, as the gateway reports it.
    let first = raw(&gw, serde_json::json!({"executable": "true"})).await;
    assert_eq!(
        first.code(),
        Some(0),
        "first command: {first:?}\n{}",
        gw.log_text()
    );
    let ns = first
        .context
        .as_ref()
        .and_then(|c| c.namespace.clone())
        .expect("the started context names the namespace");

    support::suite::run_all(&gw).await;
    if std::env::var_os("MCP_RUN_E2E_GATEWAY").is_none() {
        caches_on_a_real_cluster(&gw, &client, &ns, &instance).await;
    }

    let pods: Api<Pod> = Api::namespaced(client, &ns);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let left: Vec<String> = loop {
        let left: Vec<String> = pods
            .list(&ListParams::default().labels(&selector))
            .await
            .map(|l| {
                l.items
                    .into_iter()
                    .filter(|p| p.metadata.deletion_timestamp.is_none())
                    .filter_map(|p| p.metadata.name)
                    .collect()
            })
            .unwrap_or_else(|e| vec![format!("<cannot list pods: {e}>")]);
        if left.is_empty() || std::time::Instant::now() > deadline {
            break left;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    assert!(left.is_empty(), "runner pods left in {ns}: {left:?}");
}

/// A cache volume on the cluster's default StorageClass: written by one run as the non-root
/// runner (the pod's fsGroup makes the claim writable under `restricted`), read by the next,
/// then its claim deleted (its idle TTL is days).
async fn caches_on_a_real_cluster(gw: &Gateway, client: &kube::Client, ns: &str, instance: &str) {
    use k8s_openapi::api::core::v1::PersistentVolumeClaim;
    let run = |line: &str| {
        serde_json::json!({
            "executable": "sh",
            "args": ["-c", "cat \"$C/log\" 2>/dev/null; echo \"$1\" >> \"$C/log\"", "sh", line],
            "profile": "cached",
            "timeout_secs": 300,
        })
    };
    let first = raw(gw, run("one")).await;
    assert_eq!(
        first.code(),
        Some(0),
        "cache, first run: {first:?}\n{}",
        gw.log_text()
    );
    let second = raw(gw, run("two")).await;
    assert_eq!(
        second.stdout_str(),
        "one\n",
        "cache, second run: {second:?}"
    );
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
    let selector = format!("app.kubernetes.io/component=cache,mcp-run.dev/instance={instance}");
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        let list = claims
            .list(&ListParams::default().labels(&selector))
            .await
            .expect("list the cache claims");
        assert!(list.items.len() <= 1, "one claim per key: {list:?}");
        let held = list.items.iter().any(|c| {
            c.metadata
                .annotations
                .as_ref()
                .is_some_and(|a| a.contains_key("mcp-run.dev/held-by"))
        });
        if !held || std::time::Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let _ = claims
        .delete_collection(
            &Default::default(),
            &ListParams::default().labels(&selector),
        )
        .await;
}

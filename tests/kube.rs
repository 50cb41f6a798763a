//! The Kubernetes backend through the real binaries, against the API-server test double
//! (tests/kube_double): the shared behavioural suite, plus pod cleanup on every path, start
//! failures with their reasons, the reaper, the concurrency limit and the readiness checks.
//! e2e/ runs the same suite against a real cluster.

use crate::kube_double;
use crate::support;

use std::time::{Duration, Instant};

use kube_double::{DoubleOptions, KubeDouble};
use serde_json::json;
use support::{Gateway, config_file, http, raw, wait_until};

const NS: &str = "default";

/// A gateway on the kube backend, pointed at the double.
fn gateway(double: &KubeDouble, extra: &[&str]) -> Gateway {
    let kubeconfig = double.kubeconfig();
    let mut args = vec![
        "--backend",
        "kube",
        "--kubeconfig",
        kubeconfig.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    Gateway::start(&args)
}

/// Waits until the double holds no pod in `NS`.
fn no_pods_left(double: &KubeDouble, within: Duration) {
    let ok = wait_until(within, || double.pod_names(NS).is_empty());
    assert!(ok, "pods left: {:?}", double.pod_names(NS));
}

/// A gateway on its own double; no pod may be left once a check passed.
struct SuiteHost {
    gw: Gateway,
    double: KubeDouble,
}

impl support::suite::Host for SuiteHost {
    fn gateway(&self) -> &Gateway {
        &self.gw
    }
    fn finish(self) {
        no_pods_left(&self.double, Duration::from_secs(10));
    }
}

fn suite_host() -> SuiteHost {
    let double = KubeDouble::start();
    let gw = gateway(&double, &["--max-concurrent-pods", "64"]);
    SuiteHost { gw, double }
}

support::suite::behavioural_suite!(suite_host());

#[tokio::test(flavor = "multi_thread")]
async fn started_context_names_pod_node_and_image_and_the_pod_is_hardened() {
    let double = KubeDouble::start();
    let gw = gateway(&double, &["--image", "registry.example/tools:1"]);
    let r = raw(
        &gw,
        json!({"executable": "sh", "args": ["-c", "sleep 1; echo hi"]}),
    )
    .await;
    let ctx = r.context.clone().expect("context");
    assert_eq!(ctx.backend, "kubernetes");
    assert_eq!(ctx.namespace.as_deref(), Some(NS));
    assert_eq!(ctx.container.as_deref(), Some("runner"));
    assert_eq!(ctx.image.as_deref(), Some("registry.example/tools:1"));
    assert_eq!(ctx.profile.as_deref(), Some("default"));
    assert!(
        ctx.node.as_deref().is_some_and(|n| !n.is_empty()),
        "{ctx:?}"
    );
    assert!(ctx.pod_start_ms.is_some());
    let pod_name = ctx.pod.clone().expect("pod");
    assert_eq!(r.stdout_str(), "hi\n");
    // The pod the gateway created, as the API server stored it.
    let created = double
        .created_pods()
        .into_iter()
        .find(|p| p.metadata.name.as_deref() == Some(&pod_name))
        .expect("the double saw the pod");
    let spec = created.spec.as_ref().unwrap();
    assert_eq!(spec.automount_service_account_token, Some(false));
    assert_eq!(spec.enable_service_links, Some(false));
    assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
    assert!(spec.active_deadline_seconds.is_some_and(|d| d > 600));
    let sc = spec.containers[0].security_context.as_ref().unwrap();
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(
        sc.capabilities.as_ref().unwrap().drop.as_ref().unwrap(),
        &["ALL"]
    );
    assert_eq!(sc.seccomp_profile.as_ref().unwrap().type_, "RuntimeDefault");
    let labels = created.metadata.labels.as_ref().unwrap();
    assert_eq!(labels["app.kubernetes.io/managed-by"], "mcp-run");
    assert_eq!(labels["app.kubernetes.io/component"], "runner");
    assert_eq!(labels["mcp-run.dev/instance"], "mcp-run");
    no_pods_left(&double, Duration::from_secs(5));
    assert!(double.deletions().iter().any(|(_, n)| *n == pod_name));
}

/// The pod goes on every path: exit 0, non-zero, command not found, timeout, client gone,
/// gateway shutdown.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_pod_is_deleted_on_every_path() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let double = KubeDouble::start();
    let dir = tempfile::tempdir().unwrap();
    let cfg = config_file(&dir, "server:\n  shutdown_grace_secs: 1\n");
    let gw = gateway(&double, &["--config", cfg.to_str().unwrap()]);

    for (what, body) in [
        ("success", json!({"executable": "true"})),
        (
            "failure",
            json!({"executable": "sh", "args": ["-c", "exit 3"]}),
        ),
        (
            "not found",
            json!({"executable": "no-such-program-mcp-run"}),
        ),
        (
            "timeout",
            json!({"executable": "sleep", "args": ["30"], "timeout_secs": 1}),
        ),
    ] {
        let before = double.deletions().len();
        let r = raw(&gw, body).await;
        assert!(r.exit.is_some(), "{what}: {r:?}");
        no_pods_left(&double, Duration::from_secs(5));
        assert!(
            double.deletions().len() > before,
            "{what}: deleted through the API"
        );
    }

    // Client gone mid-run: a raw socket closed after the first output.
    let mut sock = tokio::net::TcpStream::connect(gw.base.trim_start_matches("http://"))
        .await
        .unwrap();
    let body = json!({"executable": "sh", "args": ["-c", "echo up; sleep 300"]}).to_string();
    let req = format!(
        "POST /raw HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    sock.write_all(req.as_bytes()).await.unwrap();
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !String::from_utf8_lossy(&seen).contains("\"stdout\"") {
        assert!(
            Instant::now() < deadline,
            "no output: {}",
            String::from_utf8_lossy(&seen)
        );
        let mut chunk = [0u8; 4096];
        let n = sock.read(&mut chunk).await.unwrap();
        assert!(n > 0, "connection closed early");
        seen.extend_from_slice(&chunk[..n]);
    }
    assert_eq!(double.pod_names(NS).len(), 1);
    drop(sock);
    no_pods_left(&double, Duration::from_secs(5));
    assert!(
        wait_until(Duration::from_secs(5), || double.running_execs() == 0),
        "the command was killed with its pod"
    );

    // Shutdown: a running command, SIGTERM, grace 1 s: the pod goes before the gateway exits.
    let gw_url = gw.raw_url();
    let running = tokio::spawn(async move {
        http()
            .post(gw_url)
            .json(&json!({"executable": "sleep", "args": ["300"]}))
            .send()
            .await
            .map(|r| r.status())
    });
    assert!(
        wait_until(Duration::from_secs(10), || double.pod_names(NS).len() == 1),
        "pod for the long command"
    );
    let status = support::terminate(gw).await;
    assert!(
        status.0.is_some_and(|s| s.success()),
        "gateway exit {:?}",
        status.0
    );
    assert!(
        double.pod_names(NS).is_empty(),
        "deleted before the gateway exited"
    );
    let _ = running.await;
}

/// A pod that cannot start surfaces Kubernetes' reason as a specific error, before the
/// stream, and is deleted.
#[tokio::test(flavor = "multi_thread")]
async fn start_failures_carry_the_reason() {
    let double = KubeDouble::start();
    let dir = tempfile::tempdir().unwrap();
    let cfg = config_file(
        &dir,
        r#"
kubernetes:
  pod_start_timeout_secs: 3
profiles:
  default:
    image: busybox:1.36
  pull:
    image: registry.example/pull-error:1
  config:
    image: registry.example/config-error:1
  nowhere:
    image: busybox:1.36
    node_selector: {kubernetes.io/arch: s390x}
  slow:
    image: registry.example/never-starts:1
  cannot:
    image: registry.example/cannot-run:1
"#,
    );
    let gw = gateway(&double, &["--config", cfg.to_str().unwrap()]);
    for (profile, status, code, needle) in [
        ("pull", 502, "image_pull_failed", "pull-error"),
        (
            "config",
            502,
            "container_config_error",
            "CreateContainerConfigError",
        ),
        ("nowhere", 502, "unschedulable", "Unschedulable"),
        ("slow", 504, "pod_start_timeout", "pod_start_timeout_secs"),
        (
            "cannot",
            502,
            "container_config_error",
            "ContainerCannotRun (exit code 128): OCI runtime create failed",
        ),
        ("nope", 400, "unknown_profile", "nope"),
    ] {
        let r = raw(&gw, json!({"executable": "true", "profile": profile})).await;
        assert_eq!(r.status, status, "{profile}: {r:?}");
        let err = r
            .rejection
            .unwrap_or_else(|| panic!("{profile}: no error body"))
            .error;
        assert_eq!(err.code.as_str(), code, "{profile}: {}", err.message);
        assert!(err.message.contains(needle), "{profile}: {}", err.message);
        no_pods_left(&double, Duration::from_secs(5));
    }
}

/// `run-remote -v` with `RUN_REMOTE_SERVER` at the gateway, as a child process.
fn run_remote_v(gw: &Gateway, argv: &[&str]) -> std::process::Child {
    gw.run_remote()
        .arg("-v")
        .arg("--")
        .args(argv)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run-remote")
}

/// With every pod slot taken, runs wait in a queue, first come first served, within their
/// start budget (`queued` in progress and `-v`); only a full queue refuses, with 429 and
/// `Retry-After`; capacity comes back once the pods are gone.
#[tokio::test(flavor = "multi_thread")]
async fn a_full_pod_slot_queues_and_only_a_full_queue_refuses() {
    let double = KubeDouble::start();
    let dir = tempfile::tempdir().unwrap();
    let cfg = config_file(
        &dir,
        "kubernetes:\n  max_concurrent_pods: 1\n  max_queued_runs: 1\nprofiles:\n  default: {}\n",
    );
    let gw = gateway(&double, &["--config", cfg.to_str().unwrap()]);
    let first = run_remote_v(&gw, &["sh", "-c", "echo first; sleep 3"]);
    assert!(
        wait_until(Duration::from_secs(20), || double.running_execs() == 1),
        "the first run holds the slot"
    );
    let second = run_remote_v(&gw, &["echo", "second"]);
    // The second waits in the queue: its wait is visible to others as a full queue.
    let refused = loop {
        let r = http()
            .post(gw.raw_url())
            .json(&json!({"executable": "true"}))
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let retry_after = r.headers().get("retry-after").is_some();
        let body = r.text().await.unwrap();
        if status == 429 {
            break (retry_after, body);
        }
        // Sent before the second run queued: it queued itself and ran; try again.
        assert!(body.contains("\"exit\""), "{body}");
    };
    assert!(refused.0, "Retry-After");
    assert!(
        refused.1.contains("too_many_requests") && refused.1.contains("kubernetes.max_queued_runs"),
        "{}",
        refused.1
    );
    let first = first.wait_with_output().unwrap();
    let second = second.wait_with_output().unwrap();
    assert_eq!(first.status.code(), Some(0), "{first:?}");
    assert_eq!(second.status.code(), Some(0), "{second:?}");
    assert_eq!(String::from_utf8_lossy(&second.stdout), "second\n");
    let verbose = String::from_utf8_lossy(&second.stderr);
    assert!(
        verbose.contains("run-remote: queued: waiting for a pod slot: 1 runner pods are running (kubernetes.max_concurrent_pods)"),
        "{verbose}"
    );
    assert_eq!(double.peak_pods(), 1, "never two pods with containers");
    no_pods_left(&double, Duration::from_secs(5));
    assert_eq!(
        raw(&gw, json!({"executable": "true"})).await.code(),
        Some(0)
    );
}

/// A slot of `--max-concurrent-pods` is released when the pod's containers are gone, not when
/// the delete call returns: with a limit of 1 and a kubelet that takes 2 s to remove a pod,
/// three back-to-back runs all succeed (the later ones queue), and no two pods ever have
/// containers at once. (The double also keeps a force-deleted pod's containers for a second
/// after its object is gone, as a kubelet does: deleting with grace 0 and waiting for the
/// object would free the slot while they still run.)
#[tokio::test(flavor = "multi_thread")]
async fn a_slot_is_released_when_the_pods_containers_are_gone() {
    let double = KubeDouble::start_with(DoubleOptions {
        force_kill_delay: Duration::from_secs(1),
        min_deletion: Duration::from_secs(2),
        ..DoubleOptions::default()
    });
    let gw = gateway(&double, &["--max-concurrent-pods", "1"]);
    let runs: Vec<_> = (0..3)
        .map(|i| run_remote_v(&gw, &["echo", &format!("run {i}")]))
        .collect();
    let mut queued = 0;
    for (i, run) in runs.into_iter().enumerate() {
        let out = run.wait_with_output().unwrap();
        let verbose = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "run {i}: {verbose}");
        assert_eq!(String::from_utf8_lossy(&out.stdout), format!("run {i}\n"));
        if verbose.contains("run-remote: queued:") {
            queued += 1;
        }
    }
    assert_eq!(double.peak_pods(), 1, "two pods had containers at once");
    assert!(queued >= 2, "the later runs queued for the slot");
    no_pods_left(&double, Duration::from_secs(8));
}

/// Stale labelled pods of this installation are deleted, at start-up and periodically;
/// pods of other installations, unlabelled pods and other replicas' live pods are not.
#[tokio::test(flavor = "multi_thread")]
async fn the_reaper_deletes_only_its_own_leftovers() {
    use k8s_openapi::api::core::v1::Pod;
    let double = KubeDouble::start();
    let host = nix::unistd::gethostname().unwrap().into_string().unwrap();
    let me = mcp_run::label_value(&host);
    let pod = |name: &str, labels: serde_json::Value, created: &str, expires: &str| -> Pod {
        serde_json::from_value(json!({
            "metadata": {
                "name": name, "namespace": NS,
                "creationTimestamp": created,
                "labels": labels,
                "annotations": {"mcp-run.dev/expires-at": expires}
            },
            "spec": {"containers": [{"name": "runner", "image": "busybox:1.36", "command": ["sleep", "3600"]}]}
        }))
        .unwrap()
    };
    let ours = |gateway: &str, instance: &str| {
        json!({
            "app.kubernetes.io/name": "mcp-run",
            "app.kubernetes.io/component": "runner",
            "app.kubernetes.io/managed-by": "mcp-run",
            "mcp-run.dev/instance": instance,
            "mcp-run.dev/gateway": gateway
        })
    };
    let old = "2026-01-01T00:00:00Z";
    let past = "2026-01-01T01:00:00Z";
    let future = "2999-01-01T00:00:00Z";
    double.insert_pod(pod("mine-leftover", ours(&me, "mcp-run"), old, future));
    double.insert_pod(pod(
        "other-replica-expired",
        ours("gw-b", "mcp-run"),
        old,
        past,
    ));
    double.insert_pod(pod(
        "other-replica-live",
        ours("gw-b", "mcp-run"),
        old,
        future,
    ));
    double.insert_pod(pod("other-install", ours(&me, "other"), old, past));
    double.insert_pod(pod("unlabelled", json!({"app": "web"}), old, past));
    let dir = tempfile::tempdir().unwrap();
    let cfg = config_file(
        &dir,
        "kubernetes:\n  reaper_interval_secs: 1\n  reaper_min_age_secs: 1\n",
    );
    let gw = gateway(&double, &["--config", cfg.to_str().unwrap()]);
    let gone = |n: &str| !double.pod_names(NS).iter().any(|p| p == n);
    assert!(
        wait_until(Duration::from_secs(10), || gone("mine-leftover")
            && gone("other-replica-expired")),
        "leftovers deleted: {:?}",
        double.pod_names(NS)
    );
    // Two more passes of the reaper, then the others must still be there. A pass lists the
    // installation's pods (not a watch, not by gateway), then deletes: the pass that starts
    // after the leftovers are gone has ended once the one after it lists.
    let passes = || {
        double
            .requests()
            .iter()
            .filter(|r| {
                r.starts_with("GET ")
                    && r.contains("/pods?")
                    && r.contains("mcp-run.dev%2Finstance")
                    && !r.contains("watch")
                    && !r.contains("mcp-run.dev%2Fgateway")
            })
            .count()
    };
    let seen = passes();
    assert!(
        wait_until(Duration::from_secs(10), || passes() >= seen + 2),
        "no further reaper passes: {:?}",
        double.requests()
    );
    let mut left = double.pod_names(NS);
    left.sort();
    assert_eq!(left, ["other-install", "other-replica-live", "unlabelled"]);
    // And it never touches the pods of running commands.
    let r = raw(&gw, json!({"executable": "sleep", "args": ["3"]})).await;
    assert_eq!(r.code(), Some(0), "{r:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn readiness_reflects_api_server_and_permissions() {
    let double = KubeDouble::start();
    double.deny(NS, "pods", "exec", "create");
    let gw = gateway(&double, &[]);
    let r = http().get(gw.url("/readyz")).send().await.unwrap();
    assert_eq!(r.status(), 503);
    let body = r.text().await.unwrap();
    assert!(body.contains("create pods/exec"), "{body}");
    assert!(
        gw.log_text().contains("create pods/exec"),
        "logged: {}",
        gw.log_text()
    );
    drop(double);
    let r = http().get(gw.url("/readyz")).send().await.unwrap();
    assert_eq!(r.status(), 503, "API server gone");
}

#[tokio::test(flavor = "multi_thread")]
async fn ready_when_allowed() {
    let double = KubeDouble::start();
    let gw = gateway(&double, &[]);
    let r = http().get(gw.url("/readyz")).send().await.unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
}

/// Two gateway replicas with warm pools, many concurrent requests: every request ran in a
/// pod of its own (no pod is claimed twice), warm pods were used, the pools refill, and the
/// idle pods go at shutdown.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn warm_pool_claims_are_exclusive_across_replicas() {
    let double = KubeDouble::start();
    let dir = tempfile::tempdir().unwrap();
    let cfg = config_file(
        &dir,
        "profiles:\n  default:\n    image: busybox:1.36\n    warm_pool:\n      size: 4\n",
    );
    let kubeconfig = double.kubeconfig();
    let start = |who: &str| {
        Gateway::start_with_env(
            &[
                "--backend",
                "kube",
                "--kubeconfig",
                kubeconfig.to_str().unwrap(),
                "--config",
                cfg.to_str().unwrap(),
            ],
            &[("MCP_RUN_POD_NAME", who)],
        )
    };
    let a = start("gw-a");
    let b = start("gw-b");
    let idle = |double: &KubeDouble| {
        double
            .pods(NS)
            .iter()
            .filter(|p| {
                p.metadata
                    .labels
                    .as_ref()
                    .is_some_and(|l| l.get("mcp-run.dev/state").map(String::as_str) == Some("idle"))
            })
            .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
            .count()
    };
    assert!(
        wait_until(Duration::from_secs(20), || idle(&double) == 8),
        "two pools of 4: {} idle",
        idle(&double)
    );
    let pool_pods: Vec<String> = double.pod_names(NS);

    // The clients are built before any request starts: a client takes up to a few hundred ms
    // to build on a loaded machine, and a connection that sends nothing for 10 s is closed
    // (suite::concurrent_requests says more).
    let clients: Vec<reqwest::Client> = (0..24).map(|_| support::http()).collect();
    let runs = clients.iter().enumerate().map(|(i, client)| {
        let gw = if i % 2 == 0 { &a } else { &b };
        async move {
            support::raw_with(
                client,
                gw,
                json!({"executable": "sh", "args": ["-c", "echo $MCP_RUN_X; sleep 1"], "env": {"MCP_RUN_X": format!("run{i}")}}),
            )
            .await
        }
    });
    let results = futures_util::future::join_all(runs).await;
    let mut pods = Vec::new();
    for (i, r) in results.iter().enumerate() {
        assert_eq!(r.code(), Some(0), "request {i}: {r:?}");
        assert_eq!(
            r.stdout_str(),
            format!("run{i}\n"),
            "env applies in warm pods"
        );
        pods.push(r.context.as_ref().and_then(|c| c.pod.clone()).expect("pod"));
    }
    let mut unique = pods.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), pods.len(), "a pod was used twice: {pods:?}");
    let hits = pods.iter().filter(|p| pool_pods.contains(p)).count();
    assert!(hits >= 4, "warm pods were used: {hits} of {}", pods.len());
    let metrics = http()
        .get(a.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("mcp_run_warm_pool_claims_total{profile=\"default\",result=\"hit\"}"),
        "{metrics}"
    );
    // The pools refill, then the gateways delete their idle pods when they stop.
    assert!(
        wait_until(Duration::from_secs(20), || idle(&double) == 8),
        "refilled: {} idle",
        idle(&double)
    );
    let ((sa, _), (sb, _)) = tokio::join!(support::terminate(a), support::terminate(b));
    assert!(sa.is_some_and(|s| s.success()) && sb.is_some_and(|s| s.success()));
    no_pods_left(&double, Duration::from_secs(5));
}

/// An API server that only speaks `v4.channel.k8s.io`: the backend falls back to it, with
/// the same results (v4 has no stream-close frames; stdout, stderr and the status channel
/// are the same).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exec_falls_back_to_v4() {
    let double = KubeDouble::start_with(kube_double::DoubleOptions {
        exec_protocols: vec!["v4.channel.k8s.io".into()],
        ..Default::default()
    });
    let gw = gateway(&double, &[]);
    support::suite::stream_separation_and_order(&gw).await;
    support::suite::exit_codes(&gw).await;
    support::suite::killed_by_signal(&gw).await;
    support::suite::missing_executable_and_bad_cwd(&gw).await;
    support::suite::binary_round_trip(&gw, 4 * 1024 * 1024).await;
    assert!(
        double.requests().iter().any(|r| r.contains("/exec?")),
        "exec went through the double"
    );
    // stdin on v4: the bytes arrive in order, but v4 cannot signal their end
    // (docs/kubernetes.md), so the command reads a known length instead of reading to EOF.
    let data: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let r = support::raw_stdin(
        &gw,
        json!({"executable": "head", "args": ["-c", data.len().to_string()]}),
        &data,
    )
    .await;
    assert_eq!(r.code(), Some(0), "{r:?}");
    assert!(r.stdout == data, "{} bytes back", r.stdout.len());
}

/// MCP on the Kubernetes backend: the capabilities say isolated pods, namespace and
/// profiles; a tool call reports the pod and node it ran on.
#[tokio::test(flavor = "multi_thread")]
async fn mcp_on_kubernetes() {
    use rmcp::ServiceExt as _;
    let double = KubeDouble::start();
    let dir = tempfile::tempdir().unwrap();
    let cfg = config_file(
        &dir,
        "profiles:\n  default:\n    image: busybox:1.36\n  build:\n    description: Rust builds\n    image: rust:1-slim\n    runtime_class_name: gvisor\n    warm_pool: {size: 1}\n",
    );
    let gw = gateway(&double, &["--config", cfg.to_str().unwrap()]);
    let caps = support::get_json(&gw, "/capabilities").await;
    assert_eq!(caps["backend"], "kubernetes");
    assert_eq!(caps["safety_level"], "isolated-pod");
    assert_eq!(caps["namespace"], NS);
    assert_eq!(caps["profiles"][0]["name"], "build");
    assert_eq!(caps["profiles"][0]["image"], "rust:1-slim");
    assert_eq!(caps["profiles"][0]["runtime_class"], "gvisor");
    assert_eq!(caps["profiles"][0]["warm_pool"], 1);
    assert_eq!(caps["profiles"][1]["name"], "default");
    assert_eq!(caps["limits"]["stdin"], true, "the exec feeds stdin");

    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = ()
        .serve(rmcp::transport::StreamableHttpClientTransport::from_uri(
            gw.url("/mcp"),
        ))
        .await
        .unwrap();
    let tools = client.list_tools(None).await.unwrap().tools;
    assert_eq!(
        tools[0].input_schema["properties"]["profile"]["enum"],
        json!(["build", "default"])
    );
    assert!(
        tools[0]
            .description
            .as_deref()
            .unwrap_or("")
            .contains("namespace default"),
        "{:?}",
        tools[0].description
    );
    let r = client
        .call_tool(
            rmcp::model::CallToolRequestParams::new("run_network_tool").with_arguments(
                json!({"executable": "sh", "args": ["-c", "echo in-pod"]})
                    .as_object()
                    .cloned()
                    .unwrap(),
            ),
        )
        .await
        .unwrap();
    let s = r.structured_content.unwrap();
    assert_eq!(s["outputs"][0]["stdout"], "in-pod\n");
    assert_eq!(s["context"]["backend"], "kubernetes");
    assert!(
        s["context"]["pod"]
            .as_str()
            .unwrap()
            .starts_with("mcp-run-")
    );
    assert_eq!(s["context"]["node"], "double-node-1");
    assert_eq!(s["context"]["namespace"], NS);
    client.cancel().await.unwrap();
}

/// A client that gives up while its pod is still starting: the pod goes anyway.
#[tokio::test(flavor = "multi_thread")]
async fn client_gone_during_pod_start_deletes_the_pod() {
    let double = KubeDouble::start();
    let dir = tempfile::tempdir().unwrap();
    let cfg = config_file(
        &dir,
        "profiles:\n  default:\n    image: busybox:1.36\n  slow:\n    image: registry.example/never-starts:1\n",
    );
    let gw = gateway(&double, &["--config", cfg.to_str().unwrap()]);
    let req = http()
        .post(gw.raw_url())
        .json(&json!({"executable": "true", "profile": "slow"}))
        .send();
    assert!(
        tokio::time::timeout(Duration::from_secs(1), req)
            .await
            .is_err(),
        "still starting"
    );
    assert!(
        double.created_pods().len() == 1,
        "a pod was created: {:?}",
        double.pod_names(NS)
    );
    no_pods_left(&double, Duration::from_secs(5));
}

/// A gateway killed with SIGKILL leaves its pod; the same gateway restarted deletes it.
#[tokio::test(flavor = "multi_thread")]
async fn a_restarted_gateway_deletes_what_its_crashed_run_left() {
    let double = KubeDouble::start();
    let gw = gateway(&double, &[]);
    let url = gw.raw_url();
    let running = tokio::spawn(async move {
        let _ = http()
            .post(url)
            .json(&json!({"executable": "sleep", "args": ["300"]}))
            .send()
            .await;
    });
    assert!(
        wait_until(Duration::from_secs(10), || double.pod_names(NS).len() == 1),
        "pod for the long command"
    );
    let pid = gw.pid().unwrap() as i32;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL).unwrap();
    drop(gw);
    running.abort();
    // Nothing deletes it now: the gateway that made it is gone.
    assert_eq!(double.pod_names(NS).len(), 1, "the crash left the pod");
    let _restarted = gateway(&double, &[]);
    no_pods_left(&double, Duration::from_secs(10));
}

fn labelled(p: &k8s_openapi::api::core::v1::Pod, key: &str, value: &str) -> bool {
    p.metadata
        .labels
        .as_ref()
        .is_some_and(|l| l.get(key).map(String::as_str) == Some(value))
}

/// The warm pool's upkeep deletes only with uid and resourceVersion preconditions: a pool pod
/// that another replica claimed while this gateway's cache still shows it idle (its watch
/// lags) and old (past `max_idle_secs`) is refused with 409 by the API server and left to
/// its request. Without the preconditions it would be deleted under that request.
#[tokio::test(flavor = "multi_thread")]
async fn warm_pool_upkeep_never_deletes_a_pod_claimed_meanwhile() {
    let double = KubeDouble::start();
    let dir = tempfile::tempdir().unwrap();
    let cfg = config_file(
        &dir,
        "profiles:\n  default:\n    image: busybox:1.36\n    warm_pool:\n      size: 1\n      max_idle_secs: 2\n",
    );
    let _gw = gateway(&double, &["--config", cfg.to_str().unwrap()]);
    let idle_running = |double: &KubeDouble| {
        double
            .pods(NS)
            .into_iter()
            .find(|p| {
                labelled(p, "mcp-run.dev/state", "idle")
                    && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
            })
            .and_then(|p| p.metadata.name)
    };
    assert!(
        wait_until(Duration::from_secs(20), || idle_running(&double).is_some()),
        "a warm pod"
    );
    let pod = idle_running(&double).unwrap();
    // The gateway's watch now lags; another replica claims the pod.
    double.inject(|f| f.watch_delay = Some(Duration::from_secs(15)));
    double.set_labels(
        NS,
        &pod,
        &[
            ("mcp-run.dev/state", "claimed"),
            ("mcp-run.dev/gateway", "another-replica"),
        ],
    );
    let refused = || {
        double
            .delete_log()
            .into_iter()
            .find(|d| d.name == pod && d.code == 409)
    };
    assert!(
        wait_until(Duration::from_secs(15), || refused().is_some()),
        "the upkeep tried to replace the old pod: {:?}",
        double.delete_log()
    );
    let d = refused().unwrap();
    assert!(d.uid.is_some() && d.resource_version.is_some(), "{d:?}");
    assert!(
        double.pod(NS, &pod).is_some(),
        "the claimed pod is left to its request"
    );
    double.inject(|f| f.watch_delay = None);
}

/// Pool pods stuck waiting (ImagePullBackOff that cannot heal, CreateContainerConfigError,
/// ContainerCreating past the start timeout) are replaced, with preconditioned deletes, and
/// never claimed: a request on such a profile is a pool miss.
#[tokio::test(flavor = "multi_thread")]
async fn warm_pool_replaces_stuck_pods_and_never_claims_them() {
    let double = KubeDouble::start();
    let dir = tempfile::tempdir().unwrap();
    let pool = |image: &str| {
        format!("    image: {image}\n    warm_pool:\n      size: 1\n      max_idle_secs: 3600\n")
    };
    let cfg = config_file(
        &dir,
        &format!(
            "kubernetes:\n  pod_start_timeout_secs: 1\nprofiles:\n  default:\n    image: busybox:1.36\n  pull:\n{}  config:\n{}  creating:\n{}",
            pool("registry.example/pull-error:1"),
            pool("busybox-config-error:1"),
            pool("busybox-never-starts:1"),
        ),
    );
    let gw = gateway(&double, &["--config", cfg.to_str().unwrap()]);
    let profiles = ["pull", "config", "creating"];
    let replaced = |double: &KubeDouble| {
        let created = double.created_pods();
        let log = double.delete_log();
        profiles.iter().all(|prof| {
            let mine: Vec<String> = created
                .iter()
                .filter(|p| labelled(p, "mcp-run.dev/pool", prof))
                .filter_map(|p| p.metadata.name.clone())
                .collect();
            mine.len() >= 2 && log.iter().any(|d| mine.contains(&d.name) && d.code == 200)
        })
    };
    assert!(
        wait_until(Duration::from_secs(30), || replaced(&double)),
        "each stuck pool pod deleted and replaced: created {:?}, deleted {:?}",
        double
            .created_pods()
            .iter()
            .map(|p| p.metadata.name.clone())
            .collect::<Vec<_>>(),
        double.delete_log()
    );
    let pool_pods: Vec<String> = double
        .created_pods()
        .iter()
        .filter(|p| {
            profiles
                .iter()
                .any(|prof| labelled(p, "mcp-run.dev/pool", prof))
        })
        .filter_map(|p| p.metadata.name.clone())
        .collect();
    for d in double.delete_log() {
        if pool_pods.contains(&d.name) {
            assert!(
                d.uid.is_some() && d.resource_version.is_some(),
                "the upkeep deletes with preconditions: {d:?}"
            );
        }
    }
    // Never claimed: no PATCH reached a stuck pool pod.
    for r in double.requests() {
        assert!(
            !(r.starts_with("PATCH") && pool_pods.iter().any(|n| r.contains(n.as_str()))),
            "a stuck pod was claimed: {r}"
        );
    }
    let r = raw(&gw, json!({"executable": "true", "profile": "creating"})).await;
    assert!(r.exit.is_none(), "a stuck pod cannot run a command: {r:?}");
    let metrics = http()
        .get(gw.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains(r#"mcp_run_warm_pool_claims_total{profile="creating",result="miss"} 1"#),
        "{metrics}"
    );
}

/// A session's call on the kube backend: `sh -c SCRIPT` in session `name`.
async fn in_session(gw: &Gateway, name: &str, script: &str) -> support::RawRun {
    raw(
        gw,
        json!({"executable": "sh", "args": ["-c", script], "session": name}),
    )
    .await
}

/// The API calls the gateway made since `from` (the double's request log), by kind: pod
/// creations, exec upgrades, pod watches, pod deletions (the warm pool is off).
fn api_calls(double: &KubeDouble, from: usize) -> (usize, usize, usize, usize) {
    let r = double.requests();
    let r = &r[from..];
    let count = |f: &dyn Fn(&str) -> bool| r.iter().filter(|l| f(l)).count();
    (
        count(&|l| l.starts_with("POST ") && (l.ends_with("/pods") || l.contains("/pods?"))),
        count(&|l| l.contains("/exec?")),
        count(&|l| l.contains("/pods") && l.contains("watch=")),
        count(&|l| l.starts_with("DELETE ") && l.contains("/pods/")),
    )
}

/// N calls of one session make exactly one pod, labelled with hashes (never the name) and
/// annotated with its expiry; every call after the first is exactly one exec (no create,
/// watch or delete); what a call leaves stays for the next; a timed-out call's processes are
/// killed (the wrapper and what it started) while the pod stays; the owner's end deletes it.
#[tokio::test(flavor = "multi_thread")]
async fn a_session_is_one_pod_and_each_later_call_one_exec() {
    // As a real kubelet: a closed exec stream kills nothing, only the kill exec does.
    let double = KubeDouble::start_with(DoubleOptions {
        exec_survives_disconnect: true,
        ..Default::default()
    });
    let gw = gateway(&double, &[]);
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let first = in_session(&gw, "build", &format!("echo kept > {}", state.display())).await;
    assert_eq!(first.exit.map(|e| e.code), Some(Some(0)), "{first:?}");
    let ctx = first.context.clone().unwrap();
    assert_eq!(ctx.session_call, Some(1));
    let pod = ctx.pod.clone().unwrap();
    assert_eq!(double.created_pods().len(), 1);
    let p = double.pod(NS, &pod).unwrap();
    let labels = p.metadata.labels.clone().unwrap();
    let owner = labels
        .get("mcp-run.dev/session-owner")
        .expect("owner label");
    let name = labels.get("mcp-run.dev/session").expect("session label");
    assert!(owner.len() == 16 && name.len() == 16 && !name.contains("build"));
    let expires = &p.metadata.annotations.clone().unwrap()["mcp-run.dev/expires-at"];
    assert!(!expires.is_empty());

    assert_eq!(api_calls(&double, 0).0, 1, "the first call created the pod");
    let from = double.requests().len();
    for n in 2..=5u64 {
        let r = in_session(&gw, "build", &format!("cat {}", state.display())).await;
        assert_eq!(r.stdout, b"kept\n", "{r:?}");
        let c = r.context.unwrap();
        assert_eq!(
            (c.pod.as_deref(), c.session_call),
            (Some(pod.as_str()), Some(n))
        );
    }
    assert_eq!(
        api_calls(&double, from),
        (0, 4, 0, 0),
        "(creates, execs, watches, deletes) of four later calls: {:?}",
        &double.requests()[from..]
    );

    // A timed-out call: its processes die, the pod stays, the next call runs in it.
    let pids = dir.path().join("pids");
    let r = raw(
        &gw,
        json!({"executable": "sh", "args": ["-c", format!("sleep 300 & echo $$ $! > {}; wait", pids.display())],
               "session": "build", "timeout_secs": 1}),
    )
    .await;
    assert!(r.exit.unwrap().timed_out, "{r:?}");
    let pids: Vec<i32> = std::fs::read_to_string(&pids)
        .unwrap()
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect();
    assert_eq!(pids.len(), 2);
    assert!(
        wait_until(Duration::from_secs(10), || pids
            .iter()
            .all(|p| !support::pid_alive(*p))),
        "the call's shell and its child are killed"
    );
    assert_eq!(double.pod_names(NS), vec![pod.clone()], "the pod stays");
    assert!(
        double
            .requests()
            .iter()
            .any(|l| l.contains("/exec?") && l.contains("mcp-run-kill")),
        "the kill is an exec in the pod"
    );
    let r = in_session(&gw, "build", &format!("cat {}", state.display())).await;
    assert_eq!(r.stdout, b"kept\n", "{r:?}");
    assert_eq!(double.created_pods().len(), 1);

    let ended = gw
        .authorized(http().delete(gw.url("/sessions/build")))
        .send()
        .await
        .unwrap();
    assert_eq!(ended.status(), 204);
    no_pods_left(&double, Duration::from_secs(10));
}

/// A session pod goes on idle TTL and at shutdown; after a gateway SIGKILL it is left, and
/// the restarted gateway serves it (docs/sessions.md).
#[tokio::test(flavor = "multi_thread")]
async fn session_pods_go_on_ttl_shutdown_and_after_a_crash() {
    let double = KubeDouble::start();
    let dir = tempfile::tempdir().unwrap();
    let cfg = config_file(&dir, "sessions:\n  idle_ttl_secs: 1\n");
    let gw = gateway(&double, &["--config", cfg.to_str().unwrap()]);
    let r = in_session(&gw, "t", "true").await;
    assert_eq!(r.exit.map(|e| e.code), Some(Some(0)), "{r:?}");
    assert_eq!(double.pod_names(NS).len(), 1);
    no_pods_left(&double, Duration::from_secs(10));
    let r = in_session(&gw, "t", "true").await;
    assert_eq!(r.status, 410, "{r:?}");
    drop(gw);

    // Shutdown.
    let gw = gateway(&double, &[]);
    let r = in_session(&gw, "s", "true").await;
    assert_eq!(r.exit.map(|e| e.code), Some(Some(0)), "{r:?}");
    assert_eq!(double.pod_names(NS).len(), 1);
    let (status, _gw) = support::terminate(gw).await;
    assert!(status.is_some());
    assert!(
        double.pod_names(NS).is_empty(),
        "deleted before the gateway exits"
    );

    // SIGKILL, then a restart.
    let gw = gateway(&double, &[]);
    let r = in_session(&gw, "k", "true").await;
    assert_eq!(r.exit.map(|e| e.code), Some(Some(0)), "{r:?}");
    let pid = gw.pid().unwrap() as i32;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL).unwrap();
    drop(gw);
    let pods = double.pod_names(NS);
    assert_eq!(pods.len(), 1, "the crash left the pod");
    // The restarted gateway's reaper leaves the live session's pod; its next call runs in
    // it (found by its labels), and ending it deletes it.
    let restarted = gateway(&double, &[]);
    let r = in_session(&restarted, "k", "true").await;
    assert_eq!(r.code(), Some(0), "{r:?}");
    let ctx = r.context.unwrap();
    assert_eq!(ctx.pod.as_ref(), Some(&pods[0]));
    assert_eq!(ctx.session_call, Some(2));
    let ended = http()
        .delete(restarted.url("/sessions/k"))
        .send()
        .await
        .unwrap();
    assert_eq!(ended.status(), 204);
    no_pods_left(&double, Duration::from_secs(10));
}

/// A session whose pod was deleted or evicted answers its next call with `session_lost` and
/// the reason, never with a fresh pod; the call after that opens a new session.
#[tokio::test(flavor = "multi_thread")]
async fn a_lost_session_pod_is_reported_not_replaced() {
    let double = KubeDouble::start();
    let gw = gateway(&double, &[]);
    for (how, reason) in [("deleted", "was deleted"), ("evicted", "evicted")] {
        let r = in_session(&gw, how, "true").await;
        let pod = r.context.unwrap().pod.unwrap();
        if how == "deleted" {
            double.delete_pod(NS, &pod);
        } else {
            double.kill_container(NS, &pod, true);
        }
        let created = double.created_pods().len();
        // The gateway's watch sees the loss; until then a call may still run in the pod.
        let lost = {
            let mut lost = None;
            for _ in 0..100 {
                let r = in_session(&gw, how, "true").await;
                if r.status == 410 {
                    lost = Some(r);
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            lost.expect("session_lost")
        };
        let e = lost.rejection.unwrap().error;
        assert_eq!(e.code, mcp_run::contract::ErrorCode::SessionLost);
        assert!(e.message.contains(reason), "{how}: {}", e.message);
        assert_eq!(double.created_pods().len(), created, "no fresh pod");
        assert!(
            wait_until(Duration::from_secs(10), || double.pod(NS, &pod).is_none()),
            "{how}: the lost session's pod is deleted"
        );
        let again = in_session(&gw, how, "true").await;
        assert_eq!(again.context.unwrap().session_call, Some(1));
    }
    drop(gw);
}

/// A multi-step run's steps run in one pod, deleted afterwards.
#[tokio::test(flavor = "multi_thread")]
async fn steps_run_in_one_pod() {
    let double = KubeDouble::start();
    let gw = gateway(&double, &[]);
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("f");
    let r = raw(
        &gw,
        json!({"steps": [
            {"executable": "sh", "args": ["-c", format!("echo one > {}", f.display())]},
            {"executable": "sh", "args": ["-c", format!("cat {}; exit 4", f.display())]},
            {"executable": "echo", "args": ["never"]},
        ]}),
    )
    .await;
    assert_eq!(r.stdout, b"one\n", "{r:?}");
    assert_eq!(r.exit.unwrap().code, Some(4));
    assert_eq!(double.created_pods().len(), 1);
    no_pods_left(&double, Duration::from_secs(10));
}

/// `--workspace` in a kube session: each call brings the pod's tree to the manifest (edits
/// written, deleted files removed) and leaves what the manifest does not cover (`target/`,
/// untracked files); an unchanged rerun writes nothing (one check exec, no `tar`); a symlink
/// a command planted in place of a directory is replaced, nothing written through it. With
/// the host's tools (coreutils) and with busybox's applets (the README's image).
#[test]
fn a_kube_session_tree_follows_the_manifest_and_keeps_what_it_does_not_cover() {
    let double = KubeDouble::start();
    let dir = tempfile::tempdir().unwrap();
    let ws = tempfile::tempdir().unwrap();
    let cfg = config_file(
        &dir,
        &format!(
            "workspaces:\n  cache_dir: {cache}\nprofiles:\n  default:\n    workspace_path: {ws}/host\n  \
             busybox:\n    image: registry.example/busybox-applets:1.36\n    workspace_path: {ws}/bb\n",
            cache = dir.path().join("cache").display(),
            ws = ws.path().display()
        ),
    );
    for p in ["host", "bb"] {
        std::fs::create_dir_all(ws.path().join(p)).unwrap();
    }
    let gw = gateway(&double, &["--config", cfg.to_str().unwrap()]);
    for profile in ["default", "busybox"] {
        session_tree(&gw, &double, dir.path(), profile);
    }
    for name in ["ws-default", "ws-busybox"] {
        let out = gw
            .run_remote()
            .env("XDG_CACHE_HOME", dir.path())
            .args(["sessions", "end", name])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
    }
    no_pods_left(&double, Duration::from_secs(10));
}

fn session_tree(gw: &Gateway, double: &KubeDouble, home: &std::path::Path, profile: &str) {
    let tree = tempfile::tempdir().unwrap();
    let t = tree.path();
    std::fs::create_dir_all(t.join(".git")).unwrap();
    std::fs::write(t.join(".gitignore"), "target/\n").unwrap();
    std::fs::create_dir_all(t.join("src")).unwrap();
    std::fs::write(t.join("src/lib.rs"), "pub fn a() {}\n").unwrap();
    std::fs::write(t.join("old.txt"), "to be deleted\n").unwrap();
    let outside = tempfile::tempdir().unwrap();
    let session = format!("ws-{profile}");
    let rr = |args: &[&str]| {
        let mut a = vec!["--session", &session, "--profile", profile, "--workspace"];
        a.extend_from_slice(args);
        let out = gw
            .run_remote()
            .env("XDG_CACHE_HOME", home)
            .current_dir(t)
            .args(&a)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{profile}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    // busybox's stat has no nanoseconds; the inode and ctime show a rewrite as well.
    let stat = "stat -c '%i %Z' src/lib.rs";
    let first = rr(&[
        "--",
        "sh",
        "-c",
        &format!("mkdir target; echo obj > target/o; echo mine > untracked.txt; {stat}"),
    ]);
    // An unchanged rerun moves nothing: no tar, the same inode and ctime.
    let from = double.requests().len();
    let second = rr(&["--", "sh", "-c", stat]);
    assert_eq!(first, second, "{profile}");
    let execs: Vec<String> = double.requests()[from..]
        .iter()
        .filter(|l| l.contains("/exec?"))
        .cloned()
        .collect();
    assert_eq!(
        execs.len(),
        2,
        "{profile}: the check and the command: {execs:?}"
    );
    assert!(
        !execs.iter().any(|l| l.contains("command=tar")),
        "{execs:?}"
    );
    // Edit, delete, add in the checkout; the command replaces src/ with a symlink out.
    std::fs::write(t.join("src/lib.rs"), "pub fn b() {}\n").unwrap();
    std::fs::remove_file(t.join("old.txt")).unwrap();
    std::fs::write(t.join("new.txt"), "new\n").unwrap();
    rr(&[
        "--",
        "sh",
        "-c",
        &format!(
            "rm -rf src && ln -s {} src && echo stray > src/x",
            outside.path().display()
        ),
    ]);
    let listing = rr(&[
        "--",
        "sh",
        "-c",
        "cat src/lib.rs target/o untracked.txt new.txt; test -e old.txt || echo old-gone; test -L src || echo src-is-a-dir",
    ]);
    assert_eq!(
        listing, "pub fn b() {}\nobj\nmine\nnew\nold-gone\nsrc-is-a-dir\n",
        "{profile}"
    );
    // Nothing was written through the link.
    let written: Vec<_> = std::fs::read_dir(outside.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(written, [std::ffi::OsString::from("x")], "{profile}");
}

/// A gateway replica on the double: `name` is its pod name (its runner pods' label).
fn replica(double: &KubeDouble, name: &str) -> Gateway {
    let kubeconfig = double.kubeconfig();
    Gateway::start_with_env(
        &[
            "--backend",
            "kube",
            "--kubeconfig",
            kubeconfig.to_str().unwrap(),
        ],
        &[("MCP_RUN_POD_NAME", name)],
    )
}

/// Any replica serves a kube session: opened through A, a call through B runs in the same
/// pod (found by its labels, no new pod); one call at a time across both (409 with `fail`,
/// `queued` then run with `wait`); A SIGKILLed, B carries on, and A restarted (its start-up
/// reaper) leaves the live session's pod alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn any_replica_serves_a_kube_session() {
    let double = KubeDouble::start_with(DoubleOptions {
        exec_survives_disconnect: true,
        ..Default::default()
    });
    let a = replica(&double, "gw-a");
    let b = replica(&double, "gw-b");
    let dir = tempfile::tempdir().unwrap();
    let (state, started, go) = (
        dir.path().join("state"),
        dir.path().join("started"),
        dir.path().join("go"),
    );
    let first = in_session(&a, "s", &format!("echo kept > {}", state.display())).await;
    assert_eq!(first.code(), Some(0), "{first:?}");
    let pod = first.context.unwrap().pod.unwrap();
    let via_b = in_session(&b, "s", &format!("cat {}", state.display())).await;
    assert_eq!(via_b.stdout_str(), "kept\n", "{via_b:?}");
    let ctx = via_b.context.unwrap();
    assert_eq!(ctx.pod.as_deref(), Some(pod.as_str()), "the same pod");
    assert_eq!(double.created_pods().len(), 1, "no second pod");
    let annotations = || double.pod(NS, &pod).unwrap().metadata.annotations.unwrap();
    assert_eq!(annotations()["mcp-run.dev/session-name"], "s");
    // Given back once the call's consumer let go.
    assert!(
        wait_until(Duration::from_secs(10), || !annotations()
            .contains_key("mcp-run.dev/busy-by")),
        "{:?}",
        annotations()
    );

    // Busy across replicas: A's call holds the pod until `go` exists.
    let script = format!(
        "touch {}; while [ ! -e {} ]; do sleep 0.05; done; echo a-done",
        started.display(),
        go.display()
    );
    let long = {
        let url = a.raw_url();
        let body = json!({"executable": "sh", "args": ["-c", script], "session": "s"});
        tokio::spawn(async move {
            http()
                .post(url)
                .json(&body)
                .send()
                .await
                .unwrap()
                .text()
                .await
        })
    };
    assert!(wait_until(Duration::from_secs(20), || started.exists()));
    let busy = raw(
        &b,
        json!({"executable": "true", "session": "s", "session_busy": "fail"}),
    )
    .await;
    assert_eq!(busy.status, 409, "{busy:?}");
    assert!(
        busy.rejection
            .unwrap()
            .error
            .message
            .contains("another gateway replica")
    );
    let waiting = {
        let url = b.raw_url();
        let body = json!({"executable": "echo", "args": ["b-ran"], "session": "s"});
        tokio::spawn(async move {
            http()
                .post(url)
                .header("mcp-run-progress", "1")
                .json(&body)
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap()
        })
    };
    std::fs::write(&go, "").unwrap();
    let long = long.await.unwrap().unwrap();
    // Output is base64 on the wire: "a-done\n".
    assert!(long.contains("YS1kb25lCg=="), "{long}");
    let text = waiting.await.unwrap();
    assert!(text.contains("Yi1yYW4K"), "b-ran: {text}");
    assert!(
        text.contains("another gateway replica"),
        "queued phase: {text}"
    );

    // A dies; B carries on in the same pod; A restarted leaves it alone.
    let pid = a.pid().unwrap() as i32;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL).unwrap();
    drop(a);
    let after = in_session(&b, "s", &format!("cat {}", state.display())).await;
    assert_eq!(after.stdout_str(), "kept\n", "{after:?}");
    assert_eq!(after.context.unwrap().pod.as_deref(), Some(pod.as_str()));
    let a2 = replica(&double, "gw-a");
    let again = in_session(&a2, "s", &format!("cat {}", state.display())).await;
    assert_eq!(again.stdout_str(), "kept\n", "{again:?}");
    assert_eq!(again.context.unwrap().pod.as_deref(), Some(pod.as_str()));
    assert_eq!(double.created_pods().len(), 1);
    // Ended through the replica that served the last call: gone for both.
    let ended = http().delete(a2.url("/sessions/s")).send().await.unwrap();
    assert_eq!(ended.status(), 204);
    no_pods_left(&double, Duration::from_secs(10));
    let fresh = in_session(&b, "s", "true").await;
    assert_eq!(fresh.code(), Some(0), "{fresh:?}");
    assert_eq!(
        fresh.context.unwrap().session_call,
        Some(1),
        "a new session"
    );
    // Ended through a replica that never served it: found on its pod, ended for both.
    let ended = http().delete(a2.url("/sessions/s")).send().await.unwrap();
    assert_eq!(ended.status(), 204);
    no_pods_left(&double, Duration::from_secs(10));
    let next = in_session(&b, "s", "true").await;
    assert_eq!(next.context.unwrap().session_call, Some(1), "a new session");
}

/// A replica on the double with a configuration file.
fn replica_with(double: &KubeDouble, name: &str, config: &std::path::Path) -> Gateway {
    let kubeconfig = double.kubeconfig();
    Gateway::start_with_env(
        &[
            "--backend",
            "kube",
            "--kubeconfig",
            kubeconfig.to_str().unwrap(),
            "--config",
            config.to_str().unwrap(),
        ],
        &[("MCP_RUN_POD_NAME", name)],
    )
}

/// `GET /sessions` of a gateway: (name, pod, calls) of each.
async fn listed(gw: &Gateway) -> Vec<(String, String, u64)> {
    let v = support::get_json(gw, "/sessions").await;
    v["sessions"]
        .as_array()
        .unwrap_or_else(|| panic!("{v}"))
        .iter()
        .map(|s| {
            (
                s["name"].as_str().unwrap().to_owned(),
                s["context"]["pod"].as_str().unwrap_or_default().to_owned(),
                s["calls"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// A rolling update: a replica's graceful exit (SIGTERM) leaves its live kube sessions to
/// the others, which list and serve them in the same pod; every replica's `sessions list`
/// shows the caller's sessions from their pods, whichever replica opened them. A session
/// left idle while no replica runs is deleted by the next replica's start-up (a new name),
/// not adopted; the live one is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kube_sessions_outlive_a_replica_s_graceful_exit_and_end_at_their_expiry() {
    let double = KubeDouble::start_with(DoubleOptions {
        exec_survives_disconnect: true,
        ..Default::default()
    });
    let dir = tempfile::tempdir().unwrap();
    let cfg = config_file(
        &dir,
        "profiles:\n  default:\n    image: busybox:1.36\n  brief:\n    image: busybox:1.36\n\
         sessions:\n  profiles:\n    brief:\n      idle_ttl_secs: 2\n",
    );
    let mut a = replica_with(&double, "gw-a", &cfg);
    let mut b = replica_with(&double, "gw-b", &cfg);
    let state = dir.path().join("state");
    let first = in_session(&a, "work", &format!("echo kept > {}", state.display())).await;
    assert_eq!(first.code(), Some(0), "{first:?}");
    let pod = first.context.unwrap().pod.unwrap();
    // Listed through the replica that never served it, from its pod.
    assert_eq!(listed(&b).await, [("work".into(), pod.clone(), 1)]);
    assert_eq!(listed(&a).await, [("work".into(), pod.clone(), 1)]);

    // A exits gracefully (a rolling update): the session's pod stays, B serves it.
    let status = a.terminate().expect("A exits");
    assert!(status.success(), "{status:?}");
    assert!(
        a.log_text()
            .contains("session pod left to the gateway's other replicas"),
        "{}",
        a.log_text()
    );
    let p = double.pod(NS, &pod).expect("the session's pod outlives A");
    assert!(p.metadata.deletion_timestamp.is_none());
    assert!(p.metadata.owner_references.is_none());
    let via_b = in_session(&b, "work", &format!("cat {}", state.display())).await;
    assert_eq!(via_b.stdout_str(), "kept\n", "{via_b:?}");
    assert_eq!(via_b.context.unwrap().pod.as_deref(), Some(pod.as_str()));
    assert_eq!(double.created_pods().len(), 1, "no second pod");
    assert_eq!(listed(&b).await, [("work".into(), pod.clone(), 2)]);

    // A short-lived session, then B exits too: no replica runs while it idles past its TTL.
    let brief = raw(
        &b,
        json!({"executable": "true", "session": "quick", "profile": "brief"}),
    )
    .await;
    assert_eq!(brief.code(), Some(0), "{brief:?}");
    let brief_pod = brief.context.unwrap().pod.unwrap();
    let status = b.terminate().expect("B exits");
    assert!(status.success(), "{status:?}");
    assert!(double.pod(NS, &brief_pod).is_some(), "left by B");
    // Its idle TTL passes while nobody runs: wait for the idle deadline its pod records
    // (`last-used` + `idle-ttl-secs`), past the whole second the reaper compares in.
    let a = double
        .pod(NS, &brief_pod)
        .unwrap()
        .metadata
        .annotations
        .unwrap();
    let last_used: k8s_openapi::jiff::Timestamp = a["mcp-run.dev/last-used"].parse().unwrap();
    let ttl: i64 = a["mcp-run.dev/idle-ttl-secs"].parse().unwrap();
    let idle_deadline = last_used + k8s_openapi::jiff::SignedDuration::from_secs(ttl + 1);
    assert!(wait_until(Duration::from_secs(10), || {
        k8s_openapi::jiff::Timestamp::now() > idle_deadline
    }));
    let c = replica_with(&double, "gw-c", &cfg);
    assert!(
        wait_until(Duration::from_secs(20), || double
            .pod(NS, &brief_pod)
            .is_none_or(|p| p.metadata.deletion_timestamp.is_some())),
        "the expired session's pod is deleted at start-up: {}",
        c.log_text()
    );
    assert!(
        double.pod(NS, &pod).is_some(),
        "the live session's pod stays"
    );
    assert_eq!(listed(&c).await, [("work".into(), pod.clone(), 2)]);
    let again = in_session(&c, "work", &format!("cat {}", state.display())).await;
    assert_eq!(again.stdout_str(), "kept\n", "{again:?}");
    let fresh = raw(
        &c,
        json!({"executable": "true", "session": "quick", "profile": "brief"}),
    )
    .await;
    assert_eq!(
        fresh.context.as_ref().unwrap().session_call,
        Some(1),
        "a new session: {fresh:?}"
    );
    for name in ["work", "quick"] {
        let ended = http()
            .delete(c.url(&format!("/sessions/{name}")))
            .send()
            .await
            .unwrap();
        assert_eq!(ended.status(), 204, "{name}");
    }
    no_pods_left(&double, Duration::from_secs(10));
    assert!(listed(&c).await.is_empty());
}

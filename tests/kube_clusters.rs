//! The kube backend against what real clusters do (issue 14), through the double's fault
//! injection: Pod Security admission, start-up that heals (autoscalers, registry rate
//! limits, API-server overload and rollouts), pods that go under a running command, stdin,
//! start-up phases, and what travels where.

use crate::kube_double;
use crate::support;

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use kube_double::{DoubleOptions, KubeDouble};
use mcp_run::KubeExecutor;
use mcp_run::contract::{ErrorCode, Event, Phase};
use mcp_run::{ExecSpec, Executor, Progress, StartOptions};
use mcp_run::{KubernetesConfig, Profile};
use serde_json::json;
use support::{Gateway, config_file, raw};

const NS: &str = "default";

async fn executor(
    double: &KubeDouble,
    start_timeout: u64,
    profiles: &[(&str, Profile)],
) -> KubeExecutor {
    let config = KubernetesConfig {
        kubeconfig: Some(double.kubeconfig()),
        pod_start_timeout_secs: start_timeout,
        ..Default::default()
    };
    let mut all: BTreeMap<String, Profile> =
        BTreeMap::from([("default".into(), Profile::default())]);
    all.extend(profiles.iter().map(|(n, p)| (n.to_string(), p.clone())));
    KubeExecutor::connect(config, all, mcp_run::Metrics::new())
        .await
        .expect("connect")
}

fn spec(argv: &[&str]) -> ExecSpec {
    ExecSpec {
        executable: argv[0].into(),
        args: argv[1..].iter().map(|s| s.to_string()).collect(),
        cwd: None,
        env: BTreeMap::new(),
        timeout: Duration::from_secs(30),
        profile: None,
        workspace: None,
        ..ExecSpec::default()
    }
}

/// Everything a run produced: stdout, stderr, the terminal event.
struct Outcome {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    end: Event,
}

async fn run(
    ex: &KubeExecutor,
    spec: ExecSpec,
    opts: StartOptions,
) -> Result<Outcome, mcp_run::contract::ErrorBody> {
    let mut e = ex.start(spec, opts).await?;
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    loop {
        match tokio::time::timeout(Duration::from_secs(30), e.next())
            .await
            .expect("events in time")
        {
            Some(Event::Stdout { data }) => stdout.extend_from_slice(&data),
            Some(Event::Stderr { data }) => stderr.extend_from_slice(&data),
            Some(end) if end.is_terminal() => {
                return Ok(Outcome {
                    stdout,
                    stderr,
                    end,
                });
            }
            Some(_) => {}
            None => panic!("no terminal event"),
        }
    }
}

fn exit_code(o: &Outcome) -> Option<i32> {
    match &o.end {
        Event::Exit(x) => x.code,
        _ => None,
    }
}

fn slow(step: u64) -> DoubleOptions {
    DoubleOptions {
        step_delay: Duration::from_millis(step),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn restricted_namespaces_admit_the_default_profile_and_refuse_root() {
    let mut opts = DoubleOptions::default();
    opts.namespace_labels.insert(
        NS.into(),
        BTreeMap::from([(
            "pod-security.kubernetes.io/enforce".to_string(),
            "restricted".to_string(),
        )]),
    );
    let double = KubeDouble::start_with(opts);
    let root = Profile {
        run_as_non_root: Some(false),
        ..Default::default()
    };
    // An image whose user is root runs too: the UID comes from the pod.
    let root_image = Profile {
        image: Some("registry.example/root-user:1".into()),
        ..Default::default()
    };
    let ex = executor(&double, 10, &[("root", root), ("root-image", root_image)]).await;
    let o = run(&ex, spec(&["true"]), StartOptions::default())
        .await
        .expect("admitted");
    assert_eq!(exit_code(&o), Some(0));
    let mut s = spec(&["true"]);
    s.profile = Some("root-image".into());
    let o = run(&ex, s, StartOptions::default())
        .await
        .expect("runs as 65532");
    assert_eq!(exit_code(&o), Some(0));
    let mut s = spec(&["true"]);
    s.profile = Some("root".into());
    let err = run(&ex, s, StartOptions::default())
        .await
        .err()
        .expect("refused");
    assert_eq!(err.code, ErrorCode::StartFailed);
    assert!(
        err.message.contains("violates PodSecurity \"restricted:latest\": runAsNonRoot != true (pod must not set securityContext.runAsNonRoot=false; container \"runner\" must not set securityContext.runAsNonRoot=false)"),
        "{}",
        err.message
    );
}

/// `cwd` and `env` reach the command through the wrapper's stdin header: never in the exec
/// URL (which API-server audit logs record) nor in the argv.
#[tokio::test(flavor = "multi_thread")]
async fn cwd_and_env_travel_on_stdin_not_in_the_url() {
    let double = KubeDouble::start();
    let ex = executor(&double, 10, &[]).await;
    let mut s = spec(&[
        "sh",
        "-c",
        "pwd; printf '%s|' \"$TOKEN\" \"$LINES2\"; ps -o args= -p $$",
    ]);
    s.cwd = Some("/tmp".into());
    s.env = BTreeMap::from([
        ("TOKEN".to_string(), "hunter2-secret".to_string()),
        ("LINES2".to_string(), "a\nb\\c".to_string()),
    ]);
    let o = run(&ex, s, StartOptions::default()).await.expect("runs");
    assert_eq!(
        exit_code(&o),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.starts_with("/tmp\nhunter2-secret|a\nb\\c|"), "{out}");
    let ps = out
        .split_once("b\\c|")
        .map(|(_, ps)| ps)
        .unwrap_or_default();
    assert!(ps.starts_with("sh -c pwd"), "{out}");
    assert!(
        !ps.contains("hunter2") && !ps.contains("/tmp"),
        "not in the process's argv: {ps}"
    );
    let execs: Vec<String> = double
        .requests()
        .into_iter()
        .filter(|r| r.contains("/exec?"))
        .collect();
    assert!(!execs.is_empty());
    for r in execs {
        assert!(!r.contains("hunter2") && !r.contains("%2Ftmp"), "{r}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn stdin_is_forwarded_in_order_and_its_end_reaches_the_command() {
    let double = KubeDouble::start();
    let ex = executor(&double, 10, &[]).await;
    for with_env in [false, true] {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let mut s = spec(&["sh", "-c", "cat; echo end >&2"]);
        if with_env {
            s.env.insert("A".into(), "1".into());
        }
        let input: Vec<u8> = (0..=255u8).cycle().take(300_000).collect();
        let feed = input.clone();
        tokio::spawn(async move {
            for c in feed.chunks(7_000) {
                tx.send(Bytes::copy_from_slice(c)).await.unwrap();
            }
        });
        let opts = StartOptions {
            stdin: Some(rx),
            ..Default::default()
        };
        let o = run(&ex, s, opts).await.expect("runs");
        assert_eq!(exit_code(&o), Some(0), "with_env {with_env}");
        assert_eq!(o.stdout.len(), input.len());
        assert!(
            o.stdout == input,
            "byte-exact, in order (with_env {with_env})"
        );
        assert_eq!(o.stderr, b"end\n", "cat saw the end of its input");
    }
    // Without stdin the command reads an empty input, with or without the wrapper.
    for with_env in [false, true] {
        let mut s = spec(&["cat"]);
        if with_env {
            s.env.insert("A".into(), "1".into());
        }
        let o = run(&ex, s, StartOptions::default()).await.expect("runs");
        assert_eq!((exit_code(&o), o.stdout.len()), (Some(0), 0));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn start_up_phases_are_reported_in_order() {
    let double = KubeDouble::start_with(slow(50));
    let ex = executor(&double, 10, &[]).await;
    let (progress, mut rx) = Progress::channel();
    let opts = StartOptions {
        progress,
        ..Default::default()
    };
    let o = run(&ex, spec(&["true"]), opts).await.expect("runs");
    assert_eq!(exit_code(&o), Some(0));
    let mut phases = Vec::new();
    while let Ok(Event::Phase { phase, message }) = rx.try_recv() {
        phases.push((phase, message.unwrap_or_default()));
    }
    let order: Vec<Phase> = phases.iter().map(|(p, _)| *p).collect();
    assert_eq!(
        order,
        [
            Phase::Scheduling,
            Phase::Scheduled,
            Phase::PullingImage,
            Phase::Starting,
            Phase::Running
        ],
        "{phases:?}"
    );
    assert_eq!(phases[1].1, "double-node-1");
}

/// Autoscalers schedule later; registries limit pull rates for a while: both heal within the
/// start timeout, and the caller sees why it waits.
#[tokio::test(flavor = "multi_thread")]
async fn unschedulable_and_pull_failures_heal_within_the_start_timeout() {
    let double = KubeDouble::start_with(slow(100));
    let ex = executor(&double, 15, &[]).await;
    double.inject(|f| {
        f.unschedulable_for = Some(Duration::from_millis(1500));
        f.pull_failures = 3;
    });
    let (progress, mut rx) = Progress::channel();
    let o = run(
        &ex,
        spec(&["true"]),
        StartOptions {
            progress,
            ..Default::default()
        },
    )
    .await
    .expect("starts once it heals");
    assert_eq!(exit_code(&o), Some(0));
    let mut msgs = Vec::new();
    while let Ok(Event::Phase { phase, message }) = rx.try_recv() {
        msgs.push(format!("{phase:?}: {}", message.unwrap_or_default()));
    }
    let all = msgs.join("\n");
    assert!(
        all.contains(
            "Scheduling: not scheduled: Unschedulable: 0/1 nodes are available: 1 Insufficient cpu."
        ),
        "{all}"
    );
    assert!(
        all.contains("PullingImage: ErrImagePull") && all.contains("toomanyrequests"),
        "{all}"
    );

    // Still unschedulable when the start timeout ends: the scheduler's message.
    double.inject(|f| f.unschedulable_for = Some(Duration::from_secs(30)));
    let ex = executor(&double, 2, &[]).await;
    let err = run(&ex, spec(&["true"]), StartOptions::default())
        .await
        .err()
        .expect("times out");
    assert_eq!(err.code, ErrorCode::Unschedulable, "{}", err.message);
    assert!(
        err.message.contains("Insufficient cpu") && err.message.contains("pod_start_timeout_secs"),
        "{}",
        err.message
    );
}

/// 429 with Retry-After, 500s, a create whose answer was lost, watches cut by a load
/// balancer and resumed from an expired resourceVersion, a slow exec upgrade: the run still
/// starts, within its budget.
#[tokio::test(flavor = "multi_thread")]
async fn api_server_trouble_is_retried_within_the_budget() {
    let double = KubeDouble::start_with(slow(200));
    let ex = executor(&double, 20, &[]).await;
    double.inject(|f| {
        f.create
            .push_back(kube_double::ApiError::too_many_requests(1));
        f.create.push_back(kube_double::ApiError::internal(
            "etcdserver: leader changed",
        ));
        f.watch_cuts = 2;
        f.gone_on_resume = 1;
        f.exec_delay = Some(Duration::from_millis(1500));
    });
    let t = std::time::Instant::now();
    let o = run(&ex, spec(&["echo", "ok"]), StartOptions::default())
        .await
        .expect("starts");
    assert_eq!(
        (exit_code(&o), o.stdout.as_slice()),
        (Some(0), &b"ok\n"[..])
    );
    assert!(
        t.elapsed() >= Duration::from_secs(1),
        "Retry-After honoured"
    );
    let creates = double
        .requests()
        .iter()
        .filter(|r| r.starts_with("POST /api/v1/namespaces/default/pods"))
        .count();
    assert_eq!(creates, 3);

    // The answer of a successful create is lost: the retry's 409 is recognised.
    double.inject(|f| f.create_lost_answers = 1);
    let o = run(&ex, spec(&["true"]), StartOptions::default())
        .await
        .expect("starts");
    assert_eq!(exit_code(&o), Some(0));

    // An API server that keeps refusing: a clear error once the budget is spent, not a stall.
    let ex = executor(&double, 3, &[]).await;
    double.inject(|f| {
        for _ in 0..20 {
            f.create
                .push_back(kube_double::ApiError::too_many_requests(1));
        }
    });
    let t = std::time::Instant::now();
    let err = run(&ex, spec(&["true"]), StartOptions::default())
        .await
        .err()
        .expect("gives up");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert_eq!(err.code, ErrorCode::BackendUnavailable);
    assert!(err.message.contains("TooManyRequests"), "{}", err.message);
    double.inject(|f| f.create.clear());
}

/// A pod deleted, evicted or OOM-killed under a running command: `pod_failed` saying so, not
/// "killed by signal 9".
#[tokio::test(flavor = "multi_thread")]
async fn a_pod_going_under_a_running_command_is_pod_failed() {
    let double = KubeDouble::start();
    let limited = Profile {
        resources: Some(serde_json::from_value(json!({"limits": {"memory": "64Mi"}})).unwrap()),
        ..Default::default()
    };
    let ex = executor(&double, 10, &[("limited", limited)]).await;
    for how in ["deleted", "evicted", "oom"] {
        let mut s = spec(&["sleep", "30"]);
        s.profile = Some("limited".into());
        let mut e = ex.start(s, StartOptions::default()).await.expect("starts");
        let pod = e.context().pod.clone().unwrap();
        // The pod goes while the command runs in it.
        assert!(
            support::wait_until(Duration::from_secs(10), || double
                .running_execs_in(NS, &pod)
                == 1),
            "{how}: the command never ran"
        );
        match how {
            "deleted" => double.delete_pod(NS, &pod),
            "evicted" => double.kill_container(NS, &pod, true),
            _ => double.kill_container(NS, &pod, false),
        }
        let end = loop {
            match tokio::time::timeout(Duration::from_secs(10), e.next())
                .await
                .expect("ends")
            {
                Some(ev) if ev.is_terminal() => break ev,
                Some(_) => {}
                None => panic!("no end"),
            }
        };
        match end {
            Event::Error { code, message } => {
                assert_eq!(code, ErrorCode::PodFailed, "{how}: {message}");
                let want = match how {
                    "deleted" => "was deleted",
                    "evicted" => "was evicted: The node was low on resource: memory",
                    _ => "OOMKilled; memory limit 64Mi",
                };
                assert!(message.contains(want), "{how}: {message}");
            }
            other => panic!("{how}: {other:?}"),
        }
    }
    // A command killed by a signal while its pod is fine is still a signal.
    let o = run(
        &ex,
        spec(&["sh", "-c", "kill -9 $$"]),
        StartOptions::default(),
    )
    .await
    .expect("runs");
    assert!(
        matches!(o.end, Event::Exit(x) if x.signal == Some(9)),
        "{:?}",
        o.end
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_container_that_cannot_start_reports_the_runtimes_reason() {
    let double = KubeDouble::start();
    let broken = Profile {
        keepalive_command: Some(vec!["no-such-keepalive-mcp-run".into(), "1".into()]),
        ..Default::default()
    };
    let ex = executor(&double, 10, &[("broken", broken)]).await;
    let mut s = spec(&["true"]);
    s.profile = Some("broken".into());
    let err = run(&ex, s, StartOptions::default())
        .await
        .err()
        .expect("fails");
    assert_eq!(err.code, ErrorCode::ContainerConfigError);
    assert!(
        err.message.contains("StartError")
            && err
                .message
                .contains("\"no-such-keepalive-mcp-run\": executable file not found"),
        "{}",
        err.message
    );
}

/// The same through the gateway: `/raw` answers a refused pod with the admission's text.
#[tokio::test(flavor = "multi_thread")]
async fn the_gateway_reports_admission_refusals() {
    let mut opts = DoubleOptions::default();
    opts.namespace_labels.insert(
        NS.into(),
        BTreeMap::from([(
            "pod-security.kubernetes.io/enforce".to_string(),
            "restricted".to_string(),
        )]),
    );
    let double = KubeDouble::start_with(opts);
    let dir = tempfile::tempdir().unwrap();
    let cfg = config_file(
        &dir,
        "profiles:\n  default: {}\n  root:\n    run_as_non_root: false\n",
    );
    let gw = Gateway::start(&[
        "--backend",
        "kube",
        "--kubeconfig",
        double.kubeconfig().to_str().unwrap(),
        "--config",
        cfg.to_str().unwrap(),
    ]);
    let r = raw(&gw, json!({"executable": "echo", "args": ["hi"]})).await;
    assert_eq!(r.code(), Some(0), "{r:?}");
    let r = raw(&gw, json!({"executable": "true", "profile": "root"})).await;
    let err = r.rejection.expect("refused").error;
    assert_eq!(err.code.as_str(), "start_failed");
    assert!(
        err.message.contains("violates PodSecurity"),
        "{}",
        err.message
    );
}

/// `/raw` with a stdin body on the kube backend: the shared stdin suite, and with `cwd` (the
/// wrapper's header first, then the caller's bytes).
#[tokio::test(flavor = "multi_thread")]
async fn stdin_through_the_gateway() {
    let double = KubeDouble::start();
    let gw = Gateway::start(&[
        "--backend",
        "kube",
        "--kubeconfig",
        double.kubeconfig().to_str().unwrap(),
    ]);
    support::suite::stdin_round_trip(&gw).await;
    let r = support::raw_stdin(
        &gw,
        json!({"executable": "sh", "args": ["-c", "pwd; cat"], "cwd": "/tmp"}),
        b"line 1\nline 2",
    )
    .await;
    assert_eq!(r.code(), Some(0), "{r:?}");
    assert_eq!(r.stdout_str(), "/tmp\nline 1\nline 2");
}

/// Silent commands keep their exec stream through a load balancer that cuts connections idle
/// for 2 s, because the gateway pings (here every second, `exec_ping_secs: 1`); with the
/// default 20 s the same command loses its stream, so the test fails if pings stop.
#[tokio::test(flavor = "multi_thread")]
async fn pings_keep_silent_exec_streams_through_idle_cuts() {
    let double = KubeDouble::start_with(DoubleOptions {
        idle_timeout: Some(Duration::from_secs(2)),
        ..Default::default()
    });
    let with_pings = |ping: u64| KubernetesConfig {
        kubeconfig: Some(double.kubeconfig()),
        exec_ping_secs: ping,
        ..Default::default()
    };
    let profiles = || BTreeMap::from([("default".to_string(), Profile::default())]);
    let ex = KubeExecutor::connect(with_pings(1), profiles(), mcp_run::Metrics::new())
        .await
        .expect("connect");
    let o = run(
        &ex,
        spec(&["sh", "-c", "sleep 4; echo done"]),
        StartOptions::default(),
    )
    .await
    .expect("started");
    assert_eq!(exit_code(&o), Some(0), "{:?}", o.end);
    assert_eq!(o.stdout, b"done\n");
    assert!(double.exec_pings() >= 3, "pings: {}", double.exec_pings());

    let ex = KubeExecutor::connect(with_pings(20), profiles(), mcp_run::Metrics::new())
        .await
        .expect("connect");
    let o = run(
        &ex,
        spec(&["sh", "-c", "sleep 4; echo done"]),
        StartOptions::default(),
    )
    .await
    .expect("started");
    assert!(
        matches!(o.end, Event::Error { .. }),
        "without pings the idle cut ends the stream: {:?}",
        o.end
    );
    assert!(o.stdout.is_empty());
}

/// "Executable not found" is exit 127 with `command not found` on stderr whatever the runtime
/// says: runc's and Kata's words are known, and words no pattern knows (`Opaque`) are not
/// needed: the gateway then asks the pod whether the program exists.
#[tokio::test(flavor = "multi_thread")]
async fn executable_not_found_is_127_whatever_the_runtime_says() {
    use kube_double::Runtime;
    for runtime in [Runtime::Runc, Runtime::Kata, Runtime::Opaque] {
        let double = KubeDouble::start_with(DoubleOptions {
            runtime,
            ..Default::default()
        });
        let ex = executor(&double, 30, &[]).await;
        for program in ["no-such-program-mcp-run", "/no/such/program"] {
            let o = run(&ex, spec(&[program, "arg"]), StartOptions::default())
                .await
                .expect("started");
            assert_eq!(
                exit_code(&o),
                Some(127),
                "{runtime:?} {program}: {:?}",
                o.end
            );
            assert_eq!(
                String::from_utf8_lossy(&o.stderr),
                format!("mcp-run: {program}: command not found\n"),
                "{runtime:?}"
            );
        }
        // A program that exists still runs, and one that fails is not taken for missing.
        let o = run(&ex, spec(&["sh", "-c", "exit 3"]), StartOptions::default())
            .await
            .expect("started");
        assert_eq!(exit_code(&o), Some(3), "{runtime:?}");
    }
}

/// A gateway on the double with `config` (YAML) as its configuration file.
fn gateway_with(double: &KubeDouble, dir: &tempfile::TempDir, config: &str) -> Gateway {
    let cfg = config_file(dir, config);
    Gateway::start(&[
        "--backend",
        "kube",
        "--kubeconfig",
        double.kubeconfig().to_str().unwrap(),
        "--config",
        cfg.to_str().unwrap(),
    ])
}

/// `run-remote -v -- ARGV` against the gateway: exit status, stdout, stderr.
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

/// A kubelet writes `OOMKilled` or an eviction into the pod's status after the exec stream
/// has ended (its relist, about a second later): the gateway waits for it, bounded, and
/// `run-remote` reports `pod_failed` with the reason (the memory limit, the eviction's
/// message), not a bare 137.
#[test]
fn oom_kills_and_evictions_reported_after_the_exec_ended_are_pod_failed() {
    let double = KubeDouble::start();
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway_with(
        &double,
        &dir,
        "profiles:\n  default:\n    resources: {limits: {memory: 32Mi}}\n",
    );
    for evicted in [false, true] {
        let run = run_remote_v(&gw, &["sleep", "30"]);
        assert!(
            support::wait_until(Duration::from_secs(20), || double.running_execs() == 1),
            "the command runs"
        );
        let pod = double.pod_names(NS).pop().expect("a pod");
        double.kill_container_later(NS, &pod, evicted, Duration::from_millis(1200));
        let out = run.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(125), "evicted {evicted}: {stderr}");
        let why = if evicted {
            "was evicted: The node was low on resource: memory. Threshold quantity: 100Mi, available: 90Mi. (pod_failed)"
        } else {
            "ran out of memory (OOMKilled; memory limit 32Mi) (pod_failed)"
        };
        assert!(
            stderr.contains(&format!(
                "run-remote: the command was killed: runner pod {pod} {why}"
            )),
            "evicted {evicted}: {stderr}"
        );
        assert!(support::wait_until(Duration::from_secs(10), || double
            .pod_names(NS)
            .is_empty()));
    }
}

/// API Priority and Fairness answers 429 with a plain-text body and `Retry-After`, on any
/// verb. Spread over every call of a run (create, the watch's list and watch, the exec
/// upgrade, the deletion), they are waited out within the start budget, never sooner than
/// Retry-After, and kube-rs's own retry does not add attempts of its own.
#[test]
fn retry_after_is_honoured_on_every_verb_within_the_budget() {
    let double = KubeDouble::start();
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway_with(
        &double,
        &dir,
        "kubernetes:\n  pod_start_timeout_secs: 20\nprofiles:\n  default: {}\n",
    );
    // Twelve, as a busy API server sent them to a run that a count of attempts failed.
    let storm = [
        ("create", 3),
        ("list", 4),
        ("watch", 1),
        ("exec", 2),
        ("delete", 2),
    ];
    double.inject(|f| {
        f.too_many_retry_after = 1;
        for (verb, n) in storm {
            f.too_many.insert(verb.to_string(), n);
        }
    });
    let creates_before = double
        .requests()
        .iter()
        .filter(|r| r.starts_with("POST /api/v1/namespaces/default/pods"))
        .count();
    let out = run_remote_v(&gw, &["echo", "ok"])
        .wait_with_output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "ok\n");
    assert!(
        support::wait_until(Duration::from_secs(15), || double.pod_names(NS).is_empty()),
        "the pod is deleted through the 429s"
    );
    let sent = double.too_many_sent();
    for (verb, n) in storm {
        let times: Vec<std::time::Instant> = sent
            .iter()
            .filter(|(v, _)| v == verb)
            .map(|(_, t)| *t)
            .collect();
        assert_eq!(times.len(), n, "{verb}: every 429 was met");
        for pair in times.windows(2) {
            let gap = pair[1] - pair[0];
            assert!(
                gap >= Duration::from_millis(950),
                "{verb}: retried {gap:?} after a Retry-After of 1 s"
            );
        }
    }
    // Exactly one create per 429 plus the one that succeeded: no retry layer compounds ours.
    let creates = double
        .requests()
        .iter()
        .filter(|r| r.starts_with("POST /api/v1/namespaces/default/pods"))
        .count()
        - creates_before;
    assert_eq!(creates, 4);
}

/// An API server that cannot be reached (connection refused, a name that does not resolve,
/// a certificate nobody trusts) is not a busy one: the run fails within seconds naming the
/// cause, `/readyz` fails, and no permission check is logged as done.
#[test]
fn an_unreachable_api_server_fails_within_seconds_with_the_cause() {
    let double = KubeDouble::start();
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let original = std::fs::read_to_string(double.kubeconfig()).unwrap();
    let ca_line = original
        .lines()
        .find(|l| l.contains("certificate-authority-data"))
        .unwrap()
        .to_string();
    let cases = [
        (
            "refused",
            original.replace(&double.url(), &format!("https://{closed}")),
            "Connection refused",
        ),
        (
            "dns",
            original.replace(&double.url(), "https://no-such-host.invalid:6443"),
            "dns error",
        ),
        (
            "tls",
            // The double, but its CA not trusted: the handshake fails.
            original.replace(&format!("{ca_line}\n"), ""),
            "invalid peer certificate",
        ),
    ];
    let dirs: Vec<tempfile::TempDir> = cases.iter().map(|_| tempfile::tempdir().unwrap()).collect();
    let gateways: Vec<Gateway> = cases
        .iter()
        .zip(&dirs)
        .map(|((_, kubeconfig, _), dir)| {
            let path = dir.path().join("kubeconfig");
            std::fs::write(&path, kubeconfig).unwrap();
            Gateway::start(&["--backend", "kube", "--kubeconfig", path.to_str().unwrap()])
        })
        .collect();
    let runs: Vec<(std::time::Instant, std::process::Child)> = gateways
        .iter()
        .map(|gw| {
            (
                std::time::Instant::now(),
                run_remote_v(gw, &["uname", "-n"]),
            )
        })
        .collect();
    let rt = tokio::runtime::Runtime::new().unwrap();
    for (((case, _, cause), gw), (t, run)) in cases.iter().zip(&gateways).zip(runs) {
        let out = run.wait_with_output().unwrap();
        let took = t.elapsed();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(125), "{case}: {stderr}");
        assert!(took < Duration::from_secs(15), "{case}: took {took:?}");
        assert!(
            stderr.contains("backend_unavailable") && stderr.contains("is not reachable"),
            "{case}: {stderr}"
        );
        assert!(stderr.contains(cause), "{case}: {stderr}");
        let ready = rt.block_on(async {
            let r = support::http().get(gw.url("/readyz")).send().await.unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        });
        assert_eq!(ready.0, 503, "{case}: {}", ready.1);
        let log = gw.log_text();
        assert!(
            !log.contains("permissions to run pods checked"),
            "{case}: nothing was checked: {log}"
        );
        assert!(
            log.contains("cannot check the gateway's permissions"),
            "{case}: {log}"
        );
    }
}

/// Real containers (podman and runc, `DoubleOptions::containers`): a command that the
/// kernel OOM-kills in a container with a 32Mi limit comes back as `pod_failed` naming
/// `OOMKilled` and the limit, not as a bare 137. The kill is the kernel's; the pod's status
/// comes a second after the exec ended, as from a kubelet.
#[test]
fn a_real_oom_kill_in_a_real_container_is_pod_failed() {
    if let Err(why) = kube_double::podman::available() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI installs podman, runc and busybox-static (.ci/install.d/containers.sh): {why}"
        );
        eprintln!("SKIPPED: no real containers here: {why}");
        return;
    }
    let double = KubeDouble::start_with(DoubleOptions {
        containers: true,
        ..Default::default()
    });
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway_with(
        &double,
        &dir,
        "profiles:\n  default:\n    resources: {limits: {memory: 32Mi}}\n",
    );
    // The pod's user and PID 1 are real.
    let out = run_remote_v(
        &gw,
        &["sh", "-c", "id -u; cat /proc/1/cmdline | tr '\\0' ' '"],
    )
    .wait_with_output()
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.starts_with("65532\nsleep "), "{stdout}");
    let out = run_remote_v(
        &gw,
        &[
            "sh",
            "-c",
            "x=$(head -c 200000000 /dev/zero | tr '\\0' a); echo survived",
        ],
    )
    .wait_with_output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "");
    assert_eq!(out.status.code(), Some(125), "{stderr}");
    assert!(
        stderr.contains("ran out of memory (OOMKilled; memory limit 32Mi) (pod_failed)"),
        "{stderr}"
    );
    assert!(support::wait_until(Duration::from_secs(15), || double
        .pod_names(NS)
        .is_empty()));
}

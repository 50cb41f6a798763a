//! Cache volumes (docs/caches.md) through the real gateway: kept between one-shot runs of one
//! key, shared by the runs of a key one at a time, never across identities, deleted after
//! their idle TTL; on the local backend (directories) and on the Kubernetes backend
//! (PersistentVolumeClaims, against the API-server double).

use crate::kube_double;
use crate::support;

use std::collections::BTreeMap;
use std::time::Duration;

use kube_double::{DoubleOptions, KubeDouble};
use mcp_run::contract::CacheState;
use serde_json::json;
use support::{Gateway, config_file, raw, wait_until};

const ALICE: &str = "alice-token-0123456789abcdef";
const BOB: &str = "bob-token-0123456789abcdef";
const NS: &str = "default";

/// A gateway with tokens for `alice` and `bob` and this configuration.
fn gateway(dir: &tempfile::TempDir, yaml: &str, extra: &[&str]) -> Gateway {
    gateway_env(dir, yaml, extra, &[])
}

fn gateway_env(
    dir: &tempfile::TempDir,
    yaml: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Gateway {
    // Two identities on one local backend trust each other here (docs/policy.md); the
    // kube backend ignores the section.
    let yaml = format!("local:\n  allow_multiple_identities: true\n{yaml}");
    let config = config_file(dir, &yaml);
    let mut args = vec!["--config", config.to_str().unwrap()];
    args.extend_from_slice(extra);
    let tokens = format!("alice:{ALICE},bob:{BOB}");
    let mut all = vec![("MCP_RUN_AUTH_TOKENS", tokens.as_str())];
    all.extend_from_slice(env);
    Gateway::start_with_env(&args, &all)
}

/// Appends a line to the cache's file and prints what the file held before.
fn append(line: &str, profile: &str) -> serde_json::Value {
    json!({
        "executable": "sh",
        "args": ["-c", "mkdir -p \"$C\" && cat \"$C/log\" 2>/dev/null; echo \"$1\" >> \"$C/log\"", "sh", line],
        "profile": profile,
    })
}

async fn run_as(gw: &mut Gateway, token: &str, body: serde_json::Value) -> support::RawRun {
    gw.token = Some(token.into());
    let r = raw(gw, body).await;
    gw.token = None;
    r
}

fn state(r: &support::RawRun, cache: &str) -> CacheState {
    r.context
        .as_ref()
        .and_then(|c| c.caches.get(cache).copied())
        .unwrap_or_else(|| panic!("no state for cache {cache}: {r:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn local_caches_are_kept_per_identity_bounded_and_swept() {
    let dir = tempfile::tempdir().unwrap();
    let caches = dir.path().join("caches");
    let yaml = format!(
        "caches:\n  local_dir: {}\n  idle_ttl_secs: 4\n  sweep_interval_secs: 1\n\
         profiles:\n  default: {{}}\n  build:\n    caches:\n      - {{name: data, path: /cache, env: {{C: sub}}, size: 1Mi}}\n",
        caches.display()
    );
    let mut gw = gateway(&dir, &yaml, &[]);
    // The capabilities tell a caller which profile keeps what.
    gw.token = Some(ALICE.into());
    let caps = support::get_json(&gw, "/capabilities").await;
    gw.token = None;
    let build = caps["profiles"]
        .as_array()
        .and_then(|p| p.iter().find(|p| p["name"] == "build"))
        .unwrap_or_else(|| panic!("{caps}"));
    assert_eq!(
        build["caches"],
        json!([{"name": "data", "scope": "identity", "variables": ["C"]}])
    );

    let a1 = run_as(&mut gw, ALICE, append("a1", "build")).await;
    assert_eq!(a1.code(), Some(0), "{a1:?}");
    assert_eq!(a1.stdout_str(), "");
    assert_eq!(state(&a1, "data"), CacheState::Created);
    let a2 = run_as(&mut gw, ALICE, append("a2", "build")).await;
    assert_eq!(a2.stdout_str(), "a1\n", "kept between runs of one key");
    assert_eq!(state(&a2, "data"), CacheState::Reused);
    // Another identity: its own cache, empty.
    let b1 = run_as(&mut gw, BOB, append("b1", "build")).await;
    assert_eq!(b1.stdout_str(), "", "bob never sees alice's cache");
    assert_eq!(state(&b1, "data"), CacheState::Created);
    let a3 = run_as(&mut gw, ALICE, append("a3", "build")).await;
    assert_eq!(a3.stdout_str(), "a1\na2\n");
    // A profile without caches: no variable, no state.
    let plain = run_as(
        &mut gw,
        ALICE,
        json!({"executable": "sh", "args": ["-c", "echo \"[$C]\""]}),
    )
    .await;
    assert_eq!(plain.stdout_str(), "[]\n");
    assert!(plain.context.unwrap().caches.is_empty());
    // Directories are named by a hash: no identity in any name or record.
    let names: Vec<String> = std::fs::read_dir(&caches)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names.iter().filter(|n| n.ends_with(".json")).count(),
        2,
        "{names:?}"
    );
    for n in &names {
        assert!(!n.contains("alice") && !n.contains("bob"), "{n}");
        if n.ends_with(".json") {
            let text = std::fs::read_to_string(caches.join(n)).unwrap();
            assert!(!text.contains("alice") && !text.contains("bob"), "{text}");
        }
    }
    // Over its size bound (1Mi): emptied after the run; the next run starts cold.
    let big = run_as(
        &mut gw,
        ALICE,
        json!({"executable": "sh", "args": ["-c", "head -c 2000000 /dev/zero > \"$C/big\""], "profile": "build"}),
    )
    .await;
    assert_eq!(big.code(), Some(0), "{big:?}");
    let cold = loop {
        let r = run_as(&mut gw, ALICE, append("after", "build")).await;
        // The measurement runs after the run, holding the cache: a run meanwhile waits.
        if state(&r, "data") == CacheState::Created {
            break r;
        }
        assert!(r.stdout_str().starts_with("a1\n"), "{r:?}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(cold.stdout_str(), "");
    assert!(gw.log_text().contains("cache over its size bound"));
    // Idle for the TTL (4 s): swept.
    assert!(
        wait_until(Duration::from_secs(40), || {
            std::fs::read_dir(&caches)
                .map(|d| {
                    d.flatten()
                        .all(|e| e.file_name() == ".skipped" || e.file_name() == ".lock")
                })
                .unwrap_or(false)
        }),
        "idle caches left: {:?}",
        std::fs::read_dir(&caches)
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect::<Vec<_>>()
    );
    let again = run_as(&mut gw, ALICE, append("x", "build")).await;
    assert_eq!(state(&again, "data"), CacheState::Created);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn local_runs_of_one_key_take_turns_or_skip() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = format!(
        "caches:\n  local_dir: {}\n  busy_wait_secs: 30\n\
         profiles:\n  default:\n    caches:\n      - {{name: wait, path: /w, env: {{C: .}}}}\n  \
         skip:\n    caches:\n      - {{name: skip, path: /s, env: {{C: .}}, when_busy: skip}}\n",
        dir.path().join("caches").display()
    );
    let gw = gateway(&dir, &yaml, &[]);
    let mut gw2 = Gateway::external(&gw.raw_url(), "local");
    gw2.token = Some(ALICE.into());
    // The first run says it holds the cache (a marker file), then holds it for a second.
    let slow = |profile: &str, started: &std::path::Path| {
        json!({
            "executable": "sh",
            "args": ["-c", "cat \"$C/log\" 2>/dev/null; : > \"$1\"; sleep 1; echo first > \"$C/log\"", "sh", started],
            "profile": profile,
        })
    };
    for (profile, cache) in [("default", "wait"), ("skip", "skip")] {
        let started = dir.path().join(format!("{profile}-started"));
        let first = raw(&gw2, slow(profile, &started));
        let second = async {
            // Starts while the first holds the cache.
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            while !started.exists() {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the first run started"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            raw(&gw2, append("second", profile)).await
        };
        let (first, second) = tokio::join!(first, second);
        assert_eq!(first.code(), Some(0), "{first:?}");
        if cache == "wait" {
            // Waited for the first, then saw what it wrote.
            assert_eq!(second.stdout_str(), "first\n", "{second:?}");
            assert_eq!(state(&second, cache), CacheState::Reused);
        } else {
            // Ran at once, in an empty directory of its own.
            assert_eq!(second.stdout_str(), "", "{second:?}");
            assert_eq!(state(&second, cache), CacheState::Skipped);
            // Once the first released it (after its run, in the background), the next run
            // has it: with what the first wrote, without the skipped run's line.
            let after = loop {
                let r = raw(&gw2, append("third", profile)).await;
                if state(&r, cache) != CacheState::Skipped {
                    break r;
                }
            };
            assert_eq!(
                after.stdout_str(),
                "first\n",
                "a skipped run's writes are not kept"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Kubernetes

fn restricted_double() -> KubeDouble {
    let mut opts = DoubleOptions::default();
    opts.namespace_labels.insert(
        NS.into(),
        BTreeMap::from([(
            "pod-security.kubernetes.io/enforce".to_string(),
            "restricted".to_string(),
        )]),
    );
    KubeDouble::start_with(opts)
}

fn kube_gateway(double: &KubeDouble, dir: &tempfile::TempDir, yaml: &str) -> Gateway {
    kube_replica(double, dir, yaml, "gw-a")
}

/// One replica of a gateway installation: `name` is its pod name (its runner pods' label).
fn kube_replica(double: &KubeDouble, dir: &tempfile::TempDir, yaml: &str, name: &str) -> Gateway {
    let kubeconfig = double.kubeconfig();
    gateway_env(
        dir,
        yaml,
        &[
            "--backend",
            "kube",
            "--kubeconfig",
            kubeconfig.to_str().unwrap(),
        ],
        &[("MCP_RUN_POD_NAME", name)],
    )
}

/// Whether no claim is held (every run released its caches).
fn released(double: &KubeDouble) -> bool {
    double.pvcs(NS).iter().all(|c| {
        c.metadata
            .annotations
            .as_ref()
            .is_some_and(|a| !a.contains_key("mcp-run.dev/held-by"))
    })
}

fn creates(double: &KubeDouble) -> usize {
    double
        .requests()
        .iter()
        .filter(|r| r.starts_with("POST /api/v1/namespaces/default/persistentvolumeclaims"))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kube_claims_are_kept_per_identity_mounted_restricted_and_swept() {
    let double = restricted_double();
    let dir = tempfile::tempdir().unwrap();
    let mount = dir.path().join("mnt/cache");
    let yaml = format!(
        "caches:\n  idle_ttl_secs: 5\n  sweep_interval_secs: 1\n  storage_class: fast\n\
         profiles:\n  default:\n    caches:\n      - {{name: build, path: {}, env: {{C: data}}, size: 2Gi}}\n",
        mount.display()
    );
    let mut gw = kube_gateway(&double, &dir, &yaml);

    let a1 = run_as(&mut gw, ALICE, append("a1", "default")).await;
    assert_eq!(a1.code(), Some(0), "{a1:?}");
    assert_eq!(a1.stdout_str(), "");
    assert_eq!(state(&a1, "build"), CacheState::Created);
    assert!(wait_until(Duration::from_secs(10), || released(&double)));
    let before = double.requests().len();
    let a2 = run_as(&mut gw, ALICE, append("a2", "default")).await;
    assert_eq!(a2.stdout_str(), "a1\n", "kept between runs: {a2:?}");
    assert_eq!(state(&a2, "build"), CacheState::Reused);
    // What a warm run costs the API server for its cache: read and take the claim, then read
    // and release it (the sweeper's lists aside).
    assert!(wait_until(Duration::from_secs(10), || released(&double)));
    let calls: Vec<String> = double.requests()[before..]
        .iter()
        .filter(|r| r.contains("persistentvolumeclaims") && !r.contains("labelSelector"))
        .map(|r| r.split(' ').next().unwrap().to_string())
        .collect();
    assert_eq!(
        calls,
        ["GET", "PATCH", "GET", "PATCH"],
        "{:?}",
        double.requests()
    );
    let b1 = run_as(&mut gw, BOB, append("b1", "default")).await;
    assert_eq!(b1.stdout_str(), "", "bob never sees alice's cache: {b1:?}");
    assert_eq!(state(&b1, "build"), CacheState::Created);
    let a3 = run_as(&mut gw, ALICE, append("a3", "default")).await;
    assert_eq!(a3.stdout_str(), "a1\na2\n");

    // One claim per key, created once, labelled without the identity.
    let claims = double.pvcs(NS);
    assert_eq!(claims.len(), 2, "{claims:?}");
    assert_eq!(creates(&double), 2);
    let mut owners = std::collections::BTreeSet::new();
    for c in &claims {
        let text = serde_json::to_string(c).unwrap();
        assert!(
            !text.contains("alice") && !text.contains("bob") && !text.contains(ALICE),
            "{text}"
        );
        let l = c.metadata.labels.as_ref().unwrap();
        assert_eq!(l["app.kubernetes.io/component"], "cache");
        assert_eq!(l["mcp-run.dev/cache"], "build");
        assert_eq!(l["mcp-run.dev/instance"], "mcp-run");
        assert_eq!(l["mcp-run.dev/scope"], "identity");
        owners.insert(l["mcp-run.dev/owner"].clone());
        let spec = c.spec.as_ref().unwrap();
        assert_eq!(spec.storage_class_name.as_deref(), Some("fast"));
        assert_eq!(
            spec.resources.as_ref().unwrap().requests.as_ref().unwrap()["storage"].0,
            "2Gi"
        );
        assert_eq!(
            spec.access_modes.as_deref(),
            Some(&["ReadWriteOnce".to_string()][..])
        );
    }
    assert_eq!(owners.len(), 2);
    // Released after each run (its pod gone): nobody holds a claim now.
    assert!(wait_until(Duration::from_secs(10), || double
        .pvcs(NS)
        .iter()
        .all(|c| {
            c.metadata.annotations.as_ref().is_some_and(|a| {
                !a.contains_key("mcp-run.dev/held-by") && a.contains_key("mcp-run.dev/last-used")
            })
        })));
    // The pods mounted their claims with an fsGroup, and Pod Security `restricted` (enforced
    // by the double's admission) admitted them.
    let alice_claim = double.pvc_mounts()[0].1.clone();
    let pods = double.created_pods();
    assert_eq!(pods.len(), 4);
    for p in &pods {
        let spec = p.spec.as_ref().unwrap();
        let claim = spec
            .volumes
            .iter()
            .flatten()
            .find_map(|v| v.persistent_volume_claim.as_ref())
            .expect("a claim volume");
        assert!(claim.claim_name.starts_with("mcp-run-cache-"));
        let sc = spec.security_context.as_ref().unwrap();
        assert_eq!(sc.fs_group, Some(65532));
        assert_eq!(sc.fs_group_change_policy.as_deref(), Some("OnRootMismatch"));
        let m = &spec.containers[0].volume_mounts.as_ref().unwrap()[0];
        assert_eq!(m.mount_path, mount.to_str().unwrap());
    }
    assert_eq!(
        double
            .pvc_mounts()
            .iter()
            .filter(|(_, c)| *c == alice_claim)
            .count(),
        3
    );

    // A hold whose pod is gone (a gateway killed mid-run) is taken over once a pod start
    // could have made its pod; a fresh hold of a live run is waited for.
    double.annotate_pvc(
        NS,
        &alice_claim,
        &[
            ("mcp-run.dev/held-by", Some("mcp-run-gone")),
            ("mcp-run.dev/held-since", Some("2026-01-01T00:00:00Z")),
            ("mcp-run.dev/held-until", Some("2099-01-01T00:00:00Z")),
        ],
    );
    let a4 = run_as(&mut gw, ALICE, append("a4", "default")).await;
    assert_eq!(
        a4.stdout_str(),
        "a1\na2\na3\n",
        "stale hold taken over: {a4:?}"
    );

    // Idle for the TTL: the sweeper deletes both claims.
    assert!(
        wait_until(Duration::from_secs(40), || double.pvcs(NS).is_empty()),
        "claims left: {:?}",
        double.pvcs(NS)
    );
    assert_eq!(
        double.pvc_deletions().len(),
        2,
        "{:?}",
        double.pvc_deletions()
    );
    // Cold again afterwards, with a new claim.
    let a5 = run_as(&mut gw, ALICE, append("a5", "default")).await;
    assert_eq!(a5.stdout_str(), "");
    assert_eq!(state(&a5, "build"), CacheState::Created);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kube_runs_of_one_key_race_to_one_claim_and_take_turns() {
    let double = KubeDouble::start();
    let dir = tempfile::tempdir().unwrap();
    let mount = dir.path().join("cache");
    let yaml = format!(
        "caches:\n  busy_wait_secs: 8\n  max_per_identity: 2\n\
         profiles:\n  default:\n    caches:\n      - {{name: build, path: {}, env: {{C: .}}}}\n  \
         skipping:\n    caches:\n      - {{name: build2, path: {}2, env: {{C: .}}, when_busy: skip}}\n  \
         third:\n    caches:\n      - {{name: build3, path: {}3, env: {{C: .}}}}\n",
        mount.display(),
        mount.display(),
        mount.display()
    );
    // The gateway checks the claims' verbs too: one missing makes it unready, named.
    double.deny(NS, "persistentvolumeclaims", "", "patch");
    let gw = kube_gateway(&double, &dir, &yaml);
    let ready = support::http().get(gw.url("/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 503);
    let why = ready.text().await.unwrap();
    assert!(why.contains("patch persistentvolumeclaims"), "{why}");
    let mut gw2 = Gateway::external(&gw.raw_url(), "kubernetes");
    gw2.token = Some(ALICE.into());
    // Another replica of the same installation.
    let replica = kube_replica(&double, &dir, &yaml, "gw-b");
    let mut gw3 = Gateway::external(&replica.raw_url(), "kubernetes");
    gw3.token = Some(ALICE.into());
    // Two first runs at once, one on each replica: one claim; the second run waits for the
    // first and sees its write.
    let body = |n: &str| {
        json!({
            "executable": "sh",
            "args": ["-c", "mkdir -p \"$C\" && cat \"$C/log\" 2>/dev/null; echo \"$1\" >> \"$C/log\"", "sh", n],
        })
    };
    let (x, y) = tokio::join!(raw(&gw2, body("x")), raw(&gw3, body("y")));
    assert_eq!((x.code(), y.code()), (Some(0), Some(0)), "{x:?} {y:?}");
    let outs = [x.stdout_str(), y.stdout_str()];
    assert!(
        outs == ["".to_string(), "x\n".to_string()] || outs == ["y\n".to_string(), "".to_string()],
        "one after the other: {outs:?}"
    );
    let mut states = [state(&x, "build"), state(&y, "build")];
    states.sort_by_key(|s| format!("{s:?}"));
    assert_eq!(states, [CacheState::Created, CacheState::Reused]);
    assert_eq!(double.pvcs(NS).len(), 1);

    // Held by a live run (a fresh hold): waited for within busy_wait_secs, then 429.
    let claim = double.pvcs(NS)[0].metadata.name.clone().unwrap();
    assert!(wait_until(Duration::from_secs(10), || double.pvcs(NS)[0]
        .metadata
        .annotations
        .as_ref()
        .is_some_and(|a| !a.contains_key("mcp-run.dev/held-by"))));
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    double.annotate_pvc(
        NS,
        &claim,
        &[
            ("mcp-run.dev/held-by", Some("mcp-run-elsewhere")),
            ("mcp-run.dev/held-since", Some(&now)),
            ("mcp-run.dev/held-until", Some("2099-01-01T00:00:00Z")),
        ],
    );
    // With progress asked for, the wait is a `queued` phase, then the refusal an `error` event.
    let text = support::http()
        .post(gw.raw_url())
        .bearer_auth(ALICE)
        .header("mcp-run-progress", "1")
        .json(&body("z"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let events: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(events[0]["type"], "phase", "{text}");
    assert_eq!(events[0]["phase"], "queued", "{text}");
    assert_eq!(
        events[0]["message"],
        "cache build is in use by the run in pod mcp-run-elsewhere; waiting up to 8s",
        "{text}"
    );
    let last = events.last().unwrap();
    assert_eq!(last["type"], "error", "{text}");
    assert_eq!(last["code"], "too_many_requests", "{text}");
    let busy = raw(&gw2, body("z")).await;
    let rejection = busy.rejection.expect("refused");
    assert_eq!(busy.status, 429, "{rejection:?}");
    assert!(
        rejection
            .error
            .message
            .contains("cache build stayed in use by another run for 8s"),
        "{rejection:?}"
    );
    assert_eq!(
        double.created_pods().len(),
        2,
        "no pod for a run that never got its cache"
    );

    // when_busy: skip runs at once with an emptyDir there instead, and says so.
    let on = |profile: &str, n: &str| {
        let mut b = body(n);
        b["profile"] = json!(profile);
        b
    };
    let s1 = raw(&gw2, on("skipping", "s1")).await;
    assert_eq!(state(&s1, "build2"), CacheState::Created, "{s1:?}");
    let claim2 = double
        .pvcs(NS)
        .into_iter()
        .find(|c| c.metadata.labels.as_ref().unwrap()["mcp-run.dev/cache"] == "build2")
        .unwrap()
        .metadata
        .name
        .unwrap();
    assert!(wait_until(Duration::from_secs(10), || {
        double.pvcs(NS).iter().all(|c| {
            c.metadata.name.as_deref() != Some(&claim2)
                || !c
                    .metadata
                    .annotations
                    .as_ref()
                    .unwrap()
                    .contains_key("mcp-run.dev/held-by")
        })
    }));
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    double.annotate_pvc(
        NS,
        &claim2,
        &[
            ("mcp-run.dev/held-by", Some("mcp-run-elsewhere")),
            ("mcp-run.dev/held-since", Some(&now)),
            ("mcp-run.dev/held-until", Some("2099-01-01T00:00:00Z")),
        ],
    );
    let s2 = raw(&gw2, on("skipping", "s2")).await;
    assert_eq!(s2.code(), Some(0), "{s2:?}");
    assert_eq!(state(&s2, "build2"), CacheState::Skipped);
    let pod = s2.context.as_ref().unwrap().pod.clone().unwrap();
    let spec = double
        .created_pods()
        .into_iter()
        .find(|p| p.metadata.name.as_deref() == Some(&pod))
        .unwrap()
        .spec
        .unwrap();
    let v = spec
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "mcp-run-cache-build2")
        .unwrap();
    assert!(
        v.empty_dir.is_some() && v.persistent_volume_claim.is_none(),
        "{v:?}"
    );

    // A third cache for alice is one more than caches.max_per_identity (2): run without it.
    let t = raw(&gw2, on("third", "t")).await;
    assert_eq!(t.code(), Some(0), "{t:?}");
    assert_eq!(state(&t, "build3"), CacheState::Skipped);
    assert_eq!(double.pvcs(NS).len(), 2);
    assert!(
        gw.log_text().contains("max_per_identity"),
        "{}",
        gw.log_text()
    );
}

/// A session's pod mounts the profile's caches as a one-shot run's pod does (the same key: the
/// caller's identity), holds them while the session lives, points every call at them, and
/// hands them on when the session ends; another identity's session never sees them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kube_session_pods_mount_the_caches_of_their_identity() {
    let double = restricted_double();
    let dir = tempfile::tempdir().unwrap();
    let mount = dir.path().join("mnt/cache");
    let yaml = format!(
        "profiles:\n  default:\n    caches:\n      - {{name: build, path: {}, env: {{C: data}}}}\n",
        mount.display()
    );
    let mut gw = kube_gateway(&double, &dir, &yaml);
    let in_session = |line: &str| {
        let mut body = append(line, "default");
        body["session"] = json!("s");
        body
    };
    let a1 = run_as(&mut gw, ALICE, append("a1", "default")).await;
    assert_eq!(state(&a1, "build"), CacheState::Created, "{a1:?}");
    assert!(wait_until(Duration::from_secs(10), || released(&double)));

    let s1 = run_as(&mut gw, ALICE, in_session("s1")).await;
    assert_eq!(
        s1.stdout_str(),
        "a1\n",
        "the session sees the one-shot run's cache: {s1:?}"
    );
    assert_eq!(state(&s1, "build"), CacheState::Reused);
    let pod = s1.context.as_ref().unwrap().pod.clone().unwrap();
    // Held by the session's pod while the session lives, mounted with the fsGroup.
    let held_by = |double: &KubeDouble| -> Vec<String> {
        double
            .pvcs(NS)
            .iter()
            .filter_map(|c| {
                c.metadata
                    .annotations
                    .as_ref()?
                    .get("mcp-run.dev/held-by")
                    .cloned()
            })
            .collect()
    };
    assert_eq!(held_by(&double), std::slice::from_ref(&pod));
    let s2 = run_as(&mut gw, ALICE, in_session("s2")).await;
    assert_eq!(s2.stdout_str(), "a1\ns1\n", "{s2:?}");
    assert_eq!(
        held_by(&double),
        std::slice::from_ref(&pod),
        "still held between calls"
    );
    let spec = double.pod(NS, &pod).unwrap().spec.unwrap();
    assert!(
        spec.volumes
            .unwrap()
            .iter()
            .any(|v| v.persistent_volume_claim.is_some()),
        "the session pod mounts the claim"
    );
    assert_eq!(spec.security_context.unwrap().fs_group, Some(65532));

    // Ending the session hands the claim on (after its pod is gone). (Ended before Bob's
    // session: the double mounts a claim by a host path, so two live pods cannot mount
    // different claims at one path.)
    let end = |gw: &Gateway, token: &str| {
        gw.authorized(support::http().delete(gw.url("/sessions/s")))
            .bearer_auth(token)
            .send()
    };
    assert_eq!(end(&gw, ALICE).await.unwrap().status(), 204);
    assert!(wait_until(Duration::from_secs(20), || released(&double)));

    // Bob's session: his own cache, empty.
    let b = run_as(&mut gw, BOB, in_session("b1")).await;
    assert_eq!(b.stdout_str(), "", "bob never sees alice's cache: {b:?}");
    assert_eq!(state(&b, "build"), CacheState::Created);
    assert_eq!(end(&gw, BOB).await.unwrap().status(), 204);
    assert!(wait_until(Duration::from_secs(20), || released(&double)));
    let a2 = run_as(&mut gw, ALICE, append("a2", "default")).await;
    assert_eq!(a2.stdout_str(), "a1\ns1\ns2\n", "{a2:?}");
    // Counted: two claims created (alice's, bob's), alice's mounted again twice (the session
    // once, for its pod, then the last one-shot run).
    let metrics = support::http()
        .get(gw.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for line in [
        "mcp_run_cache_events_total{cache=\"build\",event=\"created\"} 2",
        "mcp_run_cache_events_total{cache=\"build\",event=\"mounted\"} 2",
    ] {
        assert!(metrics.contains(line), "{line} in {metrics}");
    }
}

//! Serves the API-server test double on its own, for tools outside the test suite
//! (bench/kube_double_bench.py): `cargo test --test integration -- --ignored --exact kube_double_serve::serve
//! --nocapture`. Prints `KUBECONFIG=<path>` (and `TOKEN`, `URL`, `CA`) and serves until its
//! stdin closes.
//! A line `stats` on its stdin prints `STATS {json}`: the API calls so far, by kind
//! (bench/kube_session_bench.py counts a session's calls with it).
//! `KUBE_DOUBLE_STEP_MS` sets the delay of each simulated lifecycle step (default 20 ms);
//! `KUBE_DOUBLE_DENY=NS/RESOURCE/SUBRESOURCE/VERB,...` makes SelfSubjectAccessReview answer
//! "no" for those (`KubeDouble::deny`), for `kubectl auth can-i`.

use crate::kube_double;

use std::io::{BufRead as _, Write as _};
use std::time::Duration;

use kube_double::{DoubleOptions, KubeDouble};

#[test]
#[ignore = "a server for bench scripts, not a test"]
fn serve() {
    let step = std::env::var("KUBE_DOUBLE_STEP_MS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let double = KubeDouble::start_with(DoubleOptions {
        step_delay: Duration::from_millis(step),
        ..Default::default()
    });
    for rule in std::env::var("KUBE_DOUBLE_DENY")
        .unwrap_or_default()
        .split(',')
    {
        if let [ns, resource, sub, verb] = rule.split('/').collect::<Vec<_>>()[..] {
            double.deny(ns, resource, sub, verb);
        }
    }
    println!("KUBECONFIG={}", double.kubeconfig().display());
    println!("TOKEN={}", double.options().token);
    println!("URL={}", double.url());
    // The CA of the double's TLS certificate, for clients that do not read the kubeconfig.
    let ca = std::env::temp_dir().join(format!("kube-double-ca-{}.pem", std::process::id()));
    std::fs::write(&ca, double.ca_pem()).expect("write the CA");
    println!("CA={}", ca.display());
    let _ = std::io::stdout().flush();
    // Serve until whoever started us closes our stdin.
    // A line `stats` answers `STATS <json>`: the API calls received so far, by kind.
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        if line.trim() == "stats" {
            let r = double.requests();
            let count = |f: &dyn Fn(&str) -> bool| r.iter().filter(|l| f(l)).count();
            println!(
                "STATS {}",
                serde_json::json!({
                    "requests": r.len(),
                    "creates": count(&|l| l.starts_with("POST ") && (l.ends_with("/pods") || l.contains("/pods?"))),
                    "execs": count(&|l| l.contains("/exec?")),
                    "watches": count(&|l| l.contains("/pods") && l.contains("watch=")),
                    "deletes": count(&|l| l.starts_with("DELETE ") && l.contains("/pods/")),
                    "pods_created": double.created_pods().len(),
                })
            );
            let _ = std::io::stdout().flush();
        }
    }
    drop(double);
    let _ = std::fs::remove_file(&ca);
}

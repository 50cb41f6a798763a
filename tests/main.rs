//! The integration tests: one binary (as ripgrep's `tests/tests.rs`), so that the shared
//! support code and the Kubernetes API-server double are compiled and linked once.
//! Every `tests/*.rs` file is a module here; `every_test_file_is_a_module` fails when one
//! is left out (with `autotests = false` cargo would silently not build it).
//! Run one file's tests with `cargo test --test integration NAME::`.

// A test crate has no outside: `pub` here only shares helpers between its modules.
#![allow(unreachable_pub)]

mod kube_double;
mod support;

mod auth;
mod caches;
mod chart_objects;
mod cli;
mod docs;
mod double_conformance;
mod hardening;
mod hardening_conn;
mod hardening_exec;
mod hardening_mcp;
mod hardening_workspace;
mod http_edges;
mod kube;
mod kube_clusters;
mod kube_double_serve;
mod local;
mod mcp;
mod mcp_kube;
mod mcp_outputs;
mod metrics;
mod policy;
mod progress;
mod redaction;
mod replicas;
mod sessions;
mod stdin;
mod templates;
mod tools;
mod workspace;
mod workspace_kube;
mod workspace_mcp;
mod workspace_protocol;

#[test]
fn every_test_file_is_a_module() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let main = std::fs::read_to_string(dir.join("main.rs")).expect("tests/main.rs");
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("tests/") {
        let path = entry.expect("entry").path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_owned();
        let module = if path.is_dir() {
            if !path.join("mod.rs").exists() {
                continue; // fixtures, not a module
            }
            name
        } else if let Some(stem) = name.strip_suffix(".rs") {
            stem.to_owned()
        } else {
            continue;
        };
        if module != "main" && !main.lines().any(|l| l == format!("mod {module};")) {
            missing.push(module);
        }
    }
    assert!(
        missing.is_empty(),
        "tests/main.rs does not declare: {missing:?}"
    );
}

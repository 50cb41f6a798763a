//! The docs hold against the binaries: what README.md and docs/ show is run or compared here,
//! so that an edit on either side that makes them disagree fails.

use crate::support;

use std::process::Command;

use serde_json::{Value, json};
use support::{Gateway, http, run_remote_bin};

fn doc(path: &str) -> String {
    std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path))
        .unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The fenced blocks of `lang` in `text`, in order.
fn blocks(text: &str, lang: &str) -> Vec<String> {
    let open = format!("```{lang}");
    let mut out = Vec::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        match &mut current {
            None if line.trim_end() == open => current = Some(String::new()),
            Some(b) if line.trim_end() == "```" => {
                out.push(std::mem::take(b));
                current = None;
            }
            Some(b) => {
                b.push_str(line);
                b.push('\n');
            }
            None => {}
        }
    }
    out
}

/// docs/configuration.md's example starts as written, next to the tokens file it names, and
/// its sections take effect (auth on, the declared tool served).
#[tokio::test]
async fn configuration_example_starts_as_written() {
    let example = blocks(&doc("docs/configuration.md"), "yaml")
        .into_iter()
        .next()
        .expect("the example");
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("mcp-run.yaml"), &example).unwrap();
    std::fs::write(
        dir.path().join("tokens.txt"),
        "ci:0123456789abcdef0123456789abcdef\n",
    )
    .unwrap();
    // The file as it is: `--listen` only moves it off the fixed port, for parallel tests.
    let gw = Gateway::start_in(Some(dir.path()), &["--config", "mcp-run.yaml"], &[]);
    let health = http().get(gw.url("/healthz")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    let raw = |token: Option<&str>| {
        let mut r = http()
            .post(gw.raw_url())
            .json(&json!({"executable": "true", "cwd": "/workspace"}));
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        r.send()
    };
    assert_eq!(raw(None).await.unwrap().status(), 401, "auth is on");
    // With the token the request gets past auth to the example's policy (cargo and make only).
    let refused: Value = raw(Some("0123456789abcdef0123456789abcdef"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(refused["error"]["code"], "policy_violation", "{refused}");
}

/// docs/policy.md's first example is a whole configuration file: it starts as written and
/// its rules hold (`rm` denied, naming the rule).
#[tokio::test]
async fn policy_example_starts_as_written() {
    let example = blocks(&doc("docs/policy.md"), "yaml")
        .into_iter()
        .next()
        .expect("the example");
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("policy.yaml"), &example).unwrap();
    let gw = Gateway::start_in(Some(dir.path()), &["--config", "policy.yaml"], &[]);
    let refused: Value = http()
        .post(gw.raw_url())
        .json(&json!({"executable": "rm", "args": ["-rf", "/tmp/x"]}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(refused["error"]["code"], "policy_violation", "{refused}");
    assert!(
        refused["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("policy.executables"),
        "{refused}"
    );
}

/// docs/protocol.md's curl example of a refused request: the same body gets the answer the
/// doc shows, word for word (it names every field a request may have).
#[tokio::test]
async fn protocol_refusal_example_is_what_the_gateway_answers() {
    let text = doc("docs/protocol.md");
    let section = text
        .split("## Examples with curl")
        .nth(1)
        .expect("the curl examples");
    let request = blocks(section, "sh")
        .into_iter()
        .find(|b| b.contains(r#""shell":true"#))
        .expect("the refused example");
    let answer = section
        .lines()
        .find(|l| l.starts_with(r#"{"error":"#))
        .expect("its answer");
    let body = request
        .split("-d '")
        .nth(1)
        .and_then(|b| b.split('\'').next())
        .expect("the body after -d");
    let gw = Gateway::start(&[]);
    let got = http()
        .post(gw.raw_url())
        .header("Content-Type", "application/json")
        .body(body.to_owned())
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(got.trim(), answer, "docs/protocol.md shows another answer");
}

/// docs/mcp.md names the versions `initialize` negotiates and the one it answers otherwise.
#[tokio::test]
async fn mcp_protocol_versions_match_initialize() {
    let text = doc("docs/mcp.md");
    let line: String = text
        .split("\n\n")
        .find(|p| p.starts_with("Protocol versions negotiated by `initialize`"))
        .expect("the protocol paragraph")
        .replace('\n', " ");
    let re = regex::Regex::new(r"\d{4}-\d{2}-\d{2}").unwrap();
    let versions: Vec<&str> = re.find_iter(&line).map(|m| m.as_str()).collect();
    let (fallback, known) = versions.split_last().expect("versions");
    assert!(known.contains(fallback), "{line}");
    let gw = Gateway::start(&[]);
    let answer = |asked: String| {
        let gw = &gw;
        async move {
            let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize",
                "params": {"protocolVersion": asked, "capabilities": {},
                           "clientInfo": {"name": "docs", "version": "0"}}});
            let body = http()
                .post(gw.url("/mcp"))
                .header("accept", "application/json, text/event-stream")
                .json(&init)
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            let json = body
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(str::trim)
                .find(|l| l.contains("protocolVersion"))
                .map(str::to_owned)
                .unwrap_or(body);
            let v: Value = serde_json::from_str(&json).unwrap();
            v["result"]["protocolVersion"].as_str().unwrap().to_owned()
        }
    };
    for v in known {
        assert_eq!(answer(v.to_string()).await, *v, "{line}");
    }
    assert_eq!(answer("2099-01-01".into()).await, *fallback, "{line}");
}

/// docs/mcp.md's Claude Code block adds servers with distinct names (a second `mcp-run`
/// fails: it already exists), and every stdio snippet runs the installed binary.
#[test]
fn mcp_client_snippets_use_distinct_names() {
    let text = doc("docs/mcp.md");
    let mut names = Vec::new();
    for block in blocks(&text, "sh") {
        for line in block.lines().filter(|l| l.starts_with("claude mcp add")) {
            let name = line
                .split_whitespace()
                .skip(3)
                .find(|w| !w.starts_with("--") && !["http", "stdio"].contains(w))
                .unwrap_or_else(|| panic!("no name in {line}"));
            names.push(name.to_owned());
        }
    }
    assert!(names.len() >= 3, "{names:?}");
    let mut unique = names.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), names.len(), "{names:?}");
    let desktop = blocks(&text, "json")
        .into_iter()
        .find(|b| b.contains("mcpServers"))
        .expect("Claude Desktop block");
    let v: Value = serde_json::from_str(&desktop).unwrap();
    let servers = v["mcpServers"].as_object().unwrap();
    assert!(servers.len() >= 2, "local and remote");
    for (name, s) in servers {
        let command = s["command"].as_str().unwrap();
        assert!(
            command.starts_with('/'),
            "{name}: Claude Desktop needs an absolute path"
        );
    }
    assert!(
        servers
            .values()
            .any(|s| !s["args"].to_string().contains("remote"))
    );
}

/// docs/protocol.md's synopsis names every option `run-remote --help` lists.
#[test]
fn protocol_synopsis_lists_every_run_remote_option() {
    let text = doc("docs/protocol.md");
    let start = text.find("## `run-remote`").expect("run-remote section");
    let synopsis = blocks(&text[start..], "").into_iter().next().unwrap();
    let help = Command::new(run_remote_bin())
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8(help.stdout).unwrap();
    let re = regex::Regex::new(r"(?m)^\s+(?:-\w, )?(--[a-z][a-z-]+)").unwrap();
    let options: Vec<&str> = re
        .captures_iter(&help)
        .map(|c| c.get(1).unwrap().as_str())
        .filter(|o| !["--help", "--version"].contains(o))
        .collect();
    assert!(options.len() >= 9, "{options:?}");
    for o in options {
        assert!(
            synopsis.contains(o),
            "{o} missing from the synopsis:\n{synopsis}"
        );
    }
}

/// docs/templates.md shows the header row `run-remote templates` prints.
#[test]
fn templates_listing_matches_the_doc() {
    let text = doc("docs/templates.md");
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(run_remote_bin())
        .arg("templates")
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let out = String::from_utf8(out.stdout).unwrap();
    let header = out.lines().next().unwrap();
    let shown = blocks(&text, "")
        .into_iter()
        .find(|b| b.starts_with("NAME "))
        .expect("templates.md shows the listing");
    assert_eq!(shown.lines().next().unwrap(), header);
    // Each built-in line shown is one the binary prints.
    for line in shown.lines().skip(1) {
        assert!(out.lines().any(|l| l == line), "{line:?} not in\n{out}");
    }
}

//! Sessions through the real binaries on the local backend (docs/sessions.md): a runner kept
//! across calls, invisible to other sessions, identities and one-shot runs; the workspace
//! tree following the manifest while ignored outputs stay; busy, expired, ended and lost
//! sessions; per-caller caps; a call's timeout leaving the runner; nothing left behind on
//! end, expiry and shutdown.

use crate::support;

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use serde_json::{Value, json};
use support::{Gateway, config_file, http, raw, wait_until};

const TOKEN_A: &str = "token-of-alice-0123456789";
const TOKEN_B: &str = "token-of-bob-0123456789ab";

/// A gateway whose session directories (below `TMPDIR`) and workspaces are in `dir`.
fn gateway(dir: &tempfile::TempDir, extra: &str, env: &[(&str, &str)]) -> Gateway {
    let cfg = config_file(
        dir,
        &format!(
            "workspaces:\n  local_dir: {}\n  cache_dir: {}\n{extra}",
            dir.path().join("runs").display(),
            dir.path().join("cache").display()
        ),
    );
    let tmp = dir.path().join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let mut all = vec![("TMPDIR", tmp.to_str().unwrap())];
    all.extend_from_slice(env);
    Gateway::start_with_env(&["--config", cfg.to_str().unwrap()], &all)
}

/// The session directories the gateway has now.
fn session_dirs(dir: &tempfile::TempDir) -> Vec<PathBuf> {
    match std::fs::read_dir(dir.path().join("tmp/mcp-run-sessions")) {
        Ok(d) => d.flatten().map(|e| e.path()).collect(),
        Err(_) => Vec::new(),
    }
}

async fn sh(gw: &Gateway, session: Option<&str>, script: &str) -> support::RawRun {
    let mut body = json!({"executable": "sh", "args": ["-c", script]});
    if let Some(s) = session {
        body["session"] = json!(s);
    }
    raw(gw, body).await
}

async fn sessions(gw: &Gateway) -> Value {
    gw.authorized(http().get(gw.url("/sessions")))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test]
async fn state_stays_in_the_session_and_nowhere_else() {
    let dir = tempfile::tempdir().unwrap();
    // Two identities on one local backend (they trust each other here: docs/policy.md).
    let mut gw = gateway(
        &dir,
        "local:\n  allow_multiple_identities: true\n",
        &[(
            "MCP_RUN_AUTH_TOKENS",
            &format!("alice:{TOKEN_A},bob:{TOKEN_B}"),
        )],
    );
    gw.token = Some(TOKEN_A.into());
    let first = sh(
        &gw,
        Some("build"),
        "echo warm > state; mkdir -p target; echo obj > target/o; pwd",
    )
    .await;
    assert_eq!(first.code(), Some(0), "{first:?}");
    let ctx = first.context.clone().unwrap();
    assert_eq!(ctx.session.as_deref(), Some("build"));
    assert_eq!(ctx.session_call, Some(1));
    let home = first.stdout_str().trim().to_owned();
    let again = sh(&gw, Some("build"), "cat state target/o; pwd").await;
    assert_eq!(again.stdout_str(), format!("warm\nobj\n{home}\n"));
    assert_eq!(again.context.unwrap().session_call, Some(2));
    // The session's TMPDIR is its own and kept too (and goes with it).
    sh(&gw, Some("build"), "echo t > \"$TMPDIR/t\"").await;
    let tmp = sh(&gw, Some("build"), "cat \"$TMPDIR/t\"; echo \"$TMPDIR\"").await;
    let tmp = tmp.stdout_str();
    assert!(tmp.starts_with("t\n"), "{tmp}");
    assert!(
        tmp.contains("mcp-run-session-") && tmp.trim_end().ends_with("/tmp"),
        "{tmp}"
    );
    // Another session, a one-shot run, another identity with the same name: none sees it.
    let other = sh(&gw, Some("other"), "cat state").await;
    assert_ne!(other.code(), Some(0), "{}", other.stdout_str());
    let oneshot = sh(&gw, None, "cat state; pwd").await;
    assert_ne!(oneshot.stdout_str().lines().last(), Some(home.as_str()));
    gw.token = Some(TOKEN_B.into());
    let bob = sh(&gw, Some("build"), "pwd; cat state").await;
    assert_ne!(bob.code(), Some(0));
    assert_eq!(bob.context.unwrap().session_call, Some(1));
    // Each identity lists and ends only its own.
    let listed = sessions(&gw).await;
    let names: Vec<&str> = listed["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["build"]);
    assert_eq!(listed["sessions"][0]["calls"], 1);
    let end_other = gw
        .authorized(http().delete(gw.url("/sessions/other")))
        .send()
        .await
        .unwrap();
    assert_eq!(end_other.status(), 404);
    gw.token = Some(TOKEN_A.into());
    let listed = sessions(&gw).await;
    assert_eq!(listed["sessions"].as_array().unwrap().len(), 2);
    let build = &listed["sessions"][0];
    assert_eq!(build["name"], "build");
    assert_eq!(build["calls"], 4);
    assert_eq!(build["busy"], false);
    assert!(build["expires_in_secs"].as_u64().unwrap() > 800);
    // The metrics count them.
    let metrics = http()
        .get(gw.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(metrics.contains("mcp_run_sessions_open 3"), "{metrics}");
    assert!(
        metrics.contains("mcp_run_session_calls_total 6"),
        "{metrics}"
    );
    // Ending removes the directory; the name then opens a fresh session.
    assert_eq!(session_dirs(&dir).len(), 3);
    let ended = gw
        .authorized(http().delete(gw.url("/sessions/build")))
        .send()
        .await
        .unwrap();
    assert_eq!(ended.status(), 204);
    assert!(wait_until(Duration::from_secs(10), || !Path::new(&home).exists()));
    let fresh = sh(&gw, Some("build"), "cat state").await;
    assert_ne!(fresh.code(), Some(0));
    assert_eq!(fresh.context.unwrap().session_call, Some(1));
    assert!(gw.log_text().contains("outcome=session_ended"));
    // Shutdown ends every session and removes its directory.
    let (status, _gw) = support::terminate(gw).await;
    assert!(status.is_some_and(|s| s.success()));
    assert_eq!(session_dirs(&dir), Vec::<PathBuf>::new());
}

#[tokio::test]
async fn a_timed_out_call_leaves_the_runner_and_profile_changes_caps_and_lost_runners_are_clear() {
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(
        &dir,
        "profiles:\n  default: {}\n  gpu: {}\nsessions:\n  max_per_identity: 2\n",
        &[],
    );
    sh(&gw, Some("s"), "echo kept > state").await;
    let slow = raw(
        &gw,
        json!({"executable": "sleep", "args": ["30"], "session": "s", "timeout_secs": 1}),
    )
    .await;
    assert!(slow.exit.unwrap().timed_out, "{slow:?}");
    let after = sh(&gw, Some("s"), "cat state").await;
    assert_eq!(after.stdout_str(), "kept\n");
    let other = raw(
        &gw,
        json!({"executable": "true", "session": "s", "profile": "gpu"}),
    )
    .await;
    assert_eq!(other.status, 400);
    let message = other.rejection.unwrap().error.message;
    assert!(message.contains("runs profile \"default\""), "{message}");
    // At most two per caller: a third name is refused while two are open.
    assert_eq!(sh(&gw, Some("x"), "true").await.code(), Some(0));
    let z = sh(&gw, Some("z"), "true").await;
    assert_eq!(z.status, 429, "{z:?}");
    assert_eq!(
        z.rejection.unwrap().error.code,
        mcp_run::contract::ErrorCode::TooManySessions
    );
    // Lost: its directory removed behind the gateway's back.
    let home = sh(&gw, Some("s"), "pwd").await.stdout_str();
    std::fs::remove_dir_all(home.trim()).unwrap();
    let lost = sh(&gw, Some("s"), "true").await;
    assert_eq!(lost.status, 410);
    let e = lost.rejection.unwrap().error;
    assert_eq!(e.code, mcp_run::contract::ErrorCode::SessionLost);
    assert!(e.message.contains("was removed"), "{}", e.message);
    let bad = raw(&gw, json!({"executable": "true", "session": "no/slash"})).await;
    assert_eq!(bad.status, 400);
    assert!(
        bad.rejection
            .unwrap()
            .error
            .message
            .contains("invalid session name"),
    );
}

#[tokio::test]
async fn busy_sessions_wait_as_a_phase_or_fail_with_409() {
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&dir, "", &[]);
    // The first call waits for a file that the test writes once the second call queued.
    let first = http()
        .post(gw.raw_url())
        .header("content-type", "application/json")
        .body(
            json!({"executable": "sh", "args": ["-c", "pwd; while [ ! -e go ]; do sleep 0.02; done; echo first done"], "session": "s"})
                .to_string(),
        )
        .send()
        .await
        .unwrap();
    let mut first_body = first.bytes_stream();
    use futures_util::StreamExt as _;
    let mut seen = Vec::new();
    let home = loop {
        let chunk = first_body.next().await.unwrap().unwrap();
        seen.extend_from_slice(&chunk);
        let text = String::from_utf8_lossy(&seen).to_string();
        if let Some(line) = text.lines().find(|l| l.contains("\"stdout\"")) {
            let ev: mcp_run::contract::Event = serde_json::from_str(line).unwrap();
            let mcp_run::contract::Event::Stdout { data } = ev else {
                unreachable!()
            };
            break String::from_utf8_lossy(&data).trim().to_owned();
        }
    };
    let refused = raw(
        &gw,
        json!({"executable": "true", "session": "s", "session_busy": "fail"}),
    )
    .await;
    assert_eq!(refused.status, 409);
    assert_eq!(
        refused.rejection.unwrap().error.code,
        mcp_run::contract::ErrorCode::SessionBusy
    );
    // With progress, the waiting call shows the phase `queued`, then runs after the first.
    let waiting = http()
        .post(gw.raw_url())
        .header("content-type", "application/json")
        .header("mcp-run-progress", "1")
        .body(json!({"executable": "echo", "args": ["second"], "session": "s"}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(waiting.status(), 200);
    let mut second = waiting.bytes_stream();
    let mut got = Vec::new();
    loop {
        got.extend_from_slice(&second.next().await.unwrap().unwrap());
        if String::from_utf8_lossy(&got).contains("\"phase\":\"queued\"") {
            break;
        }
    }
    std::fs::write(Path::new(&home).join("go"), b"").unwrap();
    while let Some(c) = second.next().await {
        got.extend_from_slice(&c.unwrap());
    }
    let text = String::from_utf8_lossy(&got);
    assert!(
        text.contains("session s") || text.contains("session \\\"s\\\""),
        "{text}"
    );
    assert!(text.contains("\"exit\""), "{text}");
    let first_rest: Vec<u8> = {
        let mut v = seen;
        while let Some(c) = first_body.next().await {
            v.extend_from_slice(&c.unwrap());
        }
        v
    };
    assert!(String::from_utf8_lossy(&first_rest).contains("\"code\":0"));
}

#[tokio::test]
async fn expired_sessions_answer_clearly_once() {
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&dir, "sessions:\n  idle_ttl_secs: 1\n", &[]);
    sh(&gw, Some("a"), "echo x > state").await;
    assert!(wait_until(Duration::from_secs(10), || session_dirs(&dir).is_empty()));
    let expired = sh(&gw, Some("a"), "cat state").await;
    assert_eq!(expired.status, 410);
    let e = expired.rejection.unwrap().error;
    assert_eq!(e.code, mcp_run::contract::ErrorCode::SessionExpired);
    assert!(e.message.contains("idle TTL"), "{}", e.message);
    // Then the name opens a new session.
    let fresh = sh(&gw, Some("a"), "pwd").await;
    assert_eq!(fresh.context.clone().unwrap().session_call, Some(1));
}

fn git_tree() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    let r = d.path();
    std::fs::create_dir_all(r.join(".git")).unwrap();
    std::fs::write(r.join(".git/HEAD"), "ref: refs/heads/main\n").unwrap();
    std::fs::write(r.join(".gitignore"), "target/\n").unwrap();
    std::fs::create_dir_all(r.join("src")).unwrap();
    std::fs::write(r.join("src/lib.rs"), "pub fn a() {}\n").unwrap();
    std::fs::write(r.join("old.txt"), "to be deleted\n").unwrap();
    d
}

fn run_remote(gw: &Gateway, home: &Path, cwd: &Path, args: &[&str]) -> Output {
    gw.run_remote()
        .env("XDG_CACHE_HOME", home)
        .current_dir(cwd)
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn the_session_tree_follows_the_manifest_and_keeps_what_it_does_not_cover() {
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&dir, "", &[]);
    let tree = git_tree();
    let outside = tempfile::tempdir().unwrap();
    let rr = |args: &[&str]| {
        let mut a = vec!["--session", "ws", "--workspace"];
        a.extend_from_slice(args);
        let out = run_remote(&gw, dir.path(), tree.path(), &a);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let stat = "stat -c '%i %Y %Z' src/lib.rs";
    let first = rr(&[
        "--",
        "sh",
        "-c",
        &format!("mkdir target; echo obj > target/o; echo mine > untracked.txt; {stat}"),
    ]);
    // An unchanged rerun moves nothing: the same inode, mtime and ctime.
    let second = rr(&["--", "sh", "-c", stat]);
    assert_eq!(first, second);
    // Edit, delete, add in the checkout; the command replaces src/ with a symlink out.
    std::fs::write(tree.path().join("src/lib.rs"), "pub fn b() {}\n").unwrap();
    std::fs::remove_file(tree.path().join("old.txt")).unwrap();
    std::fs::write(tree.path().join("new.txt"), "new\n").unwrap();
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
        listing,
        "pub fn b() {}\nobj\nmine\nnew\nold-gone\nsrc-is-a-dir\n"
    );
    // Nothing was written through the link.
    let written: Vec<_> = std::fs::read_dir(outside.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(written, [std::ffi::OsString::from("x")]);
    // `sessions list` and `sessions end` from the client.
    let out = run_remote(&gw, dir.path(), tree.path(), &["sessions", "list"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("NAME") && text.contains("\nws "), "{text}");
    let out = run_remote(&gw, dir.path(), tree.path(), &["sessions", "end", "ws"]);
    assert!(out.status.success());
    let out = run_remote(&gw, dir.path(), tree.path(), &["sessions", "end", "ws"]);
    assert_eq!(out.status.code(), Some(125));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown_session"));
    // RUN_REMOTE_SESSION names the session too.
    let out = gw
        .run_remote()
        .env("RUN_REMOTE_SESSION", "env-named")
        .args(["--no-cwd", "--", "sh", "-c", "echo hi > f; pwd"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let out = run_remote(
        &gw,
        dir.path(),
        tree.path(),
        &["sessions", "list", "--json"],
    );
    let list: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(list["sessions"][0]["name"], "env-named");
}

/// A gateway whose backend is another gateway forwards the session: the upstream keeps it,
/// under a name made unique per caller of the forwarding gateway.
#[tokio::test]
async fn a_remote_backend_forwards_sessions_upstream() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = gateway(&dir, "", &[]);
    let front = Gateway::start(&["--backend", "remote", "--server", &upstream.raw_url()]);
    let first = sh(&front, Some("fwd"), "echo kept > state; pwd").await;
    assert_eq!(first.code(), Some(0), "{first:?}");
    let again = sh(&front, Some("fwd"), "cat state; pwd").await;
    assert_eq!(again.stdout_str(), format!("kept\n{}", first.stdout_str()));
    let ctx = again.context.unwrap();
    assert!(
        ctx.session
            .as_deref()
            .is_some_and(|s| s.starts_with("fwd-")),
        "{ctx:?}"
    );
    assert_eq!(ctx.session_call, Some(2));
    let listed = sessions(&upstream).await;
    assert_eq!(listed["sessions"].as_array().unwrap().len(), 1);
    // The forwarding gateway keeps none itself.
    let here = http().get(front.url("/sessions")).send().await.unwrap();
    assert_eq!(here.status(), 404);

    // Steps are forwarded whole: the upstream runs them in one runner, stopping at the first
    // failure (or not, with continue_on_error); in the forwarded session too.
    let run = raw(
        &front,
        json!({"steps": [
            {"executable": "sh", "args": ["-c", "echo one > f; echo first"]},
            {"executable": "sh", "args": ["-c", "cat f; exit 3"], "timeout_secs": 5},
            {"executable": "echo", "args": ["never"]}
        ]}),
    )
    .await;
    assert_eq!(run.code(), Some(3), "{run:?}");
    assert_eq!(run.stdout_str(), "first\none\n");
    let steps = run
        .events
        .iter()
        .filter(|e| matches!(e, mcp_run::contract::Event::StepExit { .. }))
        .count();
    assert_eq!(steps, 2, "{run:?}");
    let run = raw(
        &front,
        json!({"steps": [{"executable": "false"}, {"executable": "sh", "args": ["-c", "echo $A"]}],
               "continue_on_error": true, "env": {"A": "after"}}),
    )
    .await;
    assert_eq!(
        (run.code(), run.stdout_str().as_str()),
        (Some(1), "after\n"),
        "{run:?}"
    );
    let run = raw(
        &front,
        json!({"session": "fwd", "steps": [{"executable": "cat", "args": ["state"]}]}),
    )
    .await;
    assert_eq!(run.stdout_str(), "kept\n", "{run:?}");
    assert_eq!(run.context.unwrap().session_call, Some(3));
}

/// Steps run in order in one runner, their events name their step, the run stops at the
/// first failure unless `continue_on_error`, and the runner made for the run goes after it.
#[tokio::test]
async fn steps_share_one_runner_and_stop_at_the_first_failure() {
    use mcp_run::contract::Event;
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&dir, "", &[]);
    let run = raw(
        &gw,
        json!({"steps": [
            {"executable": "sh", "args": ["-c", "echo one > f; echo first"]},
            {"executable": "sh", "args": ["-c", "cat f; exit 3"]},
            {"executable": "echo", "args": ["never"]}
        ]}),
    )
    .await;
    assert_eq!(run.code(), Some(3), "{run:?}");
    assert_eq!(run.stdout_str(), "first\none\n");
    let names: Vec<String> = run
        .events
        .iter()
        .filter_map(|e| match e {
            Event::Step { step, command } => Some(format!("step {step} {command}")),
            Event::StepExit { step, exit } => Some(format!("exit {step} {:?}", exit.code)),
            _ => None,
        })
        .collect();
    assert_eq!(
        names,
        [
            "step 0 sh -c 'echo one > f; echo first'",
            "exit 0 Some(0)",
            "step 1 sh -c 'cat f; exit 3'",
            "exit 1 Some(3)"
        ]
    );
    let run = raw(
        &gw,
        json!({"steps": [{"executable": "false"}, {"executable": "echo", "args": ["after"]}],
               "continue_on_error": true, "env": {"A": "1"}}),
    )
    .await;
    assert_eq!(run.code(), Some(1));
    assert_eq!(run.stdout_str(), "after\n");
    // A step's timeout is its own.
    let run = raw(
        &gw,
        json!({"steps": [{"executable": "sleep", "args": ["30"], "timeout_secs": 1},
                         {"executable": "true"}]}),
    )
    .await;
    assert!(run.exit.unwrap().timed_out, "{run:?}");
    assert!(wait_until(Duration::from_secs(10), || session_dirs(&dir).is_empty()));
    // Bad steps are refused before anything runs.
    for bad in [
        json!({"executable": "true", "steps": [{"executable": "true"}]}),
        json!({"steps": [{"executable": ""}]}),
        json!({"executable": "true", "continue_on_error": true}),
    ] {
        let r = raw(&gw, bad.clone()).await;
        assert_eq!(r.status, 400, "{bad}");
    }
    // In a session, steps run in the session's runner.
    sh(&gw, Some("s"), "echo warm > state").await;
    let run = raw(
        &gw,
        json!({"session": "s", "steps": [{"executable": "cat", "args": ["state"]}]}),
    )
    .await;
    assert_eq!(run.stdout_str(), "warm\n");
    assert_eq!(run.context.unwrap().session_call, Some(2));
}

/// After a gateway SIGKILL its session's processes die with it, and the next gateway on the
/// host that opens a session removes the directory the killed one left.
#[tokio::test]
async fn a_killed_gateway_s_sessions_are_cleaned_by_the_next_one() {
    let dir = tempfile::tempdir().unwrap();
    let mut gw = gateway(&dir, "", &[]);
    let first = sh(&gw, Some("s"), "pwd").await;
    let home = first.stdout_str().trim().to_owned();
    assert!(Path::new(&home).is_dir());
    let pid = gw.pid().unwrap() as i32;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    assert!(wait_until(Duration::from_secs(10), || !support::pid_alive(
        pid
    )));
    assert!(Path::new(&home).is_dir(), "nothing cleaned it yet");
    gw.terminate();
    let next = gateway(&dir, "", &[]);
    let again = sh(&next, Some("s"), "pwd").await;
    assert_eq!(again.context.unwrap().session_call, Some(1));
    assert!(
        !Path::new(&home).exists(),
        "the killed gateway's session directory stayed"
    );
    assert_eq!(session_dirs(&dir).len(), 1);
}

/// A session ends at its maximum lifetime however busy; a call running then finishes first.
/// Profiles shorten the lifetimes within the operator's.
#[tokio::test]
async fn the_maximum_lifetime_ends_a_busy_session_after_its_call() {
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(
        &dir,
        "sessions:\n  profiles:\n    default: {max_lifetime_secs: 1}\n",
        &[],
    );
    sh(&gw, Some("s"), "true").await;
    // Running across the maximum lifetime: it finishes, with its output.
    let long = sh(&gw, Some("s"), "sleep 1.5; echo done").await;
    assert_eq!(long.stdout_str(), "done\n");
    let gone = wait_until(Duration::from_secs(10), || session_dirs(&dir).is_empty());
    assert!(gone, "{:?}", session_dirs(&dir));
    let next = sh(&gw, Some("s"), "true").await;
    assert_eq!(next.status, 410, "{next:?}");
    let e = next.rejection.unwrap().error;
    assert!(
        e.message.contains("maximum lifetime of 1 s"),
        "{}",
        e.message
    );
}

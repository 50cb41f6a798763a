//! The command lines as a person meets them, through the real binaries: help texts, shell
//! completions, start-up errors, and run-remote's failures (one line on stderr, exit 125, the
//! reason in `--output-format json` too), including a gateway that stops mid-run.

use crate::support;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::Value;
use support::{Gateway, config_file, gateway_bin, run_remote_bin};

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Exit 125 and exactly one line on stderr, starting with `run-remote: `; that line.
fn one_line_125(out: &Output, what: &str) -> String {
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(125), "{what}: {err}");
    assert!(
        err.starts_with("run-remote: ") && err.lines().count() == 1,
        "{what}: {err:?}"
    );
    err
}

#[test]
fn help_texts_are_each_binarys_own_with_examples() {
    let rr = Command::new(run_remote_bin()).arg("-h").output().unwrap();
    assert_eq!(rr.status.code(), Some(0));
    let rr = text(&rr.stdout);
    assert!(
        rr.starts_with("Run a command on an mcp-run gateway"),
        "run-remote -h describes run-remote: {rr}"
    );
    assert!(
        rr.contains("Usage: run-remote [OPTIONS] -- COMMAND [ARGS...]"),
        "{rr}"
    );
    assert!(
        rr.contains("Examples:\n  export RUN_REMOTE_SERVER="),
        "{rr}"
    );
    let gw = Command::new(gateway_bin()).arg("--help").output().unwrap();
    assert_eq!(gw.status.code(), Some(0));
    let gw = text(&gw.stdout);
    assert!(gw.starts_with("The mcp-run gateway"), "{gw}");
    assert!(gw.contains("Examples:\n  mcp-run serve"), "{gw}");
    // `--log-format` exists on stdio as docs/configuration.md says.
    let stdio = Command::new(gateway_bin())
        .args(["stdio", "--help"])
        .output()
        .unwrap();
    assert!(text(&stdio.stdout).contains("--log-format"));
}

#[test]
fn shell_completions_for_both_binaries() {
    for (bin, name) in [(run_remote_bin(), "run-remote"), (gateway_bin(), "mcp-run")] {
        for (shell, marker) in [
            ("bash", format!("complete -F _{}", name.replace('-', "__"))),
            ("zsh", format!("#compdef {name}")),
            ("fish", format!("complete -c {name}")),
        ] {
            let out = Command::new(&bin)
                .args(["completions", shell])
                .output()
                .unwrap();
            assert_eq!(out.status.code(), Some(0), "{name} {shell}");
            let script = text(&out.stdout);
            assert!(
                script.contains(&marker),
                "{name} {shell}: {marker} in\n{script}"
            );
        }
    }
    // run-remote's own subcommands and options are in its script.
    let bash = Command::new(run_remote_bin())
        .args(["completions", "bash"])
        .output()
        .unwrap();
    let bash = text(&bash.stdout);
    assert!(
        bash.contains("templates") && bash.contains("--keep-env"),
        "{bash}"
    );
    let bad = Command::new(run_remote_bin())
        .args(["completions", "tcsh"])
        .output()
        .unwrap();
    assert!(one_line_125(&bad, "unknown shell").contains("tcsh"));
}

/// Without `--`, with nothing at all: one line that shows the synopsis.
#[test]
fn usage_errors_show_the_synopsis() {
    for argv in [&["echo", "hi"][..], &[], &["--bogus", "--", "true"]] {
        let out = Command::new(run_remote_bin())
            .args(argv)
            .env("RUN_REMOTE_SERVER", "http://127.0.0.1:1/raw")
            .output()
            .unwrap();
        let err = one_line_125(&out, &format!("{argv:?}"));
        assert!(
            err.contains("usage: run-remote [OPTIONS] -- COMMAND [ARGS...]"),
            "{err}"
        );
    }
}

/// `--output-format json`: a failure is a result too, with the reason in `error`.
#[test]
fn json_failures_name_their_reason() {
    let out = Command::new(run_remote_bin())
        .env_remove("RUN_REMOTE_SERVER")
        .args(["--output-format", "json", "--", "echo", "a b"])
        .output()
        .unwrap();
    one_line_125(&out, "unset server");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["success"], false);
    assert_eq!(v["context"]["command_line"], "echo 'a b'");
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .starts_with("configuration_error: RUN_REMOTE_SERVER"),
        "{v}"
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let out = Command::new(run_remote_bin())
        .env("RUN_REMOTE_SERVER", format!("http://127.0.0.1:{port}/raw"))
        .args(["--output-format", "json", "--", "true"])
        .output()
        .unwrap();
    one_line_125(&out, "unreachable");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .starts_with("gateway_unreachable: "),
        "{v}"
    );
}

/// A closed stdout is 141 (as SIGPIPE) in every output format, never a silent 74.
#[test]
fn closed_stdout_is_141_in_every_format() {
    let gw = Gateway::start(&[]);
    for format in ["stream", "json", "markdown"] {
        let mut child = gw
            .run_remote()
            .args([
                "--output-format",
                format,
                "--",
                "sh",
                "-c",
                "sleep 0.5; seq 100000",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        assert_eq!(
            out.status.code(),
            Some(141),
            "{format}: {}",
            text(&out.stderr)
        );
    }
}

/// SIGTERM to the gateway: after its grace period it kills the command, and run-remote says
/// so and exits 125, not a bare 137 that reads like an out-of-memory kill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_stopped_mid_run_is_a_client_error_with_a_message() {
    use std::io::Read as _;
    let dir = tempfile::tempdir().unwrap();
    let cfg = config_file(&dir, "server:\n  shutdown_grace_secs: 1\n");
    let gw = Gateway::start(&["--config", cfg.to_str().unwrap()]);
    let spawn = |format: &str| {
        let started = dir.path().join(format);
        gw.run_remote()
            .args([
                "--output-format",
                format,
                "--",
                "sh",
                "-c",
                &format!("echo up >&2; : > '{}'; sleep 60", started.display()),
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (mut stream, json) = (spawn("stream"), spawn("json"));
    // Both commands run (the streamed one's first line arrived, and each wrote its marker)
    // before the gateway is told to stop.
    let mut stream_err = stream.stderr.take().unwrap();
    let mut up = [0u8; 3];
    stream_err.read_exact(&mut up).unwrap();
    assert_eq!(&up, b"up\n");
    assert!(
        support::wait_until(Duration::from_secs(10), || {
            dir.path().join("stream").exists() && dir.path().join("json").exists()
        }),
        "both commands started"
    );
    let (status, _gw) = support::terminate(gw).await;
    assert!(status.is_some_and(|s| s.success()));

    let code = stream.wait().unwrap().code();
    let mut err = String::new();
    stream_err.read_to_string(&mut err).unwrap();
    assert_eq!(code, Some(125), "{err}");
    assert!(
        err.starts_with("run-remote: the gateway stopped")
            && err.trim_end().ends_with("(shutting_down)")
            && err.lines().count() == 1,
        "{err:?}"
    );

    let out = json.wait_with_output().unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(125), "{err}");
    assert!(err.ends_with("(shutting_down)\n"), "{err}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        v["error"].as_str().unwrap().starts_with("shutting_down: "),
        "{v}"
    );
}

/// Start-up errors: printed once, on one line, with the fix.
#[test]
fn startup_errors_are_one_short_line() {
    let home = tempfile::tempdir().unwrap();
    let out = Command::new(gateway_bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--backend", "kube"])
        .env("HOME", home.path())
        .env("KUBECONFIG", home.path().join("missing"))
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("KUBERNETES_SERVICE_PORT")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "printed once: {err}");
    assert!(
        err.starts_with("mcp-run: --backend kube: no Kubernetes credentials")
            && err.contains("pass --kubeconfig PATH")
            && err.len() < 400,
        "{err}"
    );
    // A bad remote URL is named by where it came from.
    for (flag, env, source) in [
        (Some("localhost:1"), None, "--server"),
        (None, Some("localhost:1"), "RUN_REMOTE_SERVER"),
    ] {
        let mut cmd = Command::new(gateway_bin());
        cmd.args(["stdio", "--backend", "remote"])
            .env_remove("RUN_REMOTE_SERVER")
            .stdin(Stdio::null());
        if let Some(f) = flag {
            cmd.args(["--server", f]);
        }
        if let Some(e) = env {
            cmd.env("RUN_REMOTE_SERVER", e);
        }
        let err = text(&cmd.output().unwrap().stderr);
        assert!(
            err.starts_with(&format!("mcp-run: {source}: invalid gateway URL"))
                && err.lines().count() == 1,
            "{err}"
        );
    }
    // A missing config file, under serve and stdio; JSON logs get one JSON line instead.
    for sub in ["serve", "stdio"] {
        let out = Command::new(gateway_bin())
            .args([sub, "--config", "/nonexistent/mcp-run.yaml"])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1));
        assert_eq!(err.lines().count(), 1, "{sub}: {err}");
        assert!(err.starts_with("mcp-run: ") && err.contains("/nonexistent/mcp-run.yaml"));
        let out = Command::new(gateway_bin())
            .args([
                sub,
                "--log-format",
                "json",
                "--config",
                "/nonexistent/mcp-run.yaml",
            ])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let err = text(&out.stderr);
        assert_eq!(err.lines().count(), 1, "{sub}: {err}");
        let line: Value = serde_json::from_str(&err).unwrap();
        assert_eq!(line["level"], "ERROR", "{line}");
    }
}

//! The behavioural suite every backend must pass, through the real `/raw` endpoint and the
//! real `run-remote`: the local backend (tests/local.rs), the Kubernetes backend against the
//! API-server double (tests/kube.rs) and against a real cluster (e2e/).
//!
//! Commands used here exist both on a Linux host and in a busybox image: sh, printf, cat,
//! head, sha256sum, seq, sleep, env, pwd, mktemp.

use std::time::{Duration, Instant};

use serde_json::json;

use super::{Gateway, raw};

/// What a backend's tests hand the suite: the gateway to drive, and whatever else must live
/// as long as it (a test double, a temporary directory), checked once a check is done.
pub trait Host {
    fn gateway(&self) -> &Gateway;
    /// Runs after a check passed (e.g. "no pod left behind").
    fn finish(self)
    where
        Self: Sized,
    {
    }
}

impl Host for Gateway {
    fn gateway(&self) -> &Gateway {
        self
    }
}

/// One `#[test]` per check of the suite, each against its own host from `$setup` (an
/// expression evaluated in a child module of the caller, so the caller's private helpers
/// are in reach), in a module `behavioural_suite`: a failure names its check, and the
/// checks run in parallel. e2e/ runs the same checks in order with [`run_all`].
#[allow(unused_macros)] // e2e/ includes this file and runs `run_all` instead
macro_rules! behavioural_suite {
    ($setup:expr) => {
        mod behavioural_suite {
            #[allow(unused_imports)]
            use super::*;
            use $crate::support::suite::Host as _;

            $crate::support::suite::behavioural_suite!(@check $setup, started_context);
            $crate::support::suite::behavioural_suite!(@check $setup, stream_separation_and_order);
            $crate::support::suite::behavioural_suite!(@check $setup, exit_codes);
            $crate::support::suite::behavioural_suite!(@check $setup, killed_by_signal);
            $crate::support::suite::behavioural_suite!(@check $setup, missing_executable_and_bad_cwd);
            $crate::support::suite::behavioural_suite!(@check $setup, arguments_arrive_unchanged);
            $crate::support::suite::behavioural_suite!(@check $setup, cwd_and_env);
            $crate::support::suite::behavioural_suite!(@check $setup, binary_round_trip, 50 * 1024 * 1024);
            $crate::support::suite::behavioural_suite!(@check $setup, timeout_kills);
            $crate::support::suite::behavioural_suite!(@check $setup, run_remote_mirrors_exit_codes);
            $crate::support::suite::behavioural_suite!(@check $setup, rejections);
            $crate::support::suite::behavioural_suite!(@check $setup, concurrent_requests, 50);
        }
    };
    (@check $setup:expr, $name:ident $(, $arg:expr)?) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn $name() {
            let host = $setup;
            $crate::support::suite::$name(host.gateway() $(, $arg)?).await;
            host.finish();
        }
    };
}
#[allow(unused_imports)]
pub(crate) use behavioural_suite;

/// Runs every check in order (e2e against a real cluster); each panics with a message
/// naming what broke.
pub async fn run_all(gw: &Gateway) {
    started_context(gw).await;
    stream_separation_and_order(gw).await;
    exit_codes(gw).await;
    killed_by_signal(gw).await;
    missing_executable_and_bad_cwd(gw).await;
    arguments_arrive_unchanged(gw).await;
    cwd_and_env(gw).await;
    binary_round_trip(gw, 50 * 1024 * 1024).await;
    timeout_kills(gw).await;
    run_remote_mirrors_exit_codes(gw).await;
    rejections(gw).await;
    concurrent_requests(gw, 50).await;
}

pub async fn started_context(gw: &Gateway) {
    let r = raw(gw, json!({"executable": "true"})).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.content_type, "application/x-ndjson");
    assert!(
        matches!(
            r.events.first(),
            Some(mcp_run::contract::Event::Started { .. })
        ),
        "first event is started"
    );
    let ctx = r.context.clone().expect("context");
    assert_eq!(ctx.backend, gw.backend);
    if gw.backend == "kubernetes" {
        assert!(
            ctx.pod.is_some() && ctx.namespace.is_some() && ctx.node.is_some(),
            "{ctx:?}"
        );
    }
    assert_eq!(r.code(), Some(0));
    assert_eq!(r.after_terminal, 0, "nothing after the terminal event");
}

pub async fn stream_separation_and_order(gw: &Gateway) {
    let r = raw(
        gw,
        json!({"executable": "sh", "args": ["-c", "for i in $(seq 1 500); do echo out$i; echo err$i >&2; done"]}),
    )
    .await;
    let expect = |p: &str| (1..=500).map(|i| format!("{p}{i}\n")).collect::<String>();
    assert_eq!(
        r.stdout_str(),
        expect("out"),
        "stdout in order, nothing else"
    );
    assert_eq!(
        r.stderr_str(),
        expect("err"),
        "stderr in order, nothing else"
    );
    assert_eq!(r.code(), Some(0));
}

pub async fn exit_codes(gw: &Gateway) {
    for code in [0, 1, 3, 255] {
        let r = raw(
            gw,
            json!({"executable": "sh", "args": ["-c", format!("exit {code}")]}),
        )
        .await;
        let exit = r
            .exit
            .unwrap_or_else(|| panic!("no exit event for {code}: {r:?}"));
        assert_eq!(
            (exit.code, exit.signal, exit.timed_out),
            (Some(code), None, false),
            "exit {code}"
        );
    }
}

pub async fn killed_by_signal(gw: &Gateway) {
    let r = raw(
        gw,
        json!({"executable": "sh", "args": ["-c", "kill -TERM $$; sleep 5"]}),
    )
    .await;
    let exit = r.exit.expect("exit");
    assert_eq!((exit.code, exit.signal), (None, Some(15)), "{exit:?}");
    let out = gw
        .run_remote()
        .args(["--", "sh", "-c", "kill -KILL $$"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(128 + 9));
}

pub async fn missing_executable_and_bad_cwd(gw: &Gateway) {
    let r = raw(gw, json!({"executable": "no-such-program-mcp-run"})).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.code(), Some(127));
    assert_eq!(
        r.stderr_str(),
        "mcp-run: no-such-program-mcp-run: command not found\n"
    );
    let r = raw(gw, json!({"executable": "pwd", "cwd": "/no/such/dir"})).await;
    assert_eq!(r.code(), Some(125), "{r:?}");
    assert!(
        r.stderr_str().contains("/no/such/dir"),
        "{}",
        r.stderr_str()
    );
    let out = gw
        .run_remote()
        .args(["--", "no-such-program-mcp-run"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(127));
}

pub async fn arguments_arrive_unchanged(gw: &Gateway) {
    let args = [
        "a b", "it's", "\"q\"", "$(id)", "`id`", "a;b", "x\ny", "*", "$HOME", "", "-n", "\\t",
    ];
    let mut argv = vec!["%s|\n".to_string()];
    argv.extend(args.iter().map(|s| s.to_string()));
    let r = raw(gw, json!({"executable": "printf", "args": argv})).await;
    let expect: String = args.iter().map(|a| format!("{a}|\n")).collect();
    assert_eq!(r.stdout_str(), expect, "no shell anywhere");
    let out = gw
        .run_remote()
        .arg("--")
        .arg("printf")
        .args(&argv)
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        expect,
        "no shell in run-remote either"
    );
}

pub async fn cwd_and_env(gw: &Gateway) {
    let r = raw(gw, json!({"executable": "pwd", "cwd": "/etc"})).await;
    assert_eq!(r.stdout_str(), "/etc\n");
    let r = raw(
        gw,
        json!({"executable": "env", "env": {"MCP_RUN_A": "1 2", "MCP_RUN_B": "x=y\nz"}}),
    )
    .await;
    let out = r.stdout_str();
    assert!(
        out.contains("MCP_RUN_A=1 2\n") && out.contains("MCP_RUN_B=x=y\nz\n"),
        "{out}"
    );
    let out = gw
        .run_remote()
        .env("MCP_RUN_KEEP", "kept")
        .env("MCP_RUN_DROP", "dropped")
        .args(["--keep-env", "MCP_RUN_KEEP", "--", "env"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("MCP_RUN_KEEP=kept"), "{text}");
    assert!(
        !text.contains("MCP_RUN_DROP"),
        "only --keep-env variables arrive: {text}"
    );
    assert!(
        !text.contains("RUN_REMOTE_SERVER"),
        "the client's environment stays home: {text}"
    );
    let out = gw
        .run_remote()
        .current_dir("/etc")
        .arg("--")
        .arg("pwd")
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "/etc\n",
        "run-remote sends its cwd"
    );
}

/// The command makes `size` random bytes, hashes them itself (on stderr) and writes them on
/// stdout; the client's hash of what arrived must match.
pub async fn binary_round_trip(gw: &Gateway, size: usize) {
    use sha2::Digest;
    let script = format!(
        "f=$(mktemp) && head -c {size} /dev/urandom > \"$f\" && sha256sum \"$f\" >&2 && cat \"$f\"; rc=$?; rm -f \"$f\"; exit $rc"
    );
    let r = raw(gw, json!({"executable": "sh", "args": ["-c", script]})).await;
    assert_eq!(r.code(), Some(0), "{}", r.stderr_str());
    assert_eq!(r.stdout.len(), size);
    let want = r
        .stderr_str()
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string();
    let got = sha2::Sha256::digest(&r.stdout)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<String>();
    assert_eq!(got, want, "byte-exact");
}

pub async fn timeout_kills(gw: &Gateway) {
    let t = Instant::now();
    let r = raw(
        gw,
        json!({"executable": "sleep", "args": ["30"], "timeout_secs": 1}),
    )
    .await;
    let exit = r.exit.unwrap_or_else(|| panic!("no exit: {r:?}"));
    assert!(exit.timed_out, "{exit:?}");
    assert_eq!(exit.code, None);
    assert!(
        t.elapsed() < Duration::from_secs(15),
        "timeout took {:?}",
        t.elapsed()
    );
    let out = gw
        .run_remote()
        .args(["--timeout", "1", "--", "sleep", "30"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(124),
        "run-remote reports a timeout as 124"
    );
}

/// `async` only to share the suite's shape: it runs run-remote and blocks on it.
pub async fn run_remote_mirrors_exit_codes(gw: &Gateway) {
    for code in [0, 1, 3, 255] {
        let out = gw
            .run_remote()
            .args([
                "--",
                "sh",
                "-c",
                &format!("echo o; echo e >&2; exit {code}"),
            ])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(code));
        assert_eq!(out.stdout, b"o\n");
        assert_eq!(out.stderr, b"e\n");
    }
}

pub async fn rejections(gw: &Gateway) {
    let cases: Vec<(&str, Vec<u8>, &str, u16)> = vec![
        (
            "malformed JSON",
            b"{\"executable\":".to_vec(),
            "application/json",
            400,
        ),
        (
            "wrong type",
            br#"{"executable":["ls"]}"#.to_vec(),
            "application/json",
            400,
        ),
        (
            "unknown field",
            br#"{"executable":"ls","shell":true}"#.to_vec(),
            "application/json",
            400,
        ),
        (
            "missing executable",
            br#"{"args":["x"]}"#.to_vec(),
            "application/json",
            400,
        ),
        (
            "empty executable",
            br#"{"executable":""}"#.to_vec(),
            "application/json",
            400,
        ),
        (
            "NUL in arg",
            br#"{"executable":"ls","args":["a\u0000"]}"#.to_vec(),
            "application/json",
            400,
        ),
        (
            "NUL in env",
            br#"{"executable":"ls","env":{"A":"\u0000"}}"#.to_vec(),
            "application/json",
            400,
        ),
        (
            "bad env name",
            br#"{"executable":"ls","env":{"A-B":"1"}}"#.to_vec(),
            "application/json",
            400,
        ),
        (
            "timeout over max",
            br#"{"executable":"ls","timeout_secs":999999999}"#.to_vec(),
            "application/json",
            400,
        ),
        (
            "wrong content type",
            br#"{"executable":"ls"}"#.to_vec(),
            "text/plain",
            415,
        ),
        (
            "body too large",
            {
                let mut b = br#"{"executable":"ls","args":[""#.to_vec();
                b.extend(std::iter::repeat_n(b'a', 2 * 1024 * 1024));
                b.extend(br#""]}"#);
                b
            },
            "application/json",
            413,
        ),
    ];
    for (what, body, ct, status) in cases {
        let r = super::raw_bytes(gw, body, ct).await;
        assert_eq!(r.status, status, "{what}");
        assert!(
            r.content_type.starts_with("application/json"),
            "{what}: {}",
            r.content_type
        );
        let err = r
            .rejection
            .unwrap_or_else(|| panic!("{what}: no error body"))
            .error;
        assert!(!err.message.is_empty(), "{what}");
        assert_eq!(
            err.code.http_status(),
            status,
            "{what}: code {} matches the status",
            err.code
        );
    }
}

pub async fn concurrent_requests(gw: &Gateway, n: usize) {
    // One client (so one connection) per request, all built before the first connects:
    // building one (its TLS setup) takes ~20 ms, ~220 ms at load 11 on 2 cores, and
    // built inside the futures below, the last of 50 would keep the first's connection silent
    // past the gateway's 10 s `header_timeout` (which then rightly closes it).
    let clients: Vec<reqwest::Client> = (0..n).map(|_| super::http()).collect();
    let runs = clients.iter().enumerate().map(|(i, client)| async move {
        let r = super::raw_with(client, gw, json!({"executable": "sh", "args": ["-c", format!("seq 1 {}; echo done{i} >&2", 1000 + i)]})).await;
        let want: String = (1..=1000 + i).map(|k| format!("{k}\n")).collect();
        assert_eq!(r.stdout_str(), want, "request {i}");
        assert_eq!(r.stderr_str(), format!("done{i}\n"));
        assert_eq!(r.code(), Some(0));
    });
    futures_util::future::join_all(runs).await;
}

/// stdin reaches the command byte-exact and its end arrives as EOF; a command that does not
/// read its stdin, or stops early, still ends normally.
pub async fn stdin_round_trip(gw: &Gateway) {
    use super::raw_stdin;
    use sha2::Digest;
    let data: Vec<u8> = (0..(1u64 << 20) + 3)
        .map(|i| (i * 7919 % 251) as u8)
        .collect();
    let r = raw_stdin(gw, json!({"executable": "cat"}), &data).await;
    assert_eq!((r.status, r.code()), (200, Some(0)), "{r:?}");
    assert!(r.stdout == data, "cat returned {} bytes", r.stdout.len());
    let r = raw_stdin(gw, json!({"executable": "sha256sum"}), &data).await;
    let hex: String = sha2::Sha256::digest(&data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert!(r.stdout_str().starts_with(&hex), "{}", r.stdout_str());
    let r = raw_stdin(gw, json!({"executable": "wc", "args": ["-c"]}), b"").await;
    assert_eq!(r.stdout_str().trim(), "0", "empty stdin is EOF at once");
    let r = raw_stdin(gw, json!({"executable": "wc", "args": ["-c"]}), &data).await;
    assert_eq!(r.stdout_str().trim(), data.len().to_string());
    let big = vec![b'x'; 8 << 20];
    let t = Instant::now();
    let r = raw_stdin(gw, json!({"executable": "true"}), &big).await;
    assert_eq!(r.code(), Some(0), "a command that ignores stdin: {r:?}");
    let r = raw_stdin(gw, json!({"executable": "head", "args": ["-c", "5"]}), &big).await;
    assert_eq!((r.stdout_str().as_str(), r.code()), ("xxxxx", Some(0)));
    assert!(t.elapsed() < Duration::from_secs(30));
}

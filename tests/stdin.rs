//! stdin through `/raw` (`application/vnd.mcp-run.stdin`), the local and remote backends and
//! `run-remote -i`, through the real binaries.

use crate::support;

use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt;
use mcp_run::contract::Event;
use serde_json::json;
use support::{Gateway, config_file, raw_stdin, raw_stdin_streamed};
use tokio::sync::mpsc;

/// Reads NDJSON events off a streaming response, one at a time.
struct Events {
    body: std::pin::Pin<Box<dyn futures_util::Stream<Item = reqwest::Result<Bytes>> + Send>>,
    buf: Vec<u8>,
}

impl Events {
    fn new(resp: reqwest::Response) -> Self {
        Self {
            body: Box::pin(resp.bytes_stream()),
            buf: Vec::new(),
        }
    }

    async fn next(&mut self) -> Option<Event> {
        loop {
            if let Some(pos) = self.buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=pos).collect();
                return Some(Event::from_line(&line[..pos]).expect("event"));
            }
            let chunk = tokio::time::timeout(Duration::from_secs(30), self.body.next())
                .await
                .expect("an event within 30 s")?
                .expect("body");
            self.buf.extend_from_slice(&chunk);
        }
    }

    /// Output until `want` arrived on stdout; panics at a terminal event.
    async fn stdout_until(&mut self, want: &str) {
        let mut seen = String::new();
        while !seen.contains(want) {
            match self.next().await {
                Some(Event::Stdout { data }) => seen.push_str(&String::from_utf8_lossy(&data)),
                Some(Event::Started { .. } | Event::Keepalive) => {}
                other => panic!("waiting for {want:?}, got {other:?} after {seen:?}"),
            }
        }
    }

    async fn terminal(&mut self) -> Event {
        loop {
            match self.next().await {
                Some(e) if e.is_terminal() => return e,
                Some(_) => {}
                None => panic!("stream ended without a terminal event"),
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdin_reaches_the_local_backend() {
    let gw = Gateway::start(&[]);
    support::suite::stdin_round_trip(&gw).await;
}

/// The request body and the response stream at once (HTTP/1.1, hyper on both sides): each
/// line is answered before the next one is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdin_and_output_stream_at_the_same_time() {
    let gw = Gateway::start(&[]);
    let (tx, rx) = mpsc::channel(1);
    let resp = raw_stdin_streamed(&gw, json!({"executable": "cat"}), rx).await;
    assert_eq!(resp.status(), 200);
    let mut events = Events::new(resp);
    for line in ["one\n", "two\n", "three\n"] {
        tx.send(Bytes::from_static(line.as_bytes())).await.unwrap();
        events.stdout_until(line).await;
    }
    drop(tx);
    match events.terminal().await {
        Event::Exit(info) => assert_eq!(info.code, Some(0)),
        other => panic!("{other:?}"),
    }
}

/// A client that stops sending without ending its body: the command waits for input, and the
/// timeout still ends the run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_stdin_still_times_out() {
    let gw = Gateway::start(&[]);
    let (tx, rx) = mpsc::channel(1);
    let t = Instant::now();
    let resp = raw_stdin_streamed(&gw, json!({"executable": "cat", "timeout_secs": 2}), rx).await;
    tx.send(Bytes::from_static(b"partial")).await.unwrap();
    let mut events = Events::new(resp);
    events.stdout_until("partial").await;
    match events.terminal().await {
        Event::Exit(info) => assert!(info.timed_out, "{info:?}"),
        other => panic!("{other:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(15));
    drop(tx);
}

/// A slow command is not flooded: the gateway reads the body only as fast as the command
/// reads its stdin, so a fast producer blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdin_is_back_pressured_by_the_command() {
    let gw = Gateway::start(&[]);
    let (tx, rx) = mpsc::channel(1);
    // Reads nothing until the test creates `go`, then everything.
    let dir = tempfile::tempdir().unwrap();
    let go = dir.path().join("go");
    let script = "while [ ! -e \"$1\" ]; do sleep 0.02; done; wc -c";
    let resp = raw_stdin_streamed(
        &gw,
        json!({"executable": "sh", "args": ["-c", script, "sh", go]}),
        rx,
    )
    .await;
    let chunk = Bytes::from(vec![b'y'; 256 * 1024]);
    let sent = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = sent.clone();
    let producer = tokio::spawn(async move {
        for _ in 0..400 {
            if tx.send(chunk.clone()).await.is_err() {
                return;
            }
            counter.fetch_add(chunk.len(), std::sync::atomic::Ordering::Relaxed);
        }
    });
    // A negative check (the producer must not get far), so inherently a wait.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let early = sent.load(std::sync::atomic::Ordering::Relaxed);
    // Socket buffers, the pipe and a few chunks in the gateway: far below the 100 MiB offered.
    assert!(
        early < 32 << 20,
        "{early} bytes taken while the command read nothing"
    );
    std::fs::write(&go, "").unwrap();
    producer.await.unwrap();
    let mut events = Events::new(resp);
    events.stdout_until(&(400 * 256 * 1024).to_string()).await;
    assert!(matches!(events.terminal().await, Event::Exit(i) if i.code == Some(0)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdin_limits_and_policy() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config_file(&dir, "limits:\n  max_stdin_bytes: 1000\n");
    let gw = Gateway::start(&["--config", cfg.to_str().unwrap()]);
    // The body's length says too much: refused before the start.
    let r = raw_stdin(&gw, json!({"executable": "cat"}), &[b'a'; 5000]).await;
    assert_eq!(r.status, 413, "{r:?}");
    assert_eq!(
        r.rejection.unwrap().error.code,
        mcp_run::contract::ErrorCode::PayloadTooLarge
    );
    let r = raw_stdin(&gw, json!({"executable": "cat"}), &[b'a'; 1000]).await;
    assert_eq!((r.code(), r.stdout.len()), (Some(0), 1000));
    // Streamed without a length: the run ends with an error once the limit is passed.
    let (tx, rx) = mpsc::channel(4);
    let resp = raw_stdin_streamed(&gw, json!({"executable": "cat"}), rx).await;
    assert_eq!(resp.status(), 200);
    for _ in 0..3 {
        let _ = tx.send(Bytes::from(vec![b'b'; 600])).await;
    }
    let mut events = Events::new(resp);
    match events.terminal().await {
        Event::Error { code, message } => {
            assert_eq!(code, mcp_run::contract::ErrorCode::PayloadTooLarge);
            assert!(message.contains("max_stdin_bytes"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    drop(tx);

    let cfg = config_file(&dir, "limits:\n  allow_stdin: false\n");
    let gw = Gateway::start(&["--config", cfg.to_str().unwrap()]);
    let r = raw_stdin(&gw, json!({"executable": "cat"}), b"x").await;
    assert_eq!(r.status, 403, "{r:?}");
    assert_eq!(
        r.rejection.unwrap().error.code,
        mcp_run::contract::ErrorCode::PolicyViolation
    );
    // Requests without stdin are unaffected.
    let r = support::raw(&gw, json!({"executable": "true"})).await;
    assert_eq!(r.code(), Some(0));
}

/// A bad request line in a stdin body is a 400, like a bad JSON body.
#[tokio::test]
async fn stdin_request_line_is_validated() {
    let gw = Gateway::start(&[]);
    let r = support::raw_bytes(
        &gw,
        b"{\"executable\": \"cat\", \"bogus\": 1}\nabc".to_vec(),
        mcp_run::contract::STDIN_CONTENT_TYPE,
    )
    .await;
    assert_eq!(r.status, 400, "{r:?}");
    // Without a newline the whole body is the request, and stdin is empty.
    let r = support::raw_bytes(
        &gw,
        b"{\"executable\": \"wc\", \"args\": [\"-c\"]}".to_vec(),
        mcp_run::contract::STDIN_CONTENT_TYPE,
    )
    .await;
    assert_eq!(r.stdout_str().trim(), "0");
}

/// A gateway whose backend is another gateway forwards stdin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdin_through_the_remote_backend() {
    let upstream = Gateway::start(&[]);
    let gw = Gateway::start(&["--backend", "remote", "--server", &upstream.raw_url()]);
    support::suite::stdin_round_trip(&gw).await;
}

/// With `Mcp-Run-Progress: 1` a backend that reports no phases answers exactly as without it:
/// `started` first, rejections as HTTP errors.
#[tokio::test]
async fn progress_opt_in_keeps_the_answers_of_a_backend_without_phases() {
    let gw = Gateway::start(&[]);
    let c = support::http();
    let resp = c
        .post(gw.raw_url())
        .header("content-type", "application/json")
        .header(mcp_run::contract::PROGRESS_HEADER, "1")
        .body(json!({"executable": "echo", "args": ["hi"]}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut events = Events::new(resp);
    assert!(matches!(events.next().await, Some(Event::Started { .. })));
    events.stdout_until("hi\n").await;
    let resp = c
        .post(gw.raw_url())
        .header("content-type", "application/json")
        .header(mcp_run::contract::PROGRESS_HEADER, "1")
        .body(json!({"executable": "echo", "timeout_secs": 999999}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
}

/// `run-remote -i` streams its stdin byte-exact: 50 MB of random bytes through `cat` and
/// `sha256sum`; empty stdin is EOF at once.
#[test]
fn run_remote_i_is_byte_exact() {
    use sha2::Digest;
    let gw = Gateway::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let (path, data) = support::random_file(dir.path(), 50 * 1024 * 1024 + 7);
    let run = |flag: &str, cmd: &[&str], input: std::process::Stdio| {
        let out = gw
            .run_remote()
            .arg(flag)
            .arg("--")
            .args(cmd)
            .stdin(input)
            .output()
            .unwrap();
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        out
    };
    let file = || std::fs::File::open(&path).unwrap().into();
    let out = run("-i", &["cat"], file());
    assert_eq!(out.stdout.len(), data.len());
    assert!(out.stdout == data, "cat changed the bytes");
    let hex: String = sha2::Sha256::digest(&data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let out = run("--stdin", &["sha256sum"], file());
    assert!(String::from_utf8_lossy(&out.stdout).starts_with(&hex));
    let out = run("-i", &["wc", "-c"], std::process::Stdio::null());
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "0");
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Piped data without `-i` is not sent; run-remote says so in one line, and only then.
#[test]
fn piped_stdin_without_i_gets_a_one_line_hint() {
    use std::io::Write;
    let gw = Gateway::start(&[]);
    let run = |args: &[&str], data: Option<&[u8]>| {
        let mut cmd = gw.run_remote();
        cmd.args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        if data.is_some() {
            cmd.stdin(std::process::Stdio::piped());
        }
        let mut child = cmd.spawn().unwrap();
        if let Some(d) = data {
            let mut stdin = child.stdin.take().unwrap();
            stdin.write_all(d).unwrap();
        }
        let out = child.wait_with_output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, out, err) = run(&["--", "wc", "-c"], Some(b"data\n"));
    assert_eq!((code, out.trim()), (Some(0), "0"), "not forwarded: {err}");
    assert_eq!(err.lines().count(), 1, "{err:?}");
    assert!(err.contains("-i"), "{err:?}");
    let (code, out, err) = run(&["-i", "--", "wc", "-c"], Some(b"data\n"));
    assert_eq!((code, out.trim(), err.as_str()), (Some(0), "5", ""));
    let (code, _, err) = run(&["--", "true"], None);
    assert_eq!(
        (code, err.as_str()),
        (Some(0), ""),
        "stdin /dev/null: no hint"
    );
}

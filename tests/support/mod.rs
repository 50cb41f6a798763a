//! Test support shared by the integration tests and the e2e suite: start the real gateway
//! binary on a loopback port, talk to `/raw` as a client would, run the real `run-remote`.
//!
//! Declared once in `tests/main.rs` (the integration tests) or `#[path = "../tests/support/mod.rs"] mod support;`.
#![allow(dead_code)]

pub mod suite;
pub mod wire;

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mcp_run::contract::{ErrorResponse, Event, ExitInfo, RunContext};

/// The gateway binary built by cargo for this test run.
pub fn gateway_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_mcp-run"))
}

/// The client binary built by cargo for this test run.
pub fn run_remote_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_run-remote"))
}

/// A gateway under test: a child process started here, or one that is already running
/// (e2e against an installed gateway).
pub struct Gateway {
    child: Option<Child>,
    /// Base URL, e.g. `http://127.0.0.1:4321`.
    pub base: String,
    /// Everything the gateway wrote on stderr so far.
    pub log: Arc<Mutex<String>>,
    /// Backend name expected in `started` contexts.
    pub backend: String,
    /// Bearer token sent with every request (an installed gateway with auth on).
    pub token: Option<String>,
}

impl Gateway {
    /// Starts `mcp-run serve --listen 127.0.0.1:0 ARGS...` and waits until it listens.
    pub fn start(args: &[&str]) -> Gateway {
        Self::start_with_env(args, &[])
    }

    /// Like [`Gateway::start`], with extra environment variables for the gateway process.
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Gateway {
        Self::start_in(None, args, env)
    }

    /// Like [`Gateway::start_with_env`], in the working directory `dir` (when given).
    pub fn start_in(dir: Option<&std::path::Path>, args: &[&str], env: &[(&str, &str)]) -> Gateway {
        Self::start_wrapped(&[], dir, args, env)
    }

    /// Like [`Gateway::start_in`], started through `wrapper` (a program and its arguments
    /// that run the gateway's command line, e.g. `setpriv --reuid=...`); none: directly.
    pub fn start_wrapped(
        wrapper: &[&str],
        dir: Option<&std::path::Path>,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Gateway {
        let mut cmd = match wrapper.split_first() {
            Some((program, rest)) => {
                let mut c = Command::new(program);
                c.args(rest).arg(gateway_bin());
                c
            }
            None => Command::new(gateway_bin()),
        };
        if let Some(dir) = dir {
            cmd.current_dir(dir);
        }
        cmd.arg("serve");
        // A test that needs the address before the start (replicas naming each other) gives it.
        if !args.contains(&"--listen") {
            cmd.arg("--listen").arg("127.0.0.1:0");
        }
        cmd.args(args);
        cmd.env(
            "RUST_LOG",
            std::env::var("MCP_RUN_TEST_LOG").unwrap_or_else(|_| "info".into()),
        );
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("start mcp-run");
        let stderr = child.stderr.take().expect("stderr");
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let log2 = log.clone();
        std::thread::spawn(move || {
            let re = regex::Regex::new(r"addr=(\S+)").unwrap();
            let mut tx = Some(tx);
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if std::env::var_os("MCP_RUN_TEST_ECHO").is_some() {
                    eprintln!("[gateway] {line}");
                }
                if line.contains("listening")
                    && let Some(c) = re.captures(&line)
                    && let Some(tx) = tx.take()
                {
                    let _ = tx.send(c[1].to_string());
                }
                log2.lock().unwrap().push_str(&line);
                log2.lock().unwrap().push('\n');
            }
        });
        let addr: SocketAddr = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(a) => a.parse().expect("address"),
            Err(_) => {
                let _ = child.kill();
                panic!("gateway did not start; log:\n{}", log.lock().unwrap());
            }
        };
        let kube = args.windows(2).any(|w| w == ["--backend", "kube"]);
        Gateway {
            child: Some(child),
            base: format!("http://{addr}"),
            log,
            backend: if kube { "kubernetes" } else { "local" }.into(),
            token: None,
        }
    }

    /// A gateway that runs elsewhere, given its `/raw` URL.
    pub fn external(raw_url: &str, backend: &str) -> Gateway {
        let base = raw_url
            .trim_end_matches('/')
            .trim_end_matches("/raw")
            .to_string();
        Gateway {
            child: None,
            base,
            log: Arc::new(Mutex::new(String::new())),
            backend: backend.into(),
            token: None,
        }
    }

    /// `req` with this gateway's bearer token, if it has one.
    pub fn authorized(&self, req: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.token {
            Some(token) => req.bearer_auth(token),
            None => req,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    pub fn raw_url(&self) -> String {
        self.url("/raw")
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// `run-remote` pointed at this gateway, with an empty environment but `PATH`, in `/`
    /// (a directory that exists wherever the command runs).
    pub fn run_remote(&self) -> Command {
        let mut cmd = Command::new(run_remote_bin());
        cmd.env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("RUN_REMOTE_SERVER", self.raw_url())
            .current_dir("/")
            .stdin(Stdio::null());
        if let Some(token) = &self.token {
            cmd.env("RUN_REMOTE_TOKEN", token);
        }
        cmd
    }

    /// Sends SIGTERM and waits for the process to end, returning its exit status.
    pub fn terminate(&mut self) -> Option<std::process::ExitStatus> {
        let child = self.child.as_mut()?;
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::SIGTERM,
        );
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    pub fn log_text(&self) -> String {
        self.log.lock().unwrap().clone()
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// SIGTERM from a blocking thread, for async tests: the exit status, and the gateway back
/// (its log stays readable).
pub async fn terminate(mut gw: Gateway) -> (Option<std::process::ExitStatus>, Gateway) {
    tokio::task::spawn_blocking(move || (gw.terminate(), gw))
        .await
        .expect("terminate")
}

/// `GET path` on the gateway, as JSON.
pub async fn get_json(gw: &Gateway, path: &str) -> serde_json::Value {
    gw.authorized(http().get(gw.url(path)))
        .send()
        .await
        .expect("GET")
        .json()
        .await
        .expect("JSON body")
}

/// An HTTP client for tests (reqwest is built without a default crypto provider).
pub fn http() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder().build().unwrap()
}

/// The outcome of one `/raw` request.
#[derive(Debug, Default)]
pub struct RawRun {
    pub status: u16,
    pub content_type: String,
    /// The `error` object of a rejected request.
    pub rejection: Option<ErrorResponse>,
    pub context: Option<RunContext>,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub exit: Option<ExitInfo>,
    /// `(code, message)` of a terminal `error` event.
    pub error: Option<(String, String)>,
    pub events: Vec<Event>,
    /// Events after the terminal one (must stay empty).
    pub after_terminal: usize,
}

impl RawRun {
    pub fn code(&self) -> Option<i32> {
        self.exit.and_then(|e| e.code)
    }
    pub fn stdout_str(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
    pub fn stderr_str(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }
}

/// POSTs `body` (any JSON) to `/raw` and collects the whole answer.
pub async fn raw(gw: &Gateway, body: serde_json::Value) -> RawRun {
    raw_bytes(gw, serde_json::to_vec(&body).unwrap(), "application/json").await
}

/// [`raw`] through `client` (one [`http`] client per request: each is a connection of its own).
pub async fn raw_with(client: &reqwest::Client, gw: &Gateway, body: serde_json::Value) -> RawRun {
    raw_bytes_with(
        client,
        gw,
        serde_json::to_vec(&body).unwrap(),
        "application/json",
    )
    .await
}

/// POSTs raw bytes with a content type to `/raw` and collects the answer.
pub async fn raw_bytes(gw: &Gateway, body: Vec<u8>, content_type: &str) -> RawRun {
    raw_bytes_with(&http(), gw, body, content_type).await
}

/// [`raw_bytes`] through `client`.
pub async fn raw_bytes_with(
    client: &reqwest::Client,
    gw: &Gateway,
    body: Vec<u8>,
    content_type: &str,
) -> RawRun {
    let resp = gw
        .authorized(client.post(gw.raw_url()))
        .header("content-type", content_type)
        .body(body)
        .send()
        .await
        .expect("send");
    let status = resp.status().as_u16();
    let content_type = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let bytes = resp.bytes().await.expect("body");
    let mut run = RawRun {
        status,
        content_type,
        ..Default::default()
    };
    if status != 200 {
        run.rejection = Some(serde_json::from_slice(&bytes).unwrap_or_else(|e| {
            panic!(
                "error body is not JSON ({e}): {}",
                String::from_utf8_lossy(&bytes)
            )
        }));
        return run;
    }
    let mut terminal = false;
    for line in bytes.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
        let event: Event = serde_json::from_slice(line).expect("event line");
        if terminal {
            run.after_terminal += 1;
        }
        match &event {
            Event::Started { context } => run.context = Some(context.clone()),
            Event::Stdout { data } => run.stdout.extend_from_slice(data),
            Event::Stderr { data } => run.stderr.extend_from_slice(data),
            Event::Exit(info) => {
                run.exit = Some(*info);
                terminal = true;
            }
            Event::Error { code, message } => {
                run.error = Some((code.to_string(), message.clone()));
                terminal = true;
            }
            _ => {}
        }
        run.events.push(event);
    }
    run
}

/// POSTs a request with stdin (`Content-Type: application/vnd.mcp-run.stdin`: the request
/// JSON on the first line, then the stdin bytes) and collects the answer.
pub async fn raw_stdin(gw: &Gateway, body: serde_json::Value, stdin: &[u8]) -> RawRun {
    let mut bytes = serde_json::to_vec(&body).unwrap();
    bytes.push(b'\n');
    bytes.extend_from_slice(stdin);
    raw_bytes(gw, bytes, mcp_run::contract::STDIN_CONTENT_TYPE).await
}

/// Starts a stdin request whose body streams from `input` (chunked, ending when the sender is
/// dropped); returns the response as soon as its headers arrive.
pub async fn raw_stdin_streamed(
    gw: &Gateway,
    body: serde_json::Value,
    input: tokio::sync::mpsc::Receiver<bytes::Bytes>,
) -> reqwest::Response {
    let mut head = serde_json::to_vec(&body).unwrap();
    head.push(b'\n');
    let first = futures_util::stream::once(async move {
        Ok::<_, std::convert::Infallible>(bytes::Bytes::from(head))
    });
    let rest = futures_util::stream::unfold(input, |mut input| async move {
        let chunk = input.recv().await?;
        Some((Ok(chunk), input))
    });
    use futures_util::StreamExt;
    gw.authorized(http().post(gw.raw_url()))
        .header("content-type", mcp_run::contract::STDIN_CONTENT_TYPE)
        .body(reqwest::Body::wrap_stream(first.chain(rest)))
        .send()
        .await
        .expect("send")
}

/// Waits until `cond` holds, up to `limit`.
pub fn wait_until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether a local process exists (and is not a zombie).
pub fn pid_alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z'),
        Err(_) => false,
    }
}

/// Writes a config file for the gateway into a temp dir and returns its path.
pub fn config_file(dir: &tempfile::TempDir, yaml: &str) -> PathBuf {
    let path = dir.path().join("config.yaml");
    std::fs::File::create(&path)
        .unwrap()
        .write_all(yaml.as_bytes())
        .unwrap();
    path
}

/// A file of `len` random bytes in `dir`, and its bytes (for byte-exact round trips).
pub fn random_file(dir: &std::path::Path, len: usize) -> (std::path::PathBuf, Vec<u8>) {
    use std::io::Read as _;
    let path = dir.join("blob");
    let mut data = vec![0u8; len];
    // The kernel's generator: `rand`'s ChaCha is inlined into this crate, which the dev
    // profile does not optimise (several CPU seconds for the 50 MB of a test).
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut data))
        .expect("/dev/urandom");
    std::fs::write(&path, &data).unwrap();
    (path, data)
}

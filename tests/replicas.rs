//! Replicas of one gateway behind a proxy that sends each request to the next replica (as an
//! L7 ingress without sticky sessions does): three `mcp-run serve --peer ...` and rmcp's
//! client through a round-robin proxy written here. MCP works whichever replica answers
//! (stateless streamable HTTP), progress included; every page of a kept output reads through
//! any replica (forwarded to the one that keeps it); the peer channel takes only the secret;
//! a replica gone leaves its runs' reads failing cleanly.

use crate::support;

use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use rmcp::ServiceExt as _;
use rmcp::model::{CallToolRequestParams, ReadResourceRequestParams, ResourceContents};
use rmcp::service::RoleClient;
use rmcp::transport::StreamableHttpClientTransport;
use serde_json::{Value, json};
use support::Gateway;

const SECRET: &str = "replica-test-secret-0123456789abcdef";

/// Sends each request to the next backend in turn; counts what each got. A backend that
/// refuses the connection (a dead replica) is skipped for the next, as nginx's
/// `proxy_next_upstream error` does.
struct Proxy {
    backends: Vec<String>,
    next: AtomicUsize,
    hits: Vec<AtomicUsize>,
    client: reqwest::Client,
    /// Whether a backend that refuses the connection is skipped (else: 502, as an L7 proxy
    /// answers before it marks the upstream down).
    skip_dead: bool,
    /// Connections refused by a backend.
    refused: AtomicUsize,
}

async fn forward(State(p): State<Arc<Proxy>>, req: Request) -> Response {
    let path = req
        .uri()
        .path_and_query()
        .map(|pq| pq.as_str().to_owned())
        .unwrap_or_default();
    let (parts, body) = req.into_parts();
    let body = axum::body::to_bytes(body, 64 << 20).await.unwrap();
    let mut last = String::new();
    // An MCP client's GET (its stream for server messages, which the gateway does not offer)
    // and DELETE take no turn, so that the calls' spread over the replicas is the same
    // whenever the client sends them.
    let turns = parts.method == axum::http::Method::POST;
    for attempt in 0..p.backends.len() {
        let i = if turns {
            p.next.fetch_add(1, Ordering::SeqCst)
        } else {
            p.next.load(Ordering::SeqCst) + attempt
        } % p.backends.len();
        let mut out = p
            .client
            .request(parts.method.clone(), format!("{}{path}", p.backends[i]))
            .body(body.clone());
        for (k, v) in &parts.headers {
            if !matches!(k.as_str(), "host" | "content-length" | "connection") {
                out = out.header(k, v);
            }
        }
        match out.send().await {
            Ok(resp) => {
                p.hits[i].fetch_add(1, Ordering::SeqCst);
                let mut b = Response::builder().status(resp.status());
                for (k, v) in resp.headers() {
                    if !matches!(
                        k.as_str(),
                        "content-length" | "transfer-encoding" | "connection"
                    ) {
                        b = b.header(k, v);
                    }
                }
                return b.body(Body::from_stream(resp.bytes_stream())).unwrap();
            }
            Err(e) if e.is_connect() => {
                p.refused.fetch_add(1, Ordering::SeqCst);
                last = e.to_string();
                if !p.skip_dead {
                    break;
                }
            }
            Err(e) => return (axum::http::StatusCode::BAD_GATEWAY, e.to_string()).into_response(),
        }
    }
    (axum::http::StatusCode::BAD_GATEWAY, last).into_response()
}

/// Starts the proxy in front of `backends`; its base URL.
async fn proxy(backends: Vec<String>) -> (String, Arc<Proxy>) {
    proxy_with(backends, true).await
}

/// [`proxy`], skipping dead backends or not.
async fn proxy_with(backends: Vec<String>, skip_dead: bool) -> (String, Arc<Proxy>) {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let p = Arc::new(Proxy {
        skip_dead,
        refused: AtomicUsize::new(0),
        hits: backends.iter().map(|_| AtomicUsize::new(0)).collect(),
        backends,
        next: AtomicUsize::new(0),
        client: reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap(),
    });
    let app = axum::Router::new().fallback(forward).with_state(p.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), p)
}

/// Three replicas naming each other; their base URLs.
fn replicas(extra: &[&str]) -> (Vec<Gateway>, Vec<String>) {
    // The addresses are needed before the start: each replica names the others.
    let ports: Vec<u16> = (0..3)
        .map(|_| {
            TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port()
        })
        .collect();
    let urls: Vec<String> = ports
        .iter()
        .map(|p| format!("http://127.0.0.1:{p}"))
        .collect();
    let gws = (0..3)
        .map(|i| {
            let listen = format!("127.0.0.1:{}", ports[i]);
            let mut args = vec!["--listen", listen.as_str()];
            for (j, u) in urls.iter().enumerate() {
                if j != i {
                    args.extend(["--peer", u.as_str()]);
                }
            }
            args.extend(extra);
            Gateway::start_with_env(&args, &[("MCP_RUN_PEER_SECRET", SECRET)])
        })
        .collect();
    (gws, urls)
}

#[derive(Clone, Default)]
struct Progress(Arc<Mutex<Vec<String>>>);

impl rmcp::ClientHandler for Progress {
    async fn on_progress(
        &self,
        params: rmcp::model::ProgressNotificationParam,
        _context: rmcp::service::NotificationContext<RoleClient>,
    ) {
        self.0
            .lock()
            .unwrap()
            .push(params.message.unwrap_or_default());
    }
}

fn text_of(r: &rmcp::model::ReadResourceResult) -> String {
    match &r.contents[0] {
        ResourceContents::TextResourceContents { text, .. } => text.clone(),
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn three_replicas_behind_a_round_robin_proxy_serve_mcp_and_kept_outputs() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (mut gws, urls) = replicas(&[]);
    let (base, p) = proxy(urls.clone()).await;
    let seen = Progress::default();
    let c = seen
        .clone()
        .serve(StreamableHttpClientTransport::from_uri(format!(
            "{base}/mcp"
        )))
        .await
        .expect("initialize through the proxy");

    // tools/list and tool calls land on every replica in turn.
    let tools = c.list_all_tools().await.unwrap();
    assert!(tools.iter().any(|t| t.name == "run_network_tool"));
    let mut kept = Vec::new();
    for i in 0..3 {
        let mut params = CallToolRequestParams::new("run_network_tool").with_arguments(
            json!({"executable": "sh", "args": ["-c", format!("echo compiling step{i}; sleep 2.5; seq 1 300000")]})
                .as_object()
                .cloned()
                .unwrap(),
        );
        params.meta = Some({
            let mut m = rmcp::model::RequestMetaObject::default();
            m.set_progress_token(rmcp::model::ProgressToken(
                rmcp::model::NumberOrString::Number(i),
            ));
            m
        });
        let r = c.call_tool(params).await.expect("tools/call");
        assert_eq!(r.is_error, Some(false), "{r:?}");
        let o: &Value = &r.structured_content.as_ref().unwrap()["outputs"][0];
        assert_eq!(o["exit_code"], 0, "{o}");
        assert_eq!(o["truncated"], true, "{o}");
        let full = &o["full_output"];
        assert_eq!(full["stdout_bytes"], 1_988_895 + "compiling stepN\n".len());
        kept.push(full["stdout_uri"].as_str().unwrap().to_owned());
    }
    let progress = seen.0.lock().unwrap().clone();
    for i in 0..3 {
        assert!(
            progress
                .iter()
                .any(|m| m.contains(&format!("compiling step{i}"))),
            "progress of call {i}: {progress:?}"
        );
    }
    // Each run is tagged with the replica that keeps it: three calls, three replicas.
    let tags: std::collections::HashSet<String> = kept
        .iter()
        .map(|u| {
            let id = u
                .trim_start_matches("mcp-run://runs/")
                .split('/')
                .next()
                .unwrap();
            assert_eq!(id.len(), 40, "{u}");
            id[..8].to_owned()
        })
        .collect();
    assert_eq!(tags.len(), 3, "{kept:?}");

    // Every page of one kept output, each read through whichever replica comes next: most
    // are forwarded to the one that keeps it. The pages join into the whole output.
    let mut uri = kept[0].clone();
    let mut whole = String::new();
    let mut pages = 0;
    loop {
        let r = c
            .read_resource(ReadResourceRequestParams::new(uri.clone()))
            .await
            .expect("resources/read through any replica");
        let text = text_of(&r);
        pages += 1;
        match text.rsplit_once("\n[mcp-run: page ends here; next page: ") {
            Some((body, rest)) => {
                whole.push_str(body);
                uri = rest.trim_end().trim_end_matches(']').to_owned();
            }
            None => {
                whole.push_str(&text);
                break;
            }
        }
        assert!(pages < 200, "too many pages");
    }
    let expected: String = std::iter::once("compiling step0".to_owned())
        .chain((1..=300000).map(|n| n.to_string()))
        .map(|l| l + "\n")
        .collect();
    assert!(pages > 3, "{pages} pages");
    assert_eq!(whole.len(), expected.len());
    assert!(whole == expected, "the pages differ from the output");
    // A search and a line range, through the replicas too.
    for (q, want) in [
        ("?grep=%5E29999%24", "30000:29999"),
        ("?lines=3-4", "2\n3\n"),
    ] {
        for _ in 0..3 {
            let u = format!("{}{q}", kept[1]);
            let r = c
                .read_resource(ReadResourceRequestParams::new(u))
                .await
                .unwrap();
            let t = text_of(&r);
            assert!(t.contains(want), "{q}: {t}");
        }
    }
    // An unknown run of a live replica, and a malformed page parameter, say so from any.
    let unknown = format!(
        "mcp-run://runs/{}{}/stdout",
        &tags.iter().next().unwrap(),
        "0".repeat(32)
    );
    for _ in 0..3 {
        let e = c
            .read_resource(ReadResourceRequestParams::new(unknown.clone()))
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("no run"), "{e}");
        let e = c
            .read_resource(ReadResourceRequestParams::new(format!(
                "{}?lines=5-3",
                kept[2]
            )))
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("lines"), "{e}");
    }
    // The proxy spread the requests over all three.
    let hits: Vec<usize> = p.hits.iter().map(|h| h.load(Ordering::SeqCst)).collect();
    assert!(hits.iter().all(|&h| h > 5), "{hits:?}");

    python_sdk(&format!("{base}/mcp")).await;

    // The peer channel takes the secret only; no log line carries it.
    let http = support::http();
    for auth in [None, Some("Bearer wrong-secret-wrong-secret-wrong-secret")] {
        let mut req = http.get(format!("{}/peer/v1/replica", urls[0]));
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status(), 401);
        let body = resp.text().await.unwrap();
        assert!(body.contains("unauthorized"), "{body}");
    }
    let resp = http
        .post(format!("{}/peer/v1/outputs/read", urls[0]))
        .header("content-type", "application/json")
        .body(json!({"replica": "x", "uri": kept[0], "identity": null}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401);

    // The replica that keeps run 0 goes (SIGKILL): reading it through another one fails
    // cleanly, naming why; the others' runs still read.
    let mut owner = None;
    for (i, u) in urls.iter().enumerate() {
        let v: Value = http
            .get(format!("{u}/peer/v1/replica"))
            .bearer_auth(SECRET)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if v["replica"] == tags_of(&kept[0]) {
            owner = Some(i);
        }
    }
    let owner = owner.expect("a replica answers the tag of run 0");
    let mut dead = gws.remove(owner);
    if let Some(pid) = dead.pid() {
        sigkill(pid);
    }
    let _ = dead.terminate();
    let live: Vec<&Gateway> = gws.iter().collect();
    let direct = seen
        .clone()
        .serve(StreamableHttpClientTransport::from_uri(live[0].url("/mcp")))
        .await
        .unwrap();
    let e = direct
        .read_resource(ReadResourceRequestParams::new(kept[0].clone()))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("run the command again"), "{e}");
    for u in &kept[1..] {
        // Either it is this replica's, or the other live one's.
        let r = direct
            .read_resource(ReadResourceRequestParams::new(format!("{u}?lines=1-1")))
            .await
            .expect("a live replica's run still reads");
        assert!(text_of(&r).starts_with("compiling step"));
    }
    // New calls go on at the live replicas.
    let r = direct
        .call_tool(
            CallToolRequestParams::new("run_network_tool").with_arguments(
                json!({"executable": "echo", "args": ["still here"]})
                    .as_object()
                    .cloned()
                    .unwrap(),
            ),
        )
        .await
        .unwrap();
    assert_eq!(
        r.structured_content.as_ref().unwrap()["outputs"][0]["stdout"],
        "still here\n"
    );
    // And through the proxy, which skips the dead replica as a balancer does.
    for i in 0..3 {
        let r = c
            .call_tool(
                CallToolRequestParams::new("run_network_tool").with_arguments(
                    json!({"executable": "echo", "args": [format!("via the proxy {i}")]})
                        .as_object()
                        .cloned()
                        .unwrap(),
                ),
            )
            .await
            .unwrap();
        assert_eq!(
            r.structured_content.as_ref().unwrap()["outputs"][0]["stdout"],
            format!("via the proxy {i}\n")
        );
    }
    for gw in gws.iter().chain([&dead]) {
        assert!(!gw.log_text().contains(SECRET), "the secret is in a log");
    }
    let _ = c.cancel().await;
    let _ = direct.cancel().await;
}

/// The official Python SDK through the proxy (.ci/mcp-sdks/replicas.py), from the project's
/// virtualenv that .ci/install.d/mcp-sdks.sh makes; skipped, saying so, without it (failed
/// under CI=true).
async fn python_sdk(url: &str) {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = root.join(".venv/bin/python");
    let has_sdk = std::process::Command::new(&python)
        .args(["-c", "import mcp"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_sdk {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "the Python MCP SDK is missing from .venv: run .ci/install.d/mcp-sdks.sh"
        );
        eprintln!(
            "replicas: Python SDK check skipped (no .venv with mcp; .ci/install.d/mcp-sdks.sh)"
        );
        return;
    }
    let out = tokio::process::Command::new(&python)
        .arg(root.join(".ci/mcp-sdks/replicas.py"))
        .arg(url)
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn tags_of(uri: &str) -> String {
    uri.trim_start_matches("mcp-run://runs/")[..8].to_owned()
}

/// SIGKILL, as a crashed or evicted replica dies.
fn sigkill(pid: u32) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::SIGKILL,
    );
}

/// A replica with peers but no secret does not start; the message says what to set and
/// never echoes a credential from a peer URL.
#[test]
fn peers_need_the_secret() {
    let out = std::process::Command::new(support::gateway_bin())
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--peer",
            "http://127.0.0.1:9",
        ])
        .env_remove("MCP_RUN_PEER_SECRET")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("MCP_RUN_PEER_SECRET"), "{err}");
    let out = std::process::Command::new(support::gateway_bin())
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--peer",
            "http://me:hunter2hunter2@127.0.0.1:9",
        ])
        .env("MCP_RUN_PEER_SECRET", SECRET)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("credentials") && !err.contains("hunter2"),
        "{err}"
    );
    let out = std::process::Command::new(support::gateway_bin())
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--peer",
            "http://127.0.0.1:9",
        ])
        .env("MCP_RUN_PEER_SECRET", "short")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("too short") && !err.contains("short\""),
        "{err}"
    );
    // A peer port without peers, the peer port on the users' port, a Service name that is
    // not one: refused with the key named.
    let dir = tempfile::tempdir().unwrap();
    for (args, yaml, says) in [
        (
            vec!["--peer-listen", "127.0.0.1:0"],
            "",
            "server.peer_listen",
        ),
        (
            vec![
                "--peer",
                "http://127.0.0.1:9",
                "--listen",
                "127.0.0.1:18099",
            ],
            "server:\n  peer_listen: 127.0.0.1:18099\n",
            "must differ from server.listen",
        ),
        (
            vec![],
            "server:\n  peer_service: Not_A_Service\n",
            "server.peer_service",
        ),
    ] {
        let config = support::config_file(&dir, yaml);
        let mut cmd = std::process::Command::new(support::gateway_bin());
        cmd.args(["serve", "--config", config.to_str().unwrap()]);
        if !args.contains(&"--listen") {
            cmd.args(["--listen", "127.0.0.1:0"]);
        }
        let out = cmd
            .args(&args)
            .env("MCP_RUN_PEER_SECRET", SECRET)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(says),
            "{args:?} {yaml}: {err}"
        );
    }
}

/// The JSON-RPC answer in a streamable-HTTP response (JSON, or the SSE event carrying it).
fn answer_of(body: &str) -> Value {
    if let Ok(v) = serde_json::from_str::<Value>(body) {
        return v;
    }
    body.lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .filter_map(|d| serde_json::from_str::<Value>(d.trim()).ok())
        .find(|v| v.get("id").is_some())
        .unwrap_or_else(|| panic!("no answer in {body}"))
}

/// Every protocol version that opens with `initialize` works through the round-robin proxy:
/// the session id handed out is not needed, and each later request (a version header, or none for
/// 2024-11-05) is answered by whichever replica gets it.
#[tokio::test(flavor = "multi_thread")]
async fn every_initialize_protocol_version_works_through_any_replica() {
    let (_gws, urls) = replicas(&[]);
    let (base, p) = proxy(urls).await;
    let http = support::http();
    let post = |body: Value, version: Option<&str>| {
        let mut req = http
            .post(format!("{base}/mcp"))
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .body(body.to_string());
        if let Some(v) = version {
            req = req.header("mcp-protocol-version", v);
        }
        req.send()
    };
    for version in ["2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25"] {
        let resp = post(
            json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                "protocolVersion": version, "capabilities": {},
                "clientInfo": {"name": "replicas-test", "version": "1"}}}),
            None,
        )
        .await
        .unwrap();
        assert_eq!(resp.status(), 200, "{version}");
        // A session id is handed out (it names the client's calls for cancellation), but
        // no replica keeps anything under it: the requests below do not carry it.
        assert!(resp.headers().get("mcp-session-id").is_some(), "{version}");
        let init = answer_of(&resp.text().await.unwrap());
        assert_eq!(init["result"]["protocolVersion"], version, "{init}");
        // 2024-11-05 clients send no version header.
        let header = (version != "2024-11-05").then_some(version);
        let resp = post(
            json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
            header,
        )
        .await
        .unwrap();
        assert_eq!(resp.status(), 202, "{version}");
        for id in 2..5 {
            let resp = post(
                json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {
                    "name": "run_network_tool",
                    "arguments": {"executable": "echo", "args": [format!("{version} {id}")]}}}),
                header,
            )
            .await
            .unwrap();
            assert_eq!(resp.status(), 200, "{version}");
            let r = answer_of(&resp.text().await.unwrap());
            assert_eq!(
                r["result"]["structuredContent"]["outputs"][0]["stdout"],
                format!("{version} {id}\n"),
                "{r}"
            );
        }
    }
    let hits: Vec<usize> = p.hits.iter().map(|h| h.load(Ordering::SeqCst)).collect();
    assert!(hits.iter().all(|&h| h >= 5), "{hits:?}");
}

/// Without sessions there is nothing to route `notifications/cancelled` to: a client that
/// closes its call's HTTP stream is what stops the command. The replica notices when a write
/// fails: with peers an SSE keep-alive comes every 5 s, and the first write after the close
/// may still succeed, hence the bound of 20 s.
#[tokio::test(flavor = "multi_thread")]
async fn closing_a_calls_stream_stops_its_command() {
    let (_gws, urls) = replicas(&[]);
    let dir = tempfile::tempdir().unwrap();
    let http = support::http();
    let pidfile = dir.path().join("pid");
    let script = format!(
        "echo $$ > {}.tmp; mv {0}.tmp {0}; exec sleep 300",
        pidfile.display()
    );
    let resp = http
        .post(format!("{}/mcp", urls[1]))
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .header("mcp-protocol-version", "2025-11-25")
        .body(
            json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
                "name": "run_network_tool",
                "arguments": {"executable": "sh", "args": ["-c", script]}}})
            .to_string(),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let pid: i32 = tokio::task::spawn_blocking(move || {
        assert!(support::wait_until(Duration::from_secs(30), || pidfile.exists()));
        std::fs::read_to_string(&pidfile)
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(support::pid_alive(pid));
    let closed = std::time::Instant::now();
    drop(resp);
    let gone = tokio::task::spawn_blocking(move || {
        support::wait_until(Duration::from_secs(20), || !support::pid_alive(pid))
    })
    .await
    .unwrap();
    assert!(gone, "the command outlived its closed stream");
    eprintln!("stopped {:?} after the close", closed.elapsed());
}

/// `notifications/cancelled` (protocol versions up to 2025-11-25) stops the call wherever it
/// runs: through the round-robin proxy the notification reaches another replica than the
/// call, which finds the call's replica by asking its peers (the call is named by the session
/// id that `initialize` handed out and its request id). A call of a session (run on the
/// caller's home replica, relayed when the proxy picked another) stops too.
#[tokio::test(flavor = "multi_thread")]
async fn notifications_cancelled_stops_a_call_through_any_replica() {
    let (_gws, urls) = replicas(&[]);
    let (base, p) = proxy(urls).await;
    let http = support::http();
    let dir = tempfile::tempdir().unwrap();
    let post = |body: Value, session: Option<&str>, version: &str| {
        let mut req = http
            .post(format!("{base}/mcp"))
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .header("mcp-protocol-version", version)
            .body(body.to_string());
        if let Some(s) = session {
            req = req.header("mcp-session-id", s);
        }
        req.send()
    };
    let hits =
        |p: &Proxy| -> Vec<usize> { p.hits.iter().map(|h| h.load(Ordering::SeqCst)).collect() };
    for (n, version) in [
        "2024-11-05",
        "2025-03-26",
        "2025-06-18",
        "2025-11-25",
        "2025-11-25",
    ]
    .into_iter()
    .enumerate()
    {
        let resp = post(
            json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
                "protocolVersion": version, "capabilities": {},
                "clientInfo": {"name": "replicas-test", "version": "1"}}}),
            None,
            version,
        )
        .await
        .unwrap();
        assert_eq!(resp.status(), 200, "{version}");
        let session = resp.headers()["mcp-session-id"]
            .to_str()
            .unwrap()
            .to_owned();
        answer_of(&resp.text().await.unwrap());
        let resp = post(
            json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
            Some(&session),
            version,
        )
        .await
        .unwrap();
        assert_eq!(resp.status(), 202, "{version}");
        let pidfile = dir.path().join(format!("pid{n}"));
        let script = format!(
            "echo $$ > {}.tmp; mv {0}.tmp {0}; exec sleep 300",
            pidfile.display()
        );
        let mut arguments = json!({"executable": "sh", "args": ["-c", script]});
        // The last one: a session's call, served by the caller's home replica.
        if n == 4 {
            arguments["session"] = json!("cancel");
        }
        let before = hits(&p);
        let call = post(
            json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {
                "name": "run_network_tool", "arguments": arguments}}),
            Some(&session),
            version,
        )
        .await
        .unwrap();
        assert_eq!(call.status(), 200, "{version}");
        let after_call = hits(&p);
        let pid: i32 = tokio::task::spawn_blocking(move || {
            assert!(support::wait_until(Duration::from_secs(30), || pidfile.exists()));
            std::fs::read_to_string(&pidfile)
                .unwrap()
                .trim()
                .parse()
                .unwrap()
        })
        .await
        .unwrap();
        assert!(support::pid_alive(pid));
        // The call's stream stays open: the notification is the only cancellation.
        let resp = post(
            json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
                   "params": {"requestId": 7, "reason": "test"}}),
            Some(&session),
            version,
        )
        .await
        .unwrap();
        assert_eq!(resp.status(), 202, "{version}");
        let after_cancel = hits(&p);
        let which = |a: &[usize], b: &[usize]| (0..3).find(|&i| a[i] != b[i]).unwrap();
        assert_ne!(
            which(&before, &after_call),
            which(&after_call, &after_cancel),
            "the proxy sent the call and its cancellation to one replica"
        );
        let cancelled = std::time::Instant::now();
        let gone = tokio::task::spawn_blocking(move || {
            support::wait_until(Duration::from_secs(10), || !support::pid_alive(pid))
        })
        .await
        .unwrap();
        assert!(
            gone,
            "{version}: the call outlived its notifications/cancelled"
        );
        eprintln!(
            "{version}: stopped {:?} after the notification",
            cancelled.elapsed()
        );
        // And its answer ends.
        tokio::time::timeout(Duration::from_secs(10), call.bytes())
            .await
            .expect("the cancelled call's stream did not end")
            .ok();
        // A notification naming no running call is accepted and does nothing.
        let resp = post(
            json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
                   "params": {"requestId": 99}}),
            Some(&session),
            version,
        )
        .await
        .unwrap();
        assert_eq!(resp.status(), 202, "{version}");
        // Ending the session is accepted (nothing is kept under it).
        let resp = http
            .delete(format!("{base}/mcp"))
            .header("mcp-session-id", &session)
            .header("mcp-protocol-version", version)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 204, "{version}");
    }
    // A cancellation that arrives before its call (the call's POST took a slower path) is
    // remembered: the call, wherever it lands, ends at once without running its command.
    let session = "0123456789abcdef0123456789abcdef";
    let resp = post(
        json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
               "params": {"requestId": 11}}),
        Some(session),
        "2025-11-25",
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 202);
    let marker = dir.path().join("ran");
    let call = post(
        json!({"jsonrpc": "2.0", "id": 11, "method": "tools/call", "params": {
            "name": "run_network_tool", "arguments": {"executable": "sh",
            "args": ["-c", format!("touch {}; sleep 300", marker.display())]}}}),
        Some(session),
        "2025-11-25",
    )
    .await
    .unwrap();
    tokio::time::timeout(Duration::from_secs(10), call.bytes())
        .await
        .expect("a call cancelled before it came was answered")
        .ok();
    assert!(!marker.exists(), "the call cancelled first ran its command");
}

/// `resources/list` names the caller's kept outputs of every live replica, whichever replica
/// answers it; a replica that died (SIGKILL) is left out of the list, not an error.
#[tokio::test(flavor = "multi_thread")]
async fn resources_list_names_kept_outputs_of_every_replica() {
    let (gws, urls) = replicas(&[]);
    let (base, p) = proxy(urls).await;
    let http = support::http();
    let post = |body: Value| {
        http.post(format!("{base}/mcp"))
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .header("mcp-protocol-version", "2025-11-25")
            .body(body.to_string())
            .send()
    };
    let list = || async {
        let resp = post(json!({"jsonrpc": "2.0", "id": 9, "method": "resources/list"}))
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let r = answer_of(&resp.text().await.unwrap());
        let mut runs: Vec<String> = r["result"]["resources"]
            .as_array()
            .unwrap_or_else(|| panic!("{r}"))
            .iter()
            .filter_map(|x| x["uri"].as_str())
            .filter(|u| u.starts_with("mcp-run://runs/"))
            .map(|u| u.to_owned())
            .collect();
        runs.sort();
        runs
    };
    // One call on each replica, in turn.
    for i in 0..3 {
        let resp = post(
            json!({"jsonrpc": "2.0", "id": i, "method": "tools/call", "params": {
            "name": "run_network_tool",
            "arguments": {"executable": "echo", "args": [format!("run {i}")]}}}),
        )
        .await
        .unwrap();
        assert_eq!(resp.status(), 200);
        answer_of(&resp.text().await.unwrap());
    }
    let hits: Vec<usize> = p.hits.iter().map(|h| h.load(Ordering::SeqCst)).collect();
    assert_eq!(hits, [1, 1, 1]);
    // Every replica lists the three runs, both streams each.
    for _ in 0..3 {
        let runs = list().await;
        assert_eq!(runs.len(), 6, "{runs:?}");
        let tags: std::collections::BTreeSet<String> = runs.iter().map(|u| tags_of(u)).collect();
        assert_eq!(tags.len(), 3, "{runs:?}");
    }
    // A replica gone: its runs are left out, the others still listed by any replica.
    let dead = gws[2].pid().unwrap();
    sigkill(dead);
    assert!(support::wait_until(Duration::from_secs(10), || {
        !support::pid_alive(dead as i32)
    }));
    for _ in 0..3 {
        let runs = list().await;
        assert_eq!(runs.len(), 4, "{runs:?}");
    }
    assert!(
        gws[..2]
            .iter()
            .any(|g| g.log_text().contains("did not list its kept outputs")),
        "no replica said that it left the dead one out"
    );
}

/// `run-remote` through `front` (the proxy), in `cwd`, with its own hash cache in `cache`.
async fn run_remote(
    front: &Gateway,
    cache: &std::path::Path,
    cwd: &std::path::Path,
    args: &[&str],
) -> std::process::Output {
    let mut cmd = front.run_remote();
    cmd.env("XDG_CACHE_HOME", cache).current_dir(cwd).args(args);
    tokio::process::Command::from(cmd).output().await.unwrap()
}

fn json_of(out: &std::process::Output) -> Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {}\nstderr: {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// The gateway process that ran a command printing `$PPID` on its last line.
fn ppid_of(stdout: &str) -> u32 {
    stdout
        .trim_end()
        .lines()
        .last()
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// `run-remote` sends a run again when a replica that just died (SIGKILL) could not start it
/// and nothing was printed: through a proxy that answers 502 for a dead upstream (as an L7
/// proxy does until it marks the upstream down), the next try reaches a live replica. A run
/// with `--stdin` is never sent twice, and a gateway that never answers fails with the
/// usual exit status after a bounded number of tries.
#[tokio::test(flavor = "multi_thread")]
async fn run_remote_retries_a_run_that_a_dead_replica_could_not_start() {
    let (gws, urls) = replicas(&[]);
    let (base, p) = proxy_with(urls, false).await;
    let front = Gateway::external(&format!("{base}/raw"), "local");
    let dead = gws[1].pid().unwrap();
    sigkill(dead);
    assert!(support::wait_until(Duration::from_secs(10), || {
        !support::pid_alive(dead as i32)
    }));
    let dir = tempfile::tempdir().unwrap();
    for (i, format) in ["stream", "json"].into_iter().enumerate() {
        // The next request goes to the dead replica.
        p.next.store(1, Ordering::SeqCst);
        let refused = p.refused.load(Ordering::SeqCst);
        let out = run_remote(
            &front,
            dir.path(),
            dir.path(),
            &["-v", "--output-format", format, "--", "echo", "hello"],
        )
        .await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{format}: {stderr}");
        if i == 0 {
            assert_eq!(String::from_utf8_lossy(&out.stdout), "hello\n");
        } else {
            assert_eq!(json_of(&out)["outputs"][0]["stdout"], "hello\n");
        }
        assert_eq!(p.refused.load(Ordering::SeqCst), refused + 1, "{stderr}");
        assert!(stderr.contains("trying again in"), "{stderr}");
    }
    // With stdin, the first try may have taken input: never sent again.
    p.next.store(1, Ordering::SeqCst);
    let refused = p.refused.load(Ordering::SeqCst);
    let mut cmd = front.run_remote();
    cmd.env("XDG_CACHE_HOME", dir.path())
        .args(["-i", "--", "cat"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = tokio::process::Command::from(cmd).spawn().unwrap();
    {
        use tokio::io::AsyncWriteExt as _;
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(b"input\n").await.unwrap();
    }
    let out = child.wait_with_output().await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(125), "{stderr}");
    assert!(stderr.contains("502"), "{stderr}");
    assert!(!stderr.contains("tries"), "{stderr}");
    assert_eq!(p.refused.load(Ordering::SeqCst), refused + 1);
    // Nothing answers at all: the usual failure, after a bounded number of tries.
    let nowhere = Gateway::external(&format!("http://127.0.0.1:{}/raw", free_port()), "local");
    let began = std::time::Instant::now();
    let out = run_remote(&nowhere, dir.path(), dir.path(), &["--", "true"]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(125), "{stderr}");
    assert!(
        stderr.contains("gateway_unreachable") && stderr.contains("(after 4 tries)"),
        "{stderr}"
    );
    assert!(
        began.elapsed() < Duration::from_secs(15),
        "{:?}",
        began.elapsed()
    );
}

/// Workspaces and sessions through the round-robin proxy: a caller's workspaces and local
/// sessions live on its home replica, and whichever replica gets a request sends it there.
/// An unchanged `run-remote --workspace` rerun uploads nothing wherever it lands, sync-back
/// brings results home, six calls of one session share one runner, `GET /sessions` lists it
/// from any replica. Then the home is killed (SIGKILL) during a session call: the call ends
/// with a clear error, and the next calls work on the caller's new home.
#[tokio::test(flavor = "multi_thread")]
async fn workspaces_and_sessions_follow_the_callers_home_replica() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (mut gws, urls) = replicas(&[]);
    let (base, p) = proxy(urls.clone()).await;
    let front = Gateway::external(&format!("{base}/raw"), "local");
    let pids: Vec<u32> = gws.iter().map(|g| g.pid().unwrap()).collect();

    // Forwarded requests take the peer secret only, and need the caller they act for.
    let http = support::http();
    for path in ["/peer/v1/http/raw", "/peer/v1/http/workspaces"] {
        let url = format!("{}{path}", urls[0]);
        let body = json!({"executable": "true"}).to_string();
        let resp = http.post(&url).body(body.clone()).send().await.unwrap();
        assert_eq!(resp.status(), 401, "{path}");
        let resp = http
            .post(&url)
            .bearer_auth(SECRET)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 400, "{path}");
        let text = resp.text().await.unwrap();
        assert!(text.contains("x-mcp-run-peer-caller"), "{text}");
    }

    // A tree, run in four times: uploaded once, then nothing, whichever replica answers.
    let cache = tempfile::tempdir().unwrap();
    let tree = tempfile::tempdir().unwrap();
    std::fs::create_dir(tree.path().join("sub")).unwrap();
    std::fs::write(tree.path().join("a.txt"), "alpha\n").unwrap();
    std::fs::write(tree.path().join("sub/b.txt"), "beta\n").unwrap();
    let cat = ["--workspace", "--output-format", "json", "--", "sh", "-c"];
    let script = "cat a.txt sub/b.txt; echo $PPID";
    let mut homes = std::collections::HashSet::new();
    for i in 0..4 {
        let out = run_remote(
            &front,
            cache.path(),
            tree.path(),
            &[&cat[..], &[script]].concat(),
        )
        .await;
        assert_eq!(
            out.status.code(),
            Some(0),
            "run {i}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v = json_of(&out);
        let uploaded = &v["workspace"]["uploaded_files"];
        assert_eq!(*uploaded, if i == 0 { 2 } else { 0 }, "run {i}: {v}");
        let stdout = v["outputs"][0]["stdout"]
            .as_str()
            .unwrap_or_else(|| panic!("{v}"));
        assert!(stdout.starts_with("alpha\nbeta\n"), "{stdout}");
        homes.insert(ppid_of(stdout));
    }
    assert_eq!(homes.len(), 1, "the workspace runs ran on {homes:?}");
    let home = *homes.iter().next().unwrap();
    assert!(pids.contains(&home), "{home} is none of {pids:?}");
    // Sync-back downloads the results from the home too.
    let out = run_remote(
        &front,
        cache.path(),
        tree.path(),
        &[
            "--workspace",
            "--output-format",
            "json",
            "--sync-back",
            "out/*",
            "--",
            "sh",
            "-c",
            "mkdir -p out && echo made > out/r.txt",
        ],
    )
    .await;
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        std::fs::read_to_string(tree.path().join("out/r.txt")).unwrap(),
        "made\n"
    );

    // Six calls of one session, through the proxy: one runner (its directory keeps the
    // count), on the home, whichever replica got each call.
    let call = json!({"executable": "sh", "args": ["-c", "echo x >> calls; wc -l < calls; echo $PPID"],
                      "session": "loop"});
    for n in 1..=6u64 {
        let r = support::raw(&front, call.clone()).await;
        assert_eq!(r.code(), Some(0), "call {n}: {r:?}");
        let out = r.stdout_str();
        assert_eq!(out.lines().next().unwrap().trim(), n.to_string(), "{out}");
        assert_eq!(ppid_of(&out), home, "call {n} ran elsewhere");
        let ctx = r.context.unwrap();
        assert_eq!(ctx.session.as_deref(), Some("loop"));
        assert_eq!(ctx.session_call, Some(n));
    }
    for _ in 0..3 {
        let list = support::get_json(&front, "/sessions").await;
        let names: Vec<&str> = list["sessions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["loop"], "{list}");
    }
    let hits: Vec<usize> = p.hits.iter().map(|h| h.load(Ordering::SeqCst)).collect();
    assert!(hits.iter().all(|&h| h >= 3), "{hits:?}");

    // A session call sent to another replica, relayed to the home: a client that goes away
    // stops the command on the home.
    let h = pids.iter().position(|&p| p == home).unwrap();
    let other = (h + 1) % 3;
    let pidfile = tree.path().join("relayed.pid");
    let sleeper = format!(
        "echo $$ > {0}.tmp; mv {0}.tmp {0}; echo begun; exec sleep 300",
        pidfile.display()
    );
    let resp = http
        .post(gws[other].raw_url())
        .header("content-type", "application/json")
        .body(json!({"executable": "sh", "args": ["-c", sleeper], "session": "loop"}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let pid: i32 = tokio::task::spawn_blocking({
        let pidfile = pidfile.clone();
        move || {
            assert!(support::wait_until(Duration::from_secs(30), || pidfile.exists()));
            std::fs::read_to_string(&pidfile)
                .unwrap()
                .trim()
                .parse()
                .unwrap()
        }
    })
    .await
    .unwrap();
    assert!(support::pid_alive(pid));
    drop(resp);
    let gone = tokio::task::spawn_blocking(move || {
        support::wait_until(Duration::from_secs(20), || !support::pid_alive(pid))
    })
    .await
    .unwrap();
    assert!(gone, "the relayed command outlived its client");

    // Another one; the home dies mid-call.
    let resp = http
        .post(gws[other].raw_url())
        .header("content-type", "application/json")
        .body(json!({"executable": "sh", "args": ["-c", "echo begun; exec sleep 120"], "session": "loop"}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.bytes_stream();
    let mut seen = String::new();
    use futures_util::StreamExt as _;
    while !seen.contains("\"stdout\"") {
        let chunk = body.next().await.expect("the call's stream").unwrap();
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    sigkill(home);
    let mut dead = gws.remove(h);
    let _ = dead.terminate();
    let rest = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(chunk) = body.next().await {
            match chunk {
                Ok(c) => seen.push_str(&String::from_utf8_lossy(&c)),
                Err(_) => break,
            }
        }
        seen
    })
    .await
    .expect("the relayed call ends when its home dies");
    let last: Value = serde_json::from_str(rest.trim_end().lines().last().unwrap()).unwrap();
    assert_eq!(last["type"], "error", "{rest}");
    assert_eq!(last["code"], "backend_unavailable", "{rest}");
    assert!(
        last["message"]
            .as_str()
            .unwrap()
            .contains("stopped answering"),
        "{rest}"
    );

    // The others carry on: the session starts afresh on the caller's new home, and the
    // workspace is posted there again (run-remote uploads what the new home lacks).
    let r = support::raw(&front, call.clone()).await;
    assert_eq!(r.code(), Some(0), "{r:?}");
    let out = r.stdout_str();
    assert_eq!(out.lines().next().unwrap().trim(), "1", "{out}");
    let new_home = ppid_of(&out);
    assert!(new_home != home && pids.contains(&new_home), "{new_home}");
    for i in 0..3 {
        let out = run_remote(
            &front,
            cache.path(),
            tree.path(),
            &[&cat[..], &[script]].concat(),
        )
        .await;
        assert_eq!(
            out.status.code(),
            Some(0),
            "after the kill, run {i}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v = json_of(&out);
        assert_eq!(
            ppid_of(v["outputs"][0]["stdout"].as_str().unwrap()),
            new_home
        );
        if i > 0 {
            assert_eq!(v["workspace"]["uploaded_files"], 0, "{v}");
        }
    }
    for gw in gws.iter().chain([&dead]) {
        assert!(!gw.log_text().contains(SECRET), "the secret is in a log");
    }
}

/// Gateways on the kube backend against `double`, one per pod name (`MCP_RUN_POD_NAME`), each
/// with its peer port from `peer_ports` and the shared peer secret.
fn kube_replicas(
    double: &crate::kube_double::KubeDouble,
    config: &std::path::Path,
    pods: &[&str],
    peer_ports: &[u16],
) -> Vec<Gateway> {
    let kubeconfig = double.kubeconfig();
    pods.iter()
        .zip(peer_ports)
        .map(|(pod, port)| {
            let peer_listen = format!("127.0.0.1:{port}");
            Gateway::start_with_env(
                &[
                    "--backend",
                    "kube",
                    "--kubeconfig",
                    kubeconfig.to_str().unwrap(),
                    "--config",
                    config.to_str().unwrap(),
                    "--peer-listen",
                    &peer_listen,
                ],
                &[("MCP_RUN_PEER_SECRET", SECRET), ("MCP_RUN_POD_NAME", pod)],
            )
        })
        .collect()
}

/// The EndpointSlice of one replica, as the EndpointSlice controller writes it for the
/// chart's headless peer Service (one slice per replica here: the replicas share an address,
/// so their peer ports differ, and a slice has one port set).
fn peer_slice(pod: &str, peer_port: u16) -> Value {
    json!({
        "metadata": {
            "name": format!("mcp-run-peers-{pod}"),
            "labels": {"kubernetes.io/service-name": "mcp-run-peers",
                       "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}
        },
        "addressType": "IPv4",
        "ports": [{"name": "peer", "port": peer_port, "protocol": "TCP"}],
        "endpoints": [{
            "addresses": ["127.0.0.1"],
            "conditions": {"ready": true, "serving": true, "terminating": false},
            "targetRef": {"kind": "Pod", "namespace": "default", "name": pod}
        }]
    })
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Three gateways on the kube backend, one API server (the double), behind the round-robin
/// proxy, as the chart installs them: no `--peer`, the replicas find each other from the
/// EndpointSlices of the headless Service (`server.peer_service`, watched: a replica added
/// later is found without a restart), and the peer channel is on its own port
/// (`server.peer_listen`), which the users' port refuses.
#[tokio::test(flavor = "multi_thread")]
async fn kube_replicas_find_each_other_from_endpointslices_behind_a_round_robin_proxy() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let double = crate::kube_double::KubeDouble::start();
    let dir = tempfile::tempdir().unwrap();
    let ws = tempfile::tempdir().unwrap();
    let config = support::config_file(
        &dir,
        &format!(
            "server:\n  peer_service: mcp-run-peers\nmcp:\n  result_chars: 4000\n\
             kubernetes:\n  reaper_interval_secs: 1\n  reaper_min_age_secs: 0\n\
             profiles:\n  default:\n    workspace_path: {}\n",
            ws.path().display()
        ),
    );
    let pods = ["gw-0", "gw-1", "gw-2"];
    let peer_ports: Vec<u16> = pods.iter().map(|_| free_port()).collect();
    let mut gws = kube_replicas(&double, &config, &pods, &peer_ports);
    let (base, p) = proxy(gws.iter().map(|g| g.base.clone()).collect()).await;
    let c = ()
        .serve(StreamableHttpClientTransport::from_uri(format!(
            "{base}/mcp"
        )))
        .await
        .expect("initialize through the proxy");
    // One call per replica, each output kept by the replica that ran it.
    let mut kept = Vec::new();
    for i in 0..3 {
        let r = c
            .call_tool(
                CallToolRequestParams::new("run_network_tool").with_arguments(
                    json!({"executable": "sh", "args": ["-c", format!("echo run{i}; seq 1 20000")]})
                        .as_object()
                        .cloned()
                        .unwrap(),
                ),
            )
            .await
            .expect("tools/call");
        let o: &Value = &r.structured_content.as_ref().unwrap()["outputs"][0];
        assert_eq!(o["exit_code"], 0, "{o}");
        let uri = o["full_output"]["stdout_uri"].as_str();
        kept.push(
            uri.unwrap_or_else(|| {
                let logs: Vec<String> = gws.iter().map(|g| g.log_text()).collect();
                panic!("not kept: {r:?}\n{}", logs.join("\n----\n"))
            })
            .to_owned(),
        );
    }
    let tags: std::collections::HashSet<String> = kept.iter().map(|u| tags_of(u)).collect();
    assert_eq!(tags.len(), 3, "{kept:?}");
    assert_eq!(
        double.created_pods().len(),
        3,
        "each call ran in a pod of its own"
    );
    // No EndpointSlice yet: a replica cannot find the others, and says so.
    let mut unknown = 0;
    for u in &kept {
        for _ in 0..3 {
            if let Err(e) = c
                .read_resource(ReadResourceRequestParams::new(format!("{u}?lines=1-1")))
                .await
            {
                assert!(e.to_string().contains("no longer answers"), "{e}");
                unknown += 1;
            }
        }
    }
    assert_eq!(
        unknown, 6,
        "each run read on the two replicas that do not keep it"
    );

    // The EndpointSlice controller lists the replicas: each one's watch learns of them.
    for (pod, port) in pods.iter().zip(&peer_ports) {
        double.put_endpoint_slice("default", peer_slice(pod, *port));
    }
    for gw in &gws {
        let found = support::wait_until(Duration::from_secs(20), || {
            gw.log_text().lines().any(|l| {
                l.contains("other replicas, from the Service's EndpointSlices")
                    && peer_ports
                        .iter()
                        .filter(|p| l.contains(&format!("127.0.0.1:{p}/")))
                        .count()
                        == 2
            })
        });
        assert!(
            found,
            "the replica's watch found the two others:\n{}",
            gw.log_text()
        );
    }
    // Every kept output now reads through every replica, forwarded over the peer ports.
    for u in &kept {
        for _ in 0..3 {
            let r = c
                .read_resource(ReadResourceRequestParams::new(format!("{u}?lines=2-3")))
                .await
                .expect("resources/read through any replica");
            assert_eq!(text_of(&r).trim_end(), "1\n2", "{u}");
        }
    }
    // Workspace runs through the proxy, forwarded over the peer ports to the caller's home:
    // the tree is uploaded once, an unchanged rerun uploads nothing whichever replica
    // answers, and each run sees the tree in its pod.
    let front = Gateway::external(&format!("{base}/raw"), "kubernetes");
    let cache = tempfile::tempdir().unwrap();
    let tree = tempfile::tempdir().unwrap();
    std::fs::create_dir(tree.path().join("sub")).unwrap();
    std::fs::write(tree.path().join("a.txt"), "alpha\n").unwrap();
    std::fs::write(tree.path().join("sub/b.txt"), "beta\n").unwrap();
    let created = double.created_pods().len();
    for i in 0..3 {
        let out = run_remote(
            &front,
            cache.path(),
            tree.path(),
            &[
                "--workspace",
                "--output-format",
                "json",
                "--",
                "sh",
                "-c",
                "cat a.txt sub/b.txt",
            ],
        )
        .await;
        assert_eq!(
            out.status.code(),
            Some(0),
            "workspace run {i}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v = json_of(&out);
        assert_eq!(
            v["workspace"]["uploaded_files"],
            if i == 0 { 2 } else { 0 },
            "workspace run {i}: {v}"
        );
        assert_eq!(v["outputs"][0]["stdout"], "alpha\nbeta\n", "{v}");
    }
    assert_eq!(
        double.created_pods().len(),
        created + 3,
        "a pod per workspace run"
    );
    let hits: Vec<usize> = p.hits.iter().map(|h| h.load(Ordering::SeqCst)).collect();
    assert!(hits.iter().all(|&h| h > 3), "{hits:?}");

    // The peer channel is on the peer port only: the users' port refuses it, the peer port
    // serves nothing else, and still wants the secret.
    let http = support::http();
    let resp = http
        .get(gws[0].url("/peer/v1/replica"))
        .bearer_auth(SECRET)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    assert!(resp.text().await.unwrap().contains("peer port"));
    let peer0 = format!("http://127.0.0.1:{}", peer_ports[0]);
    let v: Value = http
        .get(format!("{peer0}/peer/v1/replica"))
        .bearer_auth(SECRET)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["replica"].as_str().map(str::len), Some(8), "{v}");
    let resp = http
        .get(format!("{peer0}/peer/v1/replica"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401);
    for path in ["/mcp", "/raw", "/healthz"] {
        let resp = http.get(format!("{peer0}{path}")).send().await.unwrap();
        assert_eq!(resp.status(), 404, "{path} on the peer port");
    }

    // A replica killed: its slice goes (as the controller removes a deleted pod); the
    // others' runs still read through the live ones, its own fail cleanly, new calls work.
    let dead_tag = tags_of(&kept[2]);
    let mut dead = None;
    for (i, port) in peer_ports.iter().enumerate() {
        let v: Value = http
            .get(format!("http://127.0.0.1:{port}/peer/v1/replica"))
            .bearer_auth(SECRET)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if v["replica"] == dead_tag.as_str() {
            dead = Some(i);
        }
    }
    let dead = dead.expect("a replica keeps run 2");
    // Killed half-way through a run: its pod is left behind.
    let dead_label = mcp_run::label_value(pods[dead]);
    let of_dead = || {
        double
            .pod_names("default")
            .into_iter()
            .filter(|n| {
                double.pod("default", n).is_some_and(|p| {
                    p.metadata.deletion_timestamp.is_none()
                        && p.metadata
                            .labels
                            .unwrap_or_default()
                            .get("mcp-run.dev/gateway")
                            == Some(&dead_label)
                })
            })
            .collect::<Vec<_>>()
    };
    let in_flight = {
        let url = gws[dead].raw_url();
        tokio::spawn(async move {
            http.post(url)
                .json(&json!({"executable": "sleep", "args": ["300"]}))
                .send()
                .await
        })
    };
    let running = support::wait_until(Duration::from_secs(20), || !of_dead().is_empty());
    assert!(running, "the dead replica's run has a pod");
    let mut gone = gws.remove(dead);
    if let Some(pid) = gone.pid() {
        sigkill(pid);
    }
    let _ = gone.terminate();
    double.remove_endpoint_slice("default", &format!("mcp-run-peers-{}", pods[dead]));
    let direct =
        ().serve(StreamableHttpClientTransport::from_uri(gws[0].url("/mcp")))
            .await
            .unwrap();
    let e = direct
        .read_resource(ReadResourceRequestParams::new(kept[2].clone()))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("run the command again"), "{e}");
    for u in &kept[..2] {
        let r = direct
            .read_resource(ReadResourceRequestParams::new(format!("{u}?lines=1-1")))
            .await
            .expect("a live replica's run still reads");
        assert!(text_of(&r).starts_with("run"), "{u}");
    }
    let r = direct
        .call_tool(
            CallToolRequestParams::new("run_network_tool").with_arguments(
                json!({"executable": "echo", "args": ["still here"]})
                    .as_object()
                    .cloned()
                    .unwrap(),
            ),
        )
        .await
        .unwrap();
    assert_eq!(
        r.structured_content.as_ref().unwrap()["outputs"][0]["stdout"],
        "still here\n"
    );
    for gw in gws.iter().chain([&gone]) {
        assert!(!gw.log_text().contains(SECRET), "the secret is in a log");
    }
    let _ = c.cancel().await;
    let _ = direct.cancel().await;
    // Its pod is gone from the EndpointSlices (deleted, not restarting): the live replicas'
    // reapers delete what it left, its in-flight run's pod and any run whose deletion it had
    // not sent yet (a run's pod is deleted after its answer went out).
    let reaped = support::wait_until(Duration::from_secs(20), || of_dead().is_empty());
    assert!(
        reaped,
        "the killed replica's pods are left: {:?}",
        of_dead()
    );
    // Its caller's connection died with it.
    let _ = in_flight.await;
    // The live replicas exit gracefully (SIGTERM; dropping a `Gateway` SIGKILLs it, which
    // would leave the pod of the last run: its deletion is sent after the answer).
    for gw in gws {
        let (status, gw) = support::terminate(gw).await;
        assert!(status.is_some_and(|s| s.success()), "{}", gw.log_text());
    }
    let clean = support::wait_until(Duration::from_secs(20), || {
        double.pod_names("default").is_empty()
    });
    assert!(clean, "pods left: {:?}", double.pod_names("default"));
}

/// Idle warm-pool pods of the double, per gateway (by the pods' `mcp-run.dev/gateway` label).
fn idle_by_gateway(
    double: &crate::kube_double::KubeDouble,
) -> std::collections::BTreeMap<String, usize> {
    let mut by = std::collections::BTreeMap::new();
    for p in double.pods("default") {
        let labels = p.metadata.labels.clone().unwrap_or_default();
        let idle = labels.get("mcp-run.dev/state").map(String::as_str) == Some("idle");
        if idle && p.metadata.deletion_timestamp.is_none() {
            *by.entry(labels["mcp-run.dev/gateway"].clone()).or_default() += 1;
        }
    }
    by
}

/// Two replicas on the kube backend, one API server, a warm pool of 3 and reapers that sweep
/// every second with no minimum age: once the replicas find each other (EndpointSlices),
/// the installation holds 3 idle pods (2 + 1), not 3 per replica, and the surplus goes;
/// concurrent runs through both never share a pod, and no reaper deletes a pod that the
/// other replica runs in (every run ends with its own output and exit 0); the pool refills
/// to 3.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kube_replicas_share_one_warm_pool_and_never_take_or_reap_each_others_pods() {
    let double = crate::kube_double::KubeDouble::start();
    let dir = tempfile::tempdir().unwrap();
    let config = support::config_file(
        &dir,
        "server:\n  peer_service: mcp-run-peers\n\
         kubernetes:\n  reaper_interval_secs: 1\n  reaper_min_age_secs: 0\n\
         profiles:\n  default:\n    image: busybox:1.36\n    warm_pool:\n      size: 3\n",
    );
    let pods = ["gw-a", "gw-b"];
    let peer_ports: Vec<u16> = pods.iter().map(|_| free_port()).collect();
    let gws = kube_replicas(&double, &config, &pods, &peer_ports);
    // Alone (no EndpointSlice lists the other), each keeps the whole pool.
    let both_full = support::wait_until(Duration::from_secs(30), || {
        idle_by_gateway(&double)
            .values()
            .copied()
            .collect::<Vec<_>>()
            == [3, 3]
    });
    assert!(both_full, "{:?}", idle_by_gateway(&double));
    // Listed together: 3 in all, split by the sorted pod names; the surplus is deleted.
    for (pod, port) in pods.iter().zip(&peer_ports) {
        double.put_endpoint_slice("default", peer_slice(pod, *port));
    }
    let want: std::collections::BTreeMap<String, usize> =
        [("gw-a".to_string(), 2), ("gw-b".to_string(), 1)].into();
    let shared = support::wait_until(Duration::from_secs(30), || idle_by_gateway(&double) == want);
    assert!(shared, "{:?}", idle_by_gateway(&double));

    let runs = (0..12).map(|i| {
        let gw = &gws[i % 2];
        async move {
            support::raw(
                gw,
                json!({"executable": "sh", "args": ["-c", "echo $X; sleep 2; echo done"], "env": {"X": format!("run{i}")}}),
            )
            .await
        }
    });
    let results = futures_util::future::join_all(runs).await;
    let mut used = Vec::new();
    for (i, r) in results.iter().enumerate() {
        let pod = r
            .context
            .as_ref()
            .and_then(|c| c.pod.clone())
            .unwrap_or_default();
        let said: Vec<String> = gws
            .iter()
            .flat_map(|g| {
                g.log_text()
                    .lines()
                    .filter(|l| l.contains(&pod))
                    .map(|l| format!("{}: {l}", g.base))
                    .collect::<Vec<_>>()
            })
            .collect();
        assert_eq!(r.code(), Some(0), "run {i}: {r:?}\n{}", said.join("\n"));
        assert_eq!(r.stdout_str(), format!("run{i}\ndone\n"), "run {i}");
        used.push(r.context.as_ref().and_then(|c| c.pod.clone()).expect("pod"));
    }
    let mut unique = used.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), used.len(), "a pod ran two runs: {used:?}");
    // Refilled to the shared size, not to a pool per replica.
    let refilled =
        support::wait_until(Duration::from_secs(30), || idle_by_gateway(&double) == want);
    assert!(refilled, "{:?}", idle_by_gateway(&double));
    let total: usize = idle_by_gateway(&double).values().sum();
    assert_eq!(total, 3);
    // Stopped (SIGTERM), each replica deletes its idle pods.
    for gw in gws {
        let (status, _) = support::terminate(gw).await;
        assert!(status.is_some_and(|s| s.success()));
    }
    let clean = support::wait_until(Duration::from_secs(20), || {
        double.pod_names("default").is_empty()
    });
    assert!(clean, "pods left: {:?}", double.pod_names("default"));
}

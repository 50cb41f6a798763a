//! Issue 24, through the real binaries: a runner (or a gateway in front of one) never writes
//! outside what the caller asked for, and hostile uploads cannot take the gateway's memory.

use crate::support;

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::process::Output;

use mcp_run::contract::{ChangedFile, Event, ExitInfo, RunContext};
use support::{Gateway, config_file};

/// A gateway whose workspace directories and cache are in `dir`.
fn gateway(dir: &tempfile::TempDir, extra: &str, args: &[&str]) -> Gateway {
    let cfg = config_file(
        dir,
        &format!(
            "workspaces:\n  local_dir: {}\n  cache_dir: {}\n{extra}",
            dir.path().join("runs").display(),
            dir.path().join("cache").display()
        ),
    );
    let mut all = vec!["--config", cfg.to_str().unwrap()];
    all.extend_from_slice(args);
    Gateway::start(&all)
}

/// `run-remote` in `cwd` with its own hash cache.
fn run_remote(gw: &Gateway, home: &Path, cwd: &Path, args: &[&str]) -> Output {
    gw.run_remote()
        .env("XDG_CACHE_HOME", home)
        .current_dir(cwd)
        .args(args)
        .output()
        .unwrap()
}

fn sha256(data: &[u8]) -> String {
    mcp_run::hash_bytes(data)
}

/// Every file below `root`, relative.
fn files_below(root: &Path) -> Vec<String> {
    let mut out: Vec<String> = walk(root)
        .into_iter()
        .map(|p| p.strip_prefix(root).unwrap().display().to_string())
        .collect();
    out.sort();
    out
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let t = e.file_type().unwrap();
        if t.is_dir() {
            out.extend(walk(&e.path()));
        } else {
            out.push(e.path());
        }
    }
    out
}

/// Issue 24.1 with a real gateway: a command that writes git hooks and config into the
/// workspace's `.git` does not get them into the caller's `.git`, whatever the globs.
#[test]
fn sync_back_never_writes_into_git() {
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&dir, "", &[]);
    let tree = tempfile::tempdir().unwrap();
    let t = tree.path();
    std::fs::create_dir_all(t.join(".git/hooks")).unwrap();
    std::fs::write(t.join(".git/HEAD"), "ref: refs/heads/main\n").unwrap();
    std::fs::write(t.join(".git/config"), "[core]\n").unwrap();
    std::fs::create_dir_all(t.join("sub")).unwrap();
    std::fs::write(t.join("src.txt"), "x").unwrap();
    let out = run_remote(
        &gw,
        dir.path(),
        t,
        &[
            "--workspace",
            "--sync-back",
            "**",
            "--",
            "sh",
            "-c",
            "mkdir -p .git/hooks sub/.GIT && echo 'touch /tmp/pwned' > .git/hooks/pre-commit && \
             printf '[core]\\n\\tfsmonitor = touch /tmp/pwned\\n' > .git/config && \
             echo x > sub/.GIT/config && echo made > made.txt",
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        !t.join(".git/hooks/pre-commit").exists(),
        "a hook came back"
    );
    assert_eq!(
        std::fs::read_to_string(t.join(".git/config")).unwrap(),
        "[core]\n"
    );
    assert!(!t.join("sub/.GIT").exists(), "{stderr}");
    assert_eq!(
        std::fs::read_to_string(t.join("made.txt")).unwrap(),
        "made\n"
    );
}

/// What the fake gateway serves.
#[derive(Clone)]
struct Served {
    files: Vec<ChangedFile>,
    /// The bytes served for each hash.
    contents: std::collections::HashMap<String, Vec<u8>>,
}

/// A malicious gateway: accepts any manifest, runs nothing, and reports `served.files` as the
/// run's results. Returns its base URL; it lives as long as the test process.
fn fake_gateway(served: Served) -> String {
    use axum::routing::{get, post};
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let raw_served = served.clone();
            let app = axum::Router::new()
                .route(
                    "/workspaces",
                    post(|| async {
                        axum::Json(serde_json::json!({"workspace": "ws_0123456789abcdef0123456789abcdef",
                            "version": "v", "files": 1, "bytes": 1, "missing": [], "missing_bytes": 0}))
                    }),
                )
                .route(
                    "/raw",
                    post(move || {
                        let served = raw_served.clone();
                        async move {
                            let mut body = Vec::new();
                            let context = RunContext {
                                backend: "local".into(),
                                ..Default::default()
                            };
                            for ev in [
                                Event::Started { context },
                                Event::WorkspaceChanges {
                                    workspace: "ws_0123456789abcdef0123456789abcdef".into(),
                                    files: served.files.clone(),
                                    truncated: false,
                                },
                                Event::Exit(ExitInfo {
                                    code: Some(0),
                                    signal: None,
                                    duration_ms: 1,
                                    timed_out: false,
                                }),
                            ] {
                                body.extend_from_slice(&ev.to_line());
                            }
                            ([("content-type", "application/x-ndjson")], body)
                        }
                    }),
                )
                .route(
                    "/workspaces/blobs/{hash}",
                    get(
                        move |axum::extract::Path(hash): axum::extract::Path<String>| {
                            let data = served.contents.get(&hash).cloned().unwrap_or_default();
                            async move { data }
                        },
                    ),
                );
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(listener.local_addr().unwrap()).unwrap();
            axum::serve(listener, app).await.unwrap();
        });
    });
    format!("http://{}", rx.recv().unwrap())
}

/// The results a malicious gateway reports: the good ones, then every kind of bad one.
fn hostile_results() -> Served {
    let mut contents = std::collections::HashMap::new();
    let mut files = Vec::new();
    let mut add = |path: &str, mode: u32, announced: &[u8], served: Vec<u8>| {
        let hash = sha256(announced);
        contents.insert(hash.clone(), served);
        files.push(ChangedFile {
            path: path.into(),
            mode,
            size: announced.len() as u64,
            hash,
        });
    };
    add("target/ok.xml", 0o644, b"ok", b"ok".to_vec());
    add("target/suid.xml", 0o4777, b"suid", b"suid".to_vec());
    add(".git/hooks/pre-commit", 0o755, b"hook", b"hook".to_vec());
    add("target/.Git/config", 0o644, b"cfg", b"cfg".to_vec());
    add("Makefile", 0o644, b"all:", b"all:".to_vec());
    add("target/a\nb.xml", 0o644, b"nl", b"nl".to_vec());
    add("target/\u{1b}[31mred.xml", 0o644, b"esc", b"esc".to_vec());
    add("target/txt\u{202e}lmx.exe", 0o644, b"rlo", b"rlo".to_vec());
    // Announced as one byte, served as 3 MiB (the right byte first).
    let mut big = b"b".to_vec();
    big.resize(3 << 20, b'b');
    add("target/zz-big.xml", 0o644, b"b", big);
    Served { files, contents }
}

/// Issue 24.1 against a malicious gateway: run-remote writes only paths that match the
/// globs it asked for, never into `.git`, never names with control or bidi characters,
/// never more than announced (streamed, not held), and without setuid bits.
#[test]
fn run_remote_refuses_what_it_did_not_ask_for() {
    let base = fake_gateway(hostile_results());
    let tree = tempfile::tempdir().unwrap();
    let t = tree.path();
    std::fs::create_dir_all(t.join(".git/hooks")).unwrap();
    std::fs::write(t.join("src.txt"), "x").unwrap();
    let home = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(support::run_remote_bin())
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("RUN_REMOTE_SERVER", format!("{base}/raw"))
        .env("XDG_CACHE_HOME", home.path())
        .current_dir(t)
        .args(["--workspace", "--sync-back", "target/*.xml", "--", "true"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("sync_back") || stderr.contains("sync-back"),
        "{stderr}"
    );
    assert_eq!(
        files_below(t),
        ["src.txt", "target/ok.xml", "target/suid.xml"],
        "{stderr}"
    );
    let mode = std::fs::metadata(t.join("target/suid.xml"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o7777, 0o755, "{mode:o}");
    assert!(stderr.contains("more than the 1 bytes"), "{stderr}");
}

/// Issue 24.1 on the remote backend: a gateway in front of a malicious upstream keeps (and
/// reports to its client) only the results the request's globs and the rules allow.
#[tokio::test]
async fn a_remote_backend_gateway_keeps_only_acceptable_results() {
    let base = fake_gateway(hostile_results());
    let dir = tempfile::tempdir().unwrap();
    let raw = format!("{base}/raw");
    let front = gateway(&dir, "", &["--backend", "remote", "--server", &raw]);
    // A workspace on the front gateway (one small file).
    let http = support::http();
    let data = b"x";
    let manifest =
        serde_json::json!({"entries": [{"path": "src.txt", "size": 1, "hash": sha256(data)}]});
    let posted: serde_json::Value = http
        .post(front.url("/workspaces"))
        .json(&manifest)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = posted["workspace"].as_str().unwrap().to_string();
    let put = http
        .put(front.url(&format!("/workspaces/{id}/blobs/{}", sha256(data))))
        .body(&data[..])
        .send()
        .await
        .unwrap();
    assert!(put.status().is_success());
    let run = support::raw(
        &front,
        serde_json::json!({"executable": "true", "workspace": id, "sync_back": ["target/*.xml"]}),
    )
    .await;
    let changes = run
        .events
        .iter()
        .find_map(|e| match e {
            Event::WorkspaceChanges { files, .. } => Some(files.clone()),
            _ => None,
        })
        .expect("workspace_changes");
    let kept: Vec<(String, u32)> = changes.iter().map(|f| (f.path.clone(), f.mode)).collect();
    assert_eq!(
        kept,
        [
            ("target/ok.xml".to_string(), 0o644),
            ("target/suid.xml".to_string(), 0o755)
        ]
    );
}

/// `(VmRSS, VmHWM)` of a process in MiB.
fn memory_mib(pid: u32) -> (f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .unwrap_or(0.0)
            / 1024.0
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// A gzip stream of `header` followed by `len` bytes of `fill`, made as it goes.
fn gzip_of(header: &[u8], len: u64, fill: u8) -> Vec<u8> {
    use std::io::Write as _;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(header).unwrap();
    let chunk = vec![fill; 1 << 20];
    let mut left = len;
    while left > 0 {
        let k = left.min(chunk.len() as u64) as usize;
        gz.write_all(&chunk[..k]).unwrap();
        left -= k as u64;
    }
    gz.finish().unwrap()
}

/// A tar header block of `kind` announcing `size` bytes of data.
fn tar_header(kind: u8, name: &str, size: u64) -> Vec<u8> {
    let mut h = tar::Header::new_gnu();
    h.set_path(name).unwrap();
    h.set_size(size);
    h.set_mode(0o644);
    h.set_entry_type(tar::EntryType::new(kind));
    h.set_cksum();
    h.as_bytes().to_vec()
}

/// Posts a one-file workspace; its id.
async fn small_workspace(gw: &Gateway, token: Option<&str>) -> String {
    let manifest = serde_json::json!({"entries": [{"path": "f", "size": 1, "hash": sha256(b"x")}]});
    let mut req = support::http().post(gw.url("/workspaces")).json(&manifest);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let posted: serde_json::Value = req.send().await.unwrap().json().await.unwrap();
    posted["workspace"].as_str().unwrap().to_string()
}

/// Issue 24.2: GNU long-name and PAX headers announcing hundreds of MiB (a few hundred KiB of
/// gzip) are refused before they are read into memory; the gateway's peak stays within
/// 32 MiB of its idle size.
#[tokio::test]
async fn tar_long_name_and_pax_bombs_are_refused_without_memory() {
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&dir, "", &[]);
    let id = small_workspace(&gw, None).await;
    let pid = gw.pid().unwrap();
    let (idle, _) = memory_mib(pid);
    for (kind, what) in [
        (b'L', "GNU long name"),
        (b'x', "PAX header"),
        (b'K', "GNU long link"),
    ] {
        // 96 MiB announced and sent: whole in memory without the cap.
        let body = gzip_of(&tar_header(kind, "././@LongLink", 96 << 20), 96 << 20, b'a');
        assert!(body.len() < 1 << 20, "{}", body.len());
        let resp = support::http()
            .post(gw.url(&format!("/workspaces/{id}/blobs")))
            .header("content-encoding", "gzip")
            .header("content-type", "application/x-tar")
            .body(body)
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        let (rss, peak) = memory_mib(pid);
        eprintln!("{what} bomb: idle {idle:.1} MiB, now {rss:.1} MiB, peak {peak:.1} MiB");
        assert!(
            peak - idle < 32.0,
            "peak {peak:.1} MiB against idle {idle:.1} MiB"
        );
        assert_eq!(status, 400, "{text}");
        assert!(text.contains(what), "{text}");
    }
}

/// A manifest of `n` files sharing one empty content, as gzip JSON; `tag` makes it unique.
fn wide_manifest(n: usize, tag: &str) -> Vec<u8> {
    use std::io::Write as _;
    let empty = sha256(b"");
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(b"{\"entries\":[").unwrap();
    for i in 0..n {
        let sep = if i == 0 { "" } else { "," };
        write!(
            gz,
            r#"{sep}{{"path":"{tag}/d{}/f{i}","size":0,"hash":"{empty}"}}"#,
            i / 100
        )
        .unwrap();
    }
    gz.write_all(b"]}").unwrap();
    gz.finish().unwrap()
}

async fn post_gzip_manifest(gw: &Gateway, token: Option<&str>, body: Vec<u8>) -> (u16, String) {
    let mut req = support::http()
        .post(gw.url("/workspaces"))
        .header("content-type", "application/json")
        .header("content-encoding", "gzip")
        .body(body);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let resp = req.send().await.unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

/// Issue 24.3: registered manifests are bounded in memory as a whole
/// (`workspaces.max_registry_bytes`), a single one over the bound is refused with 413 naming
/// it, and a symlink target over PATH_MAX is refused while parsing; the gateway's peak
/// stays within 32 MiB of idle.
#[tokio::test]
async fn registered_manifests_and_symlink_targets_are_bounded_in_memory() {
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&dir, "  max_registry_bytes: 8388608\n", &[]);
    let pid = gw.pid().unwrap();
    let (idle, _) = memory_mib(pid);
    // Each about 5 MiB registered: the registry keeps one of them.
    for i in 0..8 {
        let (status, text) =
            post_gzip_manifest(&gw, None, wide_manifest(20_000, &format!("t{i}"))).await;
        assert_eq!(status, 200, "{text}");
    }
    let (rss, peak) = memory_mib(pid);
    eprintln!(
        "8 manifests of 20,000 files: idle {idle:.1} MiB, now {rss:.1} MiB, peak {peak:.1} MiB"
    );
    assert!(
        peak - idle < 32.0,
        "peak {peak:.1} MiB against idle {idle:.1} MiB"
    );

    let (status, text) = post_gzip_manifest(&gw, None, wide_manifest(60_000, "big")).await;
    assert_eq!(status, 413, "{text}");
    assert!(text.contains("workspaces.max_registry_bytes"), "{text}");
    let (rss, peak) = memory_mib(pid);
    eprintln!("and one of 60,000 files (refused): now {rss:.1} MiB, peak {peak:.1} MiB");
    assert!(
        peak - idle < 32.0,
        "peak {peak:.1} MiB against idle {idle:.1} MiB"
    );
    drop(gw);

    // Symlink targets of 32 MiB (a few KiB of gzip each), on a fresh gateway.
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&dir, "", &[]);
    let pid = gw.pid().unwrap();
    let (idle, _) = memory_mib(pid);
    let body = {
        use std::io::Write as _;
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(br#"{"entries":[{"path":"l","kind":"symlink","target":""#)
            .unwrap();
        let chunk = "a".repeat(1 << 20);
        for _ in 0..32 {
            gz.write_all(chunk.as_bytes()).unwrap();
        }
        gz.write_all(b"\"}]}").unwrap();
        gz.finish().unwrap()
    };
    for _ in 0..4 {
        let (status, text) = post_gzip_manifest(&gw, None, body.clone()).await;
        assert_eq!(status, 413, "{text}");
        assert!(text.contains("PATH_MAX"), "{text}");
    }
    let (rss, peak) = memory_mib(pid);
    eprintln!(
        "4 symlink targets of 32 MiB: idle {idle:.1} MiB, now {rss:.1} MiB, peak {peak:.1} MiB"
    );
    assert!(
        peak - idle < 32.0,
        "peak {peak:.1} MiB against idle {idle:.1} MiB"
    );
}

const ALICE: &str = "alice-token-0123456789abcdef";
const BOB: &str = "bob-token-0123456789abcdef01";

/// Posts a workspace of one file as `token` and uploads its content: the id.
async fn owned_workspace(gw: &Gateway, token: &str, name: &str, data: &[u8]) -> String {
    let http = support::http();
    let manifest =
        serde_json::json!({"entries": [{"path": name, "size": data.len(), "hash": sha256(data)}]});
    let posted: serde_json::Value = http
        .post(gw.url("/workspaces"))
        .bearer_auth(token)
        .json(&manifest)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = posted["workspace"].as_str().expect("workspace").to_string();
    let put = http
        .put(gw.url(&format!("/workspaces/{id}/blobs/{}", sha256(data))))
        .bearer_auth(token)
        .body(data.to_vec())
        .send()
        .await
        .unwrap();
    assert!(put.status().is_success(), "{}", put.text().await.unwrap());
    id
}

/// Issue 24.5: one identity's uploads and manifests do not evict another's contents or
/// workspaces while that one holds no more than its share.
#[tokio::test]
async fn one_identity_cannot_evict_another() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config_file(
        &dir,
        &format!(
            "local:\n  allow_multiple_identities: true\nworkspaces:\n  local_dir: {}\n  cache_dir: {}\n  max_cache_bytes: 4194304\n  max_file_bytes: 1048576\n  max_workspaces: 4\n",
            dir.path().join("runs").display(),
            dir.path().join("cache").display()
        ),
    );
    let gw = Gateway::start_with_env(
        &["--config", cfg.to_str().unwrap()],
        &[("MCP_RUN_AUTH_TOKENS", &format!("alice:{ALICE},bob:{BOB}"))],
    );
    let mine = owned_workspace(&gw, ALICE, "mine.txt", b"alice's file\n").await;
    // Bob: 12 MiB of uploads in 12 workspaces.
    for i in 0..12u8 {
        let data = vec![i; 1 << 20];
        owned_workspace(&gw, BOB, &format!("b{i}"), &data).await;
    }
    let resp = support::http()
        .post(gw.raw_url())
        .bearer_auth(ALICE)
        .json(&serde_json::json!({"executable": "cat", "args": ["mine.txt"], "workspace": mine}))
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap();
    assert_eq!(status, 200, "{text}");
    assert!(text.contains(r#""type":"exit""#), "{text}");
    assert!(text.contains(&base64_of(b"alice's file\n")), "{text}");
}

fn base64_of(data: &[u8]) -> String {
    base64_simd::STANDARD.encode_to_string(data)
}

/// Issue 24.10: symlink chains are resolved (`a/b -> ..` then `s -> a/b/..` leaves the
/// tree although each is lexically inside), and an upload over `server.max_body_bytes`
/// is accepted with a Content-Length as it is chunked.
#[tokio::test]
async fn chained_symlinks_are_refused_and_declared_lengths_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&dir, "", &[]);
    let manifest = serde_json::json!({"entries": [
        {"path": "a/b", "kind": "symlink", "target": ".."},
        {"path": "s", "kind": "symlink", "target": "a/b/.."},
    ]});
    let resp = support::http()
        .post(gw.url("/workspaces"))
        .json(&manifest)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap();
    assert_eq!(status, 400, "{text}");
    assert!(text.contains(r#"\"s\" -> \"a/b/..\""#), "{text}");

    // 1.5 MiB with a Content-Length (reqwest sends one for a byte body).
    let data = vec![b'z'; 3 << 19];
    let id = owned_workspace_anon(&gw, &data).await;
    let run = support::raw(
        &gw,
        serde_json::json!({"executable": "wc", "args": ["-c", "f"], "workspace": id}),
    )
    .await;
    assert_eq!(
        run.stdout_str(),
        format!("{} f\n", 3 << 19),
        "{:?}",
        run.events
    );
}

/// [`owned_workspace`] without auth, named `f`.
async fn owned_workspace_anon(gw: &Gateway, data: &[u8]) -> String {
    let http = support::http();
    let manifest =
        serde_json::json!({"entries": [{"path": "f", "size": data.len(), "hash": sha256(data)}]});
    let posted: serde_json::Value = http
        .post(gw.url("/workspaces"))
        .json(&manifest)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = posted["workspace"].as_str().expect("workspace").to_string();
    let put = http
        .put(gw.url(&format!("/workspaces/{id}/blobs/{}", sha256(data))))
        .body(data.to_vec())
        .send()
        .await
        .unwrap();
    let status = put.status();
    assert!(
        status.is_success(),
        "{status}: {}",
        put.text().await.unwrap()
    );
    id
}

/// Entries of `dir` whose names start with `mcp-run-`.
fn ours(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("mcp-run-"))
        .collect();
    v.sort();
    v
}

/// Issue 24.10: what a SIGKILLed gateway left in `$TMPDIR` (its cache, kept outputs, idle
/// trees) is removed, and a starting gateway removes what dead gateways left there.
#[tokio::test]
async fn leftovers_of_killed_gateways_are_removed() {
    let tmp = tempfile::tempdir().unwrap();
    let tmpdir = tmp.path().to_str().unwrap().to_string();
    // Left by a gateway that is long gone (no lock file, no such process).
    std::fs::create_dir_all(tmp.path().join("mcp-run-ws-4999999-00ff/d")).unwrap();
    std::fs::write(tmp.path().join("mcp-run-ws-4999999-00ff/d/f"), "x").unwrap();
    std::fs::create_dir_all(tmp.path().join("mcp-run-cache-4999999/blobs")).unwrap();
    std::fs::create_dir_all(tmp.path().join("mcp-run-ws-0123456789abcdef")).unwrap();
    let gw = Gateway::start_with_env(&[], &[("TMPDIR", &tmpdir)]);
    let pid = gw.pid().unwrap();
    let swept = support::wait_until(std::time::Duration::from_secs(10), || {
        !ours(tmp.path()).iter().any(|n| n.contains("4999999"))
    });
    assert!(swept, "{:?}", ours(tmp.path()));
    assert!(
        tmp.path().join("mcp-run-ws-0123456789abcdef").exists(),
        "a directory without a pid is not judged"
    );
    // A run with a workspace leaves an idle tree, the cache and the output store.
    let id = owned_workspace_anon(&gw, b"data").await;
    let run = support::raw(
        &gw,
        serde_json::json!({"executable": "cat", "args": ["f"], "workspace": id}),
    )
    .await;
    assert_eq!(run.stdout_str(), "data");
    let mine = |names: Vec<String>| -> Vec<String> {
        names
            .into_iter()
            .filter(|n| n.contains(&format!("-{pid}")))
            .collect()
    };
    assert!(
        support::wait_until(std::time::Duration::from_secs(10), || {
            let m = mine(ours(tmp.path()));
            m.iter().any(|n| n.starts_with("mcp-run-ws-"))
                && m.iter().any(|n| n.starts_with("mcp-run-cache-"))
        }),
        "{:?}",
        ours(tmp.path())
    );
    drop(gw); // SIGKILL
    let gw2 = Gateway::start_with_env(&[], &[("TMPDIR", &tmpdir)]);
    let gone = support::wait_until(std::time::Duration::from_secs(20), || {
        mine(ours(tmp.path())).is_empty()
    });
    assert!(gone, "left: {:?}", ours(tmp.path()));
    drop(gw2);
}

/// Issue 24.4: the directories a manifest implies count against `workspaces.max_files`, and
/// concurrent runs on the local backend together materialise at most
/// `workspaces.max_local_inodes` files and directories.
#[tokio::test]
async fn inodes_are_bounded_per_workspace_and_across_concurrent_runs() {
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&dir, "  max_files: 6000\n  max_local_inodes: 8000\n", &[]);
    // 4,000 files, each two directories deep of its own: 8,000 directories.
    let empty = sha256(b"");
    let deep: Vec<serde_json::Value> = (0..4000)
        .map(|i| serde_json::json!({"path": format!("d{i}/e/f"), "size": 0, "hash": empty}))
        .collect();
    let resp = support::http()
        .post(gw.url("/workspaces"))
        .json(&serde_json::json!({ "entries": deep }))
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap();
    assert_eq!(status, 413, "{text}");
    assert!(
        text.contains("directories") && text.contains("workspaces.max_files"),
        "{text}"
    );

    // 5,000 files in 50 directories: one run fits, a second at the same time does not.
    let (status, text) = post_gzip_manifest(&gw, None, wide_manifest(5000, "w")).await;
    assert_eq!(status, 200, "{text}");
    let id = serde_json::from_str::<serde_json::Value>(&text).unwrap()["workspace"]
        .as_str()
        .unwrap()
        .to_string();
    let put = support::http()
        .put(gw.url(&format!("/workspaces/{id}/blobs/{empty}")))
        .body(Vec::new())
        .send()
        .await
        .unwrap();
    assert!(put.status().is_success());
    let body = serde_json::json!({"executable": "sleep", "args": ["60"], "workspace": id});
    let mut first = support::http()
        .post(gw.raw_url())
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(first.status().as_u16(), 200);
    let mut seen = String::new();
    while !seen.contains(r#""type":"started""#) {
        let chunk = first.chunk().await.unwrap().expect("started");
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    let second = support::http()
        .post(gw.raw_url())
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = second.status().as_u16();
    let text = second.text().await.unwrap();
    assert_eq!(status, 429, "{text}");
    assert!(text.contains("workspaces.max_local_inodes"), "{text}");
    drop(first);
    // Once the first run is gone, its share is free again.
    let mut ok = false;
    for _ in 0..100 {
        let r = support::http()
            .post(gw.raw_url())
            .json(&serde_json::json!({"executable": "true", "workspace": id}))
            .send()
            .await
            .unwrap();
        if r.status().as_u16() == 200 {
            ok = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(ok, "the first run's inodes were not given back");
}

/// Issue 24.1: run-remote streams a result into its file instead of holding it: a 48 MiB
/// result leaves its peak memory below the file's size.
#[test]
fn run_remote_streams_large_results() {
    let size = 48usize << 20;
    let data = vec![0x5au8; size];
    let hash = sha256(&data);
    let mut contents = std::collections::HashMap::new();
    contents.insert(hash.clone(), data);
    let base = fake_gateway(Served {
        files: vec![ChangedFile {
            path: "target/big.bin".into(),
            mode: 0o644,
            size: size as u64,
            hash,
        }],
        contents,
    });
    let tree = tempfile::tempdir().unwrap();
    std::fs::write(tree.path().join("src.txt"), "x").unwrap();
    let home = tempfile::tempdir().unwrap();
    // Through a small python process that reports its child's peak: a child forked from
    // this test process would count this process's memory at the fork.
    const MEASURE: &str = "import resource, subprocess, sys\n\
        r = subprocess.run(sys.argv[1:])\n\
        print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n\
        sys.exit(r.returncode)\n";
    let out = std::process::Command::new("python3")
        .args(["-c", MEASURE])
        .arg(support::run_remote_bin())
        .args(["--workspace", "--sync-back", "target/*", "--", "true"])
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("RUN_REMOTE_SERVER", format!("{base}/raw"))
        .env("XDG_CACHE_HOME", home.path())
        .current_dir(tree.path())
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let peak_kib: f64 = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .and_then(|l| l.trim().parse().ok())
        .expect("the peak");
    let written = std::fs::metadata(tree.path().join("target/big.bin"))
        .unwrap()
        .len();
    assert_eq!(written, size as u64);
    let peak_mib = peak_kib / 1024.0;
    eprintln!("run-remote peak while syncing back 48 MiB: {peak_mib:.1} MiB");
    assert!(peak_mib < 40.0, "run-remote peaked at {peak_mib:.1} MiB");
}

//! `pods/exec` over WebSocket: the remotecommand channel protocols, backed by a local process.

use std::os::unix::process::ExitStatusExt;
use std::path::Path as FsPath;
use std::process::Stdio;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade, close_code};
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, Method, header};
use axum::response::{IntoResponse, Response};
use futures_util::{SinkExt, StreamExt};
use k8s_openapi::api::core::v1::Pod;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

use super::server::{first, flag, parse_query};
use super::status::{ApiError, Cause, Details, Empty, Status};
use super::{ExecEntry, Shared};

const STDIN: u8 = 0;
const STDOUT: u8 = 1;
const STDERR: u8 = 2;
const ERROR: u8 = 3;
const RESIZE: u8 = 4;
/// v5: "close this stream", the stream id in the next byte.
const CLOSE: u8 = 255;

/// The negotiated subprotocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proto {
    /// `channel.k8s.io`, also what an upgrade without any protocol gets.
    V1,
    /// `base64.channel.k8s.io`.
    V1Base64,
    V4,
    V4Base64,
    V5,
}

impl Proto {
    fn name(self) -> &'static str {
        match self {
            Proto::V1 => "channel.k8s.io",
            Proto::V1Base64 => "base64.channel.k8s.io",
            Proto::V4 => "v4.channel.k8s.io",
            Proto::V4Base64 => "v4.base64.channel.k8s.io",
            Proto::V5 => "v5.channel.k8s.io",
        }
    }

    fn base64(self) -> bool {
        matches!(self, Proto::V1Base64 | Proto::V4Base64)
    }

    /// v4 and later send a JSON Status on the error channel; earlier ones the bare message.
    fn status_json(self) -> bool {
        matches!(self, Proto::V4 | Proto::V4Base64 | Proto::V5)
    }
}

/// Picks the protocol as the API server does: v5 whenever it is offered (the API server
/// serves that one itself), otherwise the first offered that the kubelet knows. `Ok(None)`:
/// no protocol was offered at all.
pub fn negotiate(headers: &HeaderMap, served: &[String]) -> Result<Option<Proto>, Vec<String>> {
    let serves = |p: Proto| served.iter().any(|s| s == p.name());
    let offered: Vec<String> = headers
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|p| p.trim().to_string())
        .filter(|p| !p.is_empty())
        .collect();
    if offered.is_empty() {
        return Ok(None);
    }
    if serves(Proto::V5) && offered.iter().any(|p| p == Proto::V5.name()) {
        return Ok(Some(Proto::V5));
    }
    for p in &offered {
        for cand in [Proto::V4, Proto::V4Base64, Proto::V1, Proto::V1Base64] {
            if p == cand.name() && serves(cand) {
                return Ok(Some(cand));
            }
        }
    }
    Err(offered)
}

struct Request {
    argv: Vec<String>,
    container: String,
    stdin: bool,
    stdout: bool,
    stderr: bool,
    tty: bool,
}

fn container_running(pod: &Pod, container: &str) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.name == container))
        .and_then(|c| c.state.as_ref())
        .is_some_and(|st| st.running.is_some())
}

/// Validates the request the way the API server's exec REST handler and the kubelet do.
fn check(
    shared: &Shared,
    ns: &str,
    name: &str,
    raw: Option<&str>,
) -> Result<(Request, Pod), ApiError> {
    let q = parse_query(raw);
    let argv: Vec<String> = q
        .iter()
        .filter(|(k, _)| k == "command")
        .map(|(_, v)| v.clone())
        .collect();
    let (stdin, stdout, stderr) = (flag(&q, "stdin"), flag(&q, "stdout"), flag(&q, "stderr"));
    let tty = flag(&q, "tty");
    let pod = shared
        .lock()
        .pods
        .get(&(ns.to_string(), name.to_string()))
        .cloned()
        .ok_or_else(|| ApiError::not_found("pods", name))?;
    let names: Vec<String> = pod
        .spec
        .as_ref()
        .map(|s| s.containers.iter().map(|c| c.name.clone()).collect())
        .unwrap_or_default();
    let container = match first(&q, "container") {
        Some(c) if !c.is_empty() => {
            if !names.iter().any(|n| n == c) {
                return Err(ApiError::bad_request(format!(
                    "container {c} is not valid for pod {name}"
                )));
            }
            c.to_string()
        }
        _ if names.len() == 1 => names[0].clone(),
        _ => {
            return Err(ApiError::bad_request(format!(
                "a container name must be specified for pod {name}, choose one of: [{}]",
                names.join(" ")
            )));
        }
    };
    if pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.as_ref())
        .is_none()
    {
        return Err(ApiError::bad_request(format!(
            "pod {name} does not have a host assigned"
        )));
    }
    if argv.is_empty() {
        return Err(ApiError::bad_request(
            "you must specify at least one command for the container",
        ));
    }
    if !stdin && !stdout && !stderr {
        return Err(ApiError::bad_request(
            "you must specify at least 1 of stdin, stdout, stderr",
        ));
    }
    Ok((
        Request {
            argv,
            container,
            stdin,
            stdout,
            // Like the kubelet: with a terminal there is no separate stderr stream.
            stderr: stderr && !tty,
            tty,
        },
        pod,
    ))
}

pub async fn exec(
    State(shared): State<Arc<Shared>>,
    Path((ns, name)): Path<(String, String)>,
    RawQuery(raw): RawQuery,
    method: Method,
    headers: HeaderMap,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    if method != Method::GET && method != Method::POST {
        return ApiError::method_not_allowed().into_response();
    }
    let (req, pod) = match check(&shared, &ns, &name, raw.as_deref()) {
        Ok(x) => x,
        Err(e) => return e.into_response(),
    };
    let Ok(mut ws) = ws else {
        return ApiError::bad_request("Upgrade request required").into_response();
    };
    let delay = shared.lock().faults.exec_delay.take();
    if let Some(d) = delay {
        // Fault injection: a slow kubelet or API server.
        tokio::time::sleep(d).await;
    }
    let running = container_running(&pod, &req.container);
    let not_found = format!("container not found ({:?})", req.container);
    let proto = match negotiate(&headers, &shared.opts.exec_protocols) {
        // v5 is upgraded by the API server's stream translator before it dials the kubelet,
        // so a kubelet refusal arrives as a status frame (see `Outcome::UpgradeFailed`).
        Ok(Some(Proto::V5)) => {
            ws.set_selected_protocol(HeaderValue::from_static(Proto::V5.name()));
            Proto::V5
        }
        // Otherwise the kubelet answers directly: its container lookup comes before the
        // WebSocket handshake, and its plain-text error is passed through.
        _ if !running => return plain(500, not_found),
        Ok(Some(p)) => {
            ws.set_selected_protocol(HeaderValue::from_static(p.name()));
            p
        }
        Ok(None) => Proto::V1,
        Err(offered) => {
            // golang.org/x/net/websocket answers a failed subprotocol handshake with 403.
            return plain(
                403,
                format!(
                    "requested protocol(s) are not supported: [{}]; supports [channel.k8s.io base64.channel.k8s.io v4.channel.k8s.io v4.base64.channel.k8s.io]",
                    offered.join(" ")
                ),
            );
        }
    };
    let refused = (!running).then(|| format!("unable to upgrade connection: {not_found}"));
    let spec = pod
        .spec
        .as_ref()
        .and_then(|s| s.containers.iter().find(|c| c.name == req.container))
        .cloned()
        .unwrap_or_default();
    let mut env: Vec<(String, String)> = spec
        .env
        .iter()
        .flatten()
        .filter(|e| e.value_from.is_none())
        .map(|e| (e.name.clone(), e.value.clone().unwrap_or_default()))
        .collect();
    let image_fs = image_fs(&shared, &spec.image.clone().unwrap_or_default());
    let container = shared
        .opts
        .containers
        .then(|| pod.metadata.uid.clone())
        .flatten();
    // In a real container the image's own PATH applies.
    if container.is_none() && !env.iter().any(|(k, _)| k == "PATH") {
        let path = match &image_fs {
            Some(bin) => bin.display().to_string(),
            None => std::env::var("PATH").unwrap_or_default(),
        };
        env.push(("PATH".into(), path));
    }
    let user = if shared.opts.run_as_pod_user {
        pod_user(&pod, &spec)
    } else {
        None
    };
    let cwd = spec
        .working_dir
        .filter(|d| !d.is_empty())
        .unwrap_or_else(|| "/".into());
    ws.on_upgrade(move |socket| async move {
        let session = Session {
            shared,
            ns,
            pod: name,
            proto,
            req,
            env,
            cwd,
            refused,
            user,
            image_fs,
            container,
        };
        session.run(socket).await;
    })
}

struct Session {
    shared: Arc<Shared>,
    ns: String,
    pod: String,
    proto: Proto,
    req: Request,
    env: Vec<(String, String)>,
    cwd: String,
    /// The kubelet refused the stream (v5 only; the socket is already upgraded).
    refused: Option<String>,
    /// `(uid, gid)` the process runs as (`DoubleOptions::run_as_pod_user`).
    user: Option<(u32, u32)>,
    /// The imitated image's programs (`image_fs`), or the host's.
    image_fs: Option<std::path::PathBuf>,
    /// The pod's uid when its container is real (`podman.rs`): the exec runs in it.
    container: Option<String>,
}

/// With `run_as_pod_user`, when the double runs as root: the uid and gid of the container's
/// (else the pod's) security context, as the runtime would use them; and, as the kubelet
/// does when it sets up the pod, each `emptyDir` mount created world-writable (0777) if it
/// does not exist yet. Without a runAsUser (or not root) processes run as the double's user.
fn pod_user(pod: &Pod, container: &k8s_openapi::api::core::v1::Container) -> Option<(u32, u32)> {
    use std::os::unix::fs::PermissionsExt as _;
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { nix::libc::geteuid() } != 0 {
        return None;
    }
    let spec = pod.spec.as_ref()?;
    let empty_dirs: Vec<&str> = spec
        .volumes
        .iter()
        .flatten()
        .filter(|v| v.empty_dir.is_some())
        .map(|v| v.name.as_str())
        .collect();
    for m in container.volume_mounts.iter().flatten() {
        let dir = FsPath::new(&m.mount_path);
        if empty_dirs.contains(&m.name.as_str()) && !dir.exists() {
            let _ = std::fs::create_dir_all(dir);
            let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777));
        }
    }
    let csc = container.security_context.as_ref();
    let psc = spec.security_context.as_ref();
    let uid = csc
        .and_then(|s| s.run_as_user)
        .or_else(|| psc.and_then(|s| s.run_as_user))?;
    let gid = csc
        .and_then(|s| s.run_as_group)
        .or_else(|| psc.and_then(|s| s.run_as_group))
        .unwrap_or(0);
    Some((u32::try_from(uid).ok()?, u32::try_from(gid).ok()?))
}

fn plain(code: u16, text: String) -> Response {
    let code = axum::http::StatusCode::from_u16(code)
        .unwrap_or(axum::http::StatusCode::INTERNAL_SERVER_ERROR);
    (
        code,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        text,
    )
        .into_response()
}

/// Removes the exec from the registry however the session ends.
struct Registered {
    shared: Arc<Shared>,
    id: u64,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.shared.lock().execs.remove(&self.id);
    }
}

fn frame(proto: Proto, ch: u8, data: &[u8]) -> Message {
    if proto.base64() {
        let mut s = String::with_capacity(1 + data.len() * 4 / 3 + 4);
        s.push((b'0' + ch) as char);
        s.push_str(&base64_simd::STANDARD.encode_to_string(data));
        Message::text(s)
    } else {
        let mut v = Vec::with_capacity(data.len() + 1);
        v.push(ch);
        v.extend_from_slice(data);
        Message::binary(v)
    }
}

/// A 64-hex-digit exec id, as containerd names exec processes.
fn exec_id() -> String {
    format!(
        "{}{}",
        super::pods::new_uid().replace('-', ""),
        super::pods::new_uid().replace('-', "")
    )
}

/// What runc reports when the process cannot be started, wrapped as containerd and the CRI
/// streaming server wrap it; a missing program in the words of `runtime`.
fn start_error(argv0: &str, cwd: &str, err: &std::io::Error, runtime: super::Runtime) -> String {
    if FsPath::new(cwd).is_dir() && err.kind() == std::io::ErrorKind::NotFound {
        let exec = exec_id();
        match runtime {
            super::Runtime::Runc => {}
            super::Runtime::Kata => {
                return format!(
                    "error executing command in container: failed to exec in container: failed to start exec \"{exec}\": Others(\"failed to handler message handler request\\n\\nCaused by:\\n    0: start process\\n    1: start\\n    2: enter process\\n    3: exec process\\n    4: rpc status: code: INTERNAL message: \\\"the file {argv0} was not found\\\"\"): unknown"
                );
            }
            super::Runtime::Opaque => {
                return format!(
                    "error executing command in container: failed to exec in container: failed to start exec \"{exec}\": exec of \"{argv0}\" refused: unknown"
                );
            }
        }
    }
    let cause = if !FsPath::new(cwd).is_dir() {
        format!("chdir to cwd (\"{cwd}\") set in config.json failed: no such file or directory")
    } else {
        match err.kind() {
            std::io::ErrorKind::NotFound if argv0.contains('/') => {
                format!("exec: \"{argv0}\": stat {argv0}: no such file or directory")
            }
            std::io::ErrorKind::NotFound => {
                format!("exec: \"{argv0}\": executable file not found in $PATH")
            }
            std::io::ErrorKind::PermissionDenied => format!("exec: \"{argv0}\": permission denied"),
            _ => format!("exec: \"{argv0}\": {err}"),
        }
    };
    format!(
        "error executing command in container: failed to exec in container: failed to start exec \"{}\": OCI runtime exec failed: exec failed: unable to start container process: {cause}: unknown",
        exec_id()
    )
}

/// The error-channel payload for the outcome (None: nothing is sent).
fn status_payload(proto: Proto, outcome: &Outcome, argv: &[String]) -> Option<String> {
    let text = match outcome {
        Outcome::Exit(0) => {
            if !proto.status_json() {
                return None;
            }
            let s = Status {
                kind: None,
                api_version: None,
                metadata: Empty {},
                status: "Success",
                message: None,
                reason: None,
                details: None,
                code: None,
            };
            return serde_json::to_string(&s).ok();
        }
        Outcome::Exit(code) => {
            // The CRI runtime's exit error; v5 is answered by the API server's stream
            // translator, which re-wraps the exit error its SPDY client decoded.
            let message = if proto == Proto::V5 {
                format!(
                    "command terminated with non-zero exit code: command terminated with exit code {code}"
                )
            } else {
                format!(
                    "command terminated with non-zero exit code: error executing command [{}], exit code {code}",
                    argv.join(" ")
                )
            };
            if !proto.status_json() {
                return Some(message);
            }
            let details = Details {
                causes: vec![Cause::new(Some("ExitCode"), &code.to_string(), None)],
                ..Details::default()
            };
            let s = Status {
                kind: None,
                api_version: None,
                metadata: Empty {},
                status: "Failure",
                message: Some(&message),
                reason: Some("NonZeroExitCode"),
                details: Some(&details),
                code: None,
            };
            return serde_json::to_string(&s).ok();
        }
        Outcome::StartFailed(err) => err,
        Outcome::UpgradeFailed(err) => {
            let e = ApiError::internal(err);
            let s = Status {
                kind: None,
                api_version: None,
                metadata: Empty {},
                status: "Failure",
                message: Some(&e.message),
                reason: Some(e.reason),
                details: e.details.as_ref(),
                code: Some(e.code),
            };
            return serde_json::to_string(&s).ok();
        }
    };
    let mut e = ApiError::internal(text);
    if proto == Proto::V5 {
        // The translator's SPDY client turns the kubelet's Status into an error carrying its
        // message, which the translator wraps in an InternalError once more.
        e = ApiError::internal(&e.message);
    }
    if !proto.status_json() {
        return Some(e.message);
    }
    // The streaming server writes the Status without kind/apiVersion.
    let s = Status {
        kind: None,
        api_version: None,
        metadata: Empty {},
        status: "Failure",
        message: Some(&e.message),
        reason: Some(e.reason),
        details: e.details.as_ref(),
        code: Some(e.code),
    };
    serde_json::to_string(&s).ok()
}

enum Outcome {
    Exit(i32),
    /// The runtime could not start the process.
    StartFailed(String),
    /// v5: the translator's SPDY connection to the kubelet was refused.
    UpgradeFailed(String),
}

/// Forwards one pipe as frames; one read per sent frame, so a slow client slows the reader.
async fn pump(mut r: impl AsyncRead + Unpin, ch: u8, proto: Proto, tx: mpsc::Sender<Message>) {
    let mut buf = vec![0u8; 32 * 1024];
    loop {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if tx.send(frame(proto, ch, &buf[..n])).await.is_err() {
                    return;
                }
            }
        }
    }
}

fn killpg(pgid: i32) {
    let _ = nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(pgid),
        nix::sys::signal::Signal::SIGKILL,
    );
}

/// Traffic on one exec WebSocket, for a load balancer's idle cut
/// (`DoubleOptions::idle_timeout`): frames either way, pings included, count as traffic.
struct Idle {
    start: std::time::Instant,
    last_ms: std::sync::atomic::AtomicU64,
    /// The connection was cut.
    cut: tokio_util::sync::CancellationToken,
    /// The session ended.
    done: tokio_util::sync::CancellationToken,
}

impl Idle {
    fn touch(&self) {
        let ms = self.start.elapsed().as_millis() as u64;
        self.last_ms.store(ms, std::sync::atomic::Ordering::Relaxed);
    }

    async fn watch(self: Arc<Self>, timeout: std::time::Duration) {
        loop {
            tokio::select! {
                _ = self.done.cancelled() => return,
                _ = tokio::time::sleep(std::time::Duration::from_millis(50)) => {}
            }
            let last = self.last_ms.load(std::sync::atomic::Ordering::Relaxed);
            let idle = (self.start.elapsed().as_millis() as u64).saturating_sub(last);
            if idle > timeout.as_millis() as u64 {
                self.cut.cancel();
                return;
            }
        }
    }
}

impl Session {
    async fn run(self, socket: WebSocket) {
        let proto = self.proto;
        let (mut sink, stream) = socket.split();
        // Read by the running process's stdin pump; otherwise drained at the end.
        let mut stream = Some(stream);
        let idle = Arc::new(Idle {
            start: std::time::Instant::now(),
            last_ms: 0.into(),
            cut: Default::default(),
            done: Default::default(),
        });
        let _done = idle.done.clone().drop_guard();
        if let Some(t) = self.shared.opts.idle_timeout {
            tokio::spawn(idle.clone().watch(t));
        }
        let (tx, mut rx) = mpsc::channel::<Message>(1);
        let writer_idle = idle.clone();
        let writer = tokio::spawn(async move {
            loop {
                // A cut connection: the socket is dropped without a close frame, and nothing
                // queued after the cut goes out (biased: the status of the process the cut
                // killed must not reach the client, as it could not through a real cut).
                let m = tokio::select! {
                    biased;
                    _ = writer_idle.cut.cancelled() => break,
                    m = rx.recv() => m,
                };
                let Some(m) = m else { break };
                let close = matches!(m, Message::Close(_));
                if sink.send(m).await.is_err() || close {
                    break;
                }
                writer_idle.touch();
            }
        });
        // The kubelet's handshake: an empty frame on the lowest writable channel.
        let first_ch = if self.req.stdout {
            STDOUT
        } else if self.req.stderr {
            STDERR
        } else {
            ERROR
        };
        let _ = tx.send(frame(proto, first_ch, &[])).await;

        let pipe = |on: bool| if on { Stdio::piped() } else { Stdio::null() };
        let program = match &self.image_fs {
            Some(bin) => in_image(bin, &self.req.argv[0]),
            None => self.req.argv[0].clone().into(),
        };
        let mut cmd = match &self.container {
            Some(uid) => {
                super::podman::exec(uid, &self.req.argv, &self.env, &self.cwd, self.req.stdin)
            }
            None => {
                let mut cmd = tokio::process::Command::new(&program);
                cmd.args(&self.req.argv[1..])
                    .env_clear()
                    .envs(self.env.iter().map(|(k, v)| (k, v)))
                    .current_dir(&self.cwd);
                cmd
            }
        };
        cmd.process_group(0)
            .stdin(pipe(self.req.stdin))
            .stdout(pipe(self.req.stdout))
            .stderr(pipe(self.req.stderr || (self.req.tty && self.req.stdout)))
            .kill_on_drop(true);
        if let Some((uid, gid)) = self.user
            && self.container.is_none()
        {
            cmd.uid(uid).gid(gid);
        }
        let spawned = match self.refused.clone() {
            Some(why) => Err(why),
            None => Ok(cmd.spawn()),
        };
        let outcome = match spawned {
            Err(why) => Outcome::UpgradeFailed(why),
            Ok(Err(e)) => Outcome::StartFailed(start_error(
                &self.req.argv[0],
                &self.cwd,
                &e,
                self.shared.opts.runtime,
            )),
            Ok(Ok(mut child)) => {
                let pgid = child.id().map(|p| p as i32).unwrap_or(0);
                let _reg = {
                    let mut st = self.shared.lock();
                    st.next_exec += 1;
                    let id = st.next_exec;
                    st.execs.insert(
                        id,
                        ExecEntry {
                            namespace: self.ns.clone(),
                            pod: self.pod.clone(),
                            pgid,
                        },
                    );
                    // The pod may have gone (or stopped) while the process was starting; its
                    // container would have taken the process with it.
                    let alive = st
                        .pods
                        .get(&(self.ns.clone(), self.pod.clone()))
                        .is_some_and(|p| container_running(p, &self.req.container));
                    if !alive {
                        killpg(pgid);
                    }
                    Registered {
                        shared: self.shared.clone(),
                        id,
                    }
                };
                let out = child
                    .stdout
                    .take()
                    .map(|o| tokio::spawn(pump(o, STDOUT, proto, tx.clone())));
                let err = child
                    .stderr
                    .take()
                    // Without a real terminal, tty output of stderr goes where a pty would
                    // send it: the stdout stream.
                    .map(|o| {
                        let ch = if self.req.tty { STDOUT } else { STDERR };
                        tokio::spawn(pump(o, ch, proto, tx.clone()))
                    });
                let stdin_tx = child.stdin.take().map(|mut w| {
                    let (stx, mut srx) = mpsc::channel::<Bytes>(8);
                    tokio::spawn(async move {
                        while let Some(b) = srx.recv().await {
                            if w.write_all(&b).await.is_err() {
                                return;
                            }
                        }
                        let _ = w.shutdown().await;
                    });
                    stx
                });
                let exited = Arc::new(std::sync::atomic::AtomicBool::new(false));
                let reader = tokio::spawn(read_client(
                    stream.take().expect("the client's frames"),
                    proto,
                    stdin_tx,
                    pgid,
                    exited.clone(),
                    (self.shared.clone(), idle.clone()),
                ));
                let status = child.wait().await;
                if let Some(h) = out {
                    let _ = h.await;
                }
                if let Some(h) = err {
                    let _ = h.await;
                }
                // The process is gone: what the client sends now (stdin it still had, its
                // close reply) is read and dropped, as the API server keeps reading until the
                // socket closes (closing with unread data would reset the connection and lose
                // the status frame), and must not kill a process group id that may be reused.
                exited.store(true, std::sync::atomic::Ordering::SeqCst);
                tokio::spawn(async move {
                    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), reader).await;
                });
                if let (Some(uid), Ok(s)) = (&self.container, &status)
                    && s.code() == Some(137)
                {
                    self.after_kill(uid).await;
                }
                match status {
                    Ok(s) => {
                        Outcome::Exit(s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(9)))
                    }
                    Err(e) => {
                        Outcome::StartFailed(format!("error executing command in container: {e}"))
                    }
                }
            }
        };
        if let Some(p) = status_payload(proto, &outcome, &self.req.argv) {
            let _ = tx.send(frame(proto, ERROR, p.as_bytes())).await;
        }
        let _ = tx
            .send(Message::Close(Some(CloseFrame {
                code: close_code::NORMAL,
                reason: "".into(),
            })))
            .await;
        drop(tx);
        let _ = writer.await;
        if let Some(mut unread) = stream {
            // A server that closes waits for the client's Close (RFC 6455 7.1.1) instead of
            // dropping a socket with unread input (a failed start never reads the stdin the
            // client sends): that would answer with a reset, which can discard the status
            // frame still in the client's receive buffer.
            let _ = tokio::time::timeout(std::time::Duration::from_secs(2), async {
                while let Some(Ok(m)) = unread.next().await {
                    if matches!(m, Message::Close(_)) {
                        break;
                    }
                }
            })
            .await;
        }
    }
}

impl Session {
    /// A process of a real container died by SIGKILL: when the kernel's OOM killer did it
    /// (the container's `oom_kill` count grew), the container ends as with a kubelet's
    /// group kill on cgroup v2, and the pod's status says `OOMKilled` a second later (the
    /// kubelet's relist), after the exec's status went out.
    async fn after_kill(&self, uid: &str) {
        let id = uid.to_string();
        let kills = tokio::task::spawn_blocking(move || super::podman::oom_kills(&id))
            .await
            .ok()
            .flatten()
            .unwrap_or(0);
        let new = {
            let mut st = self.shared.lock();
            let seen = st.oom_kills.entry(uid.to_string()).or_insert(0);
            let new = kills > *seen;
            *seen = kills;
            new
        };
        if !new {
            return;
        }
        let (shared, ns, pod, id) = (
            self.shared.clone(),
            self.ns.clone(),
            self.pod.clone(),
            uid.to_string(),
        );
        std::thread::spawn(move || {
            super::podman::kill(&id);
            shared.kill_execs(Some((&ns, &pod)));
            std::thread::sleep(std::time::Duration::from_secs(1));
            super::mark_killed(&shared, &ns, &pod, false);
        });
    }
}

/// Reads client frames: stdin data, v5 stream closes, resizes (ignored: no terminal). A
/// client that goes away gets the process group killed.
async fn read_client(
    mut stream: futures_util::stream::SplitStream<WebSocket>,
    proto: Proto,
    mut stdin: Option<mpsc::Sender<Bytes>>,
    pgid: i32,
    exited: Arc<std::sync::atomic::AtomicBool>,
    (shared, idle): (Arc<Shared>, Arc<Idle>),
) {
    loop {
        let next = tokio::select! {
            m = stream.next() => m,
            // Cut by the load balancer: the API server sees the client go.
            _ = idle.cut.cancelled() => None,
        };
        idle.touch();
        let (ch, data): (u8, Bytes) = match next {
            Some(Ok(Message::Ping(_))) => {
                shared.lock().exec_pings += 1;
                continue;
            }
            Some(Ok(Message::Binary(b))) if !proto.base64() && !b.is_empty() => {
                (b[0], b.slice(1..))
            }
            // A text frame on a binary protocol is read like a binary one, as the API
            // server's wsstream reader does.
            Some(Ok(Message::Text(t))) if !proto.base64() && !t.is_empty() => {
                let b = Bytes::copy_from_slice(t.as_bytes());
                (b[0], b.slice(1..))
            }
            Some(Ok(Message::Text(t))) if proto.base64() && !t.is_empty() => {
                let s = t.as_str();
                let ch = s.as_bytes()[0].wrapping_sub(b'0');
                match base64_simd::STANDARD.decode_to_vec(&s.as_bytes()[1..]) {
                    Ok(d) => (ch, Bytes::from(d)),
                    Err(_) => continue,
                }
            }
            Some(Ok(Message::Close(_))) | None | Some(Err(_)) => {
                if !exited.load(std::sync::atomic::Ordering::SeqCst)
                    && !shared.opts.exec_survives_disconnect
                {
                    killpg(pgid);
                }
                return;
            }
            Some(Ok(_)) => continue,
        };
        if exited.load(std::sync::atomic::Ordering::SeqCst) {
            stdin = None;
            continue;
        }
        match ch {
            STDIN => {
                if let Some(tx) = &stdin
                    && tx.send(data).await.is_err()
                {
                    stdin = None;
                }
            }
            CLOSE if proto == Proto::V5 && data.first() == Some(&STDIN) => {
                stdin = None;
            }
            RESIZE => {}
            _ => {}
        }
    }
}

/// The programs of an image the double imitates: `busybox-applets` images have exactly
/// Debian's busybox applets (`/usr/bin/busybox`, one link per applet, in one directory that is
/// the image's PATH and its `/bin`, `/usr/bin`, `/sbin`, `/usr/sbin`); `no-shell` images
/// have no program at all (a static binary's image). `None`: the host's programs.
pub(super) fn image_fs(shared: &Shared, image: &str) -> Option<std::path::PathBuf> {
    let dirs = shared.image_dirs.get_or_init(|| {
        let root = tempfile::tempdir().expect("kube double: image dir");
        let empty = root.path().join("empty");
        std::fs::create_dir(&empty).expect("kube double: empty image");
        let busybox = root.path().join("busybox");
        std::fs::create_dir(&busybox).expect("kube double: busybox image");
        if let Some(list) = std::process::Command::new(BUSYBOX)
            .arg("--list")
            .output()
            .ok()
            .filter(|o| o.status.success())
        {
            for applet in String::from_utf8_lossy(&list.stdout).lines() {
                let _ = std::os::unix::fs::symlink(BUSYBOX, busybox.join(applet));
            }
        }
        (root, empty, busybox)
    });
    if image.contains("busybox-applets") {
        Some(dirs.2.clone())
    } else if image.contains("no-shell") {
        Some(dirs.1.clone())
    } else {
        None
    }
}

/// Debian's busybox, whose applets `busybox-applets` images have.
pub const BUSYBOX: &str = "/usr/bin/busybox";

/// Where `argv0` is in an imitated image: a path in one of its bin directories is the
/// applet of that name; a bare name is looked up in its PATH by the spawn; anything else
/// does not exist there.
fn in_image(bin: &FsPath, argv0: &str) -> std::path::PathBuf {
    for dir in ["/bin/", "/usr/bin/", "/sbin/", "/usr/sbin/"] {
        if let Some(name) = argv0.strip_prefix(dir).filter(|n| !n.contains('/')) {
            return bin.join(name);
        }
    }
    if argv0.contains('/') {
        // Not in the image (the spawn fails as for a missing file).
        return bin.join(".absent").join(argv0.trim_start_matches('/'));
    }
    argv0.into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hdr(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            header::SEC_WEBSOCKET_PROTOCOL,
            HeaderValue::from_str(v).unwrap(),
        );
        h
    }

    #[test]
    fn negotiation_prefers_v5_then_client_order() {
        let all: Vec<String> = [
            Proto::V5,
            Proto::V4,
            Proto::V4Base64,
            Proto::V1,
            Proto::V1Base64,
        ]
        .iter()
        .map(|p| p.name().to_string())
        .collect();
        let negotiate = |h: &HeaderMap| negotiate(h, &all);
        let v4_only = vec!["v4.channel.k8s.io".to_string()];
        assert_eq!(
            super::negotiate(&hdr("v5.channel.k8s.io, v4.channel.k8s.io"), &v4_only),
            Ok(Some(Proto::V4))
        );
        assert!(super::negotiate(&hdr("v5.channel.k8s.io"), &v4_only).is_err());
        assert_eq!(
            negotiate(&hdr("v4.channel.k8s.io, v5.channel.k8s.io")),
            Ok(Some(Proto::V5))
        );
        assert_eq!(
            negotiate(&hdr("base64.channel.k8s.io, v4.channel.k8s.io")),
            Ok(Some(Proto::V1Base64))
        );
        assert_eq!(negotiate(&HeaderMap::new()), Ok(None));
        assert!(negotiate(&hdr("chat")).is_err());
    }

    #[test]
    fn status_payloads_match_the_streaming_server() {
        let argv = vec!["sh".to_string(), "-c".into(), "exit 3".into()];
        assert_eq!(
            status_payload(Proto::V4, &Outcome::Exit(0), &argv).as_deref(),
            Some(r#"{"metadata":{},"status":"Success"}"#)
        );
        assert_eq!(
            status_payload(Proto::V4, &Outcome::Exit(3), &argv).as_deref(),
            Some(
                r#"{"metadata":{},"status":"Failure","message":"command terminated with non-zero exit code: error executing command [sh -c exit 3], exit code 3","reason":"NonZeroExitCode","details":{"causes":[{"reason":"ExitCode","message":"3"}]}}"#
            )
        );
        assert_eq!(
            status_payload(Proto::V5, &Outcome::Exit(3), &argv).as_deref(),
            Some(
                r#"{"metadata":{},"status":"Failure","message":"command terminated with non-zero exit code: command terminated with exit code 3","reason":"NonZeroExitCode","details":{"causes":[{"reason":"ExitCode","message":"3"}]}}"#
            )
        );
        let v5 = status_payload(Proto::V5, &Outcome::StartFailed("boom".into()), &argv).unwrap();
        assert_eq!(
            v5,
            r#"{"metadata":{},"status":"Failure","message":"Internal error occurred: Internal error occurred: boom","reason":"InternalError","details":{"causes":[{"message":"Internal error occurred: boom"}]},"code":500}"#
        );
        assert_eq!(status_payload(Proto::V1, &Outcome::Exit(0), &argv), None);
    }
}

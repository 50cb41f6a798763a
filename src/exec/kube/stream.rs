//! A running exec: the `remotecommand` WebSocket session (v5, or v4 on clusters before
//! 1.30) driven directly rather than through kube-rs's `AttachedProcess`, because the
//! backend needs three things that type does not give: pings well inside a load balancer's
//! 60-second idle timeout (kube-rs pings every 60 s), the negotiated protocol (stdin's end
//! can only be signalled on v5), and the wrapper's header written before the caller's stdin.
//!
//! Output frames become `stdout`/`stderr` events in order as they arrive (awaiting the
//! bounded event channel: a slow client slows the reading of the socket, and so the
//! command); the status channel becomes the `exit` event, mapped like the local backend's;
//! a command killed because its pod went (deleted, evicted, OOM-killed) becomes a
//! `pod_failed` error that says so.

use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::{Sink, SinkExt as _, Stream, StreamExt as _};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Status;
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::{self, Message};
use tokio_util::sync::CancellationToken;

use super::guard::PodGuard;
use super::pod::CONTAINER;
use super::status::{self, ExecEnd, PodState};
use crate::contract::{ErrorCode, Event, ExitInfo};

const STDIN: u8 = 0;
const STDOUT: u8 = 1;
const STDERR: u8 = 2;
const STATUS: u8 = 3;
/// v5: "this stream ends" (the next byte names the stream).
const CLOSE: u8 = 255;

/// After the exec status arrived, how long output may still trickle in.
const DRAIN_GRACE: Duration = Duration::from_secs(2);

/// How long the look at the pod after a kill may take.
const POD_CHECK_TIMEOUT: Duration = Duration::from_secs(5);

/// After an exec ended by SIGKILL or a broken stream, how long to wait for the pod's status
/// to say why: a kubelet writes `OOMKilled` or an eviction after the exec stream ended (its
/// relist, about a second later), not before.
const POD_FATE_WAIT: Duration = Duration::from_secs(4);

/// What the exec's stdin carries: the wrapper's header, then the caller's input.
pub(super) struct Input {
    /// Whether the exec was opened with a stdin stream.
    pub open: bool,
    pub header: Option<Vec<u8>>,
    pub user: Option<mpsc::Receiver<Bytes>>,
    /// v5: stdin's end can be signalled. On v4 it cannot without closing the whole stream
    /// (and losing output), so stdin then stays open until the command ends.
    pub can_close: bool,
    /// How often to ping the WebSocket (`kubernetes.exec_ping_secs`): well inside the idle
    /// timeout of load balancers in front of API servers, so silent commands keep their
    /// stream.
    pub ping: Duration,
}

/// Runs when the command ended with an exit status, before that `exit` is reported, while
/// the pod still exists (workspace sync-back); its events go out before the `exit`.
pub(super) type BeforeExit =
    Box<dyn FnOnce() -> futures_util::future::BoxFuture<'static, Vec<Event>> + Send>;

/// What telling and reporting the end of a run needs beyond the stream.
pub(super) struct Ending {
    /// The command's program: a missing one is exit 127.
    pub executable: String,
    /// The profile's shell, to ask the pod whether the program exists.
    pub shell: String,
    /// The exec runs the wrapper (with `cwd` or `env`) in `shell`, which then found a
    /// missing program itself: a program the runtime did not find is the shell.
    pub wrapped: bool,
    pub before_exit: Option<BeforeExit>,
}

/// Streams the exec's output into the event channel, then its exit; deletes the pod on the
/// way out (the guard). Killing (timeout, client gone, shutdown) deletes the pod at once.
pub(super) async fn supervise<S>(
    ws: S,
    input: Input,
    tx: mpsc::Sender<Event>,
    cancel: CancellationToken,
    mut guard: PodGuard,
    ending: Ending,
) where
    S: Stream<Item = Result<Message, tungstenite::Error>>
        + Sink<Message, Error = tungstenite::Error>
        + Send
        + Unpin
        + 'static,
{
    let Ending {
        executable,
        shell,
        wrapped,
        before_exit,
    } = ending;
    let started = Instant::now();
    let (sink, frames) = ws.split();
    let stop_writer = CancellationToken::new();
    let _stop_writer = stop_writer.clone().drop_guard();
    tokio::spawn(write_input(sink, input, stop_writer.clone()));
    let Some(seen) = read_frames(frames, &tx, &cancel, &mut guard, &stop_writer).await else {
        // Killed: the pod goes now; with it the command and everything it started.
        let duration = started.elapsed();
        guard.delete_now().await;
        let _ = tx
            .send(Event::Exit(ExitInfo {
                code: None,
                signal: Some(9),
                duration_ms: duration.as_millis() as u64,
                timed_out: false,
            }))
            .await;
        return;
    };
    let duration_ms = started.elapsed().as_millis() as u64;
    let exit = |code, signal| {
        Event::Exit(ExitInfo {
            code,
            signal,
            duration_ms,
            timed_out: false,
        })
    };
    let event = match how_it_ended(&seen, &executable, wrapped) {
        Ended::Exit { code, signal } => exit(code, signal),
        Ended::Killed => match pod_fate(&guard, POD_FATE_WAIT).await {
            Some(why) => Event::Error {
                code: ErrorCode::PodFailed,
                message: format!("the command was killed: {why}"),
            },
            None => exit(None, Some(9)),
        },
        Ended::NoShell => Event::Error {
            code: ErrorCode::ContainerConfigError,
            message: format!(
                "the runner image has no shell {shell} (the profile's `shell`): it is needed to apply the request's cwd and env; send neither, or use an image with a POSIX shell"
            ),
        },
        Ended::NotStarted { stderr, code } => {
            let _ = tx
                .send(Event::Stderr {
                    data: stderr.into(),
                })
                .await;
            exit(Some(code), None)
        }
        Ended::Failed {
            ask_if_missing: true,
            ..
        } if exists_in_pod(&guard, &shell, &executable).await == Some(false) => {
            let _ = tx
                .send(Event::Stderr {
                    data: format!("mcp-run: {executable}: command not found\n").into(),
                })
                .await;
            exit(Some(127), None)
        }
        Ended::Failed {
            message, fate_wait, ..
        } => match pod_fate(&guard, fate_wait).await {
            Some(why) => Event::Error {
                code: ErrorCode::PodFailed,
                message: format!("{message}: {why}"),
            },
            None => Event::Error {
                code: ErrorCode::BackendError,
                message,
            },
        },
    };
    if let (Event::Exit(_), Some(hook)) = (&event, before_exit)
        && !tx.is_closed()
    {
        for e in hook().await {
            if tx.send(e).await.is_err() {
                return;
            }
        }
    }
    let _ = tx.send(event).await;
}

/// What the exec's frames told about the end of the command.
#[derive(Debug, Default)]
struct Seen {
    /// The exec status, when one came and parsed.
    status: Option<Status>,
    /// Whether the command wrote any output.
    first_byte: bool,
    /// Why the stream broke, if it did.
    transport_error: Option<String>,
}

/// Forwards output frames as events, in order, until the stream ends (or the status came
/// and [`DRAIN_GRACE`] passed without more output). `None`: cancelled.
async fn read_frames<F>(
    mut frames: F,
    tx: &mpsc::Sender<Event>,
    cancel: &CancellationToken,
    guard: &mut PodGuard,
    stop_writer: &CancellationToken,
) -> Option<Seen>
where
    F: Stream<Item = Result<Message, tungstenite::Error>> + Unpin,
{
    let mut status: Option<Option<Status>> = None;
    let mut seen = Seen::default();
    let drain = tokio::time::sleep(Duration::MAX / 4);
    tokio::pin!(drain);
    loop {
        let frame = tokio::select! {
            biased;
            _ = cancel.cancelled() => return None,
            _ = &mut drain, if status.is_some() => break,
            m = frames.next() => m,
        };
        let data: Bytes = match frame {
            Some(Ok(Message::Binary(b))) => b,
            // Servers send binary frames; a text frame is read the same way.
            Some(Ok(Message::Text(t))) => Bytes::copy_from_slice(t.as_bytes()),
            Some(Ok(_)) => continue,
            Some(Err(e)) => {
                seen.transport_error = Some(e.to_string());
                break;
            }
            None => break,
        };
        let Some((&ch, payload)) = data.split_first() else {
            continue;
        };
        let event = match ch {
            STDOUT | STDERR if !payload.is_empty() => {
                mark_first(&mut seen.first_byte, guard);
                let data = data.slice(1..);
                if ch == STDOUT {
                    Event::Stdout { data }
                } else {
                    Event::Stderr { data }
                }
            }
            STATUS => {
                // The command ended: stdin it did not read is of no use any more.
                stop_writer.cancel();
                status = Some(serde_json::from_slice::<Status>(payload).ok());
                if let Some(t) = guard.timings.as_mut() {
                    t.mark("exit");
                }
                drain
                    .as_mut()
                    .reset(tokio::time::Instant::now() + DRAIN_GRACE);
                continue;
            }
            _ => continue,
        };
        let sent = tokio::select! {
            r = tx.send(event) => r.is_ok(),
            _ = cancel.cancelled() => true,
        };
        if !sent {
            // Nobody reads any more: the command goes with its pod.
            cancel.cancel();
        }
        if status.is_some() {
            drain
                .as_mut()
                .reset(tokio::time::Instant::now() + DRAIN_GRACE);
        }
    }
    seen.status = status.flatten();
    Some(seen)
}

/// How a command ended, as far as its exec stream tells; what is still to be looked up
/// (the pod's fate, whether the program exists) is named.
#[derive(Debug, PartialEq)]
enum Ended {
    Exit {
        code: Option<i32>,
        signal: Option<i32>,
    },
    /// SIGKILL, which a kubelet reports for every process it kills with the pod: the pod's
    /// fate tells which (else it is a signal).
    Killed,
    /// The wrapper (for `cwd` or `env`) found no shell in the image.
    NoShell,
    /// The program could not be started: this on stderr, this exit code.
    NotStarted { stderr: String, code: i32 },
    /// A failure; the pod's fate (watched for `fate_wait`) may say why.
    Failed {
        message: String,
        fate_wait: Duration,
        /// The runtime refused to start the program in words no pattern knows (each runtime
        /// has its own), before any output: a program missing from the pod is exit 127.
        ask_if_missing: bool,
    },
}

fn how_it_ended(seen: &Seen, executable: &str, wrapped: bool) -> Ended {
    let status = seen.status.as_ref();
    match status::exec_end(status, executable) {
        ExecEnd::Exit {
            code: None,
            signal: Some(9),
        } => Ended::Killed,
        ExecEnd::Exit { code, signal } => Ended::Exit { code, signal },
        ExecEnd::NotStarted { code: 127, .. } if wrapped => Ended::NoShell,
        ExecEnd::NotStarted { stderr, code } => Ended::NotStarted { stderr, code },
        ExecEnd::Error(message) => {
            let message = match &seen.transport_error {
                Some(t) if status.is_none() => format!("{message} ({t})"),
                _ => message,
            };
            Ended::Failed {
                message,
                // A broken stream may be the pod's end whose status is not written yet.
                fate_wait: if status.is_none() {
                    POD_FATE_WAIT
                } else {
                    Duration::ZERO
                },
                ask_if_missing: status
                    .is_some_and(|s| s.reason.as_deref() != Some("NonZeroExitCode"))
                    && !seen.first_byte,
            }
        }
    }
}

/// Whether `executable` exists in the runner container, asked through the profile's shell
/// (`command -v`, or `test -e` for a path) instead of read from a runtime's error text, whose
/// wording differs by runtime (runc, crun, gVisor, Kata). `None`: it cannot be told (no
/// shell in the image, the pod gone, no answer in time).
async fn exists_in_pod(guard: &PodGuard, shell: &str, executable: &str) -> Option<bool> {
    const PROBE: &str =
        r#"case $1 in */*) test -e "$1" ;; *) command -v "$1" ;; esac >/dev/null 2>&1"#;
    let params = kube::api::AttachParams::default()
        .container(CONTAINER)
        .stderr(false);
    let argv = [shell, "-c", PROBE, "mcp-run", executable];
    let mut attached = tokio::time::timeout(
        POD_CHECK_TIMEOUT,
        guard.shared.pods.exec(&guard.name, argv, &params),
    )
    .await
    .ok()?
    .ok()?;
    let status = attached.take_status()?;
    let s = tokio::time::timeout(POD_CHECK_TIMEOUT, status)
        .await
        .ok()??;
    if s.status.as_deref() == Some("Success") {
        return Some(true);
    }
    // "No such program": `test -e` answers 1, `command -v` 1 (bash, busybox) or 127 (dash).
    // Anything else (126, a signal) tells nothing; a missing shell fails the exec itself.
    matches!(status::nonzero_exit_code(&s), Some(1 | 127)).then_some(false)
}

/// What happened to the guard's pod, if it is gone, going, or its container stopped:
/// watched for up to `wait` for such a state (the kubelet writes it after the exec ended),
/// else the first state seen decides.
async fn pod_fate(guard: &PodGuard, wait: Duration) -> Option<String> {
    let name = &guard.name;
    let now = tokio::time::Instant::now();
    let end = now + wait.max(POD_CHECK_TIMEOUT);
    let watch = super::backoff::watch_pod(&guard.shared.pods, name, end, |pod| match pod {
        None => Some(Some(format!("runner pod {name} was deleted"))),
        Some(p) => match fate(&p) {
            Some(why) => Some(Some(why)),
            None if wait.is_zero() => Some(None),
            None => None,
        },
    });
    if wait.is_zero() {
        return watch.await.ok().flatten();
    }
    tokio::select! {
        r = watch => r.ok().flatten(),
        // The watch sends nothing while the pod does not change: nothing happened to it.
        _ = tokio::time::sleep_until(now + wait) => None,
    }
}

/// What a pod's state says happened to it under a command: deleted, evicted, OOM-killed,
/// its container stopped, or failed.
pub(super) fn fate(p: &k8s_openapi::api::core::v1::Pod) -> Option<String> {
    let name = p.metadata.name.as_deref().unwrap_or("?");
    let limit = p
        .spec
        .as_ref()
        .and_then(|s| s.containers.iter().find(|c| c.name == CONTAINER))
        .and_then(|c| c.resources.as_ref())
        .and_then(|r| r.limits.as_ref())
        .and_then(|l| l.get("memory"))
        .map(|q| q.0.clone());
    let terminated = p
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.name == CONTAINER))
        .and_then(|c| c.state.as_ref())
        .and_then(|s| s.terminated.as_ref());
    if let Some(t) = terminated
        && t.reason.as_deref() == Some("OOMKilled")
    {
        return Some(format!(
            "runner pod {name} ran out of memory (OOMKilled; memory limit {})",
            limit.as_deref().unwrap_or("none set")
        ));
    }
    let status = p.status.as_ref();
    if status.and_then(|s| s.reason.as_deref()) == Some("Evicted") {
        return Some(format!(
            "runner pod {name} was evicted: {}",
            status.and_then(|s| s.message.as_deref()).unwrap_or("")
        ));
    }
    if p.metadata.deletion_timestamp.is_some() {
        return Some(format!("runner pod {name} was deleted"));
    }
    match status::assess(p, CONTAINER) {
        PodState::Failed(e) => Some(e.to_string()),
        _ => None,
    }
}

/// Writes the exec's stdin: the header, then the caller's input in order, then (v5) its
/// end; pings throughout. Stops when told, or when the socket fails.
async fn write_input<W>(mut sink: W, input: Input, stop: CancellationToken)
where
    W: Sink<Message, Error = tungstenite::Error> + Unpin,
{
    let frame = |ch: u8, data: &[u8]| {
        let mut v = Vec::with_capacity(data.len() + 1);
        v.push(ch);
        v.extend_from_slice(data);
        Message::Binary(v.into())
    };
    let Input {
        open,
        header,
        mut user,
        can_close,
        ping,
    } = input;
    let mut ping = tokio::time::interval_at(tokio::time::Instant::now() + ping, ping);
    if let Some(h) = header
        && sink.send(frame(STDIN, &h)).await.is_err()
    {
        return;
    }
    let mut open = open;
    loop {
        if open && user.is_none() {
            open = false;
            if can_close
                && sink
                    .send(Message::Binary(vec![CLOSE, STDIN].into()))
                    .await
                    .is_err()
            {
                return;
            }
        }
        let chunk = async {
            match user.as_mut() {
                Some(rx) => rx.recv().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = ping.tick() => {
                if sink.send(Message::Ping(Bytes::new())).await.is_err() {
                    return;
                }
            }
            c = chunk => match c {
                Some(b) if b.is_empty() => {}
                Some(b) => {
                    if sink.send(frame(STDIN, &b)).await.is_err() {
                        return;
                    }
                }
                None => user = None,
            },
        }
    }
}

fn mark_first(seen: &mut bool, guard: &mut PodGuard) {
    if !*seen {
        *seen = true;
        if let Some(t) = guard.timings.as_mut() {
            t.mark("first byte");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    fn seen(status: Option<serde_json::Value>, first_byte: bool, broke: Option<&str>) -> Seen {
        Seen {
            status: status.map(|s| serde_json::from_value(s).unwrap()),
            first_byte,
            transport_error: broke.map(str::to_owned),
        }
    }

    fn exit_code(code: i32) -> serde_json::Value {
        serde_json::json!({
            "metadata": {}, "status": "Failure", "reason": "NonZeroExitCode",
            "details": {"causes": [{"reason": "ExitCode", "message": code.to_string()}]}
        })
    }

    fn refused(message: &str) -> serde_json::Value {
        serde_json::json!({
            "metadata": {}, "status": "Failure", "reason": "InternalError", "message": message
        })
    }

    #[test]
    fn how_a_run_ended_follows_from_its_frames() {
        let ok = serde_json::json!({"metadata": {}, "status": "Success"});
        let exit = |code, signal| Ended::Exit { code, signal };
        assert_eq!(
            how_it_ended(&seen(Some(ok), false, None), "x", false),
            exit(Some(0), None)
        );
        assert_eq!(
            how_it_ended(&seen(Some(exit_code(3)), true, None), "x", false),
            exit(Some(3), None)
        );
        assert_eq!(
            how_it_ended(&seen(Some(exit_code(143)), true, None), "x", false),
            exit(None, Some(15))
        );
        // 137: a kubelet says so for every process it kills with the pod; the pod decides.
        assert_eq!(
            how_it_ended(&seen(Some(exit_code(137)), true, None), "x", false),
            Ended::Killed
        );

        let missing = refused("exec: \"nope\": executable file not found in $PATH");
        assert_eq!(
            how_it_ended(&seen(Some(missing.clone()), false, None), "nope", false),
            Ended::NotStarted {
                stderr: "mcp-run: nope: command not found\n".into(),
                code: 127
            }
        );
        // Through the wrapper, what was not found is the shell.
        assert_eq!(
            how_it_ended(&seen(Some(missing), false, None), "nope", true),
            Ended::NoShell
        );

        // Words no pattern knows: before any output the pod is asked whether the program exists.
        let odd = refused("runtime said no");
        let failed =
            |first_byte| how_it_ended(&seen(Some(odd.clone()), first_byte, None), "x", false);
        assert_eq!(
            failed(false),
            Ended::Failed {
                message: "exec failed: InternalError: runtime said no".into(),
                fate_wait: Duration::ZERO,
                ask_if_missing: true
            }
        );
        assert!(matches!(
            failed(true),
            Ended::Failed {
                ask_if_missing: false,
                ..
            }
        ));

        // A broken stream without a status: the break is named and the pod's fate awaited.
        assert_eq!(
            how_it_ended(&seen(None, true, Some("connection reset")), "x", false),
            Ended::Failed {
                message: "the exec stream ended without an exit status (connection reset)".into(),
                fate_wait: POD_FATE_WAIT,
                ask_if_missing: false
            }
        );
        // A status that came: a break after it is not the story.
        assert_eq!(
            how_it_ended(&seen(Some(exit_code(2)), false, Some("reset")), "x", false),
            exit(Some(2), None)
        );
    }

    /// What `write_input` sends on a silent exec without stdin over `silence`, as (time
    /// since the start, frame).
    async fn frames_of_a_silent_exec(
        ping: Duration,
        silence: Duration,
    ) -> Vec<(Duration, Message)> {
        let start = tokio::time::Instant::now();
        let sent = Arc::new(Mutex::new(Vec::new()));
        let log = sent.clone();
        let sink = Box::pin(futures_util::sink::unfold((), move |(), m: Message| {
            log.lock().unwrap().push((start.elapsed(), m));
            async { Ok::<_, tungstenite::Error>(()) }
        }));
        let input = Input {
            open: false,
            header: None,
            user: None,
            can_close: true,
            ping,
        };
        let _ =
            tokio::time::timeout(silence, write_input(sink, input, CancellationToken::new())).await;
        sent.lock().unwrap().clone()
    }

    /// The longest time without a frame, from the start to the end of `silence`.
    fn longest_gap(frames: &[(Duration, Message)], silence: Duration) -> Duration {
        let mut at: Vec<Duration> = frames.iter().map(|(t, _)| *t).collect();
        at.insert(0, Duration::ZERO);
        at.push(silence);
        at.windows(2).map(|w| w[1] - w[0]).max().unwrap_or_default()
    }

    /// Load balancers in front of API servers cut connections idle for longer than their
    /// timeout (60 s is common, some cut sooner). With the default `exec_ping_secs`, a
    /// command silent for ten minutes keeps its stream through any idle cut longer than
    /// 20 s: no gap between frames reaches it. (Paused time: no 20 s wall-clock test; the
    /// double's cut with a configured ping runs in tests/kube_clusters.rs.)
    #[tokio::test(start_paused = true)]
    async fn the_default_ping_keeps_streams_through_idle_cuts_longer_than_20s() {
        let ping =
            Duration::from_secs(super::super::config::KubernetesConfig::default().exec_ping_secs);
        let silence = Duration::from_secs(600);
        let frames = frames_of_a_silent_exec(ping, silence).await;
        assert!(
            frames.iter().all(|(_, m)| matches!(m, Message::Ping(_))),
            "only pings on a silent exec without stdin"
        );
        let gap = longest_gap(&frames, silence);
        let cut = Duration::from_secs(21);
        assert!(
            gap < cut,
            "{gap:?} without a frame: a {cut:?} idle cut ends the stream"
        );
        // Pings, not other traffic, fill the silence: about one per interval.
        assert!(gap >= Duration::from_secs(19), "{gap:?}");
        assert_eq!(frames.len(), 30, "one ping per 20 s");
    }
}

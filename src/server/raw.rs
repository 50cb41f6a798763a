//! `POST /raw`: one command, its events streamed back as NDJSON (docs/protocol.md).
//!
//! Two optional extensions, both backward compatible:
//! - stdin: a body of type [`STDIN_CONTENT_TYPE`] is the request JSON on its first line, then
//!   the command's stdin verbatim; it is read only as fast as the command consumes it (a
//!   bounded channel between the body and the backend), so neither side buffers unbounded;
//! - progress: with [`PROGRESS_HEADER`] the stream may begin before the command started, with
//!   `phase` events; a start that fails after that ends the stream with an `error` event.
//!
//! Size: about 500 lines of code: the stdin pump and the stream's stages (phases, started,
//! output, terminal) are one state machine over the same request.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, BodyDataStream, Bytes};
use axum::extract::{FromRequest, Request, State};
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use futures_util::future::BoxFuture;
use futures_util::stream::{Stream, StreamExt, TryStreamExt};
use tokio::sync::{mpsc, oneshot};
use tokio_util::codec::FramedRead;
use tokio_util::io::StreamReader;
use tokio_util::sync::{CancellationToken, DropGuard, WaitForCancellationFutureOwned};

use super::AppState;
use crate::auth::Caller;
use crate::contract::{
    ErrorBody, ErrorCode, Event, LineDecoder, LineError, PROGRESS_HEADER, RunRequest,
    STDIN_CONTENT_TYPE,
};
use crate::exec::{Execution, Progress};
use crate::runner::RunIo;

/// Stdin chunks that may wait for the command before the gateway stops reading the request
/// body (with the client's 256 KiB chunks, about 1 MiB per execution).
const STDIN_BUFFER: usize = 4;

/// After a run ended, how long and how much of an unread request body is still read and
/// thrown away, so that closing the connection does not reset it while the client still
/// reads the end of the response.
const DRAIN_TIME: Duration = Duration::from_secs(2);
const DRAIN_BYTES: u64 = 16 << 20;

/// The largest request line of a stdin body (the JSON body limit, `server.max_body_bytes`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct HeadLimit(pub usize);

pub(super) async fn raw(
    State(state): State<AppState>,
    caller: Option<axum::Extension<Caller>>,
    peer_closed: Option<axum::Extension<crate::server::connections::PeerClosed>>,
    axum::Extension(HeadLimit(head_limit)): axum::Extension<HeadLimit>,
    forwarded: Option<axum::Extension<crate::peers::Forwarded>>,
    request: Request,
) -> Response {
    let headers = request.headers().clone();
    let progress = wants_progress(&headers);
    let caller = caller.map(|c| c.0).unwrap_or_default();
    let parsed = if content_type_is(&headers, STDIN_CONTENT_TYPE) {
        with_stdin(&state, &headers, request.into_body(), head_limit).await
    } else {
        let body = Bytes::from_request(request, &state).await;
        super::parse_request(&headers, body).map(|r| (r, None))
    };
    let (req, stdin) = match parsed {
        Ok(p) => p,
        Err(mut e) => {
            // serde's messages quote the offending value.
            if let Some(r) = state.runner.redactor() {
                e.message = r.redact_str(&e.message);
            }
            state.runner.metrics().rejected(e.code);
            return e.into_response();
        }
    };
    // Logged below: secrets in the command line are redacted like the output, and a huge
    // command line is cut.
    let command = crate::audit::argv_json(
        &req.executable,
        &req.args,
        state.runner.redactor().map(|r| r.as_ref()),
    );
    // Dropped with the response (or here, when the start fails): ends the stdin pump.
    let (stdin_rx, stdin_guard) = match stdin {
        Some(s) => (Some(s.rx), Some(s.guard)),
        None => (None, None),
    };
    let (sink, mut phases) = if progress {
        Progress::channel()
    } else {
        // Nobody listens: phases are dropped.
        (Progress::default(), mpsc::channel(1).1)
    };
    let runner = state.runner.clone();
    let io = RunIo {
        progress: sink,
        stdin: stdin_rx,
    };
    // A run another replica forwarded (this is the caller's home) runs here.
    let mut start: BoxFuture<'static, Result<Execution, ErrorBody>> = match forwarded {
        Some(_) => Box::pin(async move { runner.start_forwarded(req, &caller, io).await }),
        None => Box::pin(async move { runner.start_with(req, &caller, io).await }),
    };
    // Until the backend reports a phase, the answer is what it always was: an HTTP error if
    // the start fails, the stream from `started` on if it succeeds.
    // A client gone during a long start (a pod that waits for a node) must not keep the
    // start running: at its EOF the stream begins (a keepalive line), whose writes tell a
    // gone client (the start is then dropped, and its pod deleted) from a half-closed one
    // (which gets the rest of the run in the stream).
    let watching = CancellationToken::new();
    let eof = peer_closed
        .as_ref()
        .and_then(|p| p.0.watch(watching.clone()))
        .unwrap_or_default();
    let first = tokio::select! {
        biased;
        started = &mut start => Err(started),
        Some(phase) = phases.recv() => Ok(phase),
        () = eof.cancelled() => Ok(Event::Keepalive),
    };
    let peer_eof = eof.is_cancelled();
    watching.cancel();
    let (first, start) = match first {
        // Phases the backend reported on its way to a quick start still go first.
        Err(Ok(execution)) => (None, Box::pin(std::future::ready(Ok(execution))) as _),
        Err(Err(e)) => {
            tracing::info!(%command, code = %e.code, message = %e.message, "rejected");
            return e.into_response();
        }
        Ok(phase) => {
            tracing::debug!(%command, ?phase, "preparing");
            (Some(phase), start)
        }
    };
    // Watched while the stream lives: the client's EOF starts probing (see `KeepAlive`).
    let streaming = CancellationToken::new();
    let peer = peer_closed
        .and_then(|p| p.0.watch(streaming.clone()))
        .unwrap_or_default();
    let run = Run {
        first,
        start,
        phases,
        keepalive: state.keepalive,
        stdin: stdin_guard,
        command,
        peer,
        probing: peer_eof,
        _watching: streaming.drop_guard(),
    };
    let mut resp = Response::new(Body::from_stream(events(run)));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-ndjson"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // Tells nginx-style proxies not to buffer the stream.
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    resp
}

fn wants_progress(headers: &HeaderMap) -> bool {
    headers
        .get(PROGRESS_HEADER)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| matches!(v.trim(), "1" | "true"))
}

fn content_type_is(headers: &HeaderMap, mime: &str) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|m| m.trim().eq_ignore_ascii_case(mime))
}

/// The stdin of a run being read from the request body.
struct Stdin {
    rx: mpsc::Receiver<Bytes>,
    /// Owned by the response: when it is dropped the pump stops reading.
    guard: StdinGuard,
}

struct StdinGuard {
    _done: DropGuard,
    /// Why the pump gave up on the body (too large, broken): the run ends with this error.
    abort: Option<oneshot::Receiver<ErrorBody>>,
}

/// Reads the request line of a stdin body and starts pumping the rest into a channel.
async fn with_stdin(
    state: &AppState,
    headers: &HeaderMap,
    body: Body,
    head_limit: usize,
) -> Result<(RunRequest, Option<Stdin>), ErrorBody> {
    let limits = state.runner.limits();
    let body = body.into_data_stream();
    // A refused request's body is still read for a moment (see `drain`).
    let refuse = |body: BodyDataStream, e: ErrorBody| {
        tokio::spawn(drain(body));
        Err(e)
    };
    if !limits.allow_stdin {
        return refuse(
            body,
            ErrorBody::new(
                ErrorCode::PolicyViolation,
                "this gateway does not accept stdin for commands (limits.allow_stdin is false)",
            ),
        );
    }
    let (body, head) = read_head(body, head_limit).await;
    let (head, rest) = match head {
        Ok(h) => h,
        Err(e) => return refuse(body, e),
    };
    let req = match serde_json::from_slice::<RunRequest>(&head) {
        Ok(r) => r,
        Err(e) => {
            let e = ErrorBody::new(ErrorCode::InvalidRequest, format!("invalid request: {e}"));
            return refuse(body, e);
        }
    };
    let max = limits.max_stdin_bytes;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(len) = declared
        && len.saturating_sub(head.len() as u64 + 1) > max
    {
        return refuse(body, too_large(max));
    }
    let (tx, rx) = mpsc::channel(STDIN_BUFFER);
    let done = CancellationToken::new();
    let (abort_tx, abort_rx) = oneshot::channel();
    tokio::spawn(pump(body, rest, tx, max, done.clone(), abort_tx));
    Ok((
        req,
        Some(Stdin {
            rx,
            guard: StdinGuard {
                _done: done.drop_guard(),
                abort: Some(abort_rx),
            },
        }),
    ))
}

fn too_large(max: u64) -> ErrorBody {
    ErrorBody::new(
        ErrorCode::PayloadTooLarge,
        format!("stdin is larger than the gateway accepts ({max} bytes, limits.max_stdin_bytes)"),
    )
}

/// Splits the first line (the request JSON) off the body; what follows it is stdin. A body
/// without a newline is all request, with empty stdin. The body comes back for what follows.
async fn read_head(
    body: BodyDataStream,
    limit: usize,
) -> (BodyDataStream, Result<(Bytes, Bytes), ErrorBody>) {
    let reader = StreamReader::new(body.map_err(std::io::Error::other));
    let mut lines = FramedRead::new(reader, LineDecoder::new(limit));
    let head = match lines.next().await {
        Some(Ok(head) | Err(LineError::Unterminated(head))) => Ok(head.freeze()),
        None => Ok(Bytes::new()),
        Some(Err(LineError::TooLong(_))) => Err(ErrorBody::new(
            ErrorCode::PayloadTooLarge,
            "the request line is larger than the server accepts",
        )),
        Some(Err(LineError::Io(e))) => Err(ErrorBody::new(
            ErrorCode::InvalidRequest,
            format!("cannot read the request body: {e}"),
        )),
    };
    // Stdin begins with what was read past the newline, then the rest of a chunk read in part.
    let parts = lines.into_parts();
    let (body, chunk) = parts.io.into_inner_with_chunk();
    let mut rest = parts.read_buf;
    if let Some(chunk) = chunk {
        rest.extend_from_slice(&chunk);
    }
    (body.into_inner(), head.map(|head| (head, rest.freeze())))
}

/// Moves the body into the command's stdin, awaiting the channel (that is the back-pressure
/// on the client). End of body: the sender is dropped, the command reads EOF. A command that
/// stopped reading (the backend dropped the receiver) gets nothing more; the rest is read and
/// discarded, still counted against `max`. When the run ended, the body is drained briefly.
async fn pump(
    mut body: BodyDataStream,
    first: Bytes,
    tx: mpsc::Sender<Bytes>,
    max: u64,
    done: CancellationToken,
    abort: oneshot::Sender<ErrorBody>,
) {
    let mut tx = Some(tx);
    let mut total = 0u64;
    let mut next = (!first.is_empty()).then_some(first);
    let failure = loop {
        let chunk = match next.take() {
            Some(c) => c,
            None => {
                let frame = tokio::select! {
                    biased;
                    _ = done.cancelled() => break None,
                    f = body.next() => f,
                };
                match frame {
                    None => return,
                    Some(Ok(c)) => c,
                    Some(Err(e)) => {
                        break Some(ErrorBody::new(
                            ErrorCode::InvalidRequest,
                            format!("the request body (stdin) broke off: {e}"),
                        ));
                    }
                }
            }
        };
        total += chunk.len() as u64;
        if total > max {
            break Some(too_large(max));
        }
        if let Some(sender) = &tx {
            tokio::select! {
                biased;
                _ = done.cancelled() => break None,
                sent = sender.send(chunk) => if sent.is_err() { tx = None },
            }
        }
    };
    drop(tx);
    if let Some(e) = failure {
        let _ = abort.send(e);
    }
    drain(body).await;
}

/// Reads what is left of a body and throws it away, for [`DRAIN_TIME`] or [`DRAIN_BYTES`] at
/// most. Closing a connection with unread data resets it, and a reset can destroy the end of
/// the response before the client read it (an error answer, the last events of a run).
async fn drain(mut body: BodyDataStream) {
    let deadline = tokio::time::sleep(DRAIN_TIME);
    tokio::pin!(deadline);
    let mut drained = 0u64;
    while drained < DRAIN_BYTES {
        tokio::select! {
            _ = &mut deadline => return,
            f = body.next() => match f {
                Some(Ok(c)) => drained += c.len() as u64,
                _ => return,
            },
        }
    }
}

struct Run {
    /// The first phase (or a keep-alive, at the client's EOF) to send.
    first: Option<Event>,
    /// The start, under way or done.
    start: BoxFuture<'static, Result<Execution, ErrorBody>>,
    /// The backend's phases (progress), sent before `started`.
    phases: mpsc::Receiver<Event>,
    keepalive: Duration,
    stdin: Option<StdinGuard>,
    command: String,
    /// Cancelled at the client's EOF (a half-close, or a client that is gone).
    peer: CancellationToken,
    /// After that EOF, short keep-alives find out which: writing to a gone client fails at once.
    probing: bool,
    /// Ends the EOF watcher with the stream.
    _watching: DropGuard,
}

/// How often a stream whose client sent EOF is probed with a keep-alive.
const CLOSED_PEER_PROBE: Duration = Duration::from_millis(200);

/// The NDJSON body of a run: phases (with progress), `started`, output, keep-alives while
/// silent, one terminal event. The execution lives inside the stream, so a client that goes
/// away drops it, and dropping it kills the command.
fn events(run: Run) -> impl Stream<Item = Result<Bytes, Infallible>> + Send {
    let Run {
        first,
        mut start,
        mut phases,
        keepalive,
        mut stdin,
        command,
        peer,
        probing,
        _watching,
    } = run;
    let events = async_stream::stream! {
        let _watching = _watching;
        if let Some(first) = first {
            yield first;
        }
        let started = loop {
            let phase = tokio::select! {
                biased;
                Some(phase) = phases.recv() => phase,
                started = &mut start => break started,
            };
            yield phase;
        };
        if let Ok(execution) = &started {
            tracing::debug!(%command, context = ?execution.context(), "started");
        }
        // Phases still queued go before what the start came to.
        while let Ok(phase) = phases.try_recv() {
            yield phase;
        }
        let mut execution = match started {
            Ok(execution) => execution,
            Err(e) => {
                tracing::info!(%command, code = %e.code, message = %e.message, "failed to start");
                yield Event::Error { code: e.code, message: e.message };
                return;
            }
        };
        yield Event::Started { context: execution.context().clone() };
        loop {
            let abort = stdin.as_mut().and_then(|s| s.abort.as_mut());
            let event = tokio::select! {
                biased;
                aborted = wait_abort(abort) => match aborted {
                    Some(e) => {
                        // Dropping the execution below kills the command.
                        execution.kill();
                        Event::Error { code: e.code, message: e.message }
                    }
                    None => {
                        // The pump ended normally: nothing more to watch.
                        if let Some(s) = stdin.as_mut() {
                            s.abort = None;
                        }
                        continue;
                    }
                },
                next = execution.next() => match next {
                    Some(event) => event,
                    None => break,
                },
            };
            if event.is_terminal() {
                // The execution ends before its last event goes out.
                drop(execution);
                yield event;
                break;
            }
            yield event;
        }
    };
    KeepAlive {
        events: Box::pin(events),
        every: keepalive,
        peer: (!probing).then(|| Box::pin(peer.cancelled_owned())),
        silence: Box::pin(tokio::time::sleep(keepalive)),
        armed: false,
    }
    .map(|event| Ok(event.to_line()))
}

/// A keep-alive after each `every` without an event (as axum's `Sse::keep_alive`), timed
/// from when the next event was asked for. At the client's EOF one at once, and from then on
/// every [`CLOSED_PEER_PROBE`]: writing to a gone client fails, which ends the stream.
struct KeepAlive<S> {
    events: Pin<Box<S>>,
    every: Duration,
    /// The client's EOF, until it came.
    peer: Option<Pin<Box<WaitForCancellationFutureOwned>>>,
    silence: Pin<Box<tokio::time::Sleep>>,
    /// Whether `silence` runs (from the first poll after an event).
    armed: bool,
}

impl<S: Stream<Item = Event>> Stream for KeepAlive<S> {
    type Item = Event;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Event>> {
        let this = &mut *self;
        if let Some(peer) = &mut this.peer
            && peer.as_mut().poll(cx).is_ready()
        {
            this.peer = None;
            this.armed = false;
            return Poll::Ready(Some(Event::Keepalive));
        }
        if let Poll::Ready(event) = this.events.as_mut().poll_next(cx) {
            this.armed = false;
            if event.is_none() {
                this.peer = None;
            }
            return Poll::Ready(event);
        }
        if !this.armed {
            let wait = if this.peer.is_none() {
                CLOSED_PEER_PROBE
            } else {
                this.every
            };
            this.silence
                .as_mut()
                .reset(tokio::time::Instant::now() + wait);
            this.armed = true;
        }
        if this.silence.as_mut().poll(cx).is_ready() {
            this.armed = false;
            return Poll::Ready(Some(Event::Keepalive));
        }
        Poll::Pending
    }
}

/// The pump's failure, `None` when it ended without one; never resolves without a pump.
async fn wait_abort(abort: Option<&mut oneshot::Receiver<ErrorBody>>) -> Option<ErrorBody> {
    match abort {
        Some(rx) => rx.await.ok(),
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::{ExitInfo, Phase, RunContext};

    async fn collect(run: Run) -> Vec<Event> {
        events(run)
            .map(|line| {
                let line = line.unwrap();
                Event::from_line(&line[..line.len() - 1]).unwrap()
            })
            .collect()
            .await
    }

    fn starting(
        start: impl std::future::Future<Output = Result<Execution, ErrorBody>> + Send + 'static,
        phases: mpsc::Receiver<Event>,
    ) -> Run {
        Run {
            first: None,
            start: Box::pin(start),
            phases,
            keepalive: Duration::from_secs(60),
            stdin: None,
            command: "x".into(),
            peer: CancellationToken::new(),
            probing: false,
            _watching: CancellationToken::new().drop_guard(),
        }
    }

    #[tokio::test]
    async fn phases_come_before_started_even_when_the_start_is_quick() {
        let (progress, phases) = Progress::channel();
        let run = starting(
            async move {
                progress.report(Phase::Scheduled, None);
                tokio::task::yield_now().await;
                progress.report(Phase::PullingImage, Some("busybox".into()));
                Ok(Execution::finished(RunContext::default(), "e".into(), 3))
            },
            phases,
        );
        let seen = collect(run).await;
        assert_eq!(
            seen,
            [
                Event::Phase {
                    phase: Phase::Scheduled,
                    message: None
                },
                Event::Phase {
                    phase: Phase::PullingImage,
                    message: Some("busybox".into())
                },
                Event::Started {
                    context: RunContext::default()
                },
                Event::Stderr {
                    data: Bytes::from_static(b"e")
                },
                Event::Exit(ExitInfo {
                    code: Some(3),
                    ..Default::default()
                }),
            ]
        );
    }

    #[tokio::test]
    async fn a_start_that_fails_after_a_phase_is_an_error_event_with_its_code() {
        let (progress, phases) = Progress::channel();
        let run = starting(
            async move {
                progress.report(Phase::PullingImage, None);
                Err(ErrorBody::new(ErrorCode::ImagePullFailed, "no such image"))
            },
            phases,
        );
        let seen = collect(run).await;
        assert_eq!(
            seen.last(),
            Some(&Event::Error {
                code: ErrorCode::ImagePullFailed,
                message: "no such image".into()
            })
        );
        assert_eq!(seen.len(), 2, "{seen:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn keepalives_while_the_start_takes_long() {
        let (_progress, phases) = Progress::channel();
        let mut run = starting(
            async {
                tokio::time::sleep(Duration::from_secs(150)).await;
                Err(ErrorBody::new(ErrorCode::PodStartTimeout, "slow"))
            },
            phases,
        );
        run.keepalive = Duration::from_secs(60);
        let seen = collect(run).await;
        assert_eq!(&seen[..2], [Event::Keepalive, Event::Keepalive]);
        assert!(matches!(
            seen[2],
            Event::Error {
                code: ErrorCode::PodStartTimeout,
                ..
            }
        ));
    }
}

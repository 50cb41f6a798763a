//! Streaming a running exec: stdout and stderr into the event channel as they arrive, then
//! the exit mapped from the status channel.

use std::time::{Duration, Instant};

use bytes::BytesMut;
use futures_util::FutureExt as _;
use kube::api::AttachedProcess;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::guard::PodGuard;
use super::pod::CONTAINER;
use super::status::{self, ExecEnd, PodState};
use crate::contract::{ErrorCode, Event, ExitInfo};
use crate::exec::{forward, read_opt};

/// After the exec status arrived, how long output may still trickle in.
const DRAIN_GRACE: Duration = Duration::from_secs(2);

/// Streams the exec's output into the event channel, then its exit; deletes the pod on the
/// way out (the guard). Killing (timeout, client gone, shutdown) deletes the pod at once.
pub(super) async fn supervise(
    mut process: AttachedProcess,
    tx: mpsc::Sender<Event>,
    cancel: CancellationToken,
    mut guard: PodGuard,
    executable: String,
) {
    let started = Instant::now();
    let mut stdout = process.stdout();
    let mut stderr = process.stderr();
    let mut status_rx = match process.take_status() {
        Some(f) => f.boxed(),
        None => futures_util::future::ready(None).boxed(),
    };
    let (mut out_buf, mut err_buf) = (BytesMut::new(), BytesMut::new());
    let mut status = None;
    let mut first_byte = false;
    let drain = tokio::time::sleep(Duration::MAX / 4);
    tokio::pin!(drain);

    while status.is_none() || stdout.is_some() || stderr.is_some() {
        tokio::select! {
            biased;
            _ = cancel.cancelled() => {
                // The pod goes now; with it the command and everything it started.
                let duration = started.elapsed();
                process.abort();
                drop(process);
                guard.delete_now().await;
                let _ = tx.send(Event::Exit(ExitInfo {
                    code: None,
                    signal: Some(9),
                    duration_ms: duration.as_millis() as u64,
                    timed_out: false,
                })).await;
                return;
            }
            n = read_opt(&mut stdout, &mut out_buf) => {
                mark_first(&mut first_byte, &mut guard);
                if !forward(n, &mut stdout, &mut out_buf, &tx, &cancel, |data| Event::Stdout { data }).await {
                    cancel.cancel();
                }
                if status.is_some() {
                    drain.as_mut().reset(tokio::time::Instant::now() + DRAIN_GRACE);
                }
            }
            n = read_opt(&mut stderr, &mut err_buf) => {
                mark_first(&mut first_byte, &mut guard);
                if !forward(n, &mut stderr, &mut err_buf, &tx, &cancel, |data| Event::Stderr { data }).await {
                    cancel.cancel();
                }
                if status.is_some() {
                    drain.as_mut().reset(tokio::time::Instant::now() + DRAIN_GRACE);
                }
            }
            s = &mut status_rx, if status.is_none() => {
                status = Some(s);
                if let Some(t) = guard.timings.as_mut() {
                    t.mark("exit");
                }
                drain.as_mut().reset(tokio::time::Instant::now() + DRAIN_GRACE);
            }
            _ = &mut drain, if status.is_some() => break,
        }
    }
    let duration_ms = started.elapsed().as_millis() as u64;
    let status = status.flatten();
    let event = match status::exec_end(status.as_ref(), &executable) {
        ExecEnd::Exit { code, signal } => Event::Exit(ExitInfo {
            code,
            signal,
            duration_ms,
            timed_out: false,
        }),
        ExecEnd::NotStarted { stderr, code } => {
            let _ = tx
                .send(Event::Stderr {
                    data: stderr.into(),
                })
                .await;
            Event::Exit(ExitInfo {
                code: Some(code),
                signal: None,
                duration_ms,
                timed_out: false,
            })
        }
        ExecEnd::Error(message) => {
            // Say what happened to the pod, when something did.
            let pod_note = match guard.shared.pods.get_opt(&guard.name).await {
                Ok(None) => Some(format!("runner pod {} was deleted", guard.name)),
                Ok(Some(p)) => match status::assess(&p, CONTAINER) {
                    PodState::Failed(e) => Some(e.message),
                    _ => None,
                },
                Err(_) => None,
            };
            Event::Error {
                code: if pod_note.is_some() {
                    ErrorCode::PodFailed
                } else {
                    ErrorCode::BackendError
                },
                message: match pod_note {
                    Some(n) => format!("{message}: {n}"),
                    None => message,
                },
            }
        }
    };
    let _ = tx.send(event).await;
}

fn mark_first(seen: &mut bool, guard: &mut PodGuard) {
    if !*seen {
        *seen = true;
        if let Some(t) = guard.timings.as_mut() {
            t.mark("first byte");
        }
    }
}

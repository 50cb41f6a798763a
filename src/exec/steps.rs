//! Multi-step runs on the "one runner, many execs" primitive ([`KeptRunner`]): the steps run in
//! order in one runner, each with its own timeout, as one [`Execution`] whose events name
//! their step (`step` before a step's output, `step_exit` after it, then one terminal `exit`).
//! The run stops at the first step that fails unless `continue_on_error`.

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{EVENT_BUFFER, ExecSpec, Execution, KeptRunner, StartOptions};
use crate::contract::{Event, ExitInfo, RunContext};

/// What a multi-step run needs.
pub(crate) struct Steps {
    pub runner: Arc<dyn KeptRunner>,
    pub steps: Vec<(ExecSpec, String)>,
    pub continue_on_error: bool,
    /// Release the runner when the run ends (a runner made for this run, not a session's).
    pub close: bool,
}

/// Starts the steps; the returned execution's terminal `exit` is the first failing step's
/// (or the last step's when all succeeded), its duration the whole run's. Dropping it kills
/// the running step (and releases a runner made for the run).
pub(crate) fn run(steps: Steps, context: RunContext, cancel: CancellationToken) -> Execution {
    let (tx, rx) = mpsc::channel(EVENT_BUFFER);
    let token = cancel.clone();
    tokio::spawn(async move {
        let Steps {
            runner,
            steps,
            continue_on_error,
            close,
        } = steps;
        let started = Instant::now();
        let mut first_failure: Option<ExitInfo> = None;
        let mut last = ExitInfo::default();
        let mut terminal: Option<Event> = None;
        for (i, (spec, command)) in steps.into_iter().enumerate() {
            if token.is_cancelled() {
                break;
            }
            if tx
                .send(Event::Step {
                    step: i,
                    command: command.clone(),
                })
                .await
                .is_err()
            {
                break;
            }
            let timeout = spec.timeout;
            let opts = StartOptions::new(token.child_token());
            let mut exec = match runner.start(spec, opts, i == 0).await {
                Ok(e) => e.with_timeout(timeout),
                Err(e) => {
                    terminal = Some(Event::Error {
                        code: e.code,
                        message: format!("step {i} ({command}) did not start: {}", e.message),
                    });
                    break;
                }
            };
            let mut exit = None;
            while let Some(ev) = exec.next().await {
                match ev {
                    Event::Exit(info) => {
                        exit = Some(info);
                        break;
                    }
                    Event::Error { code, message } => {
                        terminal = Some(Event::Error {
                            code,
                            message: format!("step {i} ({command}): {message}"),
                        });
                        break;
                    }
                    Event::Started { .. } => {}
                    other => {
                        if tx.send(other).await.is_err() {
                            return finish(&runner, close).await;
                        }
                    }
                }
            }
            let Some(info) = exit else { break };
            last = info;
            if tx
                .send(Event::StepExit {
                    step: i,
                    exit: info,
                })
                .await
                .is_err()
            {
                break;
            }
            if !info.success() {
                first_failure.get_or_insert(info);
                if !continue_on_error {
                    break;
                }
            }
        }
        let end = terminal.unwrap_or_else(|| {
            let mut info = first_failure.unwrap_or(last);
            info.duration_ms = started.elapsed().as_millis() as u64;
            Event::Exit(info)
        });
        let _ = tx.send(end).await;
        finish(&runner, close).await;
    });
    Execution::new(context, rx, cancel)
}

async fn finish(runner: &Arc<dyn KeptRunner>, close: bool) {
    if close {
        runner.close().await;
    }
}

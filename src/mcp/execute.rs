//! The one way an MCP tool call runs a command: start it through the [`Runner`] (with the
//! caller's stdin and a sink for start-up phases), collect it while reporting progress, run
//! the template over the output as it streams, keep the full output for resource reads, and
//! stop the command if the client cancels. `run_network_tool` and every declared CLI tool go
//! through [`execute`].

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rmcp::RoleServer;
use rmcp::model::{ProgressNotificationParam, ProgressToken};
use rmcp::service::{Peer, RequestContext};
use tokio::sync::mpsc;

use crate::contract::{ErrorBody, ErrorCode, Event, RunRequest};
use crate::exec::Progress;
use crate::result::{Collected, Stream, collect};
use crate::runner::{RunIo, Runner};
use crate::templates::{Filtered, StreamFilter, Template};

use super::store::{OutputStore, Recording};

/// How often progress notifications about output are sent at most.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// What a call asks for besides the run request.
#[derive(Default)]
pub(crate) struct Call {
    pub template: Option<Template>,
    pub stdin: Option<String>,
    /// Bytes of each stream held in memory (head and tail) for the result; at least four
    /// times its character budget, as a character is at most four bytes.
    pub capture_bytes: usize,
}

/// A run that started and ended (by exit, error or timeout).
pub(crate) struct Ran {
    pub collected: Collected,
    /// The template's output per stream (stdout, stderr), when a template was asked for.
    pub filtered: Option<(Filtered, Filtered)>,
    /// Where the full output can be read, when the store kept it.
    pub recording: Option<Arc<Recording>>,
    /// A multi-step run's template per step (its steps are filtered one by one); empty
    /// without a template.
    pub step_templates: Vec<Template>,
}

/// Why a call produced no run.
pub(crate) enum Stopped {
    /// The runner refused or could not start the command.
    NotStarted(ErrorBody),
    /// The client cancelled the call; the command (if it started) was killed.
    Cancelled,
}

impl Stopped {
    pub(crate) fn error(&self) -> ErrorBody {
        match self {
            Stopped::NotStarted(e) => e.clone(),
            Stopped::Cancelled => ErrorBody::new(
                ErrorCode::InvalidRequest,
                "cancelled by the client: the command was killed",
            ),
        }
    }
}

/// Runs `req` for the MCP call in `context`. Dropping the execution (on cancellation) kills
/// the command and deletes its pod.
pub(crate) async fn execute(
    runner: &Runner,
    store: Option<&OutputStore>,
    req: RunRequest,
    call: Call,
    context: &RequestContext<RoleServer>,
) -> Result<Ran, Stopped> {
    // Over HTTP the gateway's middleware identified the caller; over stdio it is local.
    let caller = crate::auth::mcp_caller(&context.extensions)
        .unwrap_or_else(|| crate::auth::Caller::local("stdio"));
    let (progress, phases) = Progress::channel();
    let reporter = context
        .meta
        .get_progress_token()
        .map(|token| Reporter::spawn(context.peer.clone(), token, phases));
    let stdin = call.stdin.map(|text| {
        let (tx, rx) = mpsc::channel(1);
        // One chunk, then end of input (the sender is dropped).
        let _ = tx.try_send(Bytes::from(text.into_bytes()));
        rx
    });
    let io = RunIo { progress, stdin };
    // `auto` picks by the command line here, or by the output as it streams; a multi-step
    // run's steps each by their own command line.
    let step_templates: Vec<Template> = match &call.template {
        Some(t) => req
            .steps
            .iter()
            .map(|s| t.for_command(&s.executable, &s.args))
            .collect(),
        None => Vec::new(),
    };
    let template = call
        .template
        .map(|t| t.for_command(&req.executable, &req.args));
    let ct = &context.ct;
    // With peers, a client that closes the call's connection cancels it.
    let gone = super::forward::connection_closed(context);
    let started = tokio::select! {
        // A call cancelled before it came (`server::mcp_http`) starts nothing.
        biased;
        _ = ct.cancelled() => Err(Stopped::Cancelled),
        _ = gone.cancelled() => Err(Stopped::Cancelled),
        s = runner.start_with(req, &caller, io) => s.map_err(Stopped::NotStarted),
    };
    let execution = match started {
        Ok(e) => e,
        Err(e) => {
            if let Some(r) = reporter {
                r.stop();
            }
            return Err(e);
        }
    };
    let recording = store.and_then(|s| s.begin(&caller));
    let mut filters = template
        .as_ref()
        .map(|t| (StreamFilter::new(t), StreamFilter::new(t)));
    let latest = reporter.as_ref().map(|r| r.latest.clone());
    let on_output = |stream: Stream, data: &[u8]| {
        if let Some(r) = &recording {
            r.push(stream, data);
        }
        if let Some((o, e)) = filters.as_mut() {
            match stream {
                Stream::Stdout => o.push(data),
                Stream::Stderr => e.push(data),
            }
        }
        if let Some(latest) = &latest
            && let Some(line) = last_line(data)
            && let Ok(mut l) = latest.lock()
        {
            *l = line;
        }
    };
    // A small cap: the result's budget is applied to what is kept here, and the full output
    // is in the recording.
    let collected = tokio::select! {
        c = collect(execution, call.capture_bytes, on_output) => Some(c),
        _ = ct.cancelled() => None,
        _ = gone.cancelled() => None,
    };
    if let Some(r) = reporter {
        r.stop();
    }
    let Some(collected) = collected else {
        return Err(Stopped::Cancelled);
    };
    if let (Some(s), Some(r)) = (store, &recording) {
        s.finish(r);
    }
    // An error or a timeout counts as a failure for the template, as a signal does.
    let failed = collected.error.is_some() || collected.exit.is_none_or(|e| e.timed_out);
    let code = if failed {
        None
    } else {
        collected.exit.and_then(|e| e.code)
    };
    let uri = |s: Stream| recording.as_ref().map(|r| r.uri(s));
    let filtered = filters
        .map(|(o, e)| {
            (
                o.finish(code, uri(Stream::Stdout).as_deref()),
                e.finish(code, uri(Stream::Stderr).as_deref()),
            )
        })
        // `auto` found no tool in a passing run: the output as it came (data, not a log).
        .filter(|(o, e)| !(o.declined && e.declined));
    Ok(Ran {
        collected,
        filtered,
        recording,
        step_templates,
    })
}

/// Sends progress notifications: each start-up phase as it is reported, then the latest
/// output line at most once a second.
struct Reporter {
    latest: Arc<Mutex<String>>,
    task: tokio::task::JoinHandle<()>,
}

impl Reporter {
    fn spawn(
        peer: Peer<RoleServer>,
        token: ProgressToken,
        mut phases: mpsc::Receiver<Event>,
    ) -> Self {
        let latest = Arc::new(Mutex::new(String::new()));
        let line = latest.clone();
        let task = tokio::spawn(async move {
            let begun = Instant::now();
            let mut tick = tokio::time::interval(PROGRESS_EVERY);
            tick.tick().await;
            // `progress` must increase with every notification.
            let mut n = 0u32;
            let mut phases_open = true;
            loop {
                let message = tokio::select! {
                    p = phases.recv(), if phases_open => match p {
                        Some(Event::Phase { phase, message }) => {
                            let name = serde_json::to_value(phase).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default();
                            match message {
                                Some(m) => format!("{name}: {m}"),
                                None => name,
                            }
                        }
                        Some(_) => continue,
                        None => { phases_open = false; continue; }
                    },
                    _ = tick.tick() => {
                        let l = line.lock().map(|l| l.clone()).unwrap_or_default();
                        let elapsed = begun.elapsed().as_secs_f64();
                        if l.is_empty() {
                            format!("running for {elapsed:.0} s")
                        } else {
                            format!("running for {elapsed:.0} s: {l}")
                        }
                    }
                };
                n += 1;
                let p = ProgressNotificationParam::new(token.clone(), f64::from(n))
                    .with_message(message);
                if peer.notify_progress(p).await.is_err() {
                    return;
                }
            }
        });
        Reporter { latest, task }
    }

    fn stop(self) {
        self.task.abort();
    }
}

/// The last non-empty line of a chunk, shortened for a progress message.
fn last_line(data: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(data);
    let line = text.lines().rev().find(|l| !l.trim().is_empty())?.trim();
    let line = crate::templates::ansi::strip_str(line);
    Some(line.chars().take(200).collect())
}

//! The audit log: one structured line per execution, target `mcp_run::audit`, written when
//! the execution ends (or is abandoned by its client) and for every refused request.
//! Fields: `identity` (token name and/or client address), `argv` (JSON, redacted),
//! `env_names` (never values), `profile`, `backend`, `host`/`namespace`/`pod`/`node`,
//! `session`, `outcome`, `exit_code`, `signal`, `timed_out`, `duration_ms`, `bytes_out`; and
//! one line per session event (`outcome=session_opened|session_ended|session_expired|
//! session_lost|session_closed`, with `identity`, `session`, `profile` and where it ran).

use std::collections::VecDeque;
use std::time::Instant;

use crate::caller::Caller;
use crate::contract::{ErrorBody, Event, RunContext};
use crate::exec::{EventFilter, ExecSpec};
use crate::redact::Redactor;

/// The tracing target of audit lines (filter with `RUST_LOG=mcp_run::audit=info`).
pub(crate) const TARGET: &str = "mcp_run::audit";

/// The most bytes of one argument an audit line keeps; the rest is replaced by a marker.
pub(crate) const MAX_LOGGED_ARG: usize = 256;
/// The most arguments an audit line lists.
pub(crate) const MAX_LOGGED_ARGS: usize = 64;

/// `s` cut to at most `max` bytes (at a character boundary), with a marker saying how much
/// was left out, so that a huge request cannot flood the log.
pub(crate) fn truncate_for_log(s: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if s.len() <= max {
        return s.into();
    }
    let mut cut = max;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}…[{} more bytes]", &s[..cut], s.len() - cut).into()
}

/// The command line of an audit line: argv as a JSON array, secrets redacted, each argument
/// and the number of arguments bounded ([`MAX_LOGGED_ARG`], [`MAX_LOGGED_ARGS`]).
pub(crate) fn argv_json(executable: &str, args: &[String], redactor: Option<&Redactor>) -> String {
    let mut argv: Vec<String> = std::iter::once(executable)
        .chain(args.iter().map(String::as_str))
        .take(MAX_LOGGED_ARGS)
        .map(|a| {
            // Redacted first: a secret cut in two would no longer be recognised.
            let a = match redactor {
                Some(r) => r.redact_str(a),
                None => a.to_owned(),
            };
            truncate_for_log(&a, MAX_LOGGED_ARG).into_owned()
        })
        .collect();
    if args.len() + 1 > MAX_LOGGED_ARGS {
        argv.push(format!(
            "…[{} more arguments]",
            args.len() + 1 - MAX_LOGGED_ARGS
        ));
    }
    serde_json::to_string(&argv).unwrap_or_default()
}

/// Refused bearer tokens: at most this many audit lines per window, then one line saying how
/// many were not logged, so that a flood of bad tokens cannot flood the log.
const UNAUTHORIZED_PER_WINDOW: u32 = 20;
const UNAUTHORIZED_WINDOW: std::time::Duration = std::time::Duration::from_secs(10);

/// Logs a request refused for its token (rate-limited, see [`UNAUTHORIZED_PER_WINDOW`]).
pub(crate) fn unauthorized(path: &str, client: &str, message: &str) {
    use std::sync::Mutex;
    static STATE: Mutex<Option<(Instant, u32, u64)>> = Mutex::new(None);
    let Ok(mut state) = STATE.lock() else { return };
    let now = Instant::now();
    let (start, count, suppressed) = state.get_or_insert((now, 0, 0));
    if now.duration_since(*start) >= UNAUTHORIZED_WINDOW {
        if *suppressed > 0 {
            tracing::info!(target: TARGET, outcome = "unauthorized", suppressed = *suppressed, "{} refused tokens were not logged (at most {UNAUTHORIZED_PER_WINDOW} lines per {} s)", suppressed, UNAUTHORIZED_WINDOW.as_secs());
        }
        *start = now;
        *count = 0;
        *suppressed = 0;
    }
    if *count < UNAUTHORIZED_PER_WINDOW {
        *count += 1;
        tracing::info!(target: TARGET, path = %truncate_for_log(path, MAX_LOGGED_ARG), client = %client, outcome = "unauthorized", "{}", message);
    } else {
        *suppressed += 1;
    }
}

/// Logs a request refused before anything started.
pub(crate) fn rejected(
    caller: &Caller,
    argv: &str,
    env_names: &str,
    profile: Option<&str>,
    e: &ErrorBody,
) {
    tracing::info!(
        target: TARGET,
        identity = %caller.describe(),
        argv = %argv,
        env_names = %env_names,
        profile = profile.unwrap_or("default"),
        outcome = "rejected",
        code = %e.code,
        "{}", e.message
    );
}

/// Logs what happened to a session: `opened`, `ended` (by its owner), `expired`, `lost`,
/// `closed` (at shutdown), with who and why.
pub(crate) fn session(
    caller: &str,
    name: &str,
    event: &str,
    profile: &str,
    context: &RunContext,
    why: &str,
) {
    let none = String::new();
    tracing::info!(
        target: TARGET,
        identity = %caller,
        session = %name,
        outcome = %format!("session_{event}"),
        profile = %profile,
        backend = %context.backend,
        host = %context.host.as_ref().unwrap_or(&none),
        namespace = %context.namespace.as_ref().unwrap_or(&none),
        pod = %context.pod.as_ref().unwrap_or(&none),
        "{why}"
    );
}

/// The env names of a request as a JSON array (the values are never logged).
pub(crate) fn env_names(spec_env: &std::collections::BTreeMap<String, String>) -> String {
    serde_json::to_string(&spec_env.keys().collect::<Vec<_>>()).unwrap_or_default()
}

/// Watches an execution's events and writes its audit line at the end.
pub(crate) struct AuditFilter {
    identity: String,
    argv: String,
    env_names: String,
    profile: String,
    context: RunContext,
    started: Instant,
    bytes_out: u64,
    done: bool,
}

impl AuditFilter {
    pub(crate) fn new(
        caller: &Caller,
        spec: &ExecSpec,
        context: &RunContext,
        redactor: Option<&Redactor>,
    ) -> Self {
        Self {
            identity: caller.describe(),
            argv: argv_json(&spec.executable, &spec.args, redactor),
            env_names: env_names(&spec.env),
            profile: spec.profile.clone().unwrap_or_else(|| "default".into()),
            context: context.clone(),
            started: Instant::now(),
            bytes_out: 0,
            done: false,
        }
    }

    fn log(&mut self, outcome: &str, exit: Option<&crate::contract::ExitInfo>, message: &str) {
        self.done = true;
        let c = &self.context;
        let none = String::new();
        tracing::info!(
            target: TARGET,
            identity = %self.identity,
            argv = %self.argv,
            env_names = %self.env_names,
            profile = %self.profile,
            backend = %c.backend,
            host = %c.host.as_ref().unwrap_or(&none),
            namespace = %c.namespace.as_ref().unwrap_or(&none),
            pod = %c.pod.as_ref().unwrap_or(&none),
            node = %c.node.as_ref().unwrap_or(&none),
            session = %c.session.as_ref().unwrap_or(&none),
            outcome,
            exit_code = exit.and_then(|e| e.code),
            signal = exit.and_then(|e| e.signal),
            timed_out = exit.map(|e| e.timed_out).unwrap_or(false),
            duration_ms = self.started.elapsed().as_millis() as u64,
            bytes_out = self.bytes_out,
            "{message}"
        );
    }
}

impl EventFilter for AuditFilter {
    fn filter(&mut self, event: Event, out: &mut VecDeque<Event>) {
        match &event {
            Event::Stdout { data } | Event::Stderr { data } => self.bytes_out += data.len() as u64,
            Event::Exit(info) => {
                let outcome = if info.timed_out {
                    "timed_out"
                } else {
                    "exited"
                };
                self.log(outcome, Some(info), "execution ended");
            }
            Event::Error { code, message } => {
                let m = format!("{code}: {message}");
                self.log("error", None, &m);
            }
            _ => {}
        }
        out.push_back(event);
    }
}

impl Drop for AuditFilter {
    fn drop(&mut self) {
        if !self.done {
            // The consumer went away before the end: the command was killed.
            self.log(
                "abandoned",
                None,
                "the client went away; the command was killed",
            );
        }
    }
}

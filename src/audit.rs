//! The audit log: one structured line per execution, target `mcp_run::audit`, written when
//! the execution ends (or is abandoned by its client) and for every refused request.
//! Fields: `identity` (token name and/or client address), `argv` (JSON, redacted),
//! `env_names` (never values), `profile`, `backend`, `host`/`namespace`/`pod`/`node`,
//! `outcome`, `exit_code`, `signal`, `timed_out`, `duration_ms`, `bytes_out`.

use std::collections::VecDeque;
use std::time::Instant;

use crate::auth::Caller;
use crate::contract::{ErrorBody, Event, RunContext};
use crate::exec::{EventFilter, ExecSpec};
use crate::redact::Redactor;

/// The tracing target of audit lines (filter with `RUST_LOG=mcp_run::audit=info`).
pub const TARGET: &str = "mcp_run::audit";

/// The command line of an audit line: argv as a JSON array, secrets redacted.
pub fn argv_json(executable: &str, args: &[String], redactor: Option<&Redactor>) -> String {
    let argv: Vec<String> = std::iter::once(executable)
        .chain(args.iter().map(String::as_str))
        .map(|a| match redactor {
            Some(r) => r.redact_str(a),
            None => a.to_owned(),
        })
        .collect();
    serde_json::to_string(&argv).unwrap_or_default()
}

/// Logs a request refused before anything started.
pub fn rejected(
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

/// The env names of a request as a JSON array (the values are never logged).
pub fn env_names(spec_env: &std::collections::BTreeMap<String, String>) -> String {
    serde_json::to_string(&spec_env.keys().collect::<Vec<_>>()).unwrap_or_default()
}

/// Watches an execution's events and writes its audit line at the end.
pub struct AuditFilter {
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
    pub fn new(
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

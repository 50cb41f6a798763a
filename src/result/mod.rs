//! Structured results (after the structured-output RFC in the design references): what an
//! MCP tool call, `run-remote --output-format json|markdown` and any other consumer that
//! wants the whole run at once get, instead of a stream.
//!
//! Output is captured with a cap per stream: the head and the tail are kept and a marker
//! says how many bytes were left out, so that a build that prints megabytes still fits an
//! agent's context and the error at the end survives. `/raw` streams are never capped.
//! Bytes are shown as UTF-8, invalid sequences replaced by U+FFFD (a cut can split a
//! character at the marker too).
//!
//! Size: about 440 lines of code; the rest are unit tests of the renderings, kept beside them.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::contract::{ErrorBody, Event, ExitInfo, RunContext, RunRequest};
use crate::exec::Execution;

mod budget;
mod template;

pub(crate) use budget::{cost, excerpt, fit_head};
pub(crate) use template::Filters;

/// The default cap per stream of `run-remote --output-format json|markdown`: 1 MiB. (MCP
/// results are sized by a character budget instead, see [`Capture::excerpt`].)
pub(crate) const DEFAULT_MAX_OUTPUT_BYTES: usize = 1024 * 1024;

/// Where and how a command ran.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub(crate) struct ExecutionContext {
    /// The tool (or client) that ran the command.
    pub tool: String,
    /// The command line, quoted for reading (it ran as argv, not through a shell).
    pub command_line: String,
    /// `kubernetes`, `local`, or what a remote gateway reported; absent when the command
    /// never reached a backend (refused, or failed before it started).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub backend: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    /// The host of a local-process run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// The workspace the command ran in, and the version of its tree.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace_version: Option<String>,
    /// The session the command ran in, and which call of it this was (1: it opened it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_call: Option<u64>,
    /// For a multi-step run: how many steps it asked for (`outputs` has one entry per step
    /// that started).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps: Option<usize>,
}

/// One command's captured result.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub(crate) struct CommandOutput {
    pub command: String,
    pub stdout: String,
    pub stderr: String,
    /// The exit code; null when a signal killed the command or it never ran.
    pub exit_code: Option<i32>,
    /// The signal that killed it.
    pub signal: Option<i32>,
    pub duration_ms: u64,
    /// When it started, RFC 3339.
    pub started_at: String,
    /// Whether stdout or stderr was cut to the cap (the text says where and how much).
    pub truncated: bool,
    /// Whether the gateway's timeout killed it.
    #[serde(default)]
    pub timed_out: bool,
    /// Where the whole output can be read, when this result leaves part of it out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub full_output: Option<FullOutput>,
}

/// The kept full output of a run (MCP resources, `resources/read`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub(crate) struct FullOutput {
    /// The URI of stdout (`mcp-run://runs/{id}/stdout`).
    pub stdout_uri: String,
    pub stdout_bytes: u64,
    pub stderr_uri: String,
    pub stderr_bytes: u64,
    /// How to read parts of it.
    pub how: String,
}

/// The whole result.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub(crate) struct StructuredResult {
    pub context: ExecutionContext,
    pub outputs: Vec<CommandOutput>,
    /// Every command started and exited 0.
    pub success: bool,
    pub total_duration_ms: u64,
    /// One line for people and agents.
    pub summary: String,
    /// Why the command did not run or did not finish (`code: message`), if so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// One stream captured with a cap: the first half and the last half of the cap are kept.
#[derive(Debug, Clone)]
pub(crate) struct Capture {
    head_cap: usize,
    tail_cap: usize,
    head: Vec<u8>,
    tail: VecDeque<u8>,
    total: u64,
}

impl Capture {
    pub(crate) fn new(cap: usize) -> Self {
        let head_cap = cap / 2;
        Self {
            head_cap,
            tail_cap: cap - head_cap,
            head: Vec::new(),
            tail: VecDeque::new(),
            total: 0,
        }
    }

    pub(crate) fn push(&mut self, mut data: &[u8]) {
        self.total += data.len() as u64;
        if self.head.len() < self.head_cap {
            let n = data.len().min(self.head_cap - self.head.len());
            self.head.extend_from_slice(&data[..n]);
            data = &data[n..];
        }
        if data.len() >= self.tail_cap {
            self.tail.clear();
            self.tail.extend(&data[data.len() - self.tail_cap..]);
            return;
        }
        let overflow = (self.tail.len() + data.len()).saturating_sub(self.tail_cap);
        self.tail.drain(..overflow);
        self.tail.extend(data);
    }

    /// Bytes that were written but are not kept.
    pub(crate) fn omitted(&self) -> u64 {
        self.total - (self.head.len() + self.tail.len()) as u64
    }

    /// The kept bytes with a marker where bytes were left out; and whether any were.
    pub(crate) fn text(&self) -> (String, bool) {
        let omitted = self.omitted();
        let mut bytes = self.head.clone();
        if omitted > 0 {
            if bytes.last().is_some_and(|b| *b != b'\n') {
                bytes.push(b'\n');
            }
            bytes.extend_from_slice(
                format!(
                    "[... mcp-run: {omitted} bytes left out of {} ...]\n",
                    self.total
                )
                .as_bytes(),
            );
        }
        bytes.extend(self.tail.iter());
        (String::from_utf8_lossy(&bytes).into_owned(), omitted > 0)
    }

    pub(crate) fn total(&self) -> u64 {
        self.total
    }

    /// The captured stream cut to `budget` (see [`excerpt`]); `marker` gets stream offsets.
    pub(crate) fn excerpt(
        &self,
        budget: usize,
        marker: impl Fn(u64, u64) -> String,
    ) -> (String, bool) {
        let mut bytes = self.head.clone();
        let split = bytes.len();
        bytes.extend(self.tail.iter());
        excerpt(&bytes, Some((split, self.omitted())), budget, marker)
    }
}

/// A run as collected from its events.
#[derive(Debug)]
pub(crate) struct Collected {
    pub context: RunContext,
    pub stdout: Capture,
    pub stderr: Capture,
    pub exit: Option<ExitInfo>,
    pub error: Option<ErrorBody>,
    pub started_at: String,
    pub duration: Duration,
    /// A multi-step run's steps, in order (empty for a single command, whose output is
    /// `stdout` and `stderr`).
    pub steps: Vec<CollectedStep>,
}

/// One step of a multi-step run as collected.
#[derive(Debug)]
pub(crate) struct CollectedStep {
    pub command: String,
    pub stdout: Capture,
    pub stderr: Capture,
    pub exit: Option<ExitInfo>,
    pub started_at: String,
}

/// Which stream a chunk came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stream {
    Stdout,
    Stderr,
}

/// Reads an execution to its end, capturing both streams; `on_output` sees every chunk
/// (for progress reports).
pub(crate) async fn collect(
    mut execution: Execution,
    cap: usize,
    mut on_output: impl FnMut(Stream, &[u8]),
) -> Collected {
    let started = Instant::now();
    let started_at = k8s_openapi::jiff::Timestamp::now().to_string();
    let context = execution.context().clone();
    let (mut stdout, mut stderr) = (Capture::new(cap), Capture::new(cap));
    let (mut exit, mut error) = (None, None);
    let mut steps: Vec<CollectedStep> = Vec::new();
    while let Some(event) = execution.next().await {
        match event {
            Event::Stdout { data } => {
                on_output(Stream::Stdout, &data);
                match steps.last_mut() {
                    Some(s) => s.stdout.push(&data),
                    None => stdout.push(&data),
                }
            }
            Event::Stderr { data } => {
                on_output(Stream::Stderr, &data);
                match steps.last_mut() {
                    Some(s) => s.stderr.push(&data),
                    None => stderr.push(&data),
                }
            }
            Event::Step { command, .. } => steps.push(CollectedStep {
                command,
                stdout: Capture::new(cap),
                stderr: Capture::new(cap),
                exit: None,
                started_at: k8s_openapi::jiff::Timestamp::now().to_string(),
            }),
            Event::StepExit { exit: info, .. } => {
                if let Some(s) = steps.last_mut() {
                    s.exit = Some(info);
                }
            }
            Event::Exit(info) => exit = Some(info),
            Event::Error { code, message } => error = Some(ErrorBody::new(code, message)),
            _ => {}
        }
    }
    Collected {
        context,
        stdout,
        stderr,
        exit,
        error,
        started_at,
        duration: started.elapsed(),
        steps,
    }
}

impl StructuredResult {
    fn context_for(tool: &str, req: &RunRequest, ctx: Option<&RunContext>) -> ExecutionContext {
        let ctx = ctx.cloned().unwrap_or_default();
        ExecutionContext {
            tool: tool.into(),
            command_line: req.command_line(),
            backend: ctx.backend,
            namespace: ctx.namespace,
            pod: ctx.pod,
            node: ctx.node,
            image: ctx.image,
            profile: ctx.profile.or_else(|| req.profile.clone()),
            host: ctx.host,
            cwd: req.cwd.clone(),
            workspace: ctx.workspace,
            workspace_version: ctx.workspace_version,
            session: ctx.session,
            session_call: ctx.session_call,
            steps: (!req.steps.is_empty()).then_some(req.steps.len()),
        }
    }

    /// The result of a multi-step run that started: one output per step that started.
    fn from_steps(tool: &str, req: &RunRequest, run: &Collected) -> Self {
        let mut context = Self::context_for(tool, req, Some(&run.context));
        context.steps = Some(req.steps.len());
        let outputs: Vec<CommandOutput> = run
            .steps
            .iter()
            .map(|s| {
                let (stdout, t1) = s.stdout.text();
                let (stderr, t2) = s.stderr.text();
                let exit = s.exit.unwrap_or_default();
                CommandOutput {
                    command: s.command.clone(),
                    stdout,
                    stderr,
                    exit_code: s.exit.and_then(|e| e.code),
                    signal: s.exit.and_then(|e| e.signal),
                    duration_ms: exit.duration_ms,
                    started_at: s.started_at.clone(),
                    truncated: t1 || t2,
                    timed_out: exit.timed_out,
                    full_output: None,
                }
            })
            .collect();
        let all_ran = outputs.len() == req.steps.len();
        let success = run.error.is_none()
            && all_ran
            && run
                .steps
                .iter()
                .all(|s| s.exit.is_some_and(|e| e.success()));
        let error = run
            .error
            .as_ref()
            .map(|e| format!("{}: {}", e.code, e.message));
        let failed = run
            .steps
            .iter()
            .position(|s| !s.exit.is_some_and(|e| e.success()));
        let how = match (&run.error, failed) {
            (Some(e), _) => format!("failed: {}", e.message),
            (None, None) if all_ran => "all succeeded".to_owned(),
            (None, None) => "stopped".to_owned(),
            (None, Some(i)) => {
                let e = run.steps[i].exit.unwrap_or_default();
                let what = match (e.timed_out, e.code, e.signal) {
                    (true, _, _) => "timed out".to_owned(),
                    (_, Some(c), _) => format!("exited {c}"),
                    (_, None, Some(sig)) => format!("was killed by signal {sig}"),
                    _ => "ended without an exit status".to_owned(),
                };
                let rest = if all_ran {
                    String::new()
                } else {
                    format!(
                        "; steps {} to {} did not run",
                        outputs.len() + 1,
                        req.steps.len()
                    )
                };
                format!("step {} `{}` {what}{rest}", i + 1, run.steps[i].command)
            }
        };
        let summary = format!(
            "{} steps: {how} in {} ms {}",
            req.steps.len(),
            run.duration.as_millis(),
            where_line(&context)
        );
        Self {
            total_duration_ms: run.duration.as_millis() as u64,
            context,
            outputs,
            success,
            summary,
            error,
        }
    }

    /// The result of a run that started.
    pub(crate) fn from_run(tool: &str, req: &RunRequest, run: &Collected) -> Self {
        if !req.steps.is_empty() {
            return Self::from_steps(tool, req, run);
        }
        let context = Self::context_for(tool, req, Some(&run.context));
        let (stdout, t1) = run.stdout.text();
        let (stderr, t2) = run.stderr.text();
        let exit = run.exit.unwrap_or_default();
        let duration_ms = run
            .exit
            .map(|e| e.duration_ms)
            .unwrap_or(run.duration.as_millis() as u64);
        let output = CommandOutput {
            command: context.command_line.clone(),
            stdout,
            stderr,
            exit_code: run.exit.and_then(|e| e.code),
            signal: run.exit.and_then(|e| e.signal),
            duration_ms,
            started_at: run.started_at.clone(),
            truncated: t1 || t2,
            timed_out: exit.timed_out,
            full_output: None,
        };
        let success =
            run.error.is_none() && run.exit.is_some_and(|e| e.code == Some(0) && !e.timed_out);
        let error = run
            .error
            .as_ref()
            .map(|e| format!("{}: {}", e.code, e.message));
        let how = match (&run.error, run.exit) {
            (Some(e), _) => format!("failed: {}", e.message),
            // The summary adds the duration: "timed out in 1002 ms".
            (None, Some(e)) if e.timed_out => "timed out".to_string(),
            (None, Some(ExitInfo { code: Some(c), .. })) => format!("exited {c}"),
            (
                None,
                Some(ExitInfo {
                    signal: Some(s), ..
                }),
            ) => format!("killed by signal {s}"),
            _ => "ended without an exit status".into(),
        };
        let summary = format!(
            "`{}` {how} in {} ms {}",
            context.command_line,
            duration_ms,
            where_line(&context)
        );
        Self {
            total_duration_ms: run.duration.as_millis() as u64,
            context,
            outputs: vec![output],
            success,
            summary,
            error,
        }
    }

    /// The result of a request that was refused or could not start.
    pub(crate) fn not_started(tool: &str, req: &RunRequest, error: &ErrorBody) -> Self {
        Self::did_not_run(tool, req, error.code.as_str(), &error.message)
    }

    /// A command that did not run, for `reason` (an error code, or a client's own reason).
    pub(crate) fn did_not_run(tool: &str, req: &RunRequest, reason: &str, message: &str) -> Self {
        let context = Self::context_for(tool, req, None);
        Self {
            summary: format!(
                "`{}` did not run: {message} ({reason})",
                context.command_line
            ),
            context,
            outputs: Vec::new(),
            success: false,
            total_duration_ms: 0,
            error: Some(format!("{reason}: {message}")),
        }
    }

    pub(crate) fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// Markdown for agents and people: where it ran, status, duration, output, errors.
    pub(crate) fn to_markdown(&self) -> String {
        let mut md = format!("## Execution: `{}`\n\n", self.context.tool);
        md.push_str(&format!(
            "**Where:** {}\n",
            where_line(&self.context).trim_start_matches("on ")
        ));
        let status = if self.success {
            "✓ Success".to_string()
        } else if let Some(e) = &self.error {
            format!("✗ Failed: {e}")
        } else if let Some(o) = self
            .outputs
            .iter()
            .find(|o| o.exit_code != Some(0) || o.timed_out)
            .or(self.outputs.first())
        {
            match (o.exit_code, o.signal, o.timed_out) {
                (_, _, true) => "✗ Timed out".to_string(),
                (Some(c), _, _) => format!("✗ Failed (exit code {c})"),
                (None, Some(s), _) => format!("✗ Killed by signal {s}"),
                _ => "✗ Failed".to_string(),
            }
        } else {
            "✗ Failed".to_string()
        };
        md.push_str(&format!("**Status:** {status}\n"));
        md.push_str(&format!("**Duration:** {}ms\n\n", self.total_duration_ms));
        for (i, o) in self.outputs.iter().enumerate() {
            if self.context.steps.is_some() {
                md.push_str(&format!(
                    "### Step {}: `{}` ({}ms)\n\n",
                    i + 1,
                    o.command,
                    o.duration_ms
                ));
            } else {
                md.push_str(&format!("### `{}` ({}ms)\n\n", o.command, o.duration_ms));
            }
            for (title, text) in [("Output", &o.stdout), ("Errors", &o.stderr)] {
                if text.is_empty() {
                    continue;
                }
                let fence = fence_for(text);
                md.push_str(&format!("**{title}:**\n{fence}\n{text}"));
                if !text.ends_with('\n') {
                    md.push('\n');
                }
                md.push_str(&format!("{fence}\n\n"));
            }
            match (o.exit_code, o.signal) {
                (Some(c), _) if c != 0 => md.push_str(&format!("**Exit Code:** {c}\n\n")),
                (None, Some(s)) => md.push_str(&format!("**Signal:** {s}\n\n")),
                _ => {}
            }
            if let Some(f) = &o.full_output {
                md.push_str(&format!(
                    "**Full output:** `{}` ({} bytes), `{}` ({} bytes): {}.\n\n",
                    f.stdout_uri, f.stdout_bytes, f.stderr_uri, f.stderr_bytes, f.how
                ));
            }
        }
        md
    }
}

/// A code fence longer than any run of backticks in the text.
fn fence_for(text: &str) -> String {
    let (mut longest, mut run) = (0, 0);
    for c in text.chars() {
        if c == '`' {
            run += 1;
            longest = longest.max(run);
        } else {
            run = 0;
        }
    }
    "`".repeat((longest + 1).max(3))
}

/// "on pod P on node N (namespace S, image I)" or "on host H".
fn where_line(c: &ExecutionContext) -> String {
    let place = match (&c.pod, &c.host) {
        (Some(pod), _) => {
            let mut s = format!("on pod `{pod}`");
            if let Some(n) = &c.node {
                s.push_str(&format!(" on node `{n}`"));
            }
            let extra: Vec<String> = [
                c.namespace.as_ref().map(|n| format!("namespace `{n}`")),
                c.image.as_ref().map(|i| format!("image `{i}`")),
            ]
            .into_iter()
            .flatten()
            .collect();
            if !extra.is_empty() {
                s.push_str(&format!(" ({})", extra.join(", ")));
            }
            s
        }
        (None, Some(host)) => format!("on host `{host}` ({} backend)", c.backend),
        (None, None) if !c.backend.is_empty() => format!("on the {} backend", c.backend),
        _ => "nowhere (it did not start)".into(),
    };
    match (&c.session, c.session_call) {
        (Some(name), Some(1)) => format!("{place}, in session `{name}` (opened by this call)"),
        (Some(name), Some(n)) => format!("{place}, in session `{name}` (call {n})"),
        _ => place,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::ErrorCode;

    #[test]
    fn capture_keeps_head_and_tail_with_a_marker() {
        let mut c = Capture::new(10);
        c.push(b"0123");
        c.push(b"456789abcdefghij");
        c.push(b"XYZ");
        assert_eq!(c.total(), 23);
        assert_eq!(c.omitted(), 13);
        let (text, truncated) = c.text();
        assert!(truncated);
        assert_eq!(
            text,
            "01234\n[... mcp-run: 13 bytes left out of 23 ...]\nijXYZ"
        );
        let mut small = Capture::new(10);
        small.push(b"abc");
        assert_eq!(small.text(), ("abc".to_string(), false));
    }

    #[test]
    fn command_lines_are_quoted_for_reading() {
        let req = RunRequest {
            executable: "sh".into(),
            args: vec!["-c".to_string(), "echo 'hi' $HOME".into(), "".into()],
            ..Default::default()
        };
        assert_eq!(req.command_line(), r#"sh -c 'echo '\''hi'\'' $HOME' ''"#);
    }

    fn req() -> RunRequest {
        serde_json::from_value(
            serde_json::json!({"executable": "sh", "args": ["-c", "make"], "cwd": "/src"}),
        )
        .unwrap()
    }

    fn run(code: Option<i32>, signal: Option<i32>, stdout: &str, stderr: &str) -> Collected {
        let (mut o, mut e) = (Capture::new(1024), Capture::new(1024));
        o.push(stdout.as_bytes());
        e.push(stderr.as_bytes());
        Collected {
            context: RunContext {
                backend: "kubernetes".into(),
                namespace: Some("ci".into()),
                pod: Some("mcp-run-abc".into()),
                node: Some("node-1".into()),
                image: Some("rust:1".into()),
                profile: Some("default".into()),
                ..Default::default()
            },
            stdout: o,
            stderr: e,
            exit: Some(ExitInfo {
                code,
                signal,
                duration_ms: 42,
                timed_out: false,
            }),
            error: None,
            started_at: "2026-11-23T10:00:00Z".into(),
            duration: Duration::from_millis(50),
            steps: Vec::new(),
        }
    }

    #[test]
    fn markdown_of_a_failure() {
        let r = StructuredResult::from_run(
            "run_network_tool",
            &req(),
            &run(Some(2), None, "building\n", "error: boom\n"),
        );
        assert!(!r.success);
        assert_eq!(
            r.to_markdown(),
            "## Execution: `run_network_tool`\n\n\
             **Where:** pod `mcp-run-abc` on node `node-1` (namespace `ci`, image `rust:1`)\n\
             **Status:** ✗ Failed (exit code 2)\n\
             **Duration:** 50ms\n\n\
             ### `sh -c make` (42ms)\n\n\
             **Output:**\n```\nbuilding\n```\n\n\
             **Errors:**\n```\nerror: boom\n```\n\n\
             **Exit Code:** 2\n\n"
        );
        assert_eq!(
            r.summary,
            "`sh -c make` exited 2 in 42 ms on pod `mcp-run-abc` on node `node-1` (namespace `ci`, image `rust:1`)"
        );
    }

    #[test]
    fn json_of_a_success_and_of_a_refusal() {
        let r =
            StructuredResult::from_run("run_network_tool", &req(), &run(Some(0), None, "ok\n", ""));
        let v: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({
                "context": {"tool": "run_network_tool", "command_line": "sh -c make", "backend": "kubernetes",
                            "namespace": "ci", "pod": "mcp-run-abc", "node": "node-1", "image": "rust:1",
                            "profile": "default", "cwd": "/src"},
                "outputs": [{"command": "sh -c make", "stdout": "ok\n", "stderr": "", "exit_code": 0, "signal": null,
                             "duration_ms": 42, "started_at": "2026-11-23T10:00:00Z", "truncated": false, "timed_out": false}],
                "success": true, "total_duration_ms": 50,
                "summary": "`sh -c make` exited 0 in 42 ms on pod `mcp-run-abc` on node `node-1` (namespace `ci`, image `rust:1`)"
            })
        );
        let refused = StructuredResult::not_started(
            "run_network_tool",
            &req(),
            &ErrorBody::new(ErrorCode::UnknownProfile, "no profile gpu"),
        );
        assert!(!refused.success && refused.outputs.is_empty());
        assert_eq!(
            refused.error.as_deref(),
            Some("unknown_profile: no profile gpu")
        );
        assert!(
            refused
                .to_markdown()
                .contains("**Status:** ✗ Failed: unknown_profile: no profile gpu")
        );
    }

    #[test]
    fn fences_outgrow_backticks_in_output() {
        let r = StructuredResult::from_run(
            "t",
            &req(),
            &run(Some(0), None, "```rust\nfn x() {}\n```\n", ""),
        );
        assert!(
            r.to_markdown().contains("**Output:**\n````\n```rust"),
            "{}",
            r.to_markdown()
        );
        let killed = StructuredResult::from_run("t", &req(), &run(None, Some(9), "", ""));
        assert!(
            killed.to_markdown().contains("✗ Killed by signal 9")
                && killed.to_markdown().contains("**Signal:** 9")
        );
    }
}

//! Tool results sized for agents: the output of a run cut to the call's budget (head and
//! tail kept, each cut marked in place with the URI that reads what was left out), the same
//! bounded text in the structured content and in the markdown, and, when anything was left
//! out, where the full output is.

use rmcp::model::{CallToolResult, ContentBlock};

use crate::contract::{ErrorBody, RunRequest};
use crate::result::{FullOutput, Stream, StructuredResult, cost, excerpt};

use super::execute::Ran;
use super::store::stream_name;

/// How to read a kept output, for results and descriptions.
pub(crate) const HOW_TO_READ: &str = "read it with resources/read; add ?lines=A-B, ?bytes=A-B or ?grep=REGEX to read a part; every read returns one page and names the next";

/// Both streams of a run as a result shows them.
pub(crate) struct Texts {
    pub stdout: String,
    pub stderr: String,
    /// Whether the budget cut either stream.
    pub cut: bool,
    /// Where the full output is, when anything was left out and it was kept.
    pub full: Option<FullOutput>,
}

/// The two streams of `ran` within `budget` characters together.
pub(crate) fn texts(ran: &Ran, budget: usize) -> Texts {
    let c = &ran.collected;
    let uri = |s: Stream| ran.recording.as_ref().map(|r| r.uri(s));
    let estimates = match &ran.filtered {
        Some((o, e)) => [
            cost(&String::from_utf8_lossy(&o.output)),
            cost(&String::from_utf8_lossy(&e.output)),
        ],
        None => [c.stdout.total() as usize, c.stderr.total() as usize],
    };
    // stderr (usually short, often the error) gets what it needs up to a third, more when
    // stdout leaves room.
    let err_share = estimates[1].min((budget / 3).max(budget.saturating_sub(estimates[0])));
    let shares = [budget - err_share, err_share];
    let mut cut = false;
    let mut removed = false;
    let mut out = [String::new(), String::new()];
    for (i, s) in [Stream::Stdout, Stream::Stderr].into_iter().enumerate() {
        let name = stream_name(s);
        let read = match uri(s) {
            Some(u) => format!("; read them: {u}"),
            None => String::new(),
        };
        let (text, was_cut) = match &ran.filtered {
            Some((o, e)) => {
                let f = if i == 0 { o } else { e };
                removed |= f.omitted_lines() > 0;
                let full = uri(s)
                    .map(|u| format!("; the full output: {u}"))
                    .unwrap_or_default();
                excerpt(&f.output, None, shares[i], |a, b| {
                    format!(
                        "[... mcp-run: {} bytes of the filtered {name} left out{full} ...]",
                        b - a
                    )
                })
            }
            None => {
                let capture = if i == 0 { &c.stdout } else { &c.stderr };
                capture.excerpt(shares[i], |a, b| {
                    let read = if read.is_empty() {
                        String::new()
                    } else {
                        format!("{read}?bytes={a}-{b}")
                    };
                    format!(
                        "[... mcp-run: bytes {a}-{b} of {name} ({} of {}) left out{read} ...]",
                        b - a,
                        capture.total()
                    )
                })
            }
        };
        cut |= was_cut;
        out[i] = text;
    }
    let full = match &ran.recording {
        Some(r) if cut || removed => Some(FullOutput {
            stdout_uri: r.uri(Stream::Stdout),
            stdout_bytes: r.total(Stream::Stdout),
            stderr_uri: r.uri(Stream::Stderr),
            stderr_bytes: r.total(Stream::Stderr),
            how: HOW_TO_READ.into(),
        }),
        _ => None,
    };
    let [stdout, stderr] = out;
    Texts {
        stdout,
        stderr,
        cut,
        full,
    }
}

/// The result of `run_network_tool`: markdown content and the [`StructuredResult`] as
/// structured content, both bounded by `budget`; `isError` unless the command exited 0.
pub(crate) fn run_result(tool: &str, req: &RunRequest, ran: &Ran, budget: usize) -> CallToolResult {
    let mut r = StructuredResult::from_run(tool, req, &ran.collected);
    if !ran.collected.steps.is_empty() {
        steps_texts(&mut r, ran, budget);
        return finish(r);
    }
    let t = texts(ran, budget);
    if let Some(o) = r.outputs.first_mut() {
        o.stdout = t.stdout;
        o.stderr = t.stderr;
        o.truncated = t.cut;
        o.full_output = t.full;
    }
    finish(r)
}

/// A multi-step run's outputs within `budget`: each step's streams get an equal share, each
/// filtered by the call's template on its own (the step's exit code decides what a failure
/// keeps). The full output of all steps together stays readable as the run's resources.
fn steps_texts(r: &mut StructuredResult, ran: &Ran, budget: usize) {
    let steps = &ran.collected.steps;
    let share = (budget / (2 * steps.len().max(1))).max(200);
    let mut cut = false;
    for (step, (o, s)) in r.outputs.iter_mut().zip(steps).enumerate() {
        let code = s.exit.filter(|e| !e.timed_out).and_then(|e| e.code);
        let mut texts = [String::new(), String::new()];
        for (i, capture) in [&s.stdout, &s.stderr].into_iter().enumerate() {
            let (text, was_cut) = match ran.step_templates.get(step) {
                Some(t) => {
                    let (whole, _) = capture.text();
                    let mut f = crate::templates::StreamFilter::new(t);
                    f.push(whole.as_bytes());
                    let filtered = f.finish(code, None);
                    excerpt(&filtered.output, None, share, |a, b| {
                        format!("[... mcp-run: {} bytes of the filtered step output left out ...]", b - a)
                    })
                }
                None => capture.excerpt(share, |a, b| {
                    format!(
                        "[... mcp-run: bytes {a}-{b} of this step's output ({} of {}) left out ...]",
                        b - a,
                        capture.total()
                    )
                }),
            };
            cut |= was_cut;
            texts[i] = text;
        }
        let [stdout, stderr] = texts;
        o.stdout = stdout;
        o.stderr = stderr;
        o.truncated |= cut;
    }
    if let (true, Some(rec), Some(last)) = (cut, &ran.recording, r.outputs.last_mut()) {
        last.full_output = Some(FullOutput {
            stdout_uri: rec.uri(Stream::Stdout),
            stdout_bytes: rec.total(Stream::Stdout),
            stderr_uri: rec.uri(Stream::Stderr),
            stderr_bytes: rec.total(Stream::Stderr),
            how: format!("{HOW_TO_READ} (every step's output, in order)"),
        });
    }
}

/// A tool result from a structured result.
pub(crate) fn finish(r: StructuredResult) -> CallToolResult {
    let content = vec![ContentBlock::text(r.to_markdown())];
    let mut result = if r.success {
        CallToolResult::success(content)
    } else {
        CallToolResult::error(content)
    };
    result.structured_content = serde_json::to_value(&r).ok();
    result
}

/// The result of a declared CLI tool: `{stdout, stderr, exitCode}` (plus `fullOutput` when
/// something was left out), `isError` when the exit code is not 0.
pub(crate) fn cli_result(ran: &Ran, budget: usize) -> CallToolResult {
    if let Some(e) = &ran.collected.error {
        return error_result(e);
    }
    let exit_code = crate::exit::status(ran.collected.exit.as_ref());
    let t = texts(ran, budget);
    let output = serde_json::to_value(super::tools::ToolOutput {
        stdout: t.stdout,
        stderr: t.stderr,
        exit_code,
        full_output: t.full,
    })
    .unwrap_or_default();
    let content = vec![ContentBlock::text(
        serde_json::to_string_pretty(&output).unwrap_or_default(),
    )];
    let mut result = if exit_code == 0 {
        CallToolResult::success(content)
    } else {
        CallToolResult::error(content)
    };
    result.structured_content = Some(output);
    result
}

/// A call that never reached a command (bad arguments, cancelled).
pub(crate) fn error_result(e: &ErrorBody) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(format!(
        "{}: {}",
        e.code, e.message
    ))])
}

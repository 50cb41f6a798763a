//! A template applied to a [`StructuredResult`] (`run-remote --output-format json|markdown`).

use super::{Stream, StructuredResult};
use crate::templates::{StreamFilter, Template};

/// Both streams filtered by one template as they arrive (bounded memory), for a run that is
/// collected whole: feed it from [`super::collect`]'s `on_output`.
pub(crate) struct Filters {
    stdout: StreamFilter,
    stderr: StreamFilter,
}

impl Filters {
    pub(crate) fn new(template: &Template) -> Self {
        Self {
            stdout: StreamFilter::new(template),
            stderr: StreamFilter::new(template),
        }
    }

    pub(crate) fn push(&mut self, stream: Stream, data: &[u8]) {
        match stream {
            Stream::Stdout => self.stdout.push(data),
            Stream::Stderr => self.stderr.push(data),
        }
    }

    /// Replaces the result's output with the filtered streams. A failure (error, timeout,
    /// signal) counts as one for the template. Says so in the summary, in one short note,
    /// only when lines were left out. Returns the lines left out.
    pub(crate) fn apply(self, result: &mut StructuredResult, full: Option<&str>) -> usize {
        let Some(o) = result.outputs.first_mut() else {
            return 0;
        };
        let code = if o.timed_out || result.error.is_some() {
            None
        } else {
            o.exit_code
        };
        let out = self.stdout.finish(code, full);
        let err = self.stderr.finish(code, full);
        let removed = out.omitted_lines() + err.omitted_lines();
        o.stdout = String::from_utf8_lossy(&out.output).into_owned();
        o.stderr = String::from_utf8_lossy(&err.output).into_owned();
        if removed > 0 {
            result.summary.push_str(&format!(
                "; template `{}` left out {removed} of {} lines",
                if out.omitted_lines() > 0 {
                    &out.template
                } else {
                    &err.template
                },
                out.total_lines + err.total_lines
            ));
        }
        removed
    }
}

/// Filters every output's stdout and stderr held whole (see [`Filters`]); returns the lines
/// left out.
#[cfg(test)]
fn apply_to_result(result: &mut StructuredResult, template: &Template) -> usize {
    let mut f = Filters::new(template);
    if let Some(o) = result.outputs.first() {
        f.push(Stream::Stdout, o.stdout.as_bytes());
        f.push(Stream::Stderr, o.stderr.as_bytes());
    }
    f.apply(result, None)
}

#[cfg(test)]
mod template_tests {
    use super::*;
    use crate::result::{CommandOutput, ExecutionContext};
    use crate::templates::Catalog;

    #[test]
    fn filters_outputs_and_says_how_to_get_everything() {
        let noise: String = (0..30).map(|i| format!("test t{i} ... ok\n")).collect();
        let mut r = StructuredResult {
            context: ExecutionContext::default(),
            outputs: vec![CommandOutput {
                command: "cargo test".into(),
                stdout: format!(
                    "{noise}test x ... FAILED\n\nfailures:\n    x\n\ntest result: FAILED. 30 passed; 1 failed\n"
                ),
                stderr: "error: test failed, to rerun pass `--lib`\n".into(),
                exit_code: Some(101),
                signal: None,
                duration_ms: 1,
                started_at: String::new(),
                truncated: false,
                timed_out: false,
                full_output: None,
            }],
            success: false,
            total_duration_ms: 1,
            summary: "`cargo test` exited 101".into(),
            error: None,
        };
        let t = Catalog::builtin().get("cargo-test").unwrap().clone();
        assert_eq!(apply_to_result(&mut r, &t), 31);
        let o = &r.outputs[0];
        assert!(o.stdout.contains("test x ... FAILED\n") && !o.stdout.contains("t3 ... ok"));
        assert_eq!(o.stderr, "error: test failed, to rerun pass `--lib`\n");
        assert!(
            r.summary
                .contains("template `cargo-test` left out 31 of 37 lines"),
            "{}",
            r.summary
        );
        // Nothing left out: nothing added.
        let before = r.summary.clone();
        assert_eq!(apply_to_result(&mut r, &t), 0);
        assert_eq!(r.summary, before);
    }
}

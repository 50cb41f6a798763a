//! A template applied to a [`StructuredResult`] (`run-remote --output-format json|markdown`).

use super::StructuredResult;
use crate::templates::Template;

/// Filters every output's stdout and stderr and says so in the summary: which template, how
/// many lines it removed, and how to get the full output. Returns the lines removed.
pub fn apply_to_result(result: &mut StructuredResult, template: &Template) -> usize {
    let mut removed = 0;
    let mut total = 0;
    for o in &mut result.outputs {
        for text in [&mut o.stdout, &mut o.stderr] {
            let f = template.apply(text.as_bytes(), o.exit_code);
            removed += f.omitted_lines();
            total += f.total_lines;
            *text = String::from_utf8_lossy(&f.output).into_owned();
        }
    }
    result.summary.push_str(&format!(
        "; template `{}` removed {removed} of {total} output lines (run again without a template for the full output)",
        template.name
    ));
    removed
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
            r.summary.contains("template `cargo-test` removed 31 of 37"),
            "{}",
            r.summary
        );
        assert!(r.summary.contains("without a template"));
    }
}

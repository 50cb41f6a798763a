//! The filtering itself: one template applied to one stream of bytes.
//!
//! Lines are kept byte for byte (CR, invalid UTF-8 and a last line without a newline
//! included); matching uses `regex::bytes`, so a line with invalid UTF-8 still matches on its
//! valid parts, and an invalid sequence matches only patterns that accept any byte.

use std::sync::LazyLock;

use regex::bytes::Regex;

use super::Template;

/// Lines that report a failure. On a non-zero exit these survive whatever the template
/// says: they are the lines a filter must never drop (compile errors before tests ran,
/// collection errors, panics, tracebacks, pytest's `E   ` assertion detail). It runs once over
/// the whole output in multi-line mode, so no alternative may match across a newline.
static ERROR_SHAPED: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(concat!(
        // Every alternative starts with a literal, so that a literal search finds candidates;
        // ASCII word boundaries, as a Unicode one slows lines with a non-ASCII byte.
        r"(?m)(?i:(?-u:\b)error(?-u:\b))",
        r"|(?:Error|Exception)(?-u:\b)",
        r"|(?-u:\b)FAIL(?:ED|URE|URES)?(?-u:\b)",
        r"|^Traceback \(most recent call last\)",
        r"|(?-u:\b)panicked at(?-u:\b)",
        r"|^E {2,}[^\s]",
        r"|●[ \t]",
        r"|: command not found",
        r"|No such file or directory",
    ))
    .unwrap_or_else(|e| unreachable!("built-in regex: {e}"))
});

/// Lines that say where a failure is: a path with a line number in the usual notations.
static LOCATION: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(concat!(
        r"^\s*-->\s",
        r#"|^\s*File "[^"]+", line \d+"#,
        r"|[\w./\\-]+\.\w+:\d+",
        r"|[\w./\\-]+\.\w+\(\d+,\d+\)",
        r"|[\w./\\-]+\.\w+:\[\d+,\d+\]",
        r"|^\s*at .*[:(]\d+",
        r"|^\s*>\s*\d+\s*\|",
    ))
    .unwrap_or_else(|e| unreachable!("built-in regex: {e}"))
});

/// How many lines after an error-shaped line are searched for its location lines.
const LOCATION_WINDOW: usize = 12;

/// On a non-zero exit, a stream of at most this many lines is kept whole: a failing tool's
/// short stderr is the message, whatever shape it has.
pub const SHORT_STREAM_LINES: usize = 10;

/// The result of applying a template to one stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filtered {
    /// The kept lines, byte for byte, after one marker line when any line was left out.
    pub output: Vec<u8>,
    /// Lines in the input (a last line without a newline counts).
    pub total_lines: usize,
    /// Lines of the input that were kept.
    pub kept_lines: usize,
}

impl Filtered {
    /// How many lines of the input were left out.
    pub fn omitted_lines(&self) -> usize {
        self.total_lines - self.kept_lines
    }
}

/// The input's lines, each with its terminator (the last one may have none).
fn split_lines(output: &[u8]) -> Vec<&[u8]> {
    let mut lines = Vec::with_capacity(output.len() / 40 + 1);
    let mut start = 0;
    for nl in memchr::memchr_iter(b'\n', output) {
        lines.push(&output[start..=nl]);
        start = nl + 1;
    }
    if start < output.len() {
        lines.push(&output[start..]);
    }
    lines
}

/// The line without its `\n` or `\r\n`, as patterns see it.
fn content(line: &[u8]) -> &[u8] {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    line.strip_suffix(b"\r").unwrap_or(line)
}

/// A line with nothing but whitespace separates paragraphs.
fn is_blank(line: &[u8]) -> bool {
    line.iter().all(|b| b.is_ascii_whitespace())
}

/// Index of the first line of the last `n` paragraphs (`lines.len()` when `n` is 0 or there
/// is no paragraph).
fn tail_start(lines: &[&[u8]], n: usize) -> usize {
    if n == 0 {
        return lines.len();
    }
    let mut found = 0;
    let mut i = lines.len();
    // Walk back: skip blank lines, then one paragraph, n times.
    while i > 0 {
        while i > 0 && is_blank(lines[i - 1]) {
            i -= 1;
        }
        if i == 0 {
            break;
        }
        while i > 0 && !is_blank(lines[i - 1]) {
            i -= 1;
        }
        found += 1;
        if found == n {
            return i;
        }
    }
    // Fewer paragraphs than asked: all of them.
    lines
        .iter()
        .position(|l| !is_blank(l))
        .unwrap_or(lines.len())
}

/// Applies `template` to one stream. `exit_code` is the command's (`None` when a signal
/// ended it, which counts as a failure).
pub fn apply(template: &Template, output: &[u8], exit_code: Option<i32>) -> Filtered {
    let lines = split_lines(output);
    let failed = exit_code != Some(0);
    let mut keep = vec![false; lines.len()];

    let tail = tail_start(&lines, template.tail_paragraphs);
    keep[tail..].iter_mut().for_each(|k| *k = true);

    if failed && lines.len() <= SHORT_STREAM_LINES {
        keep.iter_mut().for_each(|k| *k = true);
    }
    let summary_only = template.suppress_on_success && !failed;
    if !summary_only {
        for (i, line) in lines[..tail].iter().enumerate() {
            if !keep[i] && template.include.is_match(content(line)) {
                keep[i] = true;
            }
        }
    }
    if failed {
        keep_errors(output, &lines, &mut keep);
    }

    let kept_lines = keep.iter().filter(|k| **k).count();
    let omitted = lines.len() - kept_lines;
    let mut out = Vec::new();
    if omitted > 0 {
        out.extend_from_slice(
            format!(
                "[template {}: {omitted} of {} lines left out]\n",
                template.name,
                lines.len()
            )
            .as_bytes(),
        );
    }
    for (line, k) in lines.iter().zip(&keep) {
        if *k {
            out.extend_from_slice(line);
        }
    }
    Filtered {
        output: out,
        total_lines: lines.len(),
        kept_lines,
    }
}

/// Marks error-shaped lines and the location lines that follow them.
fn keep_errors(output: &[u8], lines: &[&[u8]], keep: &mut [bool]) {
    let base = output.as_ptr() as usize;
    let starts: Vec<usize> = lines.iter().map(|l| l.as_ptr() as usize - base).collect();
    let mut error_lines: Vec<usize> = Vec::new();
    for m in ERROR_SHAPED.find_iter(output) {
        let i = starts.partition_point(|&s| s <= m.start()) - 1;
        if error_lines.last() != Some(&i) {
            error_lines.push(i);
        }
    }
    // Lines below this one were already searched for locations.
    let mut searched = 0;
    for &i in &error_lines {
        keep[i] = true;
        let text = content(lines[i]);
        let mut from = i + 1;
        if text.ends_with(b":") && memchr::memmem::find(text, b"panicked at").is_some() {
            // Rust prints the panic message on the line after `panicked at path:l:c:`.
            if let Some(k) = (i + 1..lines.len()).find(|&k| !is_blank(lines[k])) {
                keep[k] = true;
                from = k + 1;
            }
        }
        let end = (from + LOCATION_WINDOW).min(lines.len());
        for k in from.max(searched)..end {
            if !keep[k] && LOCATION.is_match(content(lines[k])) {
                keep[k] = true;
            }
        }
        searched = searched.max(end);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::templates::TemplateSpec;

    fn t(re: &str, tail: usize) -> Template {
        Template::new(
            "t",
            TemplateSpec {
                description: "test".into(),
                include_regex: re.into(),
                tail_paragraphs: tail,
                suppress_on_success: false,
            },
        )
        .unwrap()
    }

    fn body(f: &Filtered) -> String {
        let s = String::from_utf8_lossy(&f.output).into_owned();
        match s.strip_prefix('[') {
            Some(rest) => rest
                .split_once('\n')
                .map(|x| x.1.to_owned())
                .unwrap_or_default(),
            None => s,
        }
    }

    #[test]
    fn include_plus_last_paragraph_in_order() {
        let out = b"a\nHIT 1\nb\n\nc\nHIT 2\n\nsummary 1\nsummary 2\n";
        let f = apply(&t("HIT", 1), out, Some(0));
        assert_eq!(body(&f), "HIT 1\nHIT 2\nsummary 1\nsummary 2\n");
        assert_eq!(f.total_lines, 9);
        assert_eq!(f.kept_lines, 4);
        assert!(
            String::from_utf8_lossy(&f.output).starts_with("[template t: 5 of 9 lines left out]\n")
        );
    }

    #[test]
    fn overlap_is_printed_once() {
        let out = b"x\n\nHIT a\nHIT b\n";
        let f = apply(&t("HIT", 1), out, Some(0));
        assert_eq!(body(&f), "HIT a\nHIT b\n");
        assert_eq!(f.kept_lines, 2);
    }

    #[test]
    fn paragraphs_are_separated_by_blank_and_whitespace_lines() {
        let out = b"p1\n\np2a\np2b\n  \n\np3\n\n\n";
        let f = apply(&t("^$NEVER", 2), out, Some(0));
        // The blank lines inside the tail are kept, so the paragraphs stay apart.
        assert_eq!(body(&f), "p2a\np2b\n  \n\np3\n\n\n");
        let all = apply(&t("^$NEVER", 5), out, Some(0));
        assert_eq!(
            body(&all),
            "p2a\np2b\n  \n\np3\n\n\n".replace("p2a", "p1\n\np2a")
        );
        let none = apply(&t("^$NEVER", 0), out, Some(0));
        assert_eq!(none.kept_lines, 0);
        assert_eq!(body(&none), "");
    }

    #[test]
    fn nothing_left_out_means_no_marker() {
        let f = apply(&t("x", 1), b"only\nparagraph\n", Some(0));
        assert_eq!(f.output, b"only\nparagraph\n");
        assert_eq!(f.omitted_lines(), 0);
        assert_eq!(apply(&t("x", 1), b"", Some(0)).output, b"");
    }

    #[test]
    fn crlf_lines_match_anchored_patterns_and_stay_byte_exact() {
        let out = b"noise\r\nWARN: x$\r\nnoise\r\n\r\nend\r\n";
        let f = apply(&t(r"x\$$", 1), out, Some(0));
        assert_eq!(body(&f), "WARN: x$\r\nend\r\n");
        // \r\n blank lines separate paragraphs too.
        assert_eq!(f.kept_lines, 2);
    }

    #[test]
    fn last_line_without_newline() {
        let out = b"a\nHIT\nb\n\nlast words";
        let f = apply(&t("HIT", 1), out, Some(0));
        assert_eq!(body(&f), "HIT\nlast words");
        assert_eq!(f.total_lines, 5);
        let g = apply(&t("words", 0), out, Some(0));
        assert_eq!(body(&g), "last words");
    }

    #[test]
    fn invalid_utf8_is_kept_byte_for_byte_and_matched_on_its_valid_parts() {
        let out = b"ok\nbad \xff\xfe HIT here\nok\n\ntail \xc3\n";
        let f = apply(&t("HIT", 1), out, Some(0));
        let kept: &[u8] = b"bad \xff\xfe HIT here\ntail \xc3\n";
        assert!(f.output.ends_with(kept), "{:?}", f.output);
        assert_eq!(f.kept_lines, 2);
    }

    #[test]
    fn errors_survive_on_failure_only() {
        let mut out = String::new();
        for i in 0..20 {
            out.push_str(&format!("test t{i} ... ok\n"));
        }
        out.push_str("error[E0308]: mismatched types\n --> src/lib.rs:3:5\n  |\n");
        out.push_str("Traceback (most recent call last):\n  File \"a.py\", line 3, in f\n");
        out.push_str("E   assert 1 == 2\n");
        out.push_str("thread 'x' panicked at src/lib.rs:9:5:\nassertion `left == right` failed\n");
        out.push_str("\nsummary\n");
        let failed = body(&apply(&t("^NEVER$", 1), out.as_bytes(), Some(1)));
        for needle in [
            "error[E0308]: mismatched types\n --> src/lib.rs:3:5\n",
            "Traceback (most recent call last):\n  File \"a.py\", line 3, in f\n",
            "E   assert 1 == 2\n",
            "panicked at src/lib.rs:9:5:\nassertion `left == right` failed\n",
            "summary\n",
        ] {
            assert!(failed.contains(needle), "{needle:?} missing from {failed}");
        }
        assert!(!failed.contains("t3 ... ok"));
        let ok = body(&apply(&t("^NEVER$", 1), out.as_bytes(), Some(0)));
        assert_eq!(ok, "summary\n");
        // A signal is a failure too.
        assert!(body(&apply(&t("^NEVER$", 1), out.as_bytes(), None)).contains("E   assert"));
    }

    #[test]
    fn short_stream_is_kept_whole_on_failure() {
        let out = b"usage: tool [-x]\n\nunknown flag -y\n";
        assert_eq!(apply(&t("^NEVER$", 1), out, Some(2)).output, out);
        assert_eq!(
            body(&apply(&t("^NEVER$", 1), out, Some(0))),
            "unknown flag -y\n"
        );
    }

    #[test]
    fn suppress_on_success_prints_only_the_summary() {
        let mut spec = TemplateSpec {
            description: "d".into(),
            include_regex: "HIT".into(),
            tail_paragraphs: 1,
            suppress_on_success: true,
        };
        let out = b"HIT\nx\n\nsummary\n";
        let tpl = Template::new("s", spec.clone()).unwrap();
        assert_eq!(body(&apply(&tpl, out, Some(0))), "summary\n");
        let long = format!(
            "{}HIT\nx\n\nsummary\n",
            "noise\n".repeat(SHORT_STREAM_LINES)
        );
        assert_eq!(
            body(&apply(&tpl, long.as_bytes(), Some(1))),
            "HIT\nsummary\n"
        );
        spec.suppress_on_success = false;
        let tpl = Template::new("s", spec).unwrap();
        assert_eq!(body(&apply(&tpl, out, Some(0))), "HIT\nsummary\n");
    }
}

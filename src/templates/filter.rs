//! The filtering itself: one template applied to one stream of bytes.
//!
//! Every template applies the same generic rules, built from kinds of lines rather than from
//! one tool's format: failure lines (errors, failing tests of many runners, panics,
//! tracebacks) with their locations, code frames and expected/actual detail, kept when the
//! run failed; diagnostics (`path:line:col: warning: ...`, rule codes, `In f line 3:`) and
//! summary or count lines (`Found 9 errors`, `Ran 12 tests`, `ℹ fail 4`, `3 failing`), kept
//! whatever the exit; runtime noise (`at node:internal/...`, `generatedMessage: true,`) never.
//! A template adds its tool's lines (`include_regex`), leaves some out (`exclude_regex`) and
//! keeps the last paragraphs. The output is never larger than the input: when filtering
//! would not shrink a stream, it is returned as it came, without a note.
//!
//! Lines are kept byte for byte (CR, invalid UTF-8 and a last line without a newline
//! included); matching uses `regex::bytes`, so a line with invalid UTF-8 still matches on its
//! valid parts, and an invalid sequence matches only patterns that accept any byte.

use std::collections::VecDeque;
use std::sync::{Arc, LazyLock};

use regex::bytes::Regex;

use super::Template;
use super::auto::{self, Picked};

/// Lines that report a failure. On a non-zero exit these survive whatever the template
/// says: compile errors before tests ran, collection errors, panics, tracebacks, pytest's
/// `E   ` detail, the failing-test lines of many runners (`✖ name`, `not ok 3 - name`,
/// `1) suite`, `***Failed`, `XPASS`) and expected/actual shapes (`999 !== 1000`).
const ERROR_SHAPED: &str = concat!(
    // ASCII word boundaries, as a Unicode one slows lines with a non-ASCII byte.
    r"(?i:(?-u:\b)error(?-u:\b))",
    r"|(?:Error|Exception)(?-u:\b)",
    r"|(?-u:\b)(?:FAIL(?:ED|URE|URES)?|[Ff]ail(?:ed|ure|ing)|failures)(?-u:\b)",
    r"|^Traceback \(most recent call last\)",
    r"|(?-u:\b)panicked at(?-u:\b)",
    r"|^E {2,}[^\s]",
    r"|(?u:●)[ \t]",
    r"|^\s*(?u:[✖✗✘×]) ",
    r"|^\s*not ok \d+",
    r"|^\s*\d+\) \S",
    r"|\*\*\*(?:Not Run|Exception|Timeout)",
    r"|XPASS",
    r"|\S !==? \S",
    r"|: command not found",
    r"|No such file or directory",
    r"|(?i:could not|cannot|can't|unable to) (?:find|open|load|resolve|access|read|connect)",
    // A command that failed, as the tool that ran it says (docker, pnpm, make, CI scripts).
    r"|(?-u:\b)exit(?:ed)?(?: with)?(?: exit)? (?:code|status):? [1-9]",
    r"|returned a non-zero (?:code|exit status)|did not complete successfully",
);

/// Diagnostics, kept whatever the exit code (a warning-only lint run exits 0): compiler and
/// linter lines with a location and a severity or a rule code, headers that give the
/// location of the lines under them.
const DIAGNOSTIC: &str = concat!(
    // gcc, clang, javac, mypy, flake8, ruff (concise), pylint, shellcheck -f gcc, go vet.
    r"^[^\s:]+:\d+(?::\d+)?:\s*(?:fatal error|error|warning|note|info|style|remark|[A-Z][A-Z0-9]{0,3}\d{2,5}(?-u:\b)|\[[A-Z]\d{3,5}\()",
    // tsc, MSBuild.
    r"|^[^\s(]+\(\d+,\d+\): (?:error|warning) ",
    // shellcheck's tty format.
    r"|^In \S+ line \d+:$",
    r"|(?-u:\b)SC\d{4} \((?:error|warning|info|style)\):",
    // eslint's stylish rows (the file is the line above the first row).
    r"|^\s+\d+:\d+\s+(?:error|warning)\s",
    // rustc, cargo, clippy, Go's and Swift's `warning:` (`error:` is a failure line).
    r"|^warning(?:\[[\w:-]+\])?: \S",
    // ruff's full format: `F401 [*] message`.
    r"|^[A-Z]{1,4}\d{2,4} (?:\[\*\] )?\S",
    r"|^\[WARNING\] ",
);

/// Summary and count lines: what a run came to, kept whatever the exit code.
const SUMMARY: &str = concat!(
    r"^Found \d+ (?:errors?|warnings?|problems?)(?-u:\b)",
    r"|^Success: no issues found",
    r"|^All checks passed!",
    r"|^Ran \d+ tests? in ",
    r"|^(?:OK|FAILED)(?: \([^)]*\))?\s*$",
    r"|^\s*\d+ (?:passing|failing|pending)(?: \(|\s*$)",
    r"|^(?u:ℹ) (?:tests|suites|pass|fail|cancelled|skipped|todo) \d+$",
    r"|^# (?:tests|suites|pass|fail|cancelled|skipped|todo) \d+$",
    r"|\d+% tests passed, \d+ tests? failed out of \d+",
    r"|^The following tests FAILED:",
    r"|^\s+\d+ - \S+ \((?:Failed|Not Run|Timeout|SEGFAULT|Subprocess aborted|Exception|Child aborted)\)",
    r"|^Your code has been rated at ",
    r"|^(?u:✖) \d+ problems? \(",
    r"|^\d+ (?:errors?|warnings?)(?: and \d+ (?:errors?|warnings?))? generated\.$",
    r"|^\d+ (?:errors?|warnings?)$",
    r"|^\s*(?:Test Suites|Tests|Test Files):?\s+\d",
    r"|^[=\s]*\d+ (?:passed|failed|errors?|xfailed|xpassed)(?-u:\b).* in [\d.]+s(?-u:\b)",
    r"|^(?:\w+: )?\d+ passed, \d+ failed",
    r"|^test result: ",
    r"|^(?:ok|FAIL)\s+\S+\s+(?:[\d.]+s|\(cached\))",
    r"|^FAIL$",
    r"|BUILD (?:SUCCESS|FAILURE|SUCCESSFUL|FAILED)",
    r"|^\[\w+\] Tests run: \d+, Failures: \d+, Errors: \d+, Skipped: \d+\s*$",
    r"|^\s*Finished `\w+` profile",
    r"|^Successfully (?:built|tagged|installed) \S",
    r"|^Success! The configuration is valid",
    r"|^(?:Error: )?\d+ chart\(s\) linted, \d+ chart\(s\) failed",
);

/// A caret line under a source line in a code frame (`   |     ^^^`, `  ~~~~`): the line it
/// marks is kept on a failure, the frame's other context lines are not. The caret line itself
/// is kept when it underlines a span (`^^^^`, `~~~~`: which expression); a single `^` only
/// gives a column, which the failure's location (`file:line:col`) already says.
const CARET: &str = r"^\s*(\d+\s*)?\|?\s*[\^~]+\s*$";

fn compile(pattern: &str) -> Regex {
    Regex::new(pattern).unwrap_or_else(|e| unreachable!("built-in regex: {e}"))
}

static CARET_RE: LazyLock<Regex> = LazyLock::new(|| compile(CARET));

/// Everything a line can match to be looked at more closely, with a template's own pattern
/// in front: most lines of a log match none, and one pass over them decides that.
pub(super) fn any_pattern(include: &str) -> String {
    // The generic rules in ASCII mode here (`\s`, `\d`, `\w` of ASCII; `\S` any other byte):
    // a much smaller automaton than their Unicode classes, and a superset of what they match
    // on the text of logs (non-ASCII literals such as `✖` still match their UTF-8 bytes).
    format!("(?:{include})|(?-u:{ERROR_SHAPED}|{DIAGNOSTIC}|{SUMMARY}|{CARET})")
}

/// Lines that say where a failure is: a path with a line number in the usual notations.
const LOCATION_PATTERN: &str = concat!(
    r"^\s*-->\s",
    r#"|^\s*File "[^"]+", line \d+"#,
    r"|[\w./\\-]+\.\w+:\d+",
    r"|[\w./\\-]+\.\w+\(\d+,\d+\)",
    r"|[\w./\\-]+\.\w+:\[\d+,\d+\]",
    r"|^\s*at .*[:(]\d+",
    r"|^\s*>\s*\d+\s*\|",
    r"|^\s*location: ",
);

/// Lines of an expected/actual diff under a failure (`- [1, 2, 3]`, `+   'b',`, `-7`).
const DIFF_PATTERN: &str = r"^\s*[-+](?:\s+\S|\d|\[|\{|')|^\s*(?:expected|actual):";

/// How many lines after an error-shaped line are searched for its location lines.
const LOCATION_WINDOW: usize = 12;

/// How many lines after a kept diff line are still searched.
const DIFF_WINDOW: usize = 6;

/// On a non-zero exit, a stream of at most this many lines is kept whole: a failing tool's
/// short stderr is the message, whatever shape it has.
pub(crate) const SHORT_STREAM_LINES: usize = 10;

/// The result of applying a template to one stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filtered {
    /// The kept lines, byte for byte, after one marker line when any line was left out.
    pub output: Vec<u8>,
    /// Lines in the input (a last line without a newline counts).
    pub total_lines: usize,
    /// Lines of the input that were kept.
    pub kept_lines: usize,
    /// The template that was applied, as the note names it (`pytest`, or `pytest (auto, by
    /// the command)`).
    pub template: String,
    /// `auto` found no tool and the run passed without a summary line: the stream is most
    /// likely data that was asked for, and goes as it came (`output` is the stream itself
    /// when it was short enough to hold; a front that has the stream uses its own copy).
    pub declined: bool,
}

impl Filtered {
    /// How many lines of the input were left out.
    pub fn omitted_lines(&self) -> usize {
        self.total_lines - self.kept_lines
    }
}

/// The longest line the filter holds: longer ones are split, so that a stream without
/// newlines cannot grow the filter's memory.
pub(crate) const MAX_LINE: usize = 64 * 1024;

/// The most bytes of kept lines held (half for the first, half for the last); beyond it the
/// middle of the kept lines is dropped and counted.
pub(crate) const MAX_KEPT: usize = 8 * 1024 * 1024;

/// The most bytes of the trailing paragraphs held.
pub(crate) const MAX_TAIL: usize = 256 * 1024;

/// The most lines of the trailing paragraphs kept: a summary is short, and a last
/// "paragraph" of thousands of progress lines is noise (its failure lines are kept anyway).
pub(crate) const MAX_TAIL_LINES: usize = 50;

/// A stream up to this size is held whole, so that it can be returned unchanged when
/// filtering would not shrink it. A longer one that filtering would not shrink loses its
/// note instead (the kept lines alone are never longer than the input).
pub(crate) const RAW_HOLD: usize = 256 * 1024;

/// `auto` looks at this many lines of the output at most (or [`SNIFF_BYTES`]) for a line
/// that names the tool; the lines are held meanwhile, then filtered as usual.
pub(crate) const SNIFF_LINES: usize = 300;
pub(crate) const SNIFF_BYTES: usize = 128 * 1024;

/// How many lines of a diagnostic block (an error line followed by its code frame, up to
/// the next blank line) are kept at most.
const BLOCK_LINES: usize = 60;

/// The line without its `\n` or `\r\n`, as patterns see it.
fn content(line: &[u8]) -> &[u8] {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    line.strip_suffix(b"\r").unwrap_or(line)
}

/// A line with nothing but whitespace separates paragraphs.
fn is_blank(line: &[u8]) -> bool {
    line.iter().all(|b| b.is_ascii_whitespace())
}

/// A line of a code frame under a diagnostic: `  |`, `12 |`, `-->`, `= note:`, `...`, and
/// the `---` that opens a TAP failure's YAML block.
const FRAME_PATTERN: &str =
    r"^\s*(\d+\s*)?\||^\s*-->\s|^\s*= \w|^\s*\.\.\.\s*$|^\s*(help|note)(\[\w+\])?:|^\s*---\s*$";

/// A stack frame inside a library or the runtime (`at ... (node_modules/...)`,
/// `at java.base/...`, a Python frame in site-packages): not one of the project's, so not
/// kept as a failure's location.
static LIBRARY_FRAME: LazyLock<Regex> = LazyLock::new(|| {
    compile(concat!(
        r"^\s*at .*(node_modules/|node:|\(<anonymous>\)|java\.base/|jdk\.internal\.",
        r"|org\.junit\.|junit\.framework\.|org\.apache\.maven\.|sun\.reflect\.|org\.gradle\.)",
        r#"|^\s*File "[^"]*/(site-packages|dist-packages|lib/python\d[\d.]*)/"#,
    ))
});

/// Runtime noise: never kept, whatever is around it (the fields Node's assert adds to every
/// failure, TAP's timings, frames inside Node itself).
const NOISE_PATTERN: &str = concat!(
    r"^\s*(?:generatedMessage: (?:true|false),?|operator: '\w+',?|code: 'ERR_[A-Z_]+',?",
    r"|failureType: '\w+'|duration_ms: [\d.]+|type: '(?:test|suite)')\s*$",
    r"|\(node:[\w/]+:\d+:\d+\)\s*$",
);

/// The rules every judged line is tried against, in one pass: the same patterns as their
/// single regexes (the index of each is its `RULE_*` constant).
static RULES: LazyLock<regex::bytes::RegexSet> = LazyLock::new(|| {
    regex::bytes::RegexSet::new([
        NOISE_PATTERN,
        SUMMARY,
        DIAGNOSTIC,
        ERROR_SHAPED,
        LOCATION_PATTERN,
        FRAME_PATTERN,
        DIFF_PATTERN,
    ])
    .unwrap_or_else(|e| unreachable!("built-in regex: {e}"))
});
const RULE_NOISE: usize = 0;
const RULE_SUMMARY: usize = 1;
const RULE_DIAGNOSTIC: usize = 2;
const RULE_ERROR: usize = 3;
const RULE_LOCATION: usize = 4;
const RULE_FRAME: usize = 5;
const RULE_DIFF: usize = 6;

/// A source line of a code frame (`  12 | code`, `> 12 | code`, `  12| code`): the program's
/// text, not a report, so never error-shaped itself (`throw new Error(...)`) and never "the
/// source line under a location"; it is kept only as the line a caret or a template marks.
static CODE_LINE: LazyLock<Regex> = LazyLock::new(|| compile(r"^\s*>?\s*\d+\s*\|"));

/// A row of a diagnostic table without its file (`  12:3  error  ...`): the file is the
/// line above the first row.
static ROW: LazyLock<Regex> = LazyLock::new(|| compile(r"^\s+\d+:\d+\s"));

/// Kept lines shorter than this (trimmed) are kept however often they repeat (code-frame
/// rules like `  |`); longer ones are kept once (a runner that prints every failure twice).
const DEDUPE_MIN: usize = 12;

/// Why a line is a candidate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Why {
    /// The template's pattern: kept unless the run passed and the template shows only the
    /// summary then.
    Include,
    /// A summary or a diagnostic: kept whatever the exit code.
    Always,
    /// A failure line, its location or its block: kept when the run failed.
    Failure,
}

/// The templates `auto` picks from while it reads the first lines of the output.
struct Sniff {
    catalog: Arc<super::AutoCatalog>,
    held: Vec<u8>,
    /// How much of `held` was looked at (whole lines only).
    scanned: usize,
    lines: usize,
}

/// A template applied to one stream as it arrives, in bounded memory: lines are judged one
/// by one, and only candidates (and the trailing paragraphs) are held until the exit code
/// decides what stays.
pub struct StreamFilter {
    template: Template,
    picked: Picked,
    sniff: Option<Sniff>,
    partial: Vec<u8>,
    lines: usize,
    /// The first lines, for a failing stream short enough to keep whole.
    first: Vec<Vec<u8>>,
    head: Vec<(usize, Why, Vec<u8>)>,
    head_bytes: usize,
    tail: VecDeque<(usize, Why, Vec<u8>)>,
    tail_bytes: usize,
    /// Candidates dropped between `head` and `tail` (bounded memory).
    dropped: usize,
    /// The lines of the last paragraphs: (line number, starts a paragraph, bytes), trailing
    /// blanks included; `spare` recycles their buffers.
    par: VecDeque<(usize, bool, Vec<u8>)>,
    par_count: usize,
    par_bytes: usize,
    spare: Vec<Vec<u8>>,
    previous_blank: bool,
    /// Lines after a failure line still searched for its locations.
    window: usize,
    /// Keep the next non-blank line (a panic's or a test header's message).
    want_message: bool,
    /// Lines left in the diagnostic block being kept (0: none).
    block: usize,
    /// The block is a TAP YAML block, which ends at `...` rather than at a blank line.
    block_tap: bool,
    /// The lines opened by the last header are kept always (a diagnostic's), not only on a
    /// failure.
    context_always: bool,
    /// Lines of a numbered failure's title still to keep (mocha's `1) suite` / `test:`).
    title: usize,
    /// Inside a Python traceback: its `File "...", line N` frames are locations.
    traceback: bool,
    /// The line before was a kept location: an indented source line under it is kept.
    after_location: bool,
    /// The line before was a failure line (a block starts when a frame line follows).
    after_failure: bool,
    /// Hashes of the candidate lines kept so far (each long line is kept once).
    seen: std::collections::HashSet<u64>,
    /// The previous line's number, unless it is a candidate already (the line a caret
    /// marks), and its bytes.
    previous: Option<usize>,
    previous_line: Vec<u8>,
    /// The stream as it came while it is at most [`RAW_HOLD`] bytes (`raw_whole`).
    raw: Vec<u8>,
    raw_whole: bool,
    raw_bytes: usize,
    /// Whether a stream that filtering would not shrink goes as it came (always, but for
    /// the unit tests of the other rules on tiny inputs).
    shrink_only: bool,
    /// A summary line was seen (see [`StreamFilter::finish`] for `auto`'s generic pick).
    saw_summary: bool,
    /// Quiet lines are taken many at once ([`StreamFilter::skip_quiet`]); off only in the
    /// test that checks it changes nothing.
    skip: bool,
    /// A reused buffer for the chunk in lowercase.
    lower: Vec<u8>,
}

impl StreamFilter {
    pub fn new(template: &Template) -> StreamFilter {
        let sniff = template.auto.as_ref().map(|catalog| Sniff {
            catalog: catalog.clone(),
            held: Vec::new(),
            scanned: 0,
            lines: 0,
        });
        StreamFilter {
            template: template.clone(),
            picked: template.picked,
            sniff,
            partial: Vec::new(),
            lines: 0,
            first: Vec::new(),
            head: Vec::new(),
            head_bytes: 0,
            tail: VecDeque::new(),
            tail_bytes: 0,
            dropped: 0,
            par: VecDeque::new(),
            par_count: 0,
            par_bytes: 0,
            spare: Vec::new(),
            previous_blank: true,
            window: 0,
            want_message: false,
            block: 0,
            block_tap: false,
            context_always: false,
            title: 0,
            traceback: false,
            after_location: false,
            after_failure: false,
            seen: std::collections::HashSet::new(),
            previous: None,
            previous_line: Vec::new(),
            raw: Vec::new(),
            raw_whole: true,
            raw_bytes: 0,
            shrink_only: true,
            saw_summary: false,
            skip: true,
            lower: Vec::new(),
        }
    }

    /// The template as the note names it.
    fn label(&self) -> String {
        match self.picked {
            Picked::Named => self.template.name.clone(),
            Picked::Command => format!("{} (auto, by the command)", self.template.name),
            Picked::Output => format!("{} (auto, by the output)", self.template.name),
        }
    }

    /// Feeds the next bytes of the stream.
    pub fn push(&mut self, data: &[u8]) {
        if let Some(s) = self.sniff.as_mut() {
            s.held.extend_from_slice(data);
            let mut found = None;
            while let Some(i) = memchr::memchr(b'\n', &s.held[s.scanned..]) {
                let line = &s.held[s.scanned..s.scanned + i];
                s.scanned += i + 1;
                s.lines += 1;
                if let Some(name) = auto::by_line(content(&super::ansi::strip(line))) {
                    found = Some(name);
                    break;
                }
            }
            if found.is_some() || s.lines >= SNIFF_LINES || s.held.len() >= SNIFF_BYTES {
                self.pick(found);
            }
            return;
        }
        self.feed(data);
    }

    /// Ends `auto`'s look at the output: the template it points to (or the generic one)
    /// filters the lines held so far, then the rest.
    fn pick(&mut self, name: Option<&'static str>) {
        let Some(s) = self.sniff.take() else {
            return;
        };
        let (template, picked) = match name.and_then(|n| s.catalog.get(n)) {
            Some(t) => (t.clone(), Picked::Output),
            None => (s.catalog.generic(), Picked::Output),
        };
        self.template = template;
        self.picked = picked;
        self.feed(&s.held);
    }

    /// No failure is open: the next line is judged by the patterns alone.
    fn busy(&self) -> bool {
        self.window > 0
            || self.block > 0
            || self.after_failure
            || self.want_message
            || self.after_location
            || self.title > 0
            || self.traceback
    }

    fn feed(&mut self, mut data: &[u8]) {
        let prefilter = if self.skip {
            self.template.prefilter()
        } else {
            None
        };
        // The whole lines of the chunk in lowercase, for the prefilter's literals (made once
        // per chunk, not per search).
        let lines_end = memchr::memrchr(b'\n', data).map_or(0, |i| i + 1);
        let mut lower = std::mem::take(&mut self.lower);
        lower.clear();
        if prefilter.is_some() {
            lower.extend(data[..lines_end].iter().map(u8::to_ascii_lowercase));
        }
        let chunk = data;
        // Where the next line with a literal starts, and the next escape, once searched: a
        // search goes on from where the last one stopped, not again from each line judged.
        let (mut literal_at, mut escape_at) = (None, None);
        while !data.is_empty() {
            let at = chunk.len() - data.len();
            if let Some(p) = &prefilter
                && at < lines_end
                && self.partial.is_empty()
                && !self.busy()
            {
                let literal = *match &mut literal_at {
                    Some(l) if *l >= at => l,
                    slot => slot.insert(at + p.first_literal_line(&lower[at..lines_end])),
                };
                let escape = *match &mut escape_at {
                    Some(e) if *e >= at => e,
                    slot => slot.insert(
                        memchr::memchr(super::ansi::ESC, &chunk[at..lines_end])
                            .map_or(lines_end, |i| at + i),
                    ),
                };
                // Patterns see lines without colour: a line with an escape goes the long way.
                let escape_line =
                    memchr::memrchr(b'\n', &chunk[at..escape]).map_or(at, |i| at + i + 1);
                let n = self.skip_quiet(p, &chunk[at..literal.min(escape_line)]);
                data = &data[n..];
                if data.is_empty() {
                    break;
                }
            }
            let room = MAX_LINE - self.partial.len();
            let (n, complete) = match memchr::memchr(b'\n', &data[..data.len().min(room)]) {
                Some(i) => (i + 1, true),
                None if data.len() >= room => (room, true),
                None => (data.len(), false),
            };
            if complete && self.partial.is_empty() {
                // A whole line in the chunk: judged in place, without a copy.
                self.line(&data[..n]);
            } else {
                self.partial.extend_from_slice(&data[..n]);
                if complete {
                    let line = std::mem::take(&mut self.partial);
                    self.line(&line);
                }
            }
            data = &data[n..];
        }
        self.lower = lower;
    }

    /// Takes the whole lines at the start of `region` (whole lines up to the first one with
    /// a literal of the prefilter or an escape) that the prefilter's line DFA passes over, so
    /// that no pattern matches them (most lines of a log), and does for them what
    /// [`StreamFilter::line`] does for such a line; returns the bytes taken.
    fn skip_quiet(&mut self, prefilter: &super::prefilter::Prefilter, region: &[u8]) -> usize {
        let tail = self.template.tail_paragraphs > 0;
        let mut start = 0;
        let mut previous = None;
        for end in memchr::memchr_iter(b'\n', region) {
            if end + 1 - start > MAX_LINE {
                // Split by `feed` into pieces of MAX_LINE: the long way.
                break;
            }
            let line = &region[start..=end];
            if prefilter.line_may_match(content(line)) {
                break;
            }
            let no = self.lines;
            self.lines += 1;
            if self.first.len() <= SHORT_STREAM_LINES {
                self.first.push(line.to_vec());
            }
            if tail {
                self.paragraph(no, line, is_blank(line));
            }
            previous = Some((no, start));
            start = end + 1;
        }
        let taken = &region[..start];
        self.raw_bytes += taken.len();
        if self.raw_whole {
            if self.raw.len() + taken.len() <= RAW_HOLD {
                self.raw.extend_from_slice(taken);
            } else {
                self.raw_whole = false;
                self.raw = Vec::new();
            }
        }
        if let Some((no, at)) = previous {
            self.remember_previous(no, &region[at..start]);
        }
        start
    }

    fn candidate(&mut self, no: usize, why: Why, line: &[u8]) {
        let text = content(line).trim_ascii();
        if text.len() >= DEDUPE_MIN {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            text.hash(&mut h);
            if !self.seen.insert(h.finish()) {
                return;
            }
        }
        let entry = (no, why, line.to_vec());
        if self.head_bytes + line.len() <= MAX_KEPT / 2 {
            self.head_bytes += line.len();
            self.head.push(entry);
            return;
        }
        self.tail_bytes += line.len();
        self.tail.push_back(entry);
        while self.tail_bytes > MAX_KEPT / 2 {
            match self.tail.pop_front() {
                Some((_, _, l)) => {
                    self.tail_bytes -= l.len();
                    self.dropped += 1;
                }
                None => break,
            }
        }
    }

    fn remember_previous(&mut self, no: usize, line: &[u8]) {
        // Kept in a reused buffer: most lines are never asked for again.
        self.previous = Some(no);
        self.previous_line.clear();
        self.previous_line.extend_from_slice(line);
    }

    fn line(&mut self, raw: &[u8]) {
        let no = self.lines;
        self.lines += 1;
        self.raw_bytes += raw.len();
        if self.raw_whole {
            if self.raw.len() + raw.len() <= RAW_HOLD {
                self.raw.extend_from_slice(raw);
            } else {
                self.raw_whole = false;
                self.raw = Vec::new();
            }
        }
        // Agents and patterns see the text without colour.
        let stripped = super::ansi::strip(raw);
        let line: &[u8] = &stripped;
        let text = content(line);
        let blank = is_blank(line);
        if self.first.len() <= SHORT_STREAM_LINES {
            self.first.push(line.to_vec());
        }
        self.paragraph(no, line, blank);

        let busy = self.busy();
        if !busy && !blank && !self.template.any().is_match(text) {
            // Most lines: no rule applies and no failure is open.
            self.remember_previous(no, line);
            return;
        }

        let mut why = None;
        if self.template.include.is_match(text) {
            why = Some(Why::Include);
        }
        // Source text and library stack frames are not failure reports, whatever words they
        // contain (`throw new Error(`, `at Resolver._throwModNotFoundError (node_modules/..)`).
        let code = memchr::memchr(b'|', text).is_some() && CODE_LINE.is_match(text);
        let trimmed = text.trim_ascii_start();
        let library = (trimmed.starts_with(b"at ") || trimmed.starts_with(b"File \""))
            && LIBRARY_FRAME.is_match(text);
        // One pass for all the rules; each bit is what its own regex would say.
        let rules = RULES.matches(text);
        let noise = rules.matched(RULE_NOISE);
        let summary = !code && rules.matched(RULE_SUMMARY);
        let diagnostic = !code && !summary && rules.matched(RULE_DIAGNOSTIC);
        let failure = !code && !library && !summary && rules.matched(RULE_ERROR);
        if summary {
            why = Some(Why::Always);
            self.saw_summary = true;
        }
        // Locations matter only near a failure: most lines skip the pattern.
        let near = self.window > 0 || self.block > 0 || self.after_failure || self.traceback;
        let location = !failure && near && rules.matched(RULE_LOCATION);
        // Lines kept for the header before them: always for a diagnostic's, else on failure.
        let context = if self.context_always {
            Why::Always
        } else {
            Why::Failure
        };
        let mut keep = None;
        if self.block > 0 {
            let end = if self.block_tap {
                trimmed == b"..."
            } else {
                blank
            };
            if end {
                self.block = 0;
            } else {
                self.block -= 1;
                keep = Some(Why::Failure);
            }
        } else if self.after_failure && !blank && rules.matched(RULE_FRAME) {
            // An error line followed by its code frame: the block up to the next blank line
            // is one diagnostic (rustc's labels under the source excerpt); a TAP failure's
            // YAML block up to its `...`.
            self.block = BLOCK_LINES;
            self.block_tap = trimmed == b"---";
            keep = Some(if FRAME_LOCATION.is_match(text) {
                context
            } else {
                Why::Failure
            });
        }
        if self.want_message && !blank {
            keep = Some(context);
            self.want_message = false;
        }
        if self.title > 0 && !blank {
            keep = Some(Why::Failure);
            self.title = if text.ends_with(b":") {
                0
            } else {
                self.title - 1
            };
        }
        if self.window > 0 {
            self.window -= 1;
            if location {
                keep = Some(context);
            } else if !failure && !context_is_always(context) && rules.matched(RULE_DIFF) {
                keep = Some(Why::Failure);
                // A long diff: the location comes after it.
                self.window = self.window.max(DIFF_WINDOW);
            }
        }
        if self.traceback {
            if location {
                keep = Some(Why::Failure);
            }
            if blank || (failure && !trimmed.starts_with(b"File \"")) {
                self.traceback = false;
            }
        }
        if self.after_location
            && !blank
            && !code
            && !rules.matched(RULE_FRAME)
            && text.first().is_some_and(|b| *b == b' ' || *b == b'\t')
        {
            // The source line under a location (`test_x.py:1: in <module>` / `    import x`).
            keep = Some(context);
        }
        self.after_location = location && keep.is_some();
        // Only a header (not indented, not itself a frame line) opens a diagnostic block.
        let header = failure || diagnostic;
        self.after_failure = header && text.first().is_some_and(|b| !b.is_ascii_whitespace())
            || (failure && trimmed.starts_with(b"not ok "));
        if header {
            self.window = LOCATION_WINDOW;
            self.context_always = diagnostic && !failure;
            // A header whose message is on the next line: `panicked at f.rs:1:2:`, a test
            // header `● suite › test`, `In f.sh line 3:`.
            if text.ends_with(b":") || memchr::memmem::find(text, "●".as_bytes()).is_some() {
                self.want_message = true;
            }
            if failure && NUMBERED.is_match(text) {
                self.title = 3;
            }
            if failure && text.starts_with(b"Traceback (most recent call last)") {
                self.traceback = true;
            }
        }
        if diagnostic {
            why = Some(Why::Always);
            if ROW.is_match(text)
                && let Some(p) = self.previous.take()
            {
                // The file an eslint-style table of rows is about.
                let l = std::mem::take(&mut self.previous_line);
                if !is_blank(&l) {
                    self.candidate(p, Why::Always, &l);
                }
                self.previous_line = l;
            }
        }
        if memchr::memchr2(b'^', b'~', text).is_some() && CARET_RE.is_match(text) {
            // A single `^` is a column (in the location too); a span says which expression.
            if memchr::memchr2_iter(b'^', b'~', text).nth(1).is_some() {
                keep = keep.or(Some(Why::Failure));
            }
            if let Some(p) = self.previous.take() {
                let l = std::mem::take(&mut self.previous_line);
                self.candidate(p, Why::Failure, &l);
                self.previous_line = l;
            }
        }
        if library {
            keep = None;
        }
        if failure {
            keep = Some(Why::Failure);
        }
        if why.is_none() || why == Some(Why::Include) {
            why = match (why, keep) {
                (Some(Why::Include), Some(Why::Always)) => Some(Why::Always),
                (Some(w), _) => Some(w),
                (None, k) => k,
            };
        }
        if noise || self.template.excludes(text) {
            why = None;
        }
        if let Some(why) = why {
            self.candidate(no, why, line);
            self.previous = None;
        } else {
            self.remember_previous(no, line);
        }
    }

    fn paragraph(&mut self, no: usize, line: &[u8], blank: bool) {
        let n = self.template.tail_paragraphs;
        if n == 0 {
            return;
        }
        let starts = !blank && self.previous_blank;
        self.previous_blank = blank;
        if starts {
            self.par_count += 1;
            if self.par_count > n {
                self.drop_first_paragraph();
            }
        }
        if self.par_count == 0 {
            // Blank lines before the first paragraph.
            return;
        }
        let mut buf = self.spare.pop().unwrap_or_default();
        buf.clear();
        buf.extend_from_slice(line);
        self.par_bytes += buf.len();
        self.par.push_back((no, starts, buf));
        // Bounded: earlier paragraphs go whole before the last one is cut (the paragraph
        // before a summary may be the whole body: 400 `test ... ok` lines of a passing
        // `cargo test --lib`); a last paragraph of megabytes keeps its end.
        while self.par_bytes > MAX_TAIL || self.par.len() > MAX_TAIL_LINES {
            if self.par_count > 1 {
                self.drop_first_paragraph();
                continue;
            }
            let Some((_, _, l)) = self.par.pop_front() else {
                break;
            };
            self.par_bytes -= l.len();
            self.spare.push(l);
        }
    }

    /// Drops the lines of the first paragraph held.
    fn drop_first_paragraph(&mut self) {
        while let Some((_, _, l)) = self.par.pop_front() {
            self.par_bytes -= l.len();
            self.spare.push(l);
            if self.par.front().is_some_and(|(_, starts, _)| *starts) {
                break;
            }
        }
        self.par_count -= 1;
        self.spare.truncate(MAX_TAIL_LINES + 1);
    }

    /// Ends the stream. `exit_code` is the command's (`None`: it did not exit normally, a
    /// failure). `full` names where the full output is, for the note.
    pub fn finish(mut self, exit_code: Option<i32>, full: Option<&str>) -> Filtered {
        if self.sniff.is_some() {
            self.pick(None);
        }
        if !self.partial.is_empty() {
            let line = std::mem::take(&mut self.partial);
            self.line(&line);
        }
        let label = self.label();
        let failed = exit_code != Some(0);
        // `auto` found no tool, and the command passed without a summary line: its output
        // is most likely what was asked for (`cat`, `ls`, a script's report), not a log.
        let declined = !failed
            && self.picked == Picked::Output
            && self.template.name == auto::GENERIC
            && !self.saw_summary;
        if declined && self.raw_whole {
            return Filtered {
                output: super::ansi::strip(&self.raw).into_owned(),
                total_lines: self.lines,
                kept_lines: self.lines,
                template: label,
                declined,
            };
        }
        let total = self.lines;
        let mut kept: Vec<(usize, &[u8])> = Vec::new();
        if failed && total <= SHORT_STREAM_LINES {
            kept = self
                .first
                .iter()
                .enumerate()
                .map(|(i, l)| (i, l.as_slice()))
                .collect();
        } else {
            let summary_only = self.template.suppress_on_success && !failed;
            let wanted = |why: Why| match why {
                Why::Include => !summary_only,
                Why::Always => true,
                Why::Failure => failed,
            };
            let tail_lines: Vec<(usize, &[u8])> = self
                .par
                .iter()
                .map(|(i, _, l)| (*i, l.as_slice()))
                .collect();
            let tail_from = tail_lines.first().map_or(total, |(i, _)| *i);
            let candidates = self
                .head
                .iter()
                .chain(&self.tail)
                .filter(|(no, why, _)| *no < tail_from && wanted(*why))
                .map(|(no, _, l)| (*no, l.as_slice()));
            kept.extend(candidates);
            kept.extend(tail_lines);
        }
        let kept_lines = kept.len();
        let omitted = total - kept_lines;
        let mut out = Vec::new();
        if omitted > 0 {
            let mut note = format!("[template {label}: {omitted} of {total} lines left out");
            if self.dropped > 0 {
                note.push_str(&format!(
                    " ({} matching lines among them, over the filter's memory bound)",
                    self.dropped
                ));
            }
            if let Some(full) = full {
                note.push_str(&format!("; full output: {full}"));
            }
            note.push_str("]\n");
            out.extend_from_slice(note.as_bytes());
        }
        let body = out.len();
        for (_, line) in &kept {
            out.extend_from_slice(line);
        }
        if self.shrink_only && omitted > 0 && out.len() >= self.raw_bytes {
            // Filtering would not shrink the stream: it goes as it came (without colour),
            // without a note; too long to have been held, it loses the note alone.
            out = if self.raw_whole {
                super::ansi::strip(&self.raw).into_owned()
            } else {
                out.split_off(body)
            };
            let kept_lines = if self.raw_whole { total } else { kept_lines };
            return Filtered {
                output: out,
                total_lines: total,
                kept_lines,
                template: label,
                declined,
            };
        }
        Filtered {
            output: out,
            total_lines: total,
            kept_lines,
            template: label,
            declined,
        }
    }
}

fn context_is_always(w: Why) -> bool {
    w == Why::Always
}

/// A frame line that is a location (`--> src/a.rs:3:5`): kept with its header.
static FRAME_LOCATION: LazyLock<Regex> = LazyLock::new(|| compile(r"^\s*-->\s"));

/// A numbered failure header (mocha's `  1) suite`), whose title goes on over the next
/// lines up to one that ends with `:`.
static NUMBERED: LazyLock<Regex> = LazyLock::new(|| compile(r"^\s*\d+\) \S"));

/// Applies `template` to one stream held whole (see [`StreamFilter`]). `exit_code` is the
/// command's (`None` when a signal ended it, which counts as a failure).
pub(crate) fn apply(template: &Template, output: &[u8], exit_code: Option<i32>) -> Filtered {
    let mut f = StreamFilter::new(template);
    f.push(output);
    f.finish(exit_code, None)
}

/// [`apply`] without the rule that returns a stream unchanged when filtering would not
/// shrink it: the unit tests of the other rules use tiny inputs.
#[cfg(test)]
fn apply_any_size(template: &Template, output: &[u8], exit_code: Option<i32>) -> Filtered {
    let mut f = StreamFilter::new(template);
    f.shrink_only = false;
    f.push(output);
    f.finish(exit_code, None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::templates::TemplateSpec;

    use super::apply_any_size as apply;

    fn t(re: &str, tail: usize) -> Template {
        Template::new(
            "t",
            TemplateSpec {
                description: "test".into(),
                include_regex: re.into(),
                tail_paragraphs: tail,
                suppress_on_success: false,
                exclude_regex: None,
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
    fn a_long_paragraph_before_the_summary_is_left_out_whole() {
        // A passing `cargo test --lib`: the test list, then the result.
        let mut out = String::from("\nrunning 400 tests\n");
        for i in 0..400 {
            out.push_str(&format!("test t{i} ... ok\n"));
        }
        out.push_str("\ntest result: ok. 400 passed\n\n");
        let f = apply(&t("^NEVER$", 2), out.as_bytes(), Some(0));
        assert_eq!(body(&f), "test result: ok. 400 passed\n\n");
        // Short paragraphs are all kept; a long last one keeps its last lines.
        let short = "x\n\nfailures:\n    t1\n\ntest result: FAILED\n";
        let f = apply(&t("^NEVER$", 2), short.as_bytes(), Some(0));
        assert_eq!(body(&f), "failures:\n    t1\n\ntest result: FAILED\n");
        let f = apply(&t("^NEVER$", 2), &out.as_bytes()[..out.len() - 30], Some(0));
        assert_eq!(f.kept_lines, MAX_TAIL_LINES);
        assert!(body(&f).ends_with("test t399 ... ok\n"));
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
            exclude_regex: None,
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

#[cfg(test)]
mod skip_tests {
    use super::*;
    use crate::templates::Catalog;

    /// The filter fed in chunks of the given sizes, in turn (the last one repeats).
    fn run(t: &Template, log: &[u8], chunks: &[usize], code: Option<i32>, skip: bool) -> Filtered {
        let mut f = StreamFilter::new(t);
        f.skip = skip;
        let mut rest = log;
        for size in chunks
            .iter()
            .copied()
            .chain(std::iter::repeat(chunks[chunks.len() - 1]))
        {
            if rest.is_empty() {
                break;
            }
            let (c, r) = rest.split_at(size.min(rest.len()));
            f.push(c);
            rest = r;
        }
        f.finish(code, None)
    }

    /// Taking quiet lines many at once gives what judging them one by one gives: on every
    /// real log of the fixtures, with its tool's template, `generic` and `auto`, and on a log
    /// with CRLF line ends, colour and long lines mixed in. The reference judges every line
    /// and takes the log whole; the filter under test gets it in chunks of many sizes (lines
    /// cut anywhere, regions of one line and of thousands). What happens before the end does
    /// not depend on the exit code, so exit 1 (which shows every kind of kept line) is
    /// enough but for the tool's template, also run with exit 0.
    #[test]
    fn skipping_quiet_lines_changes_nothing() {
        let root =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/templates");
        let mut logs = Vec::new();
        for dir in [root.clone(), root.join("holdout")] {
            for entry in std::fs::read_dir(dir).unwrap() {
                let path = entry.unwrap().path();
                let Ok(template) = std::fs::read_to_string(path.join("template")) else {
                    continue;
                };
                for stream in ["stdout", "stderr"] {
                    if let Ok(log) = std::fs::read(path.join(stream)) {
                        logs.push((template.trim().to_owned(), log));
                    }
                }
            }
        }
        assert!(logs.len() > 100, "{}", logs.len());
        let mut mixed = Vec::new();
        for (i, (_, log)) in logs.iter().take(40).enumerate() {
            mixed.extend(log.iter().flat_map(|b| {
                if *b == b'\n' {
                    b"\r\n".to_vec()
                } else {
                    vec![*b]
                }
            }));
            mixed.extend_from_slice(b"\x1b[31mplain words in red\x1b[0m\n");
            if i % 10 == 0 {
                mixed.extend(std::iter::repeat_n(b'x', MAX_LINE + 10));
            }
            mixed.extend_from_slice(b"\n\n");
        }
        logs.push(("pytest".into(), mixed));
        let catalog = Catalog::builtin();
        let chunks = [61, 1, 7, 32 * 1024, 200, 3, 4096, 13, 64 * 1024 + 5];
        for (tool, log) in &logs {
            for (name, code) in [
                (tool.as_str(), Some(1)),
                (tool.as_str(), Some(0)),
                ("generic", Some(1)),
                ("auto", Some(1)),
            ] {
                let t = catalog.get(name).unwrap();
                assert_eq!(
                    run(t, log, &chunks, code, true),
                    run(t, log, &[log.len().max(1)], code, false),
                    "{name}, exit {code:?}"
                );
            }
        }
    }
}

#[cfg(test)]
mod rule_tests {
    use super::*;
    use crate::templates::TemplateSpec;

    use super::apply_any_size as apply;

    fn t(re: &str, exclude: Option<&str>) -> Template {
        Template::new(
            "t",
            TemplateSpec {
                description: "test".into(),
                include_regex: re.into(),
                tail_paragraphs: 0,
                suppress_on_success: false,
                exclude_regex: exclude.map(str::to_owned),
            },
        )
        .unwrap()
    }

    fn kept(tpl: &Template, out: &str, code: i32) -> String {
        let f = apply(tpl, out.as_bytes(), Some(code));
        let s = String::from_utf8(f.output).unwrap();
        s.split_once("]\n").map(|x| x.1.to_owned()).unwrap_or(s)
    }

    fn noise() -> String {
        (0..20).map(|i| format!("step {i} fine\n")).collect()
    }

    #[test]
    fn diagnostic_blocks_carets_and_messages() {
        let out = format!(
            "{}error[E0308]: mismatched types\n --> src/a.rs:2:5\n  |\n2 |     x\n  |     ^ expected `u64`, found `u32`\n\n{}  ● cart › rejects\n\n    unknown sku: B\n\n      3 |   if (x) {{\n    > 4 |     throw new Error(`unknown`);\n        |           ^\n      5 |   }}\n{}",
            noise(),
            noise(),
            noise()
        );
        let k = kept(&t("^NEVER$", None), &out, 1);
        assert!(k.contains("  |     ^ expected `u64`, found `u32`\n"), "{k}");
        assert!(k.contains("    unknown sku: B\n"), "{k}");
        // The marked line stays; its single `^` is only a column and goes.
        assert!(
            k.contains("    > 4 |     throw new Error(`unknown`);\n"),
            "{k}"
        );
        assert!(!k.contains("|           ^"), "{k}");
        assert!(!k.contains("      3 |") && !k.contains("      5 |"), "{k}");
        assert!(!k.contains("step 3 fine"), "{k}");
    }

    #[test]
    fn a_caret_span_is_kept_a_single_caret_is_a_column() {
        let out = format!(
            "{}src/a.ts:3:7 - error TS2322: Type 'string' is not assignable\n\n3 const x: number = \"s\";\n        ~\n\nsrc/b.ts:4:1 - error TS2339: Property 'fullName'\n\n4 user.fullName;\n       ~~~~~~~~\n{}",
            noise(),
            noise()
        );
        let k = kept(&t("^NEVER$", None), &out, 1);
        assert!(k.contains("3 const x: number = \"s\";\n"), "{k}");
        assert!(!k.contains("        ~\n"), "{k}");
        assert!(k.contains("4 user.fullName;\n       ~~~~~~~~\n"), "{k}");
    }

    #[test]
    fn code_frames_are_source_not_reports() {
        // Vitest's frame under its location: only the marked line; a context line that says
        // `Error` is program text, not a failure.
        let out = format!(
            "{}Error: unknown sku: B\n ❯ price vt/cart.test.ts:5:11\n      3| function price(sku) {{\n      4|   if (bad) throw new Error(\"x\");\n      5|     throw new Error(`unknown`);\n       |           ^\n      6|   }}\n{}",
            noise(),
            noise()
        );
        let k = kept(&t("^NEVER$", None), &out, 1);
        assert!(
            k.contains("Error: unknown sku: B\n ❯ price vt/cart.test.ts:5:11\n      5|     throw new Error(`unknown`);\n"),
            "{k}"
        );
        assert!(
            !k.contains("3| function") && !k.contains("4|") && !k.contains("6|"),
            "{k}"
        );
        assert!(!k.contains("       |"), "{k}");
    }

    #[test]
    fn library_frames_are_left_out_even_when_error_shaped() {
        let out = format!(
            "{}  ● Test suite failed to run\n\n    Cannot find module './x.json'\n\n      at Resolver._throwModNotFoundError (node_modules/jest-resolve/build/index.js:1031:11)\n      at Object.require (jt/config.test.js:1:13)\n{}",
            noise(),
            noise()
        );
        let k = kept(&t("^NEVER$", None), &out, 1);
        assert!(!k.contains("node_modules/"), "{k}");
        assert!(
            k.contains("      at Object.require (jt/config.test.js:1:13)\n"),
            "{k}"
        );
        assert!(k.contains("    Cannot find module './x.json'\n"), "{k}");
    }

    #[test]
    fn colour_is_ignored_and_removed() {
        let out = format!(
            "{}\x1b[91merror\x1b[0m\x1b[90m TS2322: \x1b[0mType 'string'\n",
            noise()
        );
        let k = kept(&t("error TS\\d+", None), &out, 0);
        assert_eq!(k, "error TS2322: Type 'string'\n");
    }

    #[test]
    fn source_line_under_a_location_and_library_frames() {
        let out = format!(
            "{}E   ImportError: no module x\ntest_x.py:1: in <module>\n    import x\n{}java.lang.IllegalStateException: boom\n\tat java.base/java.util.ArrayList.forEach(ArrayList.java:1596)\n\tat com.shop.CartTest.adds(CartTest.java:12)\n",
            noise(),
            noise()
        );
        let k = kept(&t("^NEVER$", None), &out, 1);
        assert!(
            k.contains("test_x.py:1: in <module>\n    import x\n"),
            "{k}"
        );
        assert!(
            k.contains("CartTest.java:12") && !k.contains("java.base/"),
            "{k}"
        );
    }

    #[test]
    fn repeated_lines_once_and_excluded_lines_never() {
        let out = format!(
            "{}FAILED the long test name here\n[ERROR] Re-run Maven using the -X switch\n{}FAILED the long test name here\n",
            noise(),
            noise()
        );
        let k = kept(&t("^NEVER$", Some(r"^\[ERROR\] Re-run")), &out, 1);
        assert_eq!(k, "FAILED the long test name here\n");
        let bad = Template::new(
            "b",
            TemplateSpec {
                description: "d".into(),
                include_regex: "x".into(),
                tail_paragraphs: 0,
                suppress_on_success: false,
                exclude_regex: Some("(".into()),
            },
        );
        assert_eq!(bad.err().map(|e| e.0), Some("exclude_regex"));
    }

    #[test]
    fn never_larger_than_the_input() {
        // Every line an error: nothing to leave out worth a note, so the stream as it came.
        let out = "error: a\nerror: b\nnoise\nerror: c\nerror: d\nerror: e\nerror: f\nerror: g\nerror: h\nerror: i\nerror: j\nerror: k\n";
        let f = super::apply(&t("^NEVER$", None), out.as_bytes(), Some(1));
        assert_eq!(f.output, out.as_bytes());
        assert_eq!(f.omitted_lines(), 0);
        // Colour goes, though: agents get no escape sequences.
        let coloured = out.replace("noise", "\x1b[1mnoise\x1b[0m");
        let f = super::apply(&t("^NEVER$", None), coloured.as_bytes(), Some(1));
        assert_eq!(f.output, out.as_bytes());
        // A stream too long to hold that filtering would not shrink loses the note alone.
        let mut long = String::new();
        while long.len() <= RAW_HOLD {
            long.push_str("error: the same kind of line over and over, each one different ");
            long.push_str(&format!("{}\n", long.len()));
        }
        long.push_str("x\n");
        let f = super::apply(&t("^NEVER$", None), long.as_bytes(), Some(1));
        assert!(f.output.len() < long.len());
        assert!(!f.output.starts_with(b"[template"));
        assert_eq!(f.omitted_lines(), 1);
    }

    #[test]
    fn generic_kinds_of_lines() {
        let out = format!(
            "{}Found 9 errors in 2 files (checked 4 source files)\n{}F401 [*] `os` imported but unused\n --> a.py:1:8\n\n{}In bin/backup.sh line 3:\nfor f in $(ls); do\n{}  ✖ restocks by n (1.1ms)\n    4 !== 5\n      generatedMessage: true,\n      at Test.runInAsyncScope (node:async_hooks:206:9)\n{}ℹ fail 4\n{}",
            noise(),
            noise(),
            noise(),
            noise(),
            noise(),
            noise()
        );
        let failed = kept(&t("^NEVER$", None), &out, 1);
        for needle in [
            "Found 9 errors in 2 files",
            "F401 [*] `os` imported but unused\n --> a.py:1:8\n",
            "In bin/backup.sh line 3:\nfor f in $(ls); do\n",
            "  ✖ restocks by n (1.1ms)\n    4 !== 5\n",
            "ℹ fail 4\n",
        ] {
            assert!(failed.contains(needle), "{needle:?} missing from {failed}");
        }
        assert!(
            !failed.contains("generatedMessage") && !failed.contains("node:async_hooks"),
            "{failed}"
        );
        assert!(!failed.contains("step 3 fine"), "{failed}");
        // A passing run keeps its summaries and diagnostics, not its failure-shaped lines.
        let passed = kept(&t("^NEVER$", None), &out, 0);
        assert!(
            passed.contains("ℹ fail 4\n") && passed.contains(" --> a.py:1:8\n"),
            "{passed}"
        );
        assert!(!passed.contains("!=="), "{passed}");
    }

    #[test]
    fn memory_is_bounded_on_a_line_without_newlines() {
        let mut f = StreamFilter::new(&t("x", None));
        for _ in 0..100 {
            f.push(&[b'x'; 100_000]);
        }
        let out = f.finish(Some(0), None);
        // Split into lines of MAX_LINE bytes at most; every one matches and is kept, up to
        // the bound on kept bytes.
        assert!(out.output.len() <= MAX_KEPT + 4096, "{}", out.output.len());
        assert_eq!(out.total_lines, 10_000_000 / MAX_LINE + 1);
    }
}

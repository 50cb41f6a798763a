//! Finding the lines that a template's rules might match without running the rules on every
//! byte: most lines of a log match none, and they are passed over in bulk
//! ([`super::filter::StreamFilter`]).
//!
//! The rules (a template's `include_regex` and the generic rules, as one alternation) are
//! split by shape, automatically, from their syntax:
//! - an alternative that has a distinctive literal every match must contain (`panicked at`,
//!   `error` in any case, `... FAILED` after `^test .*`) is found by one SIMD multi-literal
//!   search (Teddy, `aho_corasick::packed`) over many lines at once;
//! - the others are anchored at the start of the line (`^\s*\d+\) \S`, `^[^\s:]+:\d+:`) and
//!   are checked line by line with a small DFA that stops at the first byte no rule can
//!   continue with (most lines: after a few bytes).
//!
//! Both sides are supersets, never exact: a line they point to is judged by the real rules
//! (literals are matched on ASCII-lowercased text, so that `(?i:error)`'s 32 case variants
//! are one literal; the line DFA treats a non-ASCII character as any run of non-ASCII bytes
//! and ignores Unicode word boundaries). A line they pass over matches no rule.

use aho_corasick::{AhoCorasick, MatchKind, packed};
use regex_automata::dfa::{Automaton, StartKind, dense};
use regex_automata::util::primitives::StateID;
use regex_automata::util::start;
use regex_automata::{Anchored, nfa::thompson};
use regex_syntax::hir::literal::{Extractor, Seq};
use regex_syntax::hir::{Class, ClassBytes, ClassBytesRange, Hir, HirKind, Look, Repetition};

/// The most bytes the line DFA may take (a template from a config file cannot eat memory;
/// beyond it there is no prefilter and every line is judged by the rules).
const DFA_LIMIT: usize = 4 << 20;

/// What a line must show for the rules to possibly match it.
#[derive(Debug)]
pub(crate) struct Prefilter {
    literals: Option<Literals>,
    lines: Option<LineDfa>,
}

/// Literals, lowercase, at least one of which is in every match of the literal side.
#[derive(Debug)]
enum Literals {
    /// SIMD (Teddy): up to 64 literals where the CPU has SSSE3 or NEON.
    Packed(packed::Searcher),
    /// Otherwise an Aho-Corasick automaton: the same answer, slower.
    Automaton(AhoCorasick),
}

/// An anchored DFA over one line's text (without its line end).
#[derive(Debug)]
struct LineDfa {
    dfa: dense::DFA<Vec<u32>>,
    start: StateID,
}

type Lits = Vec<Vec<u8>>;

impl Prefilter {
    /// The prefilter for a pattern as [`regex::bytes::Regex`] compiles it (lines are matched
    /// without their line end); `None` when it cannot be built (then every line is judged by
    /// the rules).
    pub(crate) fn new(pattern: &str) -> Option<Prefilter> {
        let (lits, per_line) = split_rules(pattern)?;
        Some(Prefilter {
            literals: Literals::new(lits)?,
            lines: LineDfa::new(per_line)?,
        })
    }

    /// The offset of the first line of `lines` (whole lines, each ending in `\n`) that the
    /// rules might match, or `lines.len()`. `lower` is `lines` ASCII-lowercased.
    pub(crate) fn first_literal_line(&self, lower: &[u8]) -> usize {
        let found = match &self.literals {
            None => None,
            Some(Literals::Packed(s)) => s.find(lower).map(|m| m.start()),
            Some(Literals::Automaton(ac)) => ac.find(lower).map(|m| m.start()),
        };
        match found {
            Some(at) => memchr::memrchr(b'\n', &lower[..at]).map_or(0, |i| i + 1),
            None => lower.len(),
        }
    }

    /// Whether the line side of the rules might match this line's text.
    pub(crate) fn line_may_match(&self, text: &[u8]) -> bool {
        self.lines.as_ref().is_some_and(|l| l.may_match(text))
    }
}

impl Literals {
    fn new(lits: Lits) -> Option<Option<Literals>> {
        if lits.is_empty() {
            return Some(None);
        }
        if let Some(s) = packed::Config::new().builder().extend(&lits).build() {
            return Some(Some(Literals::Packed(s)));
        }
        let ac = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostFirst)
            .build(&lits)
            .ok()?;
        Some(Some(Literals::Automaton(ac)))
    }

    #[cfg(test)]
    fn is_packed(&self) -> bool {
        matches!(self, Literals::Packed(_))
    }
}

impl LineDfa {
    fn new(alternatives: Vec<Hir>) -> Option<Option<LineDfa>> {
        if alternatives.is_empty() {
            return Some(None);
        }
        let nfa = thompson::Compiler::new()
            .configure(
                thompson::Config::new()
                    .utf8(false)
                    .nfa_size_limit(Some(DFA_LIMIT)),
            )
            .build_from_hir(&Hir::alternation(alternatives))
            .ok()?;
        let dfa = dense::Builder::new()
            .configure(
                dense::Config::new()
                    .start_kind(StartKind::Anchored)
                    .accelerate(false)
                    .dfa_size_limit(Some(DFA_LIMIT))
                    .determinize_size_limit(Some(DFA_LIMIT)),
            )
            .build_from_nfa(&nfa)
            .ok()?;
        let start = dfa
            .start_state(&start::Config::new().anchored(Anchored::Yes))
            .ok()?;
        Some(Some(LineDfa { dfa, start }))
    }

    fn may_match(&self, text: &[u8]) -> bool {
        let dfa = &self.dfa;
        let mut s = self.start;
        for &b in text {
            s = dfa.next_state(s, b);
            if dfa.is_special_state(s) {
                // A match (reported one byte late), or no rule can match any more.
                return !dfa.is_dead_state(s);
            }
        }
        dfa.is_match_state(dfa.next_eoi_state(s))
    }
}

/// The pattern's literals (lowercase) and its alternatives for the line DFA.
fn split_rules(pattern: &str) -> Option<(Lits, Vec<Hir>)> {
    let hir = regex_syntax::ParserBuilder::new()
        .utf8(false)
        .build()
        .parse(pattern)
        .ok()?;
    let mut alternatives = Vec::new();
    split(&hir, &mut alternatives);
    let extractor = Extractor::new();
    let mut lits: Lits = Vec::new();
    let mut per_line = Vec::new();
    for alt in alternatives {
        let anchored = alt.properties().look_set_prefix().contains(Look::Start);
        match required(&alt, &extractor) {
            Some(l) if fits(anchored, &l) => lits.extend(l),
            _ if anchored => per_line.push(widen(&alt)),
            // Found nowhere in particular: the line DFA looks along the whole line.
            _ => per_line.push(Hir::concat(vec![any_bytes(0), widen(&alt)])),
        }
    }
    Some((minimal(lits), per_line))
}

/// The alternatives of a pattern's top-level alternation (through groups).
fn split(hir: &Hir, out: &mut Vec<Hir>) {
    match hir.kind() {
        HirKind::Alternation(subs) => subs.iter().for_each(|s| split(s, out)),
        HirKind::Capture(c) => split(&c.sub, out),
        _ => out.push(hir.clone()),
    }
}

/// Whether a literal set is worth searching for. An alternative anchored at the line start
/// usually fails in the line DFA after a byte or two, so its literals go to the search only
/// when they are long and unusual (`... failed`, `test result: `: the DFA would walk the whole
/// of every `test ...` line); any other alternative needs literals of two bytes at least.
fn fits(anchored: bool, lits: &Lits) -> bool {
    let min = lits.iter().map(Vec::len).min().unwrap_or(usize::MAX);
    if anchored {
        min >= 4 && lits.len() <= 4 && lits.iter().all(|l| unusual(l))
    } else {
        min >= 2
    }
}

/// A literal with a byte that is not a letter, digit or space: rarer in running text.
fn unusual(lit: &[u8]) -> bool {
    lit.iter()
        .any(|b| !b.is_ascii_alphanumeric() && *b != b' ' && *b != b'\t')
}

/// The best set of literals that every match of `hir` contains one of (lowercased), if any.
fn required(hir: &Hir, ex: &Extractor) -> Option<Lits> {
    let mut best = from_seq(ex.extract(hir));
    match hir.kind() {
        HirKind::Concat(subs) => {
            for i in 0..subs.len() {
                // A match of the concatenation contains a match of each tail of it.
                if i > 0 {
                    let tail = Hir::concat(subs[i..].to_vec());
                    better(&mut best, from_seq(ex.extract(&tail)));
                }
                better(&mut best, required(&subs[i], ex));
            }
        }
        HirKind::Alternation(subs) => {
            let mut all = Vec::new();
            for s in subs {
                all.extend(required(s, ex)?);
            }
            better(&mut best, Some(dedup(all)));
        }
        HirKind::Capture(c) => better(&mut best, required(&c.sub, ex)),
        HirKind::Repetition(r) if r.min >= 1 => better(&mut best, required(&r.sub, ex)),
        _ => {}
    }
    best
}

/// A finite prefix sequence as lowercase literals (shortened when that makes fewer of them:
/// `# tests 0`..`# tests 9` is `# tests`); `None` for an infinite one or one with the empty
/// literal (which every text contains).
fn from_seq(seq: Seq) -> Option<Lits> {
    let lits = seq.literals()?;
    if lits.iter().any(|l| l.is_empty()) {
        return None;
    }
    let mut best = None;
    for n in [3, 4, 6, 8, 12, 16, usize::MAX] {
        let v = lits
            .iter()
            .map(|l| l.as_bytes()[..l.len().min(n)].to_ascii_lowercase())
            .collect();
        better(&mut best, Some(dedup(v)));
    }
    best
}

fn dedup(mut v: Lits) -> Lits {
    v.sort();
    v.dedup();
    v
}

/// Fewer false hits first: literals of four bytes or more, then fewer of them, then ones with
/// an unusual byte, then longer ones.
fn score(l: &Lits) -> (usize, std::cmp::Reverse<usize>, bool, usize) {
    let min = l.iter().map(Vec::len).min().unwrap_or(usize::MAX);
    (
        min.min(4),
        std::cmp::Reverse(l.len()),
        l.iter().all(|l| unusual(l)),
        min,
    )
}

fn better(best: &mut Option<Lits>, candidate: Option<Lits>) {
    if let Some(c) = candidate
        && best.as_ref().is_none_or(|b| score(&c) > score(b))
    {
        *best = Some(c);
    }
}

/// Without the literals that contain another one (a text with `failed` has `fail`).
fn minimal(lits: Lits) -> Lits {
    let mut lits = dedup(lits);
    lits.sort_by_key(Vec::len);
    let mut kept: Lits = Vec::new();
    for l in lits {
        if !kept.iter().any(|k| memchr::memmem::find(&l, k).is_some()) {
            kept.push(l);
        }
    }
    kept
}

fn any_bytes(min: u32) -> Hir {
    Hir::repetition(Repetition {
        min,
        max: None,
        greedy: true,
        sub: Box::new(Hir::class(Class::Bytes(ClassBytes::new([
            ClassBytesRange::new(0, 0xff),
        ])))),
    })
}

/// Unicode classes up to this many characters are kept as they are by [`widen`].
const SMALL_CLASS: usize = 128;

/// A superset of `hir` that a DFA over bytes handles small and without giving up: a large
/// Unicode class (`\w`, `\S`) is its ASCII part or any run of non-ASCII bytes; Unicode word
/// boundaries hold everywhere.
fn widen(hir: &Hir) -> Hir {
    match hir.kind() {
        HirKind::Empty | HirKind::Literal(_) | HirKind::Class(Class::Bytes(_)) => hir.clone(),
        HirKind::Class(Class::Unicode(c))
            if c.ranges()
                .iter()
                .map(|r| r.end() as usize - r.start() as usize + 1)
                .sum::<usize>()
                <= SMALL_CLASS =>
        {
            // A handful of characters (`[✖✗✘×]`, `(?i:k)`): as they are.
            hir.clone()
        }
        HirKind::Class(Class::Unicode(c)) => {
            let ascii = Hir::class(Class::Bytes(ClassBytes::new(
                c.ranges()
                    .iter()
                    .filter(|r| r.start().is_ascii())
                    .map(|r| ClassBytesRange::new(r.start() as u8, r.end().min('\x7f') as u8)),
            )));
            if c.ranges().last().is_some_and(|r| !r.end().is_ascii()) {
                let high = Hir::repetition(Repetition {
                    min: 1,
                    max: None,
                    greedy: true,
                    sub: Box::new(Hir::class(Class::Bytes(ClassBytes::new([
                        ClassBytesRange::new(0x80, 0xff),
                    ])))),
                });
                Hir::alternation(vec![ascii, high])
            } else {
                ascii
            }
        }
        HirKind::Look(
            Look::WordUnicode
            | Look::WordUnicodeNegate
            | Look::WordStartUnicode
            | Look::WordEndUnicode
            | Look::WordStartHalfUnicode
            | Look::WordEndHalfUnicode,
        ) => Hir::empty(),
        HirKind::Look(_) => hir.clone(),
        HirKind::Repetition(r) => Hir::repetition(Repetition {
            sub: Box::new(widen(&r.sub)),
            ..r.clone()
        }),
        HirKind::Capture(c) => widen(&c.sub),
        HirKind::Concat(subs) => Hir::concat(subs.iter().map(widen).collect()),
        HirKind::Alternation(subs) => Hir::alternation(subs.iter().map(widen).collect()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn literals(pattern: &str) -> Lits {
        let hir = regex_syntax::ParserBuilder::new()
            .utf8(false)
            .build()
            .parse(pattern)
            .unwrap();
        required(&hir, &Extractor::new()).unwrap()
    }

    #[test]
    fn literals_come_from_the_pattern() {
        assert_eq!(literals(r"(?-u:\b)panicked at(?-u:\b)"), [b"panicked at"]);
        // Case variants are one lowercase literal.
        assert_eq!(literals(r"(?i:(?-u:\b)error(?-u:\b))"), [b"error"]);
        // Inside: the part after a class that has no literals.
        assert_eq!(literals(r"\d+% tests passed"), [b"% tests passed"]);
        assert_eq!(
            literals(r"^test .* \.\.\. FAILED$"),
            [b" ... failed".to_vec()]
        );
    }

    /// Every built-in gets the fast path: a prefilter, with its literals in one SIMD search
    /// where the CPU has one (a rule without a distinctive literal goes to the line DFA, and
    /// more than 64 literals would fall back to a slower automaton).
    #[test]
    fn every_builtin_has_a_prefilter() {
        let catalog = crate::templates::Catalog::builtin();
        for name in catalog.names() {
            let t = catalog.get(&name).unwrap();
            if t.is_auto() {
                continue;
            }
            let p = t
                .prefilter()
                .unwrap_or_else(|| panic!("{name}: no prefilter"));
            let simd = cfg!(target_arch = "x86_64") && std::is_x86_feature_detected!("ssse3");
            let (lits, per_line) = split_rules(t.any().as_str()).unwrap();
            let lits = lits.len();
            eprintln!(
                "{name}: {lits} literals, {} rules for the line DFA ({} bytes)",
                per_line.len(),
                p.lines.as_ref().map_or(0, |l| l.dfa.memory_usage())
            );
            assert!(
                !simd || p.literals.as_ref().is_none_or(Literals::is_packed),
                "{name}: {lits} literals, not one SIMD search"
            );
        }
    }

    /// The fixtures' lines, each without its line end and colour, and a few made up for the
    /// rules no fixture shows (case variants, non-ASCII text).
    fn fixture_lines() -> Vec<Vec<u8>> {
        let root =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/templates");
        let mut lines = Vec::new();
        for dir in [root.clone(), root.join("holdout")] {
            for entry in std::fs::read_dir(dir).unwrap() {
                let path = entry.unwrap().path();
                for stream in ["stdout", "stderr"] {
                    if let Ok(log) = std::fs::read(path.join(stream)) {
                        let log = crate::templates::ansi::strip(&log).into_owned();
                        lines.extend(
                            log.split(|b| *b == b'\n')
                                .map(|l| l.strip_suffix(b"\r").unwrap_or(l).to_vec()),
                        );
                    }
                }
            }
        }
        assert!(lines.len() > 5000, "{}", lines.len());
        for l in [
            "eRRoR: x",
            "Ⅹ ERROR",
            "  ✖ naïve test",
            "not ok 3 - é",
            "12 passing (3ms)",
            "src/é.rs:1:2: warning: x",
            "x\u{85}y FAILED",
        ] {
            lines.push(l.as_bytes().to_vec());
        }
        lines
    }

    /// The property the filter relies on: every line that a template's rules match, the
    /// prefilter points to (by a literal or by the line DFA). Checked for every built-in on
    /// every line of the fixtures; and it passes over most of the other lines (else it would
    /// be no use).
    #[test]
    fn the_prefilter_points_to_every_line_the_rules_match() {
        let catalog = crate::templates::Catalog::builtin();
        let lines = fixture_lines();
        for name in catalog.names() {
            let t = catalog.get(&name).unwrap();
            if t.is_auto() {
                continue;
            }
            let p = t.prefilter().unwrap();
            let (mut matched, mut passed_over) = (0, 0);
            for line in &lines {
                let mut lower = line.to_ascii_lowercase();
                lower.push(b'\n');
                let flagged = p.first_literal_line(&lower) == 0 || p.line_may_match(line);
                if t.any().is_match(line) {
                    matched += 1;
                    assert!(flagged, "{name}: {:?}", String::from_utf8_lossy(line));
                } else if !flagged {
                    passed_over += 1;
                }
            }
            // The fixtures are mostly failing runs, richer in near misses (`Errors: 0`,
            // `PASS x.test.js`) than most logs.
            assert!(
                passed_over * 4 > (lines.len() - matched) * 3,
                "{name}: passes over only {passed_over} of {} lines no rule matches",
                lines.len() - matched
            );
        }
    }

    #[test]
    fn lines_are_found_by_literal_or_by_the_line_dfa() {
        let p = Prefilter::new(r"panicked at|^\s*\d+\) \S|(?i:error)").unwrap();
        let text = b"a\nb 1) x\nsome ERROR here\n";
        let lower = text.to_ascii_lowercase();
        assert_eq!(p.first_literal_line(&lower), 9);
        assert!(!p.line_may_match(b"a"));
        assert!(!p.line_may_match(b"b 1) x"));
        assert!(p.line_may_match(b"  12) x"));
        assert!(p.literals.as_ref().unwrap().is_packed() || !cfg!(target_arch = "x86_64"));
    }

    #[test]
    fn non_ascii_and_unicode_classes_stay_supersets() {
        let p = Prefilter::new(r"^\w+ \d$").unwrap();
        assert!(p.literals.is_none());
        assert!(p.line_may_match("héllo 3".as_bytes()));
        assert!(p.line_may_match("x ٣".as_bytes()));
        assert!(!p.line_may_match(b"hello x 3"));
    }
}

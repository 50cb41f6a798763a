//! The character budget of a result: what output costs once JSON-escaped, and how a text
//! is cut to a budget with its head and tail kept and the cut marked in place.

/// What a character of output costs in a result: its length once JSON-escaped (`\u0000` is
/// 6, `\n` is 2, any other printable character 1).
fn char_cost(c: char) -> usize {
    match c {
        '"' | '\\' | '\n' | '\r' | '\t' | '\u{8}' | '\u{c}' => 2,
        c if (c as u32) < 0x20 => 6,
        _ => 1,
    }
}

/// The cost of a text in a result (see [`char_cost`]).
pub(crate) fn cost(s: &str) -> usize {
    s.chars().map(char_cost).sum()
}

/// Calls `f(byte offset after the character, its cost)` for each character of `bytes` as
/// lossy UTF-8 shows it (an invalid sequence is one U+FFFD).
fn each_char(bytes: &[u8], mut f: impl FnMut(usize, usize) -> bool) {
    let mut at = 0;
    for chunk in bytes.utf8_chunks() {
        for c in chunk.valid().chars() {
            at += c.len_utf8();
            if !f(at, char_cost(c)) {
                return;
            }
        }
        if !chunk.invalid().is_empty() {
            at += chunk.invalid().len();
            if !f(at, 1) {
                return;
            }
        }
    }
}

/// How many leading bytes of `bytes` fit in `budget`, ending on a character boundary.
pub(crate) fn fit_head(bytes: &[u8], budget: usize) -> usize {
    let (mut used, mut end) = (0, 0);
    each_char(bytes, |at, c| {
        if used + c > budget {
            return false;
        }
        used += c;
        end = at;
        true
    });
    end
}

/// How many trailing bytes of `bytes` fit in `budget`, starting on a character boundary.
pub(crate) fn fit_tail(bytes: &[u8], budget: usize) -> usize {
    let mut total = 0;
    each_char(bytes, |_, c| {
        total += c;
        true
    });
    // Skip characters from the front until the rest fits.
    let (mut skipped, mut start) = (0, 0);
    if total > budget {
        each_char(bytes, |at, c| {
            skipped += c;
            start = at;
            total - skipped > budget
        });
    }
    bytes.len() - start
}

/// The cost of a bounded marker line (offsets, a URI).
const MARKER_COST: usize = 400;

/// `bytes` cut to `budget`: the head and the tail kept (on line boundaries when near), the
/// cut marked in place by `marker(first byte left out, end of the bytes left out)`. Colour
/// escapes are removed. The flag says whether anything was left out.
pub(crate) fn excerpt(
    bytes: &[u8],
    gap: Option<(usize, u64)>,
    budget: usize,
    marker: impl Fn(u64, u64) -> String,
) -> (String, bool) {
    let show = |b: &[u8]| String::from_utf8_lossy(&crate::templates::ansi::strip(b)).into_owned();
    // `gap`: bytes (at this offset of `bytes`, this many) that were never held.
    let (split, missing) = gap.unwrap_or((bytes.len(), 0));
    let whole = cost(&String::from_utf8_lossy(bytes));
    if missing == 0 && whole <= budget {
        return (show(bytes), false);
    }
    let avail = budget.saturating_sub(MARKER_COST).max(200);
    let (head_part, tail_part) = if missing > 0 {
        bytes.split_at(split)
    } else {
        (bytes, bytes)
    };
    // Errors are usually at the end: the tail gets the larger share.
    let mut h = fit_head(head_part, avail * 2 / 5);
    if let Some(i) = memchr::memrchr(b'\n', &head_part[..h])
        && i + 1 >= h / 2
        && h < head_part.len()
    {
        h = i + 1;
    }
    let head_cost = cost(&String::from_utf8_lossy(&head_part[..h]));
    let mut t = fit_tail(tail_part, avail.saturating_sub(head_cost));
    if missing == 0 {
        // One buffer: the tail must not overlap the head.
        t = t.min(bytes.len() - h);
    }
    let tail_start = tail_part.len() - t;
    if let Some(i) = memchr::memchr(b'\n', &tail_part[tail_start..])
        && i < t / 2
        && tail_start > 0
    {
        t -= i + 1;
    }
    let total = bytes.len() as u64 + missing;
    let cut_from = h as u64;
    let cut_to = total - t as u64;
    let mut out = show(&head_part[..h]);
    if cut_to > cut_from {
        if !out.is_empty() && !out.ends_with('\n') {
            out.push('\n');
        }
        out.push_str(&marker(cut_from, cut_to));
        out.push('\n');
    }
    out.push_str(&show(&tail_part[tail_part.len() - t..]));
    (out, cut_to > cut_from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn costs_are_json_escaped_lengths() {
        for s in ["plain", "a\"b\\c", "line\n\ttab", "\0\u{1}x", "é✓"] {
            let json = serde_json::to_string(s).unwrap();
            assert_eq!(cost(s), json.chars().count() - 2, "{s:?}");
        }
        assert_eq!(fit_head(b"abc\0def", 4), 3);
        assert_eq!(fit_head(b"ab\xffcd", 3), 3);
        assert_eq!(fit_tail(b"abc\0def", 9), 4);
        assert_eq!(fit_tail("xé".as_bytes(), 1), 2);
    }

    #[test]
    fn excerpts_keep_head_and_tail_on_line_boundaries() {
        let text: String = (0..2000).map(|i| format!("line {i}\n")).collect();
        let (out, cut) = excerpt(text.as_bytes(), None, 1000, |a, b| format!("[cut {a}-{b}]"));
        assert!(cut);
        assert!(cost(&out) <= 1000, "{}", cost(&out));
        assert!(
            out.starts_with("line 0\n") && out.ends_with("line 1999\n"),
            "{out}"
        );
        let marker = out.lines().find(|l| l.starts_with("[cut ")).unwrap();
        let (a, b) = marker[5..marker.len() - 1].split_once('-').unwrap();
        let (a, b): (usize, usize) = (a.parse().unwrap(), b.parse().unwrap());
        // What is shown plus what the marker names is the whole text.
        let shown = out.replace(&format!("{marker}\n"), "");
        assert_eq!(format!("{}{}", &text[..a], &text[b..]), shown);
        assert_eq!(
            excerpt(b"short\n", None, 1000, |_, _| unreachable!()),
            ("short\n".into(), false)
        );
        // Colour is removed.
        assert_eq!(
            excerpt(b"\x1b[31mred\x1b[0m", None, 1000, |_, _| String::new()).0,
            "red"
        );
    }
}

//! Reading kept output back: `mcp-run://runs/{id}/{stream}{?lines,bytes,grep}`.
//!
//! - no query: the stream from its start;
//! - `bytes=A-B`: bytes A (from 0) up to B (exclusive; `A-` to the end), as they are: text
//!   when they are UTF-8, else a `blob` content (base64) beside a text content with the notes;
//! - `lines=A-B`: lines A to B (from 1, inclusive; `A-` to the end), colour removed;
//! - `grep=REGEX`: the lines that match, each as `N:line`, colour removed (with `lines=`,
//!   only within that range).
//!
//! Every read returns one page within the result budget; a page that does not reach the
//! end says so on its last line and names the URI of the next page.

use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};

use crate::result::{Stream, cost};

use super::store::{Recording, stream_name};

/// The URI template agents fill in.
pub(crate) const TEMPLATE: &str = "mcp-run://runs/{id}/{stream}{?lines,bytes,grep}";

const PREFIX: &str = "mcp-run://runs/";

/// A parsed output URI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct OutputUri {
    pub id: String,
    pub stream: Stream,
    pub query: Query,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Query {
    pub bytes: Option<(u64, Option<u64>)>,
    pub lines: Option<(u64, Option<u64>)>,
    pub grep: Option<String>,
}

/// Why an output URI cannot be read (the MCP front answers each with `invalid_params`).
#[derive(Debug, thiserror::Error)]
pub(crate) enum ResourceError {
    #[error("not an output URI: {0:?}")]
    NotOurs(String),
    #[error("expected {TEMPLATE}, got {0:?}")]
    Shape(String),
    #[error("the stream is stdout or stderr, not {0:?}")]
    Stream(String),
    #[error("invalid run id {0:?}")]
    RunId(String),
    #[error("{0:?} is not UTF-8 once decoded")]
    NotUtf8(String),
    #[error("{what} must be START-END or START- (numbers from {min}), got {value:?}")]
    Range {
        what: &'static str,
        min: u64,
        value: String,
    },
    #[error("grep needs a pattern")]
    EmptyGrep,
    #[error("unknown parameter {0:?}: use lines, bytes or grep")]
    UnknownParameter(String),
    #[error("bytes cannot be combined with lines or grep")]
    BytesWithLines,
    #[error("invalid grep pattern {pattern:?}: {source}")]
    Grep {
        pattern: String,
        source: regex::Error,
    },
    #[error("cannot read the output: {0}")]
    Read(#[from] std::io::Error),
}

/// Whether `uri` is one of ours (so that a bad one gets a precise error).
pub(crate) fn is_output_uri(uri: &str) -> bool {
    uri.starts_with(PREFIX)
}

fn range(v: &str, what: &'static str, min: u64) -> Result<(u64, Option<u64>), ResourceError> {
    let bad = || ResourceError::Range {
        what,
        min,
        value: v.to_owned(),
    };
    let (a, b) = v.split_once('-').ok_or_else(bad)?;
    let a: u64 = a.parse().map_err(|_| bad())?;
    let b: Option<u64> = if b.is_empty() {
        None
    } else {
        Some(b.parse().map_err(|_| bad())?)
    };
    if a < min || b.is_some_and(|b| b < a) {
        return Err(bad());
    }
    Ok((a, b))
}

/// A query value as sent: `+` is a space (form encoding), `%XX` a byte; the bytes must be
/// UTF-8. A `%` not followed by two hex digits stays as it is.
fn percent_decode(s: &str) -> Result<String, ResourceError> {
    let spaced = s.replace('+', " ");
    percent_encoding::percent_decode_str(&spaced)
        .decode_utf8()
        .map(|d| d.into_owned())
        .map_err(|_| ResourceError::NotUtf8(s.to_owned()))
}

/// What a query value may hold as it is (RFC 3986's unreserved characters); the rest is
/// percent-encoded.
const QUERY_VALUE: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');

fn encode(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, QUERY_VALUE).to_string()
}

impl OutputUri {
    pub(crate) fn parse(uri: &str) -> Result<OutputUri, ResourceError> {
        let rest = uri
            .strip_prefix(PREFIX)
            .ok_or_else(|| ResourceError::NotOurs(uri.to_owned()))?;
        let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (id, stream) = path
            .split_once('/')
            .ok_or_else(|| ResourceError::Shape(uri.to_owned()))?;
        let stream = match stream {
            "stdout" => Stream::Stdout,
            "stderr" => Stream::Stderr,
            s => return Err(ResourceError::Stream(s.to_owned())),
        };
        if id.is_empty() || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(ResourceError::RunId(id.to_owned()));
        }
        let mut q = Query::default();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let v = percent_decode(v)?;
            match k {
                "bytes" => q.bytes = Some(range(&v, "bytes", 0)?),
                "lines" => q.lines = Some(range(&v, "lines", 1)?),
                "grep" if !v.is_empty() => q.grep = Some(v),
                "grep" => return Err(ResourceError::EmptyGrep),
                k => return Err(ResourceError::UnknownParameter(k.to_owned())),
            }
        }
        if q.bytes.is_some() && (q.lines.is_some() || q.grep.is_some()) {
            return Err(ResourceError::BytesWithLines);
        }
        Ok(OutputUri {
            id: id.to_owned(),
            stream,
            query: q,
        })
    }

    fn base(&self) -> String {
        format!("{PREFIX}{}/{}", self.id, stream_name(self.stream))
    }
}

/// One page of a read.
pub(crate) struct Page {
    /// The page, or with `blob` only the notes about it (next page, what was kept).
    pub text: String,
    /// A `bytes=` page that is not UTF-8: its exact bytes, sent as a `blob` resource content
    /// (base64), so that a range reads what the command wrote.
    pub blob: Option<Vec<u8>>,
    /// The next page's URI, when this one does not reach the end.
    pub next: Option<String>,
}

/// Reads one page of `uri` from `run`, at most `budget` characters (as [`cost`] counts).
pub(crate) fn read(run: &Recording, uri: &OutputUri, budget: usize) -> Result<Page, ResourceError> {
    let path = run.path(uri.stream);
    let file = std::fs::File::open(path)?;
    let kept = run.kept(uri.stream);
    let total = run.total(uri.stream);
    let mut page = match (&uri.query.bytes, &uri.query.grep) {
        (Some((a, b)), _) => bytes_page(file, uri, *a, *b, kept, budget)?,
        (None, Some(re)) => grep_page(file, uri, re, budget)?,
        (None, None) => match uri.query.lines {
            Some(_) => lines_page(file, uri, budget)?,
            None => bytes_page(file, uri, 0, None, kept, budget)?,
        },
    };
    if page.next.is_none() && kept < total {
        page.text.push_str(&format!(
            "\n[mcp-run: only the first {kept} of {total} bytes of this stream were kept (the per-stream bound mcp.max_output_bytes, or the disk refused more)]\n"
        ));
    }
    if let Some(next) = &page.next {
        page.text
            .push_str(&format!("\n[mcp-run: page ends here; next page: {next}]\n"));
    }
    Ok(page)
}

/// Room left for the text once the closing note is counted.
fn room(budget: usize) -> usize {
    budget.saturating_sub(300).max(100)
}

fn bytes_page(
    mut file: std::fs::File,
    uri: &OutputUri,
    start: u64,
    end: Option<u64>,
    kept: u64,
    budget: usize,
) -> Result<Page, ResourceError> {
    let end = end.unwrap_or(kept).min(kept);
    if start > end {
        return Ok(Page {
            text: format!("[mcp-run: the stream has {kept} bytes; nothing at {start}]\n"),
            blob: None,
            next: None,
        });
    }
    file.seek(SeekFrom::Start(start))?;
    // A character costs at most 6 (a control byte escaped), and at least one byte.
    let want = (end - start).min(room(budget) as u64 * 4);
    let mut buf = Vec::with_capacity(want as usize);
    file.take(want).read_to_end(&mut buf)?;
    let n = crate::result::fit_head(&buf, room(budget));
    // Prefer to end the page after a newline, when one is near.
    let n = match memchr::memrchr(b'\n', &buf[..n]) {
        Some(i) if n < buf.len() && i + 1 >= n / 2 => i + 1,
        _ => n,
    };
    let (n, blob) = match std::str::from_utf8(&buf[..n]) {
        Ok(_) => (n, false),
        // Text whose last character the page end cut: that character starts the next page.
        Err(e) if e.error_len().is_none() && e.valid_up_to() > 0 => (e.valid_up_to(), false),
        // Not text: the exact bytes, as many as fit the budget once base64 (4 per 3).
        Err(_) => (buf.len().min(room(budget) / 4 * 3).max(1), true),
    };
    let stop = start + n as u64;
    let (text, blob) = if blob {
        (String::new(), Some(buf[..n].to_vec()))
    } else {
        (String::from_utf8_lossy(&buf[..n]).into_owned(), None)
    };
    Ok(Page {
        text,
        blob,
        next: (stop < end).then(|| {
            let e = if end == kept {
                String::new()
            } else {
                end.to_string()
            };
            format!("{}?bytes={stop}-{e}", uri.base())
        }),
    })
}

fn lines_page(file: std::fs::File, uri: &OutputUri, budget: usize) -> Result<Page, ResourceError> {
    let (first, last) = uri.query.lines.unwrap_or((1, None));
    let room = room(budget);
    let mut used = 0;
    let mut text = String::new();
    let mut reader = BufReader::new(file);
    let mut line = Vec::new();
    let mut no = 0u64;
    loop {
        line.clear();
        let n = reader.read_until(b'\n', &mut line)?;
        if n == 0 {
            return Ok(Page {
                text,
                blob: None,
                next: None,
            });
        }
        no += 1;
        if no < first {
            continue;
        }
        if last.is_some_and(|l| no > l) {
            return Ok(Page {
                text,
                blob: None,
                next: None,
            });
        }
        let s = String::from_utf8_lossy(&crate::templates::ansi::strip(&line)).into_owned();
        let c = cost(&s);
        if used + c > room && no > first {
            let end = last.map(|l| l.to_string()).unwrap_or_default();
            return Ok(Page {
                text,
                blob: None,
                next: Some(format!("{}?lines={no}-{end}", uri.base())),
            });
        }
        if used + c > room {
            // One line longer than a page: its start, and the rest by bytes is out of reach
            // here; say so.
            let n = crate::result::fit_head(s.as_bytes(), room);
            text.push_str(&String::from_utf8_lossy(&s.as_bytes()[..n]));
            text.push_str(&format!(
                "\n[mcp-run: line {no} is longer than a page; read it with ?bytes=]\n"
            ));
            let end = last.map(|l| l.to_string()).unwrap_or_default();
            let next = (last != Some(no)).then(|| format!("{}?lines={}-{end}", uri.base(), no + 1));
            return Ok(Page {
                text,
                blob: None,
                next,
            });
        }
        used += c;
        text.push_str(&s);
    }
}

fn grep_page(
    file: std::fs::File,
    uri: &OutputUri,
    re: &str,
    budget: usize,
) -> Result<Page, ResourceError> {
    let pattern = regex::RegexBuilder::new(re)
        .size_limit(1 << 22)
        .build()
        .map_err(|source| ResourceError::Grep {
            pattern: re.to_owned(),
            source,
        })?;
    let (first, last) = uri.query.lines.unwrap_or((1, None));
    let room = room(budget);
    let (mut used, mut matches) = (0, 0u64);
    let mut text = String::new();
    let mut reader = BufReader::new(file);
    let mut line = Vec::new();
    let mut no = 0u64;
    loop {
        line.clear();
        let n = reader.read_until(b'\n', &mut line)?;
        no += 1;
        if n == 0 || last.is_some_and(|l| no > l) {
            if matches == 0 {
                text.push_str(&format!("[mcp-run: no line matches {re:?}]\n"));
            }
            return Ok(Page {
                text,
                blob: None,
                next: None,
            });
        }
        if no < first {
            continue;
        }
        let s = String::from_utf8_lossy(&crate::templates::ansi::strip(&line)).into_owned();
        if !pattern.is_match(s.trim_end_matches(['\n', '\r'])) {
            continue;
        }
        let mut entry = format!("{no}:{s}");
        if !entry.ends_with('\n') {
            entry.push('\n');
        }
        let c = cost(&entry);
        if used + c > room {
            if matches == 0 {
                let n = crate::result::fit_head(entry.as_bytes(), room);
                text.push_str(&String::from_utf8_lossy(&entry.as_bytes()[..n]));
                text.push('\n');
                no += 1;
            }
            let end = last.map(|l| l.to_string()).unwrap_or_default();
            return Ok(Page {
                text,
                blob: None,
                next: Some(format!(
                    "{}?grep={}&lines={no}-{end}",
                    uri.base(),
                    encode(re)
                )),
            });
        }
        matches += 1;
        used += c;
        text.push_str(&entry);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_what_the_template_allows() {
        let u =
            OutputUri::parse("mcp-run://runs/ab12/stderr?lines=10-20&grep=error%3A%20x").unwrap();
        assert_eq!(u.id, "ab12");
        assert_eq!(u.stream, Stream::Stderr);
        assert_eq!(u.query.lines, Some((10, Some(20))));
        assert_eq!(u.query.grep.as_deref(), Some("error: x"));
        let u = OutputUri::parse("mcp-run://runs/ab12/stdout?bytes=5-").unwrap();
        assert_eq!(u.query.bytes, Some((5, None)));
        for bad in [
            "mcp-run://runs/ab12",
            "mcp-run://runs/ab12/stdin",
            "mcp-run://runs/../stdout",
            "mcp-run://runs/ab12/stdout?lines=0-3",
            "mcp-run://runs/ab12/stdout?lines=5-3",
            "mcp-run://runs/ab12/stdout?bytes=x",
            "mcp-run://runs/ab12/stdout?bytes=1-2&lines=1-",
            "mcp-run://runs/ab12/stdout?color=1",
        ] {
            assert!(OutputUri::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(encode("a b/c"), "a%20b%2Fc");
        assert_eq!(percent_decode(&encode("é [x]")).unwrap(), "é [x]");
    }
}

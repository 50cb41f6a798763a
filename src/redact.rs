//! Redaction (config `redaction:`): configured literal secrets and regular expressions are
//! replaced by `[REDACTED]` in what leaves an execution: `/raw` streams, MCP results, audit
//! lines. Installed once as an [`EventFilter`] by the Runner, so no backend and no front end
//! has to know about it.
//!
//! Streams arrive in chunks, and a secret may be split between two of them. Every secret has
//! a known maximum length (a literal's length; a pattern's `max_len`, required in the
//! configuration); with `W` the largest, each stream holds back its last `W - 1` bytes until
//! the next chunk (or the end of the command) shows whether they begin a secret. A match
//! that starts before that window lies wholly in the buffer and is final. The cost is
//! latency for those few bytes and one copy of each chunk; `docs/policy.md` has the numbers.

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::Bytes;
use regex::bytes::Regex;
use serde::{Deserialize, Serialize};

use crate::contract::Event;
use crate::exec::EventFilter;

/// What replaces every secret.
pub(crate) const REPLACEMENT: &[u8] = b"[REDACTED]";

/// The `redaction:` section of the configuration.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RedactionConfig {
    /// Literal secrets (prefer `secrets_env`: a config file is not a Secret).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<String>,
    /// Names of the gateway's environment variables whose values are secrets (a Kubernetes
    /// Secret mounted as environment). Unset or empty variables are skipped.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub secrets_env: Vec<String>,
    /// Regular expressions (Rust `regex` syntax, on bytes).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub patterns: Vec<PatternConfig>,
}

/// One pattern and the longest text it can match.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PatternConfig {
    pub regex: String,
    /// The longest match in bytes; a secret split across chunks is caught only within this
    /// bound (text of a longer match may leave before the rest arrives).
    pub max_len: usize,
}

/// The longest secret accepted: it bounds the bytes held back per stream.
pub(crate) const MAX_SECRET_LEN: usize = 4096;

/// A configuration error: the field and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{field}` {message}")]
pub struct RedactionConfigError {
    pub field: String,
    pub message: String,
}

fn err(field: String, message: impl Into<String>) -> RedactionConfigError {
    RedactionConfigError {
        field,
        message: message.into(),
    }
}

impl RedactionConfig {
    pub fn is_empty(&self) -> bool {
        self.secrets.is_empty() && self.secrets_env.is_empty() && self.patterns.is_empty()
    }

    /// Checks what does not depend on the environment.
    pub fn validate(&self) -> Result<(), RedactionConfigError> {
        for (i, s) in self.secrets.iter().enumerate() {
            let field = format!("redaction.secrets[{i}]");
            if s.is_empty() {
                return Err(err(field, "must not be empty"));
            }
            if s.len() > MAX_SECRET_LEN {
                return Err(err(field, format!("is longer than {MAX_SECRET_LEN} bytes")));
            }
        }
        for (i, name) in self.secrets_env.iter().enumerate() {
            if !crate::contract::is_valid_env_name(name) {
                return Err(err(
                    format!("redaction.secrets_env[{i}]"),
                    format!("{name:?} is not a variable name"),
                ));
            }
        }
        for (i, p) in self.patterns.iter().enumerate() {
            let re = Regex::new(&p.regex)
                .map_err(|e| err(format!("redaction.patterns[{i}].regex"), e.to_string()))?;
            if re.is_match(b"") {
                return Err(err(
                    format!("redaction.patterns[{i}].regex"),
                    "matches the empty string",
                ));
            }
            if p.max_len == 0 || p.max_len > MAX_SECRET_LEN {
                return Err(err(
                    format!("redaction.patterns[{i}].max_len"),
                    format!("must be between 1 and {MAX_SECRET_LEN}"),
                ));
            }
        }
        Ok(())
    }
}

/// The compiled redaction: one regex for every secret and pattern, and the window.
#[derive(Debug)]
pub(crate) struct Redactor {
    re: Regex,
    /// The longest secret, in bytes.
    window: usize,
}

impl Redactor {
    /// Builds the redactor of a validated configuration; `env` reads `secrets_env`.
    /// `Ok(None)` when there is nothing to redact.
    pub(crate) fn from_config(
        config: &RedactionConfig,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<Arc<Redactor>>, RedactionConfigError> {
        config.validate()?;
        let mut literals: Vec<String> = config.secrets.clone();
        for (i, name) in config.secrets_env.iter().enumerate() {
            match env(name).filter(|v| !v.is_empty()) {
                Some(v) if v.len() > MAX_SECRET_LEN => {
                    return Err(err(
                        format!("redaction.secrets_env[{i}]"),
                        format!("the value of {name} is longer than {MAX_SECRET_LEN} bytes"),
                    ));
                }
                Some(v) => literals.push(v),
                None => {
                    tracing::warn!(variable = %name, "redaction.secrets_env: variable unset or empty, nothing to redact for it")
                }
            }
        }
        Self::new(&literals, &config.patterns)
    }

    /// A redactor for literal secrets and patterns (already validated).
    pub(crate) fn new(
        literals: &[String],
        patterns: &[PatternConfig],
    ) -> Result<Option<Arc<Redactor>>, RedactionConfigError> {
        // Longest literal first: alternation is leftmost-first, and a secret that is a prefix
        // of another must not leave the other's tail behind.
        let mut literals: Vec<&String> = literals.iter().filter(|s| !s.is_empty()).collect();
        literals.sort_by_key(|s| std::cmp::Reverse(s.len()));
        literals.dedup();
        let mut alternatives: Vec<String> = literals
            .iter()
            .map(|s| format!("(?:{})", regex::escape(s)))
            .collect();
        alternatives.extend(patterns.iter().map(|p| format!("(?:{})", p.regex)));
        if alternatives.is_empty() {
            return Ok(None);
        }
        let window = literals
            .iter()
            .map(|s| s.len())
            .chain(patterns.iter().map(|p| p.max_len))
            .max()
            .unwrap_or(1)
            .max(1);
        let re = Regex::new(&alternatives.join("|"))
            .map_err(|e| err("redaction.patterns".into(), e.to_string()))?;
        Ok(Some(Arc::new(Redactor { re, window })))
    }

    /// The longest secret: each stream holds back one byte less.
    #[cfg(test)]
    pub(crate) fn window(&self) -> usize {
        self.window
    }

    /// Redacts a complete text.
    pub(crate) fn redact(&self, data: &[u8]) -> Vec<u8> {
        self.re.replace_all(data, REPLACEMENT).into_owned()
    }

    /// Redacts a complete string (argv in audit lines).
    pub(crate) fn redact_str(&self, s: &str) -> String {
        String::from_utf8_lossy(&self.redact(s.as_bytes())).into_owned()
    }

    /// The state of one output stream.
    pub(crate) fn stream(self: &Arc<Self>) -> StreamRedactor {
        StreamRedactor {
            redactor: self.clone(),
            carry: Vec::new(),
        }
    }
}

/// Redacts one stream chunk by chunk, holding back the bytes that may begin a secret.
#[derive(Debug)]
pub(crate) struct StreamRedactor {
    redactor: Arc<Redactor>,
    carry: Vec<u8>,
}

impl StreamRedactor {
    /// Takes the next chunk; returns what can be sent now.
    pub(crate) fn push(&mut self, chunk: &[u8]) -> Vec<u8> {
        let mut buf = std::mem::take(&mut self.carry);
        buf.extend_from_slice(chunk);
        // A secret starting at or after `cut` may be incomplete; one starting before it has
        // all of its at most `window` bytes in `buf`, so its match is final.
        let cut = buf.len().saturating_sub(self.redactor.window - 1);
        let mut out = Vec::with_capacity(buf.len());
        let mut pos = 0;
        for m in self.redactor.re.find_iter(&buf) {
            if m.start() >= cut {
                break;
            }
            out.extend_from_slice(&buf[pos..m.start()]);
            out.extend_from_slice(REPLACEMENT);
            pos = m.end();
        }
        let keep = pos.max(cut);
        out.extend_from_slice(&buf[pos..keep]);
        buf.drain(..keep);
        self.carry = buf;
        out
    }

    /// The end of the stream: the held-back bytes, redacted.
    pub(crate) fn finish(&mut self) -> Vec<u8> {
        let rest = std::mem::take(&mut self.carry);
        self.redactor.redact(&rest)
    }

    /// How many bytes are held back now.
    #[cfg(test)]
    pub(crate) fn held(&self) -> usize {
        self.carry.len()
    }
}

/// The [`EventFilter`] that redacts both output streams of an execution.
pub(crate) struct RedactFilter {
    stdout: StreamRedactor,
    stderr: StreamRedactor,
}

impl RedactFilter {
    pub(crate) fn new(redactor: &Arc<Redactor>) -> Self {
        Self {
            stdout: redactor.stream(),
            stderr: redactor.stream(),
        }
    }
}

impl EventFilter for RedactFilter {
    fn filter(&mut self, event: Event, out: &mut VecDeque<Event>) {
        match event {
            Event::Stdout { data } => {
                let data = self.stdout.push(&data);
                if !data.is_empty() {
                    out.push_back(Event::Stdout { data: data.into() });
                }
            }
            Event::Stderr { data } => {
                let data = self.stderr.push(&data);
                if !data.is_empty() {
                    out.push_back(Event::Stderr { data: data.into() });
                }
            }
            Event::Exit(_) | Event::Error { .. } => {
                let o = self.stdout.finish();
                if !o.is_empty() {
                    out.push_back(Event::Stdout {
                        data: Bytes::from(o),
                    });
                }
                let e = self.stderr.finish();
                if !e.is_empty() {
                    out.push_back(Event::Stderr {
                        data: Bytes::from(e),
                    });
                }
                out.push_back(event);
            }
            other => out.push_back(other),
        }
    }
}

/// The redaction applied to every log line, whoever writes it (the gateway, rmcp's debug
/// log of tool arguments, hyper): set once the configuration is loaded.
static LOG_REDACTOR: std::sync::OnceLock<Arc<Redactor>> = std::sync::OnceLock::new();

/// Redacts log lines with `r` from now on.
pub(crate) fn redact_logs(r: Arc<Redactor>) {
    let _ = LOG_REDACTOR.set(r);
}

/// A `tracing_subscriber` writer for stderr that redacts each log line as a whole (a line is
/// formatted into one buffer, so a secret is never split between writes).
pub(crate) fn log_writer() -> LogLine {
    LogLine(Vec::new())
}

/// One log line on its way to stderr.
pub(crate) struct LogLine(Vec<u8>);

impl std::io::Write for LogLine {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let line = std::mem::take(&mut self.0);
        if line.is_empty() {
            return Ok(());
        }
        let out = match LOG_REDACTOR.get() {
            Some(r) => r.redact(&line),
            None => line,
        };
        std::io::Write::write_all(&mut std::io::stderr().lock(), &out)
    }
}

impl Drop for LogLine {
    fn drop(&mut self) {
        let _ = std::io::Write::flush(self);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn redactor(literals: &[&str], patterns: &[(&str, usize)]) -> Arc<Redactor> {
        let l: Vec<String> = literals.iter().map(|s| s.to_string()).collect();
        let p: Vec<PatternConfig> = patterns
            .iter()
            .map(|(r, n)| PatternConfig {
                regex: r.to_string(),
                max_len: *n,
            })
            .collect();
        Redactor::new(&l, &p).unwrap().unwrap()
    }

    /// Feeds `text` in chunks split at `splits` and returns the whole output.
    fn streamed(r: &Arc<Redactor>, text: &[u8], splits: &[usize]) -> Vec<u8> {
        let mut s = r.stream();
        let mut out = Vec::new();
        let mut last = 0;
        for &at in splits.iter().chain(std::iter::once(&text.len())) {
            out.extend(s.push(&text[last..at]));
            assert!(s.held() < r.window(), "held {} bytes", s.held());
            last = at;
        }
        out.extend(s.finish());
        out
    }

    #[test]
    fn a_secret_split_anywhere_is_caught() {
        let r = redactor(&["hunter2-secret"], &[("ghp_[A-Za-z0-9]{8}", 12)]);
        let text = b"login hunter2-secret ok; token ghp_abcd1234 end\n";
        let want = b"login [REDACTED] ok; token [REDACTED] end\n".to_vec();
        assert_eq!(r.redact(text), want);
        for a in 0..=text.len() {
            for b in a..=text.len() {
                assert_eq!(streamed(&r, text, &[a, b]), want, "split at {a}, {b}");
            }
        }
        // One byte at a time.
        let every: Vec<usize> = (1..text.len()).collect();
        assert_eq!(streamed(&r, text, &every), want);
    }

    #[test]
    fn longest_literal_wins_and_empty_input_is_fine() {
        let r = redactor(&["abc", "abcdef"], &[]);
        assert_eq!(
            r.redact(b"xabcdefx abc"),
            b"x[REDACTED]x [REDACTED]".to_vec()
        );
        assert_eq!(streamed(&r, b"", &[]), b"".to_vec());
        let mut s = r.stream();
        // Text that cannot begin a secret goes out at once, but for window - 1 bytes.
        assert_eq!(s.push(b"0123456789"), b"01234".to_vec());
        assert_eq!(s.held(), 5);
    }

    #[test]
    fn regex_metacharacters_in_literals_are_literal() {
        let r = redactor(&["a.b*c"], &[]);
        assert_eq!(r.redact(b"a.b*c axbbc"), b"[REDACTED] axbbc".to_vec());
    }

    #[test]
    fn the_filter_flushes_before_the_terminal_event() {
        let r = redactor(&["topsecret"], &[]);
        let mut f = RedactFilter::new(&r);
        let mut out = VecDeque::new();
        f.filter(
            Event::Stdout {
                data: Bytes::from_static(b"value: tops"),
            },
            &mut out,
        );
        f.filter(
            Event::Stdout {
                data: Bytes::from_static(b"ecret\nbye"),
            },
            &mut out,
        );
        f.filter(Event::Exit(Default::default()), &mut out);
        let mut text = Vec::new();
        for e in &out {
            if let Event::Stdout { data } = e {
                text.extend_from_slice(data);
            }
        }
        assert_eq!(text, b"value: [REDACTED]\nbye".to_vec());
        assert!(matches!(out.back(), Some(Event::Exit(_))));
    }

    #[test]
    fn config_errors_name_the_field() {
        for (yaml, field) in [
            ("secrets: ['']", "redaction.secrets[0]"),
            ("secrets_env: ['A-B']", "redaction.secrets_env[0]"),
            (
                "patterns: [{regex: '(', max_len: 3}]",
                "redaction.patterns[0].regex",
            ),
            (
                "patterns: [{regex: 'a*', max_len: 3}]",
                "redaction.patterns[0].regex",
            ),
            (
                "patterns: [{regex: 'a', max_len: 0}]",
                "redaction.patterns[0].max_len",
            ),
        ] {
            let c: RedactionConfig = yaml_serde::from_str(yaml).unwrap();
            assert_eq!(c.validate().unwrap_err().field, field, "{yaml}");
        }
        let missing = yaml_serde::from_str::<RedactionConfig>("patterns: [{regex: 'a'}]");
        assert!(missing.is_err(), "max_len is required");
    }
}

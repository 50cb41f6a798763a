//! The wire contract shared by the gateway and its clients: the `/raw` request
//! (`RunNetworkToolInput`), the NDJSON events of a run, and the JSON error body.
//!
//! Everything that crosses the network is defined here once, so that the server,
//! `run-remote` and the `remote` backend cannot drift apart. `docs/protocol.md` is the
//! prose version of this module.
//!
//! Size: over 500 lines on purpose: the whole wire contract in one module, so that nothing that
//! crosses the network is defined anywhere else.

use std::collections::BTreeMap;

use base64_simd::STANDARD as BASE64;
use bytes::{Bytes, BytesMut};
use serde::{Deserialize, Serialize};

/// `Content-Type` of a `/raw` request that carries the command's stdin: the request JSON on
/// the first line, then the stdin bytes verbatim until the end of the body (its end is the
/// command's end of input). `application/json` bodies carry no stdin.
pub const STDIN_CONTENT_TYPE: &str = "application/vnd.mcp-run.stdin";

/// Request header (`Mcp-Run-Progress: 1`) asking `/raw` for `phase` events while the command
/// is being prepared. With it, a start that fails after a phase was sent ends the stream with
/// an `error` event instead of an HTTP error status.
pub const PROGRESS_HEADER: &str = "mcp-run-progress";

/// The body of `POST /raw` and the arguments of the MCP tool `run_network_tool`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RunRequest {
    /// The program to run: a name looked up in `PATH`, or a path. Never interpreted by a shell.
    /// Required unless `steps` is given.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub executable: String,
    /// Arguments passed to the program as they are, one argv entry each.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    /// Absolute working directory of the command.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Environment variables set for the command, in addition to the backend's base environment.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Kill the command after this many seconds (bounded by the server's maximum).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_secs: Option<u64>,
    /// Runner profile (Kubernetes backend); `default` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    /// A workspace id from `POST /workspaces`: the command runs in a fresh copy of that tree,
    /// and `cwd` is relative to its root.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace: Option<String>,
    /// With `workspace`: globs (relative to the workspace root; `*` within a path component,
    /// `**` across) of files to report back when the command created or changed them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sync_back: Vec<String>,
    /// Names the project whose caches the run uses, for the profile's caches with
    /// `scope: workspace` (default: the workspace's id). Caches are always the caller's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_scope: Option<String>,
    /// Run in the runner of this named session instead of a fresh one, so that what earlier
    /// calls wrote stays (build outputs, caches, installed packages). The first call with a
    /// name opens the session; pass the same name for every call of an edit-build-test loop.
    /// Names are the caller's own: another identity's `build` is another session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// With `session`: what a call does when another call of the session is running:
    /// `wait` for it (within this call's timeout; the default) or `fail` at once with 409
    /// `session_busy`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_busy: Option<SessionBusy>,
    /// Several commands run in order in one runner, in place of `executable` and `args`. Each
    /// step's `cwd`, `env` and `timeout_secs` default to the request's. The run stops at the
    /// first step that fails unless `continue_on_error`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub steps: Vec<Step>,
    /// With `steps`: run the later steps after one failed.
    #[serde(default, skip_serializing_if = "is_false")]
    pub continue_on_error: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// One command of a multi-step run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Step {
    /// The program to run, as `executable` of a request.
    pub executable: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    /// The step's working directory (default: the request's `cwd`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Added to (and overriding) the request's `env`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// The step's own timeout (default: the request's `timeout_secs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_secs: Option<u64>,
}

/// The most steps one request may give.
pub const MAX_STEPS: usize = 32;

/// What a session's call does while another call of the session runs.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum SessionBusy {
    /// Wait for the running call (reported as the phase `queued`), within the call's timeout.
    #[default]
    Wait,
    /// Fail at once with 409 `session_busy`.
    Fail,
}

/// The longest session name.
pub const MAX_SESSION_NAME: usize = 63;

/// Checks a session name: 1 to 63 characters of `A-Z a-z 0-9 . _ -`, starting with a letter
/// or digit.
pub fn check_session_name(name: &str) -> Result<(), ErrorBody> {
    let ok = !name.is_empty()
        && name.len() <= MAX_SESSION_NAME
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(ErrorBody::new(
            ErrorCode::InvalidRequest,
            format!(
                "invalid session name {:?}: 1 to {MAX_SESSION_NAME} characters of A-Z, a-z, 0-9, `.`, `_` and `-`, starting with a letter or digit",
                truncate(name, 80)
            ),
        ))
    }
}

fn truncate(s: &str, max: usize) -> &str {
    let mut cut = s.len().min(max);
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    &s[..cut]
}

/// One open session, as `GET /sessions` lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct SessionInfo {
    pub name: String,
    /// The runner profile the session's runner was made from.
    pub profile: String,
    /// Where the session's commands run (backend, host or pod).
    pub context: RunContext,
    /// Seconds since the session was opened.
    pub age_secs: u64,
    /// Seconds since its last call ended (0 while a call runs).
    pub idle_secs: u64,
    /// Seconds until the session ends unless used: the idle TTL, or less when its maximum
    /// lifetime comes first.
    pub expires_in_secs: u64,
    /// Calls run in it so far.
    pub calls: u64,
    /// Whether a call is running now.
    pub busy: bool,
}

/// The body of `GET /sessions`: the caller's open sessions.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct SessionList {
    pub sessions: Vec<SessionInfo>,
}

/// The most `sync_back` globs a request may give.
pub const MAX_SYNC_BACK_GLOBS: usize = 64;

/// The `RunNetworkToolInput` name used by the reference design for the same JSON.
pub type RunNetworkToolInput = RunRequest;

impl RunRequest {
    /// Checks what can be checked without knowing the server's configuration.
    /// Server limits (maximum timeout, profiles) are checked by the gateway.
    pub fn validate(&self) -> Result<(), ErrorBody> {
        if !self.steps.is_empty() {
            if !self.executable.is_empty() || !self.args.is_empty() {
                return Err(ErrorBody::new(
                    ErrorCode::InvalidRequest,
                    "give either `executable` (and `args`) or `steps`, not both",
                ));
            }
            if self.steps.len() > MAX_STEPS {
                return Err(ErrorBody::new(
                    ErrorCode::InvalidRequest,
                    format!("at most {MAX_STEPS} `steps`, got {}", self.steps.len()),
                ));
            }
            for (i, step) in self.step_requests().iter().enumerate() {
                step.validate().map_err(|mut e| {
                    e.message = format!("steps[{i}]: {}", e.message);
                    e
                })?;
            }
            return Ok(());
        }
        if self.continue_on_error {
            return Err(ErrorBody::new(
                ErrorCode::InvalidRequest,
                "`continue_on_error` needs `steps`",
            ));
        }
        if self.executable.is_empty() {
            return Err(ErrorBody::new(
                ErrorCode::InvalidRequest,
                "`executable` must not be empty",
            ));
        }
        check_nul("executable", &self.executable)?;
        if let Some(s) = &self.cache_scope
            && (s.is_empty() || s.len() > 128 || s.chars().any(char::is_control))
        {
            return Err(ErrorBody::new(
                ErrorCode::InvalidRequest,
                "`cache_scope` must be 1 to 128 characters without control characters",
            ));
        }
        for (i, arg) in self.args.iter().enumerate() {
            check_nul(&format!("args[{i}]"), arg)?;
        }
        if let Some(ws) = &self.workspace {
            check_nul("workspace", ws)?;
            if let Some(cwd) = &self.cwd {
                check_nul("cwd", cwd)?;
                if cwd.starts_with('/') || cwd.split('/').any(|c| c == "..") {
                    return Err(ErrorBody::new(
                        ErrorCode::InvalidRequest,
                        format!(
                            "with `workspace`, `cwd` is relative to the workspace root and must not contain `..`, got {cwd:?}"
                        ),
                    ));
                }
            }
            if self.sync_back.len() > MAX_SYNC_BACK_GLOBS {
                return Err(ErrorBody::new(
                    ErrorCode::InvalidRequest,
                    format!("at most {MAX_SYNC_BACK_GLOBS} `sync_back` globs"),
                ));
            }
            for (i, g) in self.sync_back.iter().enumerate() {
                check_nul(&format!("sync_back[{i}]"), g)?;
            }
        } else if !self.sync_back.is_empty() {
            return Err(ErrorBody::new(
                ErrorCode::InvalidRequest,
                "`sync_back` needs a `workspace`",
            ));
        } else if let Some(cwd) = &self.cwd {
            check_nul("cwd", cwd)?;
            if !cwd.starts_with('/') {
                return Err(ErrorBody::new(
                    ErrorCode::InvalidRequest,
                    format!("`cwd` must be an absolute path, got {cwd:?}"),
                ));
            }
        }
        for (name, value) in &self.env {
            if !is_valid_env_name(name) {
                return Err(ErrorBody::new(
                    ErrorCode::InvalidRequest,
                    format!(
                        "invalid environment variable name {name:?}: names must match [A-Za-z_][A-Za-z0-9_]*"
                    ),
                ));
            }
            check_nul(&format!("env.{name}"), value)?;
        }
        if self.timeout_secs == Some(0) {
            return Err(ErrorBody::new(
                ErrorCode::InvalidRequest,
                "`timeout_secs` must be at least 1",
            ));
        }
        if let Some(p) = &self.profile {
            check_nul("profile", p)?;
        }
        if let Some(name) = &self.session {
            check_session_name(name)?;
        } else if self.session_busy.is_some() {
            return Err(ErrorBody::new(
                ErrorCode::InvalidRequest,
                "`session_busy` needs a `session`",
            ));
        }
        Ok(())
    }

    /// Each step as a request of its own: the step's fields, the request's defaults and
    /// everything else of the request (profile, workspace, session).
    pub fn step_requests(&self) -> Vec<RunRequest> {
        self.steps
            .iter()
            .map(|s| {
                let mut env = self.env.clone();
                env.extend(s.env.clone());
                RunRequest {
                    executable: s.executable.clone(),
                    args: s.args.clone(),
                    cwd: s.cwd.clone().or_else(|| self.cwd.clone()),
                    env,
                    timeout_secs: s.timeout_secs.or(self.timeout_secs),
                    steps: Vec::new(),
                    continue_on_error: false,
                    ..self.clone()
                }
            })
            .collect()
    }

    /// The command line as a person would read it (for logs and renderings only; never executed).
    pub fn command_line(&self) -> String {
        if !self.steps.is_empty() {
            return self
                .step_requests()
                .iter()
                .map(RunRequest::command_line)
                .collect::<Vec<_>>()
                .join(" ; ");
        }
        std::iter::once(&self.executable)
            .chain(&self.args)
            .map(|s| shell_quote(s))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

fn check_nul(field: &str, s: &str) -> Result<(), ErrorBody> {
    if s.contains('\0') {
        return Err(ErrorBody::new(
            ErrorCode::InvalidRequest,
            format!("`{field}` contains a NUL byte"),
        ));
    }
    Ok(())
}

/// POSIX portable environment names (also what Kubernetes accepts for container env).
pub fn is_valid_env_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    matches!(bytes.next(), Some(b'A'..=b'Z' | b'a'..=b'z' | b'_'))
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// Quotes a word for display the way a POSIX shell would need it.
pub fn shell_quote(s: &str) -> String {
    let safe = !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@%".contains(&b));
    if safe {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// Where a command runs. One shape for every backend; fields a backend does not know are absent.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct RunContext {
    /// `local` or `kubernetes` (a `remote` backend reports what the gateway reported).
    pub backend: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    /// How long the pod took from creation to Running, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_start_ms: Option<u64>,
    /// The workspace the command ran in (its id), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace: Option<String>,
    /// The version of that workspace's tree (SHA-256 of its manifest).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace_version: Option<String>,
    /// The profile's caches and what became of each (docs/caches.md).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub caches: BTreeMap<String, CacheState>,
    /// The session the command ran in, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// Which call of its session this is: 1 for the call that opened the session (a fresh
    /// runner), then 2, 3, ...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_call: Option<u64>,
}

/// What became of one of a run's caches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CacheState {
    /// Created for this run: empty, a cold cache.
    Created,
    /// Kept from earlier runs of the same key.
    Reused,
    /// Held by another run, or one cache more than the identity may have: the run got an
    /// empty directory there instead, gone afterwards.
    Skipped,
}

/// A stage of preparing a command, reported while the caller waits (mostly by the Kubernetes
/// backend, whose pods take from a second to minutes to start).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Waiting for a slot (concurrency limit) or for the backend.
    Queued,
    /// The runner pod was created and waits for a node.
    Scheduling,
    /// A node was chosen.
    Scheduled,
    /// The node pulls the runner image.
    PullingImage,
    /// The container is being created or started.
    Starting,
    /// The command is about to run (`started` follows).
    Running,
}

/// A file a run created or changed in its workspace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ChangedFile {
    /// Relative to the workspace root.
    pub path: String,
    /// 420 (0644) or 493 (0755).
    pub mode: u32,
    pub size: u64,
    /// SHA-256 of the content.
    pub hash: String,
}

/// How a command ended.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
pub struct ExitInfo {
    /// The exit code, or null when the command was killed by a signal.
    pub code: Option<i32>,
    /// The signal that killed the command, if any.
    pub signal: Option<i32>,
    pub duration_ms: u64,
    /// True when the gateway killed the command because `timeout_secs` passed.
    pub timed_out: bool,
}

impl ExitInfo {
    /// The exit status a shell would report: the code, or 128 + signal.
    pub fn shell_status(&self) -> i32 {
        match (self.code, self.signal) {
            (Some(c), _) => c,
            (None, Some(s)) => 128 + s,
            (None, None) => 255,
        }
    }

    pub fn success(&self) -> bool {
        self.code == Some(0) && !self.timed_out
    }
}

/// One line of the NDJSON stream of `POST /raw`.
// `started` (the context) is the largest and comes once per run; boxing it would cost an
// allocation and a pattern change everywhere for no measurable gain.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Event {
    /// First event: the command has been started, and where.
    Started { context: RunContext },
    /// Bytes the command wrote to stdout (base64 on the wire).
    Stdout {
        #[serde(with = "b64")]
        data: Bytes,
    },
    /// Bytes the command wrote to stderr (base64 on the wire).
    Stderr {
        #[serde(with = "b64")]
        data: Bytes,
    },
    /// Sent while the command is silent, so that idle proxies keep the connection open.
    Keepalive,
    /// How far the backend got while preparing the command (before `started`): queued for a
    /// slot, pod scheduled, image being pulled. Advisory: clients that do not know it skip it.
    Phase {
        phase: Phase,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        message: Option<String>,
    },
    /// Sent before `exit` when the request named `sync_back` globs: the workspace's files
    /// that match and that the command created or changed, each downloadable by hash
    /// (`GET /workspaces/blobs/{hash}`) until the cache evicts it.
    WorkspaceChanges {
        workspace: String,
        files: Vec<ChangedFile>,
        /// True when the workspace's limits cut the list short.
        #[serde(default)]
        truncated: bool,
    },
    /// A multi-step run: step `step` (from 0) starts; the output events up to its
    /// `step_exit` are its.
    Step { step: usize, command: String },
    /// A multi-step run: step `step` ended. The run's terminal `exit` follows the last step
    /// that ran.
    StepExit { step: usize, exit: ExitInfo },
    /// Terminal: the command ended.
    Exit(ExitInfo),
    /// Terminal: the run failed after the stream began.
    Error { code: ErrorCode, message: String },
    /// Any event type this version does not know; clients skip it.
    #[serde(other)]
    Unknown,
}

impl Event {
    pub fn is_terminal(&self) -> bool {
        matches!(self, Event::Exit(_) | Event::Error { .. })
    }

    /// The event as one NDJSON line, newline included.
    pub fn to_line(&self) -> Bytes {
        // Output chunks are nearly all of the traffic: written directly (base64 needs no JSON
        // escaping) with SIMD base64, into one allocation, instead of through serde.
        if let Event::Stdout { data } | Event::Stderr { data } = self {
            let prefix = self.output_prefix();
            let mut v = Vec::with_capacity(prefix.len() + BASE64.encoded_length(data.len()) + 3);
            v.extend_from_slice(prefix);
            BASE64.encode_append(data, &mut v);
            v.extend_from_slice(b"\"}\n");
            return Bytes::from(v);
        }
        // Serialising these types cannot fail: every map key is a string.
        let mut v = serde_json::to_vec(self).unwrap_or_else(|_| b"{\"type\":\"unknown\"}".to_vec());
        v.push(b'\n');
        Bytes::from(v)
    }

    fn output_prefix(&self) -> &'static [u8] {
        match self {
            Event::Stderr { .. } => STDERR_PREFIX,
            _ => STDOUT_PREFIX,
        }
    }

    /// Parses one NDJSON line (without its newline). Output events in the exact form this
    /// crate writes are decoded without a JSON pass; anything else goes through serde.
    pub fn from_line(line: &[u8]) -> Result<Event, serde_json::Error> {
        Self::from_line_mut(BytesMut::from(line))
    }

    /// [`Event::from_line`] on a line the caller owns: output data is decoded in place, so
    /// the event's bytes share the line's buffer (no allocation, no copy).
    pub fn from_line_mut(mut line: BytesMut) -> Result<Event, serde_json::Error> {
        for (prefix, stdout) in [(STDOUT_PREFIX, true), (STDERR_PREFIX, false)] {
            // A backslash means JSON escapes (`\/`): only serde reads those.
            if line.starts_with(prefix)
                && line.ends_with(b"\"}")
                && memchr::memchr(b'\\', &line).is_none()
            {
                let end = line.len() - 2;
                let decoded = BASE64
                    .decode_inplace(&mut line[prefix.len()..end])
                    .map(|d| d.len());
                if let Ok(n) = decoded {
                    let data = line.freeze().slice(prefix.len()..prefix.len() + n);
                    return Ok(if stdout {
                        Event::Stdout { data }
                    } else {
                        Event::Stderr { data }
                    });
                }
                // serde would refuse it too, with the same decoder.
                return Err(serde::de::Error::custom(
                    "invalid base64 in an output event",
                ));
            }
        }
        serde_json::from_slice(&line)
    }
}

/// Splits NDJSON into lines, each without its `\n` (a `tokio_util` decoder, for `FramedRead`).
/// A line whose newline has not come within `max` bytes is an error, so that a peer cannot
/// make the reader buffer without bound.
#[derive(Debug)]
pub(crate) struct LineDecoder {
    max: usize,
    /// How much of the buffer is known to hold no newline (lines span many reads).
    scanned: usize,
}

/// Why [`LineDecoder`] gave up.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LineError {
    #[error("a line is longer than {0} bytes")]
    TooLong(usize),
    /// The stream ended after these bytes, without a newline.
    #[error("the stream ended mid-line")]
    Unterminated(BytesMut),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl LineDecoder {
    pub(crate) fn new(max: usize) -> Self {
        Self { max, scanned: 0 }
    }
}

impl tokio_util::codec::Decoder for LineDecoder {
    type Item = BytesMut;
    type Error = LineError;

    fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<BytesMut>, LineError> {
        if let Some(pos) = memchr::memchr(b'\n', &buf[self.scanned..]).map(|p| p + self.scanned) {
            self.scanned = 0;
            let mut line = buf.split_to(pos + 1);
            line.truncate(pos);
            return Ok(Some(line));
        }
        self.scanned = buf.len();
        if buf.len() > self.max {
            return Err(LineError::TooLong(self.max));
        }
        Ok(None)
    }

    fn decode_eof(&mut self, buf: &mut BytesMut) -> Result<Option<BytesMut>, LineError> {
        if let Some(line) = self.decode(buf)? {
            return Ok(Some(line));
        }
        self.scanned = 0;
        if buf.is_empty() {
            Ok(None)
        } else {
            Err(LineError::Unterminated(buf.split()))
        }
    }
}

const STDOUT_PREFIX: &[u8] = b"{\"type\":\"stdout\",\"data\":\"";
const STDERR_PREFIX: &[u8] = b"{\"type\":\"stderr\",\"data\":\"";

mod b64 {
    use super::*;

    pub(super) fn serialize<S: serde::Serializer>(data: &Bytes, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&BASE64.encode_to_string(data))
    }

    pub(super) fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Bytes, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        BASE64
            .decode_to_vec(s.as_bytes())
            .map(Bytes::from)
            .map_err(serde::de::Error::custom)
    }
}

/// Machine-readable error codes, used in HTTP error bodies and in `error` events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// Malformed JSON, wrong types, unknown fields, invalid values (400).
    InvalidRequest,
    /// The named profile does not exist (400).
    UnknownProfile,
    /// The request body exceeds the server's limit (413).
    PayloadTooLarge,
    /// The request is not `application/json` (415).
    UnsupportedMediaType,
    /// Missing or invalid bearer token (401).
    Unauthorized,
    /// The execution policy forbids the request (403).
    PolicyViolation,
    /// The `Host` or `Origin` header names a host the gateway does not serve (403): DNS
    /// rebinding protection (`server.allowed_hosts`).
    ForbiddenHost,
    /// Too many executions at once, or rate limited (429).
    TooManyRequests,
    /// Not found (404).
    NotFound,
    /// The method is not allowed on this path (405).
    MethodNotAllowed,
    /// The gateway is shutting down (503).
    ShuttingDown,
    /// The backend is not reachable or not ready (503).
    BackendUnavailable,
    /// The runner image could not be pulled (502 before the stream, or an `error` event).
    ImagePullFailed,
    /// No node can take the runner pod.
    Unschedulable,
    /// The runner container's configuration is invalid.
    ContainerConfigError,
    /// The runner pod did not become ready within the start timeout (504).
    PodStartTimeout,
    /// The runner pod failed or disappeared while the command ran.
    PodFailed,
    /// The command could not be started for a reason other than the above.
    StartFailed,
    /// A backend failure after the stream began.
    BackendError,
    /// An unexpected failure in the gateway.
    Internal,
    /// Client side only, never sent by a gateway: the gateway cannot be reached.
    GatewayUnreachable,
    /// Client side only, never sent by a gateway: the gateway's answer broke the protocol
    /// (malformed event, stream cut before the terminal event).
    ProtocolError,
    /// The workspace id is unknown, expired, or another identity's (404).
    UnknownWorkspace,
    /// Some of the workspace's contents are not in the gateway's cache (not uploaded, or
    /// evicted): post the manifest again and upload what is missing (409).
    WorkspaceIncomplete,
    /// Uploaded bytes do not hash to the name they were sent under (400).
    HashMismatch,
    /// Another call of the session is running and the request asked not to wait (409).
    SessionBusy,
    /// The session's runner is gone (pod evicted or deleted, node gone, directory removed);
    /// the message says why. The name is free again: the next call opens a new session (410).
    SessionLost,
    /// The session ended after its idle TTL or maximum lifetime; the name is free again:
    /// the next call opens a new session (410).
    SessionExpired,
    /// No open session of the caller has this name (404).
    UnknownSession,
    /// The caller (or the gateway) has as many open sessions as it may: end one (429).
    TooManySessions,
    /// A code this version does not know.
    #[serde(other)]
    Unknown,
}

impl ErrorCode {
    /// The wire name (the same string serde writes).
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidRequest => "invalid_request",
            ErrorCode::UnknownProfile => "unknown_profile",
            ErrorCode::PayloadTooLarge => "payload_too_large",
            ErrorCode::UnsupportedMediaType => "unsupported_media_type",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::PolicyViolation => "policy_violation",
            ErrorCode::ForbiddenHost => "forbidden_host",
            ErrorCode::TooManyRequests => "too_many_requests",
            ErrorCode::NotFound => "not_found",
            ErrorCode::MethodNotAllowed => "method_not_allowed",
            ErrorCode::ShuttingDown => "shutting_down",
            ErrorCode::BackendUnavailable => "backend_unavailable",
            ErrorCode::ImagePullFailed => "image_pull_failed",
            ErrorCode::Unschedulable => "unschedulable",
            ErrorCode::ContainerConfigError => "container_config_error",
            ErrorCode::PodStartTimeout => "pod_start_timeout",
            ErrorCode::PodFailed => "pod_failed",
            ErrorCode::StartFailed => "start_failed",
            ErrorCode::BackendError => "backend_error",
            ErrorCode::Internal => "internal",
            ErrorCode::GatewayUnreachable => "gateway_unreachable",
            ErrorCode::ProtocolError => "protocol_error",
            ErrorCode::UnknownWorkspace => "unknown_workspace",
            ErrorCode::WorkspaceIncomplete => "workspace_incomplete",
            ErrorCode::HashMismatch => "hash_mismatch",
            ErrorCode::SessionBusy => "session_busy",
            ErrorCode::SessionLost => "session_lost",
            ErrorCode::SessionExpired => "session_expired",
            ErrorCode::UnknownSession => "unknown_session",
            ErrorCode::TooManySessions => "too_many_sessions",
            ErrorCode::Unknown => "unknown",
        }
    }

    /// The HTTP status used when this error rejects a request before its stream begins.
    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::InvalidRequest | ErrorCode::UnknownProfile | ErrorCode::HashMismatch => 400,
            ErrorCode::Unauthorized => 401,
            ErrorCode::PolicyViolation | ErrorCode::ForbiddenHost => 403,
            ErrorCode::NotFound | ErrorCode::UnknownWorkspace | ErrorCode::UnknownSession => 404,
            ErrorCode::WorkspaceIncomplete | ErrorCode::SessionBusy => 409,
            ErrorCode::SessionLost | ErrorCode::SessionExpired => 410,
            ErrorCode::MethodNotAllowed => 405,
            ErrorCode::PayloadTooLarge => 413,
            ErrorCode::UnsupportedMediaType => 415,
            ErrorCode::TooManyRequests | ErrorCode::TooManySessions => 429,
            ErrorCode::ImagePullFailed
            | ErrorCode::Unschedulable
            | ErrorCode::ContainerConfigError
            | ErrorCode::PodFailed
            | ErrorCode::StartFailed
            | ErrorCode::BackendError => 502,
            ErrorCode::ShuttingDown
            | ErrorCode::BackendUnavailable
            | ErrorCode::GatewayUnreachable => 503,
            ErrorCode::ProtocolError => 502,
            ErrorCode::PodStartTimeout => 504,
            ErrorCode::Internal | ErrorCode::Unknown => 500,
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The JSON body of every HTTP error: `{"error":{"code":"...","message":"..."}}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ErrorBody {
    pub code: ErrorCode,
    pub message: String,
    /// For `too_many_requests`: seconds until a retry can succeed (the `Retry-After`
    /// header; 1 when absent). Not part of the JSON body.
    #[serde(skip)]
    pub retry_after_secs: Option<u64>,
}

impl ErrorBody {
    /// The error a gateway's failed answer carries: its JSON error body, or a protocol error
    /// naming the status when the body is not one (a proxy's page, an old gateway).
    pub fn from_answer(status: impl std::fmt::Display, body: &str) -> ErrorBody {
        match serde_json::from_str::<ErrorResponse>(body) {
            Ok(r) => r.error,
            Err(_) => ErrorBody::new(
                ErrorCode::ProtocolError,
                format!(
                    "the gateway answered {status} without an error body: {}",
                    body.trim()
                ),
            ),
        }
    }

    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            retry_after_secs: None,
        }
    }

    /// Sets the `Retry-After` seconds of a `too_many_requests` answer.
    pub fn retry_after(mut self, secs: u64) -> Self {
        self.retry_after_secs = Some(secs.max(1));
        self
    }
}

/// The envelope around [`ErrorBody`] on the wire.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ErrorResponse {
    pub error: ErrorBody,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lines of `chunks` as a `FramedRead` gives them, until the first error.
    async fn lines(chunks: &[&'static [u8]], max: usize) -> (Vec<BytesMut>, Option<LineError>) {
        use futures_util::StreamExt;
        let body = futures_util::stream::iter(
            chunks
                .iter()
                .map(|c| Ok::<_, std::io::Error>(Bytes::from_static(c))),
        );
        let reader = tokio_util::io::StreamReader::new(body);
        let mut framed = tokio_util::codec::FramedRead::new(reader, LineDecoder::new(max));
        let mut out = Vec::new();
        while let Some(line) = framed.next().await {
            match line {
                Ok(l) => out.push(l),
                Err(e) => return (out, Some(e)),
            }
        }
        (out, None)
    }

    #[tokio::test]
    async fn lines_split_across_reads_and_stay_bounded() {
        let (got, err) = lines(&[b"ab", b"c\n\nd", b"e\nf\n"], 8).await;
        assert_eq!(got, [&b"abc"[..], b"", b"de", b"f"]);
        assert!(err.is_none());
        // The bound holds before a newline comes, whatever the reads.
        let (got, err) = lines(&[b"ok\n12345", b"6789", b"0\n"], 8).await;
        assert_eq!(got, [&b"ok"[..]]);
        assert!(matches!(err, Some(LineError::TooLong(8))), "{err:?}");
        // A stream that ends mid-line hands back what it had.
        let (got, err) = lines(&[b"a\n", b"{\"x\""], 8).await;
        assert_eq!(got, [&b"a"[..]]);
        match err {
            Some(LineError::Unterminated(rest)) => assert_eq!(&rest[..], b"{\"x\""),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn events_round_trip_as_documented() {
        let e = Event::Stdout {
            data: Bytes::from_static(b"hi\n\xff"),
        };
        assert_eq!(
            e.to_line(),
            Bytes::from_static(b"{\"type\":\"stdout\",\"data\":\"aGkK/w==\"}\n")
        );
        let exit = Event::Exit(ExitInfo {
            code: Some(3),
            signal: None,
            duration_ms: 12,
            timed_out: false,
        });
        let line = String::from_utf8(exit.to_line().to_vec()).unwrap();
        assert_eq!(
            line,
            "{\"type\":\"exit\",\"code\":3,\"signal\":null,\"duration_ms\":12,\"timed_out\":false}\n"
        );
        let back: Event = serde_json::from_str(&line).unwrap();
        assert_eq!(back, exit);
        let unknown: Event = serde_json::from_str(r#"{"type":"future_thing","x":1}"#).unwrap();
        assert_eq!(unknown, Event::Unknown);
        let err: Event =
            serde_json::from_str(r#"{"type":"error","code":"brand_new","message":"m"}"#).unwrap();
        assert_eq!(
            err,
            Event::Error {
                code: ErrorCode::Unknown,
                message: "m".into()
            }
        );
    }

    #[test]
    fn output_lines_decode_in_place_and_escapes_still_parse() {
        let data: Vec<u8> = (0..=255u8).cycle().take(300_001).collect();
        for event in [
            Event::Stdout {
                data: Bytes::from(data.clone()),
            },
            Event::Stderr { data: Bytes::new() },
        ] {
            let line = event.to_line();
            let back = Event::from_line(&line[..line.len() - 1]).unwrap();
            assert_eq!(back, event);
        }
        // Valid JSON that is not in the fast path's exact form.
        let escaped = br#"{"type":"stdout","data":"aGkK\/w=="}"#;
        assert_eq!(
            Event::from_line(escaped).unwrap(),
            Event::Stdout {
                data: Bytes::from_static(b"hi\n\xff")
            }
        );
        let spaced = br#"{"type": "stderr", "data": "aGkK/w=="}"#;
        assert_eq!(
            Event::from_line(spaced).unwrap(),
            Event::Stderr {
                data: Bytes::from_static(b"hi\n\xff")
            }
        );
        assert!(Event::from_line(br#"{"type":"stdout","data":"a*=="}"#).is_err());
    }

    #[test]
    fn request_rejects_unknown_fields_and_bad_values() {
        assert!(serde_json::from_str::<RunRequest>(r#"{"executable":"ls","bogus":1}"#).is_err());
        let ok: RunRequest = serde_json::from_str(r#"{"executable":"ls","args":["-l"]}"#).unwrap();
        assert!(ok.validate().is_ok());
        for bad in [
            r#"{"executable":""}"#,
            r#"{"executable":"a\u0000b"}"#,
            r#"{"executable":"ls","args":["x\u0000"]}"#,
            r#"{"executable":"ls","env":{"1A":"x"}}"#,
            r#"{"executable":"ls","env":{"A=B":"x"}}"#,
            r#"{"executable":"ls","cwd":"relative"}"#,
            r#"{"executable":"ls","timeout_secs":0}"#,
        ] {
            let r: RunRequest = serde_json::from_str(bad).unwrap();
            assert_eq!(
                r.validate().unwrap_err().code,
                ErrorCode::InvalidRequest,
                "{bad}"
            );
        }
    }

    #[test]
    fn error_code_names_match_serde() {
        for code in [
            ErrorCode::InvalidRequest,
            ErrorCode::PodStartTimeout,
            ErrorCode::ImagePullFailed,
        ] {
            assert_eq!(serde_json::to_value(code).unwrap(), code.as_str());
        }
    }

    #[test]
    fn quoting_for_display() {
        assert_eq!(shell_quote("ls"), "ls");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_quote(""), "''");
    }

    #[test]
    fn shell_status() {
        let e = ExitInfo {
            code: None,
            signal: Some(9),
            ..Default::default()
        };
        assert_eq!(e.shell_status(), 137);
    }
}

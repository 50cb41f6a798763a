//! Workspaces: the caller's working tree on the runner (issue 17, docs/workspaces.md).
//!
//! The client walks its tree ([`walk`]), sends a [`Manifest`] (paths, modes, sizes, SHA-256
//! hashes) to `POST /workspaces`, and uploads only the contents the gateway lacks
//! ([`server`]). The gateway keeps contents in a bounded on-disk cache ([`store`]) and
//! materialises a workspace per run: a fresh directory on the local backend ([`local`]), a tar
//! stream into the pod on the Kubernetes backend. After the run, files matching the request's
//! `sync_back` globs that the command created or changed are reported in a `workspace_changes`
//! event and can be downloaded by hash.

pub(crate) mod client;
pub(crate) mod config;
pub(crate) mod jsoncap;
pub(crate) mod kept;
pub(crate) mod local;
pub(crate) mod manifest;
pub(crate) mod results;
pub(crate) mod store;
pub(crate) mod tarball;
pub(crate) mod tarcap;
pub(crate) mod trees;
pub(crate) mod walk;

pub(crate) use config::WorkspaceConfig;
pub(crate) use store::{Workspace, WorkspaceStore};

use std::sync::Arc;

/// A workspace attached to a run: which tree, where the command runs inside it, and what
/// comes back.
#[derive(Clone)]
pub struct WorkspaceRun {
    pub workspace: Arc<Workspace>,
    pub store: Arc<WorkspaceStore>,
    /// The command's directory relative to the workspace root (`""`: the root).
    pub cwd: String,
    /// Globs of files to report back after the run.
    pub sync_back: Vec<String>,
}

impl std::fmt::Debug for WorkspaceRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkspaceRun")
            .field("id", &self.workspace.id)
            .field("cwd", &self.cwd)
            .field("sync_back", &self.sync_back)
            .finish()
    }
}

impl PartialEq for WorkspaceRun {
    fn eq(&self, other: &Self) -> bool {
        self.workspace.id == other.workspace.id
            && self.cwd == other.cwd
            && self.sync_back == other.sync_back
    }
}

impl Eq for WorkspaceRun {}

/// Where the policy sees a workspace run's directory (`policy.cwd` rules apply below it).
pub(crate) const POLICY_ROOT: &str = "/workspace";

/// Why a request's `cwd` cannot be a workspace run's directory: `400 invalid_request`.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CwdError {
    #[error("invalid `cwd`: {0}")]
    Invalid(#[from] manifest::PathError),
    /// `prefix`: the file or symlink the path goes through.
    #[error("`cwd` {rel:?} is not a directory of the workspace ({prefix:?} is a file or symlink)")]
    NotADirectory { rel: String, prefix: String },
}

impl From<CwdError> for crate::contract::ErrorBody {
    fn from(e: CwdError) -> Self {
        Self::new(crate::contract::ErrorCode::InvalidRequest, e.to_string())
    }
}

/// The command's directory inside a workspace, from the request's relative `cwd`: normalised
/// (no `.`, no empty components), and not below one of the tree's files or symlinks.
pub(crate) fn run_cwd(ws: &Workspace, cwd: Option<&str>) -> Result<String, CwdError> {
    let parts: Vec<&str> = cwd
        .unwrap_or("")
        .split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .collect();
    let rel = parts.join("/");
    if rel.is_empty() {
        return Ok(rel);
    }
    manifest::check_path(&rel, 4096)?;
    let entries = &ws.manifest.entries;
    for end in rel.match_indices('/').map(|(i, _)| i).chain([rel.len()]) {
        let prefix = &rel[..end];
        if entries
            .binary_search_by(|e| e.path.as_str().cmp(prefix))
            .is_ok()
        {
            return Err(CwdError::NotADirectory {
                rel: rel.clone(),
                prefix: prefix.to_owned(),
            });
        }
    }
    Ok(rel)
}

/// SHA-256 of `data` as 64 lowercase hex digits: the name of a content.
pub fn hash_bytes(data: &[u8]) -> String {
    use sha2::Digest as _;
    hex(&sha2::Sha256::digest(data))
}

/// SHA-256 of a file's content, streamed.
pub(crate) fn hash_file(path: &std::path::Path) -> std::io::Result<String> {
    use sha2::Digest as _;
    use std::io::Read as _;
    let mut f = std::fs::File::open(path)?;
    let mut h = sha2::Sha256::new();
    // digest 0.11's hashers are not io::Write: feed them by hand.
    let mut buf = vec![0u8; 256 * 1024];
    loop {
        match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => h.update(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(hex(&h.finalize()))
}

/// Lowercase hex of a digest.
pub(crate) fn hex(digest: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut s = String::with_capacity(digest.len() * 2);
    for b in digest {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// Whether `s` is a content name: 64 lowercase hex digits.
pub(crate) fn is_hash(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

//! The manifest of a workspace: every file and symlink of the tree, by relative path, with
//! its mode, size and content hash. Validated once on the gateway; the rules are those of
//! docs/protocol.md ("Workspaces").

use std::collections::HashMap;

use sha2::Digest as _;

use serde::{Deserialize, Serialize};

use super::config::WorkspaceConfig;
use crate::contract::{ErrorBody, ErrorCode};

/// The body of `POST /workspaces`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub entries: Vec<ManifestEntry>,
}

/// A regular file or a symlink. Directories are implied by the paths below them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EntryKind {
    #[default]
    File,
    Symlink,
}

/// Mode of a plain file.
pub(crate) const MODE_FILE: u32 = 0o644;
/// Mode of an executable file.
pub(crate) const MODE_EXEC: u32 = 0o755;

/// One file of the tree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ManifestEntry {
    /// Relative to the workspace root, `/`-separated, without `.` or `..` components.
    #[serde(deserialize_with = "bounded_string")]
    pub path: String,
    #[serde(default, skip_serializing_if = "is_file")]
    pub kind: EntryKind,
    /// Files: 420 (0644) or 493 (0755). Symlinks: ignored.
    #[serde(default = "default_mode")]
    pub mode: u32,
    /// Files: the content's length in bytes.
    #[serde(default)]
    pub size: u64,
    /// Files: SHA-256 of the content, 64 lowercase hex digits.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub hash: String,
    /// Symlinks: the link's target, relative and inside the workspace.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "bounded_target"
    )]
    pub target: Option<String>,
}

/// The longest path or symlink target a manifest may carry (Linux's PATH_MAX); refused while
/// parsing, before it is copied.
pub(crate) const MAX_MANIFEST_STRING: usize = 4096;

/// A string of at most [`MAX_MANIFEST_STRING`] bytes.
fn bounded_string<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    struct Bounded;
    impl serde::de::Visitor<'_> for Bounded {
        type Value = String;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            write!(f, "a string of at most {MAX_MANIFEST_STRING} bytes")
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<String, E> {
            if v.len() > MAX_MANIFEST_STRING {
                return Err(E::custom(format!(
                    "a path or symlink target of {} bytes is longer than {MAX_MANIFEST_STRING} (PATH_MAX)",
                    v.len()
                )));
            }
            Ok(v.to_owned())
        }
    }
    d.deserialize_str(Bounded)
}

fn bounded_target<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    bounded_string(d).map(Some)
}

fn is_file(k: &EntryKind) -> bool {
    *k == EntryKind::File
}

fn default_mode() -> u32 {
    MODE_FILE
}

impl ManifestEntry {
    pub fn file(path: impl Into<String>, executable: bool, size: u64, hash: String) -> Self {
        Self {
            path: path.into(),
            kind: EntryKind::File,
            mode: if executable { MODE_EXEC } else { MODE_FILE },
            size,
            hash,
            target: None,
        }
    }

    pub fn symlink(path: impl Into<String>, target: String) -> Self {
        Self {
            path: path.into(),
            kind: EntryKind::Symlink,
            mode: 0o777,
            size: target.len() as u64,
            hash: String::new(),
            target: Some(target),
        }
    }
}

/// Why a manifest is refused; the message says which entry and rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    /// `400 invalid_request`.
    #[error("{0}")]
    Invalid(String),
    /// Over a limit: `413 payload_too_large`.
    #[error("{0}")]
    TooLarge(String),
}

impl ManifestError {
    pub(crate) fn code(&self) -> ErrorCode {
        match self {
            ManifestError::Invalid(_) => ErrorCode::InvalidRequest,
            ManifestError::TooLarge(_) => ErrorCode::PayloadTooLarge,
        }
    }
}

impl From<ManifestError> for ErrorBody {
    fn from(e: ManifestError) -> Self {
        ErrorBody::new(e.code(), e.to_string())
    }
}

fn invalid(message: String) -> ManifestError {
    ManifestError::Invalid(message)
}

fn too_large(message: String) -> ManifestError {
    ManifestError::TooLarge(message)
}

/// Why a path is not a plain relative path ([`check_path`]). Not a wire error by itself:
/// the manifest, a run's `cwd` and a sync-back result each say what the path was.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("an empty path")]
    Empty,
    /// `start`: its first 40 characters.
    #[error("path {start:?}... is longer than {max} bytes")]
    TooLong { start: String, max: usize },
    #[error("path {0:?} contains a NUL byte")]
    Nul(String),
    #[error("path {0:?} is absolute")]
    Absolute(String),
    #[error("path {0:?} has an empty component")]
    EmptyComponent(String),
    /// A `.` or `..` component.
    #[error("path {path:?} has a {component:?} component")]
    Dots {
        path: String,
        component: &'static str,
    },
    #[error("path {0:?} has a component over 255 bytes")]
    LongComponent(String),
}

/// Checks a relative path: not empty, `/`-separated normal components only, no NUL,
/// at most `max_bytes` long.
pub(crate) fn check_path(path: &str, max_bytes: usize) -> Result<(), PathError> {
    if path.is_empty() {
        return Err(PathError::Empty);
    }
    if path.len() > max_bytes {
        return Err(PathError::TooLong {
            start: path.chars().take(40).collect(),
            max: max_bytes,
        });
    }
    if path.contains('\0') {
        return Err(PathError::Nul(path.to_owned()));
    }
    if path.starts_with('/') {
        return Err(PathError::Absolute(path.to_owned()));
    }
    for c in path.split('/') {
        match c {
            "" => return Err(PathError::EmptyComponent(path.to_owned())),
            "." => {
                return Err(PathError::Dots {
                    path: path.to_owned(),
                    component: ".",
                });
            }
            ".." => {
                return Err(PathError::Dots {
                    path: path.to_owned(),
                    component: "..",
                });
            }
            _ if c.len() > 255 => return Err(PathError::LongComponent(path.to_owned())),
            _ => {}
        }
    }
    Ok(())
}

/// Whether a symlink at `path` with `target` stays inside the tree (lexically).
pub(crate) fn symlink_stays_inside(path: &str, target: &str) -> bool {
    if target.is_empty() || target.starts_with('/') || target.contains('\0') {
        return false;
    }
    // The link's directory, then the target's components.
    let mut depth: Vec<&str> = path.split('/').collect();
    depth.pop();
    for c in target.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                if depth.pop().is_none() {
                    return false;
                }
            }
            other => depth.push(other),
        }
    }
    true
}

/// Whether a symlink at `path` with `target` stays inside the tree once the symlinks of the
/// tree it passes through (`links`: path → target) are followed too, as the kernel will:
/// `a/b -> ..` then `s -> a/b/..` leaves the tree although each is lexically inside. More
/// than 40 links on the way (Linux's limit) counts as leaving.
pub(crate) fn resolves_inside(path: &str, target: &str, links: &HashMap<&str, &str>) -> bool {
    use std::collections::VecDeque;
    let mut at: Vec<&str> = path.split('/').collect();
    at.pop();
    let mut todo: VecDeque<&str> = target.split('/').collect();
    let mut hops = 0;
    while let Some(c) = todo.pop_front() {
        match c {
            "" | "." => {}
            ".." => {
                if at.pop().is_none() {
                    return false;
                }
            }
            name => {
                at.push(name);
                if let Some(next) = links.get(at.join("/").as_str()) {
                    hops += 1;
                    if hops > 40 || next.starts_with('/') {
                        return false;
                    }
                    at.pop();
                    for tc in next.split('/').rev() {
                        todo.push_front(tc);
                    }
                }
            }
        }
    }
    true
}

/// Parses a manifest from `reader` without holding its text: at most `max_files` entries are
/// read (more is refused at once), and no path or target over [`MAX_MANIFEST_STRING`] bytes
/// is copied (see [`super::jsoncap`] for what bounds the parser's own buffer).
pub(crate) fn parse(
    reader: impl std::io::Read,
    max_files: usize,
    max_cost: u64,
) -> Result<Manifest, ManifestError> {
    use serde::de::DeserializeSeed as _;
    let mut de = serde_json::Deserializer::from_reader(reader);
    let m = ManifestSeed {
        max_files,
        max_cost,
    }
    .deserialize(&mut de)
    .and_then(|m| de.end().map(|()| m));
    m.map_err(|e| {
        let text = e.to_string();
        if [
            "workspaces.max_files",
            "PATH_MAX",
            "workspaces.max_manifest_bytes",
            "workspaces.max_registry_bytes",
        ]
        .iter()
        .any(|bound| text.contains(bound))
        {
            too_large(format!("invalid manifest: {text}"))
        } else {
            invalid(format!("invalid manifest: {text}"))
        }
    })
}

/// [`Manifest`]'s deserialisation with a bound on its entries.
struct ManifestSeed {
    max_files: usize,
    max_cost: u64,
}

impl<'de> serde::de::DeserializeSeed<'de> for ManifestSeed {
    type Value = Manifest;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Manifest, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> serde::de::Visitor<'de> for ManifestSeed {
    type Value = Manifest;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an object with `entries`")
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Manifest, A::Error> {
        use serde::de::Error as _;
        let mut entries = None;
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            if key != "entries" {
                return Err(A::Error::unknown_field(&key, &["entries"]));
            }
            if entries.is_some() {
                return Err(A::Error::duplicate_field("entries"));
            }
            entries = Some(map.next_value_seed(EntriesSeed {
                max_files: self.max_files,
                max_cost: self.max_cost,
            })?);
        }
        Ok(Manifest {
            entries: entries.ok_or_else(|| A::Error::missing_field("entries"))?,
        })
    }
}

struct EntriesSeed {
    max_files: usize,
    max_cost: u64,
}

impl<'de> serde::de::DeserializeSeed<'de> for EntriesSeed {
    type Value = Vec<ManifestEntry>;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> serde::de::Visitor<'de> for EntriesSeed {
    type Value = Vec<ManifestEntry>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a list of entries")
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::new();
        let mut cost = 0;
        while let Some(e) = seq.next_element::<ManifestEntry>()? {
            cost += entry_cost(&e);
            if cost > self.max_cost {
                return Err(serde::de::Error::custom(format!(
                    "the manifest would take more than the {} bytes of memory the gateway keeps for registered manifests (workspaces.max_registry_bytes)",
                    self.max_cost
                )));
            }
            if out.len() == self.max_files {
                return Err(serde::de::Error::custom(format!(
                    "the manifest lists more files than the gateway's maximum of {} (workspaces.max_files)",
                    self.max_files
                )));
            }
            out.push(e);
        }
        Ok(out)
    }
}

/// A writer into a hash.
struct HashWriter(sha2::Sha256);

impl std::io::Write for HashWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// About what one entry costs in the gateway's memory once registered: its fixed part and
/// its strings, with the allocator's overhead (on the high side; docs/workspaces.md).
pub(crate) fn entry_cost(e: &ManifestEntry) -> u64 {
    160 + (e.path.len() + e.hash.len() + e.target.as_ref().map_or(0, |t| t.len())) as u64
}

/// A validated manifest, sorted by path, with what the gateway needs to know about it.
#[derive(Debug, Clone)]
pub struct Checked {
    pub manifest: Manifest,
    /// SHA-256 of the canonical (sorted) manifest: the workspace's version.
    pub digest: String,
    /// Each distinct content and its size.
    pub contents: HashMap<String, u64>,
    pub files: usize,
    /// Directories the paths imply.
    pub dirs: usize,
    pub bytes: u64,
}

impl Manifest {
    /// Validates the manifest against the gateway's limits; every rule of the protocol.
    pub fn check(mut self, limits: &WorkspaceConfig) -> Result<Checked, ManifestError> {
        if self.entries.len() > limits.max_files {
            return Err(too_large(format!(
                "the manifest lists {} files, more than the gateway's maximum of {} (workspaces.max_files)",
                self.entries.len(),
                limits.max_files
            )));
        }
        self.entries.sort_by(|a, b| a.path.cmp(&b.path));
        let is_entry = |p: &str| {
            self.entries
                .binary_search_by(|e| e.path.as_str().cmp(p))
                .is_ok()
        };
        let mut contents = HashMap::new();
        let mut bytes = 0u64;
        let mut prev: Option<&str> = None;
        for e in &self.entries {
            check_path(&e.path, limits.max_path_bytes)
                .map_err(|m| invalid(format!("invalid manifest: {m}")))?;
            if prev.is_some_and(|p| p == e.path.as_str()) {
                return Err(invalid(format!(
                    "invalid manifest: path {:?} is listed twice",
                    e.path
                )));
            }
            prev = Some(e.path.as_str());
            match e.kind {
                EntryKind::File => {
                    if !super::is_hash(&e.hash) {
                        return Err(invalid(format!(
                            "invalid manifest: {:?} has no valid hash (64 lowercase hex digits of SHA-256)",
                            e.path
                        )));
                    }
                    if e.mode != MODE_FILE && e.mode != MODE_EXEC {
                        return Err(invalid(format!(
                            "invalid manifest: {:?} has mode {:o}; files are 644 or 755",
                            e.path, e.mode
                        )));
                    }
                    if e.target.is_some() {
                        return Err(invalid(format!(
                            "invalid manifest: file {:?} has a symlink target",
                            e.path
                        )));
                    }
                    if e.size > limits.max_file_bytes {
                        return Err(too_large(format!(
                            "{:?} is {} bytes, more than the gateway's maximum file size of {} (workspaces.max_file_bytes)",
                            e.path, e.size, limits.max_file_bytes
                        )));
                    }
                    if let Some(&size) = contents.get(&e.hash)
                        && size != e.size
                    {
                        return Err(invalid(format!(
                            "invalid manifest: hash {} is listed with two sizes",
                            e.hash
                        )));
                    }
                    contents.insert(e.hash.clone(), e.size);
                    bytes += e.size;
                }
                EntryKind::Symlink => {
                    let target = e.target.as_deref().unwrap_or_default();
                    if target.len() > MAX_MANIFEST_STRING {
                        return Err(too_large(format!(
                            "invalid manifest: the target of symlink {:?} is longer than {MAX_MANIFEST_STRING} bytes (PATH_MAX)",
                            e.path
                        )));
                    }
                    if !symlink_stays_inside(&e.path, target) {
                        return Err(invalid(format!(
                            "invalid manifest: symlink {:?} -> {target:?} leaves the workspace",
                            e.path
                        )));
                    }
                    if !e.hash.is_empty() {
                        return Err(invalid(format!(
                            "invalid manifest: symlink {:?} has a hash",
                            e.path
                        )));
                    }
                }
            }
        }
        if bytes > limits.max_bytes {
            return Err(too_large(format!(
                "the workspace holds {bytes} bytes, more than the gateway's maximum of {} (workspaces.max_bytes)",
                limits.max_bytes
            )));
        }
        let distinct: u64 = contents.values().sum();
        if distinct > limits.max_cache_bytes {
            return Err(too_large(format!(
                "the workspace's contents ({distinct} bytes) do not fit in the gateway's cache of {} bytes (workspaces.max_cache_bytes)",
                limits.max_cache_bytes
            )));
        }
        let links: HashMap<&str, &str> = self
            .entries
            .iter()
            .filter(|e| e.kind == EntryKind::Symlink)
            .map(|e| (e.path.as_str(), e.target.as_deref().unwrap_or_default()))
            .collect();
        for (path, target) in &links {
            if !resolves_inside(path, target, &links) {
                return Err(invalid(format!(
                    "invalid manifest: symlink {path:?} -> {target:?} leaves the workspace through the symlinks it passes (or passes more than 40)"
                )));
            }
        }
        // A file or symlink cannot also be a directory of another entry (nothing may be
        // written through a symlink).
        for e in &self.entries {
            let mut end = 0;
            while let Some(i) = e.path[end..].find('/') {
                end += i;
                if is_entry(&e.path[..end]) {
                    return Err(invalid(format!(
                        "invalid manifest: {:?} is below {:?}, which is not a directory",
                        e.path,
                        &e.path[..end]
                    )));
                }
                end += 1;
            }
        }
        // Directories count too: one content can stand for many files, each in a directory
        // of its own, and every one is an inode where the tree is written.
        let mut dirs = std::collections::HashSet::new();
        for e in &self.entries {
            for (i, _) in e.path.match_indices('/') {
                dirs.insert(&e.path[..i]);
            }
        }
        if dirs.len() > limits.max_files {
            return Err(too_large(format!(
                "the manifest implies {} directories, more than the gateway's maximum of {} (workspaces.max_files)",
                dirs.len(),
                limits.max_files
            )));
        }
        let dirs = dirs.len();
        // Hashed as it is written, not held: the canonical text is as large as the body.
        let mut canonical = HashWriter(sha2::Sha256::new());
        serde_json::to_writer(&mut canonical, &self).map_err(|e| invalid(e.to_string()))?;
        Ok(Checked {
            digest: super::hex(&sha2::Digest::finalize(canonical.0)),
            files: self.entries.len(),
            dirs,
            bytes,
            contents,
            manifest: self,
        })
    }
}

/// The answer to `POST /workspaces`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct PostResponse {
    /// The id to send as `workspace` in `/raw` requests and to upload contents to.
    pub workspace: String,
    /// SHA-256 of the canonical manifest: the version of the tree.
    pub version: String,
    pub files: usize,
    pub bytes: u64,
    /// Hashes of the contents to upload.
    pub missing: Vec<String>,
    pub missing_bytes: u64,
}

/// The answer to an upload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct UploadResponse {
    pub stored: usize,
    pub bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(c: char) -> String {
        std::iter::repeat_n(c, 64).collect()
    }

    fn limits() -> WorkspaceConfig {
        WorkspaceConfig::default()
    }

    #[test]
    fn paths() {
        for ok in ["a", "a/b.txt", ".hidden/x", "a b/ü"] {
            assert!(check_path(ok, 100).is_ok(), "{ok}");
        }
        for bad in ["", "/a", "a/../b", "..", "./a", "a//b", "a/", "a\0b"] {
            assert!(check_path(bad, 100).is_err(), "{bad:?}");
        }
        assert!(check_path("abcdef", 5).is_err());
    }

    #[test]
    fn symlinks() {
        assert!(symlink_stays_inside("a/l", "../b"));
        assert!(symlink_stays_inside("l", "b/c"));
        assert!(!symlink_stays_inside("l", "../b"));
        assert!(!symlink_stays_inside("a/l", "../../b"));
        assert!(!symlink_stays_inside("l", "/etc"));
        assert!(!symlink_stays_inside("l", ""));
    }

    #[test]
    fn rejects_duplicates_conflicts_and_limits() {
        let f = |p: &str| ManifestEntry::file(p, false, 1, h('a'));
        let m = |e: Vec<ManifestEntry>| Manifest { entries: e }.check(&limits());
        assert!(m(vec![f("a"), f("b/c")]).is_ok());
        assert_eq!(
            m(vec![f("a"), f("a")]).unwrap_err().code(),
            ErrorCode::InvalidRequest
        );
        assert!(m(vec![f("a"), f("a/b")]).is_err());
        assert!(m(vec![ManifestEntry::symlink("l", "x".into()), f("l/b")]).is_err());
        assert!(m(vec![ManifestEntry::symlink("l", "../x".into())]).is_err());
        let mut bad_hash = f("x");
        bad_hash.hash = "ABC".into();
        assert!(m(vec![bad_hash]).is_err());
        let mut bad_mode = f("x");
        bad_mode.mode = 0o4755;
        assert!(m(vec![bad_mode]).is_err());
        let small = WorkspaceConfig {
            max_files: 1,
            ..limits()
        };
        let e = Manifest {
            entries: vec![f("a"), f("b")],
        }
        .check(&small)
        .unwrap_err();
        assert_eq!(e.code(), ErrorCode::PayloadTooLarge);
    }

    #[test]
    fn chained_symlinks_are_resolved() {
        let l = |p: &str, t: &str| ManifestEntry::symlink(p, t.into());
        let m = |e: Vec<ManifestEntry>| Manifest { entries: e }.check(&limits());
        assert!(m(vec![l("a/b", ".."), l("s", "a/b/..")]).is_err());
        assert!(m(vec![l("a/b", ".."), l("s", "a/b/x")]).is_ok());
        assert!(m(vec![l("x", "y"), l("y", "x")]).is_err(), "a loop");
        assert!(m(vec![l("d/up", ".."), l("d/s", "up/d/up/..")]).is_err());
        assert!(m(vec![l("p", "q/r"), l("q/r", "../z")]).is_ok());
    }

    #[test]
    fn parsing_bounds_entries_and_strings() {
        let f = ManifestEntry::file("a", false, 1, h('a'));
        let two = serde_json::to_vec(&Manifest {
            entries: vec![
                f.clone(),
                ManifestEntry {
                    path: "b".into(),
                    ..f
                },
            ],
        })
        .unwrap();
        assert_eq!(parse(&two[..], 2, 1 << 20).unwrap().entries.len(), 2);
        let e = ErrorBody::from(parse(&two[..], 2, 300).unwrap_err());
        assert!(e.message.contains("max_registry_bytes"), "{}", e.message);
        let e = ErrorBody::from(parse(&two[..], 1, 1 << 20).unwrap_err());
        assert_eq!(e.code, ErrorCode::PayloadTooLarge, "{}", e.message);
        let long = format!(
            r#"{{"entries":[{{"path":"l","kind":"symlink","target":"{}"}}]}}"#,
            "x".repeat(5000)
        );
        let e = ErrorBody::from(parse(long.as_bytes(), 10, 1 << 20).unwrap_err());
        assert!(e.message.contains("PATH_MAX"), "{}", e.message);
        assert!(parse(&b"{\"entries\":[],\"x\":1}"[..], 10, 1 << 20).is_err());
    }

    #[test]
    fn digest_is_order_independent() {
        let a = ManifestEntry::file("a", false, 1, h('a'));
        let b = ManifestEntry::file("b", true, 2, h('b'));
        let x = Manifest {
            entries: vec![a.clone(), b.clone()],
        }
        .check(&limits())
        .unwrap();
        let y = Manifest {
            entries: vec![b, a],
        }
        .check(&limits())
        .unwrap();
        assert_eq!(x.digest, y.digest);
        assert_eq!((x.files, x.bytes), (2, 3));
    }
}

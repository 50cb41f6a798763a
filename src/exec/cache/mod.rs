//! Cache volumes (docs/caches.md): storage that outlives one run, for one-shot runs that
//! want fresh runners but warm caches (`CARGO_HOME`, a cargo target directory, npm's or
//! pip's download cache).
//!
//! A profile declares its `caches:` ([`CacheSpec`]); the `caches:` section of the
//! configuration ([`CachesConfig`]) holds the operator's bounds. Each run's cache is found by
//! its key ([`CacheKey`]): the profile, the cache's name, a hash of the caller's identity,
//! and, for `scope: workspace`, the request's `cache_scope` (else its workspace). The key
//! never contains the identity itself, and two identities never share a key.
//!
//! Backend-neutral here; the local backend keeps a directory per key ([`local`]), the
//! Kubernetes backend a PersistentVolumeClaim per key (`exec::kube::cache`).

pub(crate) mod local;

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::contract::{ErrorBody, ErrorCode};

/// Why a run did not get its caches (the local backend's; the kube backend's claims say
/// [`CacheError::Busy`] too).
#[derive(Debug, thiserror::Error)]
pub(crate) enum CacheError {
    #[error(
        "cache {name} stayed in use by another run for {secs}s (caches.busy_wait_secs); retry later, or set when_busy: skip"
    )]
    Busy { name: String, secs: u64 },
    #[error("the run was cancelled while it waited for its cache")]
    Cancelled,
    /// The blocking task that prepares a cache panicked or was cancelled.
    #[error("preparing a cache failed: {0}")]
    Preparing(tokio::task::JoinError),
    #[error("cannot prepare cache {name}: {source}")]
    Prepare {
        name: String,
        source: std::io::Error,
    },
    /// The empty directory of a run that cannot have its cache.
    #[error("cannot make a directory for cache {name}: {source}")]
    SkipDir {
        name: String,
        source: std::io::Error,
    },
}

impl From<CacheError> for ErrorBody {
    fn from(e: CacheError) -> Self {
        let code = match e {
            CacheError::Busy { .. } => ErrorCode::TooManyRequests,
            CacheError::Cancelled => ErrorCode::ShuttingDown,
            CacheError::Preparing(_) => ErrorCode::Internal,
            CacheError::Prepare { .. } | CacheError::SkipDir { .. } => ErrorCode::StartFailed,
        };
        ErrorBody::new(code, e.to_string())
    }
}

/// `caches:` of the configuration: the operator's bounds for every profile's caches.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CachesConfig {
    /// A cache no run used for this long is deleted (its claim, or its directory).
    pub idle_ttl_secs: u64,
    /// How often idle caches are looked for.
    pub sweep_interval_secs: u64,
    /// The longest a run waits for a cache that another run holds (`when_busy: wait`);
    /// within the run's start budget too.
    pub busy_wait_secs: u64,
    /// The size of a cache whose profile names none.
    pub default_size: String,
    /// The largest size a profile may declare.
    pub max_size: String,
    /// Cache keys (claims, directories) one identity may have at once; a run that would
    /// create one more runs without that cache and says so.
    pub max_per_identity: usize,
    /// Kubernetes: the StorageClass of new claims unless the cache names one [default: the
    /// cluster's default class].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub storage_class: Option<String>,
    /// Kubernetes: the access mode of new claims. `ReadWriteOncePod` where the CSI driver
    /// supports it; the gateway lets one run hold a cache at a time either way.
    pub access_mode: String,
    /// Local backend: where the cache directories are [default: `mcp-run-caches` in the
    /// system's temporary directory].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub local_dir: Option<PathBuf>,
}

impl Default for CachesConfig {
    fn default() -> Self {
        Self {
            idle_ttl_secs: 7 * 24 * 3600,
            sweep_interval_secs: 300,
            busy_wait_secs: 120,
            default_size: "10Gi".into(),
            max_size: "100Gi".into(),
            max_per_identity: 16,
            storage_class: None,
            access_mode: "ReadWriteOnce".into(),
            local_dir: None,
        }
    }
}

impl CachesConfig {
    /// `(field, message)` on failure.
    pub fn validate(&self) -> Result<(), (String, String)> {
        let err = |f: &str, m: String| Err((format!("caches.{f}"), m));
        for (f, v) in [
            ("idle_ttl_secs", self.idle_ttl_secs),
            ("sweep_interval_secs", self.sweep_interval_secs),
            ("max_per_identity", self.max_per_identity as u64),
        ] {
            if v == 0 {
                return err(f, "must be at least 1".into());
            }
        }
        let Some(max) = parse_quantity(&self.max_size) else {
            return err(
                "max_size",
                format!("{:?} is not a size such as 50Gi", self.max_size),
            );
        };
        match parse_quantity(&self.default_size) {
            None => {
                return err(
                    "default_size",
                    format!("{:?} is not a size such as 10Gi", self.default_size),
                );
            }
            Some(d) if d > max => {
                return err("default_size", "must not be over caches.max_size".into());
            }
            _ => {}
        }
        if !matches!(
            self.access_mode.as_str(),
            "ReadWriteOnce" | "ReadWriteOncePod" | "ReadWriteMany"
        ) {
            return err(
                "access_mode",
                format!(
                    "is {:?}; use ReadWriteOnce, ReadWriteOncePod or ReadWriteMany",
                    self.access_mode
                ),
            );
        }
        if let Some(c) = &self.storage_class
            && !is_subdomain(c)
        {
            return err("storage_class", format!("{c:?} is not a StorageClass name"));
        }
        Ok(())
    }

    pub fn local_dir(&self) -> PathBuf {
        self.local_dir
            .clone()
            .unwrap_or_else(|| std::env::temp_dir().join("mcp-run-caches"))
    }

    /// The size bound of one cache in bytes.
    pub fn size_of(&self, spec: &CacheSpec) -> u64 {
        spec.size
            .as_deref()
            .and_then(parse_quantity)
            .or_else(|| parse_quantity(&self.default_size))
            .unwrap_or(10 << 30)
    }

    /// The size as a Kubernetes quantity.
    pub fn quantity_of(&self, spec: &CacheSpec) -> String {
        spec.size
            .clone()
            .unwrap_or_else(|| self.default_size.clone())
    }
}

/// One entry of a profile's `caches:`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheSpec {
    /// Names the cache within its profile (a DNS label: `cargo`, `npm`).
    pub name: String,
    /// Where the cache is mounted in a runner pod (absolute). The local backend has no
    /// mounts: there the cache is a directory of the gateway's, and `env` points at it.
    pub path: String,
    /// Variables that point tools at the cache: a value is a path inside the cache,
    /// relative (`cargo-home`, `.` for the cache itself) or absolute below `path`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// The size bound, as a Kubernetes quantity (`5Gi`) [default: `caches.default_size`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<String>,
    /// Who shares the cache.
    #[serde(default)]
    pub scope: CacheScope,
    /// What a run does when another run holds the cache.
    #[serde(default)]
    pub when_busy: WhenBusy,
    /// Kubernetes: the StorageClass of its claims [default: `caches.storage_class`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_class: Option<String>,
}

/// Who shares a cache: every run of one identity (and profile), or only those that also
/// name the same `cache_scope` (else the same workspace).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheScope {
    #[default]
    Identity,
    Workspace,
}

/// What a run does when its cache is held by another run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WhenBusy {
    /// Waits for it, within `caches.busy_wait_secs` and the start budget (a `queued`
    /// phase says so); then fails with 429.
    #[default]
    Wait,
    /// Runs at once with an empty cache instead (the run's context says `skipped`).
    Skip,
}

impl CacheSpec {
    /// Errors are `(field below the cache, message)`.
    pub fn validate(&self, bounds: &CachesConfig) -> Result<(), (String, String)> {
        let err = |f: &str, m: String| Err((f.to_string(), m));
        if !is_dns_label(&self.name) || self.name.len() > 40 {
            return err(
                "name",
                format!(
                    "{:?} must be a DNS label of at most 40 characters (lowercase letters, digits, '-')",
                    self.name
                ),
            );
        }
        let p = self.path.trim_end_matches('/');
        if !self.path.starts_with('/') || p.is_empty() || p.split('/').any(|c| c == "..") {
            return err(
                "path",
                format!(
                    "{:?} must be an absolute directory other than /, without `..`",
                    self.path
                ),
            );
        }
        for (k, v) in &self.env {
            if !crate::contract::is_valid_env_name(k) {
                return err("env", format!("{k:?} is not a variable name"));
            }
            if self.relative(v).is_none() {
                return err(
                    "env",
                    format!(
                        "{k}={v:?} must be a path inside the cache: relative without `..`, or below {}",
                        self.path
                    ),
                );
            }
        }
        if let Some(size) = &self.size {
            match (parse_quantity(size), parse_quantity(&bounds.max_size)) {
                (None, _) => return err("size", format!("{size:?} is not a size such as 5Gi")),
                (Some(s), Some(max)) if s > max => {
                    return err(
                        "size",
                        format!("{size} is over caches.max_size ({})", bounds.max_size),
                    );
                }
                (Some(0), _) => return err("size", "must not be 0".into()),
                _ => {}
            }
        }
        if let Some(c) = &self.storage_class
            && !is_subdomain(c)
        {
            return err("storage_class", format!("{c:?} is not a StorageClass name"));
        }
        Ok(())
    }

    /// An `env` value as a path relative to the cache's root (`""`: the root), or `None`
    /// when it points outside.
    pub fn relative(&self, value: &str) -> Option<String> {
        let root = self.path.trim_end_matches('/');
        let rel = if let Some(rest) = value.strip_prefix('/') {
            let rest = format!("/{rest}");
            match rest.strip_prefix(root) {
                Some("") => "",
                Some(r) if r.starts_with('/') => &r[1..],
                _ => return None,
            }
            .to_string()
        } else {
            value.to_string()
        };
        let parts: Vec<&str> = rel
            .split('/')
            .filter(|c| !c.is_empty() && *c != ".")
            .collect();
        if parts.contains(&"..") {
            return None;
        }
        Some(parts.join("/"))
    }

    /// The variables for a cache whose root is at `root` (a mount path or a directory).
    pub fn env_at(&self, root: &str) -> impl Iterator<Item = (String, String)> + '_ {
        let root = root.trim_end_matches('/').to_string();
        self.env.iter().map(move |(k, v)| {
            let rel = self.relative(v).unwrap_or_default();
            let path = if rel.is_empty() {
                root.clone()
            } else {
                format!("{root}/{rel}")
            };
            (k.clone(), path)
        })
    }
}

/// Whose run it is and what it names, as far as caches care.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct CacheRequest<'a> {
    /// The caller's identity (`None` with auth off: every caller is the same one).
    pub owner: Option<&'a str>,
    /// The request's `cache_scope`, for `scope: workspace` caches.
    pub scope: Option<&'a str>,
    /// The request's workspace id, when it names no `cache_scope`.
    pub workspace: Option<&'a str>,
}

/// A cache's identity: who may use it, and the name its claim or directory gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CacheKey {
    /// The cache's name in the profile.
    pub cache: String,
    pub profile: String,
    /// 40 hex digits of SHA-256 over (profile, cache, owner, scope): names the claim or
    /// the directory.
    pub id: String,
    /// 16 hex digits of SHA-256 of the identity (never the identity itself): a label value.
    pub owner_hash: String,
    /// `identity`, or 16 hex digits of the scope's hash.
    pub scope_key: String,
}

/// The owner hash of an identity (with auth off, the one anonymous owner).
pub(crate) fn owner_hash(owner: Option<&str>) -> String {
    let mut h = Sha256::new();
    h.update(b"mcp-run cache owner\0");
    match owner {
        Some(o) => {
            h.update(b"id\0");
            h.update(o.as_bytes());
        }
        None => h.update(b"anonymous"),
    }
    hex(&h.finalize())[..16].to_string()
}

impl CacheKey {
    pub(crate) fn new(profile: &str, spec: &CacheSpec, req: &CacheRequest<'_>) -> Self {
        let owner_hash = owner_hash(req.owner);
        let scope_key = match spec.scope {
            CacheScope::Identity => "identity".to_string(),
            CacheScope::Workspace => {
                let (kind, v) = match (req.scope, req.workspace) {
                    (Some(s), _) => ("scope", s),
                    (None, Some(w)) => ("workspace", w),
                    (None, None) => ("none", ""),
                };
                let mut h = Sha256::new();
                h.update(kind.as_bytes());
                h.update(b"\0");
                h.update(v.as_bytes());
                hex(&h.finalize())[..16].to_string()
            }
        };
        let mut h = Sha256::new();
        // Length-prefixed parts: no two tuples hash alike.
        for part in [
            "mcp-run cache v1",
            profile,
            &spec.name,
            req.owner.unwrap_or(""),
            if req.owner.is_some() { "id" } else { "anon" },
            &scope_key,
        ] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part.as_bytes());
        }
        Self {
            cache: spec.name.clone(),
            profile: profile.to_string(),
            id: hex(&h.finalize())[..40].to_string(),
            owner_hash,
            scope_key,
        }
    }
}

/// How the capabilities document describes a profile's caches.
pub(crate) fn info(specs: &[CacheSpec]) -> Vec<crate::capabilities::CacheInfo> {
    specs
        .iter()
        .map(|c| crate::capabilities::CacheInfo {
            name: c.name.clone(),
            scope: match c.scope {
                CacheScope::Identity => "identity",
                CacheScope::Workspace => "workspace",
            }
            .into(),
            variables: c.env.keys().cloned().collect(),
        })
        .collect()
}

/// The variables of a run's caches under the request's own: a request that sets one of them
/// keeps its value.
pub(crate) fn merge_env(
    request: &mut BTreeMap<String, String>,
    caches: impl IntoIterator<Item = (String, String)>,
) {
    for (k, v) in caches {
        request.entry(k).or_insert(v);
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

fn is_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.split('.').all(is_dns_label)
}

/// A Kubernetes quantity of bytes (`5Gi`, `500M`, `1073741824`) in bytes; `None` for
/// anything else (fractions, milli-units).
pub(crate) fn parse_quantity(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().ok()?;
    let mult: u64 = match unit {
        "" => 1,
        "k" => 1000,
        "M" => 1000u64.pow(2),
        "G" => 1000u64.pow(3),
        "T" => 1000u64.pow(4),
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        _ => return None,
    };
    n.checked_mul(mult)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(yaml: &str) -> CacheSpec {
        yaml_serde::from_str(yaml).unwrap()
    }

    #[test]
    fn quantities() {
        assert_eq!(parse_quantity("5Gi"), Some(5 << 30));
        assert_eq!(parse_quantity("500M"), Some(500_000_000));
        assert_eq!(parse_quantity("1024"), Some(1024));
        assert_eq!(parse_quantity("1.5Gi"), None);
        assert_eq!(parse_quantity("Gi"), None);
        assert_eq!(parse_quantity("5gi"), None);
    }

    #[test]
    fn env_values_stay_inside_the_cache() {
        let s = spec(
            "{name: cargo, path: /cache/cargo/, env: {CARGO_HOME: home, CARGO_TARGET_DIR: /cache/cargo/target, X: .}}",
        );
        s.validate(&CachesConfig::default()).unwrap();
        let env: Vec<_> = s.env_at("/srv/c/abc").collect();
        assert_eq!(
            env,
            [
                ("CARGO_HOME".into(), "/srv/c/abc/home".into()),
                ("CARGO_TARGET_DIR".into(), "/srv/c/abc/target".into()),
                ("X".into(), "/srv/c/abc".to_string()),
            ]
        );
        for bad in ["../x", "/cache/other", "/cache/cargo2/x", "a/../../b"] {
            let s = CacheSpec {
                env: [("A".to_string(), bad.to_string())].into(),
                ..s.clone()
            };
            assert_eq!(
                s.validate(&CachesConfig::default()).unwrap_err().0,
                "env",
                "{bad}"
            );
        }
    }

    #[test]
    fn invalid_caches_name_the_field() {
        let b = CachesConfig::default();
        for (yaml, field) in [
            ("{name: Cargo, path: /c}", "name"),
            ("{name: c, path: c}", "path"),
            ("{name: c, path: /}", "path"),
            ("{name: c, path: /c, size: 1TB}", "size"),
            ("{name: c, path: /c, size: 200Gi}", "size"),
            (
                "{name: c, path: /c, storage_class: Fast_SSD}",
                "storage_class",
            ),
        ] {
            assert_eq!(spec(yaml).validate(&b).unwrap_err().0, field, "{yaml}");
        }
        let bad = CachesConfig {
            default_size: "200Gi".into(),
            ..CachesConfig::default()
        };
        assert_eq!(bad.validate().unwrap_err().0, "caches.default_size");
    }

    #[test]
    fn keys_separate_identities_profiles_and_scopes() {
        let s = spec("{name: cargo, path: /c}");
        let a = CacheKey::new(
            "rust",
            &s,
            &CacheRequest {
                owner: Some("alice"),
                ..Default::default()
            },
        );
        let a2 = CacheKey::new(
            "rust",
            &s,
            &CacheRequest {
                owner: Some("alice"),
                scope: Some("x"),
                workspace: Some("ws_1"),
            },
        );
        let b = CacheKey::new(
            "rust",
            &s,
            &CacheRequest {
                owner: Some("bob"),
                ..Default::default()
            },
        );
        let anon = CacheKey::new("rust", &s, &CacheRequest::default());
        let other_profile = CacheKey::new(
            "node",
            &s,
            &CacheRequest {
                owner: Some("alice"),
                ..Default::default()
            },
        );
        // Identity scope ignores the workspace.
        assert_eq!(a, a2);
        assert_ne!(a.id, b.id);
        assert_ne!(a.owner_hash, b.owner_hash);
        assert_ne!(a.id, anon.id);
        assert_ne!(a.id, other_profile.id);
        assert!(!a.id.contains("alice") && a.id.len() == 40);
        // A token named like the anonymous marker is still not anonymous.
        let fake = CacheKey::new(
            "rust",
            &s,
            &CacheRequest {
                owner: Some(""),
                ..Default::default()
            },
        );
        assert_ne!(fake.id, anon.id);

        let w = spec("{name: cargo, path: /c, scope: workspace}");
        let k = |scope, ws| {
            CacheKey::new(
                "rust",
                &w,
                &CacheRequest {
                    owner: Some("alice"),
                    scope,
                    workspace: ws,
                },
            )
        };
        assert_eq!(k(Some("proj"), Some("ws_1")), k(Some("proj"), Some("ws_2")));
        assert_ne!(k(Some("proj"), None).id, k(Some("other"), None).id);
        assert_ne!(k(None, Some("ws_1")).id, k(None, Some("ws_2")).id);
        assert_ne!(k(None, Some("proj")).id, k(Some("proj"), None).id);
    }

    #[test]
    fn request_env_wins() {
        let mut env: BTreeMap<String, String> =
            [("CARGO_HOME".to_string(), "/mine".to_string())].into();
        merge_env(
            &mut env,
            [
                ("CARGO_HOME".to_string(), "/c".to_string()),
                ("B".to_string(), "/c/b".to_string()),
            ],
        );
        assert_eq!(env["CARGO_HOME"], "/mine");
        assert_eq!(env["B"], "/c/b");
    }
}

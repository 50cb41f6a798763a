//! Limits applied to every execution, whatever the front end or backend: a leaf module that
//! the policy, the runner, the backends and the configuration all read, and that imports
//! none of them.

use serde::{Deserialize, Serialize};

/// The default of `limits.max_concurrent_executions`.
pub(crate) const DEFAULT_MAX_CONCURRENT_EXECUTIONS: usize = 64;

/// Limits applied to every execution (`limits:` in the configuration file).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// The timeout of a request that does not set `timeout_secs`.
    pub default_timeout_secs: u64,
    /// The largest `timeout_secs` a request may ask for.
    pub max_timeout_secs: u64,
    /// Executions at once over every front end; more get 429. Default 64; `null`: no limit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_concurrent_executions: Option<usize>,
    /// Executions a client (auth identity, else address) may start: a token bucket.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<RateLimitConfig>,
    /// Whether requests may send the command a standard input (`run-remote -i`); when false
    /// such requests get 403 `policy_violation`.
    pub allow_stdin: bool,
    /// The most stdin one execution may receive, in bytes; more ends the run with a
    /// `payload_too_large` error (413 before the start when the body's length says so).
    pub max_stdin_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            default_timeout_secs: 600,
            max_timeout_secs: 3600,
            // Sized for the chart's 256 MiB: a stalled stream holds about 1 MiB
            // (docs/policy.md#memory-per-stream).
            max_concurrent_executions: Some(DEFAULT_MAX_CONCURRENT_EXECUTIONS),
            rate_limit: None,
            allow_stdin: true,
            max_stdin_bytes: 1 << 30,
        }
    }
}

/// `limits.rate_limit`: a token bucket per client.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RateLimitConfig {
    /// Executions a client may start per minute, on average.
    pub per_minute: u32,
    /// Executions a client may start at once after being idle (the bucket size).
    pub burst: u32,
}

impl Limits {
    /// Checks the rules that types alone do not express: `(field, message)` on failure.
    pub fn validate(&self) -> Result<(), (String, String)> {
        let invalid = |f: &str, m: String| Err((f.to_owned(), m));
        if self.max_timeout_secs == 0 {
            return invalid("limits.max_timeout_secs", "must be at least 1".into());
        }
        if self.default_timeout_secs == 0 || self.default_timeout_secs > self.max_timeout_secs {
            return invalid(
                "limits.default_timeout_secs",
                format!(
                    "must be between 1 and limits.max_timeout_secs ({})",
                    self.max_timeout_secs
                ),
            );
        }
        if self.max_concurrent_executions == Some(0) {
            return invalid(
                "limits.max_concurrent_executions",
                "must be at least 1".into(),
            );
        }
        if let Some(r) = &self.rate_limit {
            if r.per_minute == 0 {
                return invalid("limits.rate_limit.per_minute", "must be at least 1".into());
            }
            if r.burst == 0 {
                return invalid("limits.rate_limit.burst", "must be at least 1".into());
            }
        }
        Ok(())
    }
}

/// The budget of `max` that everyone in this process naming the same `key` (the local
/// backend's workspace directory) draws from: the workspace store's runs and the local
/// backend's sessions count against one `workspaces.max_local_inodes`, built apart from
/// each other.
pub(crate) fn shared_budget(
    key: &std::path::Path,
    max: u64,
) -> std::sync::Arc<tokio::sync::Semaphore> {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex, Weak};
    static BUDGETS: Mutex<Option<HashMap<std::path::PathBuf, Weak<tokio::sync::Semaphore>>>> =
        Mutex::new(None);
    let mut budgets = BUDGETS.lock().unwrap_or_else(|p| p.into_inner());
    let map = budgets.get_or_insert_with(HashMap::new);
    map.retain(|_, w| w.strong_count() > 0);
    if let Some(s) = map.get(key).and_then(Weak::upgrade) {
        return s;
    }
    let permits = usize::try_from(max)
        .unwrap_or(usize::MAX)
        .min(tokio::sync::Semaphore::MAX_PERMITS);
    let s = Arc::new(tokio::sync::Semaphore::new(permits));
    map.insert(key.to_owned(), Arc::downgrade(&s));
    s
}

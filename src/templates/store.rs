//! The template configuration for long-running processes (the gateway, the MCP server):
//! loaded per working directory, cached with a TTL, and never lost to a bad edit.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{Catalog, Template};

/// The default time a loaded configuration is trusted before the file is read again.
pub(crate) const DEFAULT_TTL: Duration = Duration::from_secs(5);

struct Entry {
    checked: Instant,
    catalog: Arc<Catalog>,
    #[cfg_attr(
        not(test),
        expect(dead_code, reason = "logged when set; tests read it")
    )]
    error: Option<String>,
}

/// Caches [`Catalog::load`] per directory. When a reload fails, the error is logged (on
/// stderr, through tracing) and the last good catalog of that directory stays in use; with
/// no good one yet, the built-ins are used.
pub(crate) struct TemplateStore {
    ttl: Duration,
    entries: Mutex<HashMap<PathBuf, Entry>>,
    /// What directories add to: the built-ins, plus a server's own configured templates.
    base: Arc<Catalog>,
    /// Whether `.mcp-run/config.yaml` files are looked for at all (not under `serve`, whose
    /// templates come from its own configuration file).
    discover: bool,
}

impl TemplateStore {
    pub(crate) fn new(ttl: Duration) -> TemplateStore {
        Self::with_base(ttl, Catalog::builtin(), true)
    }

    /// A store whose directories add to `base`; with `discover` false, every directory gets
    /// `base` alone.
    pub(crate) fn with_base(ttl: Duration, base: Catalog, discover: bool) -> TemplateStore {
        TemplateStore {
            ttl,
            entries: Mutex::new(HashMap::new()),
            base: Arc::new(base),
            discover,
        }
    }

    /// The templates available for a command run in `dir`.
    pub(crate) fn catalog(&self, dir: &Path) -> Arc<Catalog> {
        if !self.discover {
            return self.base.clone();
        }
        let mut entries = self
            .entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(e) = entries.get(dir)
            && e.checked.elapsed() < self.ttl
        {
            return e.catalog.clone();
        }
        let loaded = match super::find_config(dir) {
            Some(path) => (*self.base).clone().overlay_file(&path),
            None => Ok((*self.base).clone()),
        };
        let (catalog, error) = match loaded {
            Ok(c) => (Arc::new(c), None),
            Err(err) => {
                let message = err.to_string();
                let kept = match entries.get(dir) {
                    Some(e) => e.catalog.clone(),
                    None => self.base.clone(),
                };
                tracing::warn!(error = %message, kept = ?kept.config_path(),
                    "invalid template configuration; keeping the last good one");
                (kept, Some(message))
            }
        };
        entries.insert(
            dir.to_owned(),
            Entry {
                checked: Instant::now(),
                catalog: catalog.clone(),
                error,
            },
        );
        catalog
    }

    /// The template `name` for a command run in `dir`.
    pub(crate) fn get(&self, name: &str, dir: &Path) -> Option<Template> {
        self.catalog(dir).get(name).cloned()
    }

    /// The template names for `dir`, sorted (for a tool schema's enum).
    pub(crate) fn names(&self, dir: &Path) -> Vec<String> {
        self.catalog(dir).names()
    }

    /// The error of the last load in `dir`, when it failed and an older catalog is in use.
    #[cfg(test)]
    pub(crate) fn last_error(&self, dir: &Path) -> Option<String> {
        let entries = self
            .entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        entries.get(dir).and_then(|e| e.error.clone())
    }
}

impl Default for TemplateStore {
    fn default() -> Self {
        Self::new(DEFAULT_TTL)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::templates::CONFIG_PATH;

    fn write(dir: &Path, text: &str) {
        let p = dir.join(CONFIG_PATH);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    const GOOD: &str = "templates:\n  mine:\n    description: one\n    include_regex: X\n";

    #[test]
    fn keeps_the_last_good_configuration() {
        let root = tempfile::tempdir().unwrap();
        let store = TemplateStore::new(Duration::ZERO);
        write(root.path(), GOOD);
        assert_eq!(store.get("mine", root.path()).unwrap().description, "one");
        assert!(store.last_error(root.path()).is_none());

        write(
            root.path(),
            "templates:\n  mine: {description: two, include_regex: '['}\n",
        );
        assert_eq!(store.get("mine", root.path()).unwrap().description, "one");
        let err = store.last_error(root.path()).unwrap();
        assert!(
            err.contains("\"mine\"") && err.contains("config.yaml"),
            "{err}"
        );

        write(root.path(), &GOOD.replace("one", "three"));
        assert_eq!(store.get("mine", root.path()).unwrap().description, "three");
        assert!(store.last_error(root.path()).is_none());
    }

    #[test]
    fn falls_back_to_builtins_without_a_good_configuration() {
        let root = tempfile::tempdir().unwrap();
        write(root.path(), "templates: [");
        let store = TemplateStore::new(Duration::ZERO);
        assert!(store.get("cargo-test", root.path()).is_some());
        assert!(store.get("mine", root.path()).is_none());
        assert!(store.last_error(root.path()).is_some());
    }

    #[test]
    fn caches_within_the_ttl() {
        let root = tempfile::tempdir().unwrap();
        write(root.path(), GOOD);
        let store = TemplateStore::new(Duration::from_secs(3600));
        assert!(store.names(root.path()).contains(&"mine".to_owned()));
        write(root.path(), &GOOD.replace("mine", "other"));
        // Not read again within the TTL.
        assert!(store.names(root.path()).contains(&"mine".to_owned()));
        let fresh = TemplateStore::new(Duration::from_secs(3600));
        assert!(fresh.names(root.path()).contains(&"other".to_owned()));
    }
}

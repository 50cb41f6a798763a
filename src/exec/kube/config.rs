//! The configuration of the Kubernetes backend: the `kubernetes:` section and the runner
//! `profiles:` of the gateway's configuration file (docs/kubernetes.md).
//!
//! Our own keys are snake_case like the rest of the file; where a profile embeds a
//! Kubernetes object (resources, tolerations, volumes, volume mounts) it is written exactly
//! as in a pod spec, camelCase, and parsed into the k8s-openapi type.

use std::collections::BTreeMap;
use std::path::PathBuf;

use k8s_openapi::api::core::v1::{ResourceRequirements, Toleration, Volume, VolumeMount};
use serde::{Deserialize, Serialize};

use crate::limits::Limits;

/// The image of the `default` profile when neither the file nor `--image` names one.
pub(crate) const DEFAULT_IMAGE: &str = "busybox:1.36";

/// The UID and GID of runner pods unless a profile names others: non-zero (Pod Security
/// `restricted`), and the conventional "nonroot" ID of distroless images; busybox and most
/// images run as any UID.
pub(crate) const DEFAULT_RUN_AS: i64 = 65532;

/// `kubernetes:`: where and how runner pods are created.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KubernetesConfig {
    /// Namespace of the runner pods. Default: the gateway's own namespace in-cluster, else
    /// the kubeconfig context's namespace, else `default`.
    pub namespace: Option<String>,
    /// A kubeconfig file instead of the in-cluster account or `KUBECONFIG`.
    pub kubeconfig: Option<PathBuf>,
    /// A kubeconfig context instead of the current one.
    pub context: Option<String>,
    /// Names this installation in the runner pods' `mcp-run.dev/instance` label; the reaper
    /// only ever touches pods of its own instance. The Helm chart sets the release name.
    pub instance: String,
    /// Runner pods at once; beyond it requests wait in a queue, first come first served,
    /// within their start budget (`pod_start_timeout_secs`).
    pub max_concurrent_pods: usize,
    /// Runs that may wait for a pod slot at once; beyond it requests get 429 with
    /// `Retry-After` (0: no queue).
    pub max_queued_runs: usize,
    /// How long a runner pod may take to be Running.
    pub pod_start_timeout_secs: u64,
    /// The gateway's own limit on its request rate to the API server (requests per second;
    /// 0 turns it off), and the burst allowed above it.
    pub api_qps: f64,
    pub api_burst: u32,
    /// How often the gateway pings an exec's WebSocket: well inside the idle timeout of the
    /// load balancers in front of the API server (commonly 60 s), so that silent commands
    /// keep their stream. kube-rs's own interval is 60 s.
    pub exec_ping_secs: u64,
    /// How often the reaper looks for leftover pods.
    pub reaper_interval_secs: u64,
    /// How old a finished or expired runner pod of another gateway replica must be before
    /// the reaper deletes it.
    pub reaper_min_age_secs: u64,
}

impl Default for KubernetesConfig {
    fn default() -> Self {
        Self {
            namespace: None,
            kubeconfig: None,
            context: None,
            instance: "mcp-run".into(),
            max_concurrent_pods: 32,
            max_queued_runs: 64,
            pod_start_timeout_secs: 120,
            api_qps: 50.0,
            api_burst: 100,
            exec_ping_secs: 20,
            reaper_interval_secs: 60,
            reaper_min_age_secs: 300,
        }
    }
}

impl KubernetesConfig {
    /// Errors are `(field below kubernetes., message)`.
    pub(crate) fn validate(&self, _limits: &Limits) -> Result<(), (String, String)> {
        let err = |f: &str, m: &str| Err((format!("kubernetes.{f}"), m.to_string()));
        if let Some(ns) = &self.namespace
            && !is_dns_label(ns)
        {
            return err(
                "namespace",
                "must be a DNS label (lowercase letters, digits, '-', at most 63 characters)",
            );
        }
        if !is_label_value(&self.instance) || self.instance.is_empty() {
            return err(
                "instance",
                "must be a non-empty label value (letters, digits, '-', '_', '.', at most 63 characters)",
            );
        }
        if self.max_concurrent_pods == 0 {
            return err("max_concurrent_pods", "must be at least 1");
        }
        if self.pod_start_timeout_secs == 0 {
            return err("pod_start_timeout_secs", "must be at least 1");
        }
        if !self.api_qps.is_finite() || self.api_qps < 0.0 {
            return err(
                "api_qps",
                "must be a number of requests per second, 0 or more",
            );
        }
        if self.api_burst == 0 {
            return err("api_burst", "must be at least 1");
        }
        if self.exec_ping_secs == 0 {
            return err("exec_ping_secs", "must be at least 1");
        }
        if self.reaper_interval_secs == 0 {
            return err("reaper_interval_secs", "must be at least 1");
        }
        Ok(())
    }
}

/// A runner profile: the pod a request runs in.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Profile {
    /// One line for agents: what this profile is for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// The runner image [default: busybox:1.36, or `--image`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// The container's main process, which only has to stay alive while commands are exec'd
    /// into it [default: `sleep <the pod's deadline in seconds>`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub keepalive_command: Option<Vec<String>>,
    /// The POSIX shell used to apply `cwd` and `env` before the command (argv is passed as
    /// positional parameters, never parsed as shell text) [default: /bin/sh].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shell: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<String>,
    /// Names of Secrets of the runner namespace.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub image_pull_secrets: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub runtime_class_name: Option<String>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    /// The pod's ServiceAccount (for image pull secrets or workload identity); its token is
    /// still not mounted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service_account_name: Option<String>,
    /// Extra labels and annotations; they cannot replace mcp-run's own labels.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// The UID commands run as [default: 65532 while `run_as_non_root` holds].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run_as_user: Option<i64>,
    /// The primary GID [default: 65532 while `run_as_non_root` holds].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run_as_group: Option<i64>,
    /// `runAsNonRoot` of the pod [default: true, which the Pod Security `restricted` level
    /// requires]. `false` is the explicit opt-out: the image's own user (often root) then
    /// applies, and a namespace enforcing `restricted` refuses the pod (docs/kubernetes.md).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run_as_non_root: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fs_group: Option<i64>,
    /// Mount the image's root filesystem read-only (commands then write only to volumes).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub read_only_root_filesystem: bool,
    /// The container's working directory: where commands without `cwd` run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub working_dir: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<Volume>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub volume_mounts: Vec<VolumeMount>,
    /// Where requests with a `workspace` get their tree (docs/workspaces.md). When set, the
    /// profile's pods get an `emptyDir` volume mounted there (unless a volume of the profile
    /// is mounted there already). Unset: this profile refuses workspace requests.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workspace_path: Option<String>,
    /// Pods of this profile kept Running ahead of requests (docs/kubernetes.md).
    #[serde(skip_serializing_if = "WarmPoolConfig::is_off")]
    pub warm_pool: WarmPoolConfig,
    /// Storage kept between runs of one caller (docs/caches.md): a PersistentVolumeClaim per
    /// cache key on Kubernetes, a directory on the local backend.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub caches: Vec<crate::exec::cache::CacheSpec>,
}

/// `warm_pool:` of a profile.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WarmPoolConfig {
    /// Idle Running pods this gateway keeps for the profile; 0 turns the pool off.
    pub size: usize,
    /// An idle pod older than this is replaced by a fresh one.
    pub max_idle_secs: u64,
}

impl Default for WarmPoolConfig {
    fn default() -> Self {
        Self {
            size: 0,
            max_idle_secs: 3600,
        }
    }
}

impl WarmPoolConfig {
    fn is_off(&self) -> bool {
        *self == Self::default()
    }
}

impl Profile {
    pub fn image(&self) -> &str {
        self.image.as_deref().unwrap_or(DEFAULT_IMAGE)
    }

    /// Whether the pod must run as non-root (the default; see `run_as_non_root`).
    pub fn non_root(&self) -> bool {
        self.run_as_non_root.unwrap_or(true)
    }

    /// The UID and GID written into the pod: the profile's, else [`DEFAULT_RUN_AS`] while
    /// running as non-root, else the image's.
    pub fn run_as(&self) -> (Option<i64>, Option<i64>) {
        if self.non_root() {
            (
                Some(self.run_as_user.unwrap_or(DEFAULT_RUN_AS)),
                Some(self.run_as_group.unwrap_or(DEFAULT_RUN_AS)),
            )
        } else {
            (self.run_as_user, self.run_as_group)
        }
    }

    pub fn shell(&self) -> &str {
        self.shell.as_deref().unwrap_or("/bin/sh")
    }

    /// Errors are `(field below the profile, message)`.
    pub(crate) fn validate(&self) -> Result<(), (String, String)> {
        let err = |f: &str, m: String| Err((f.to_string(), m));
        if let Some(image) = &self.image
            && (image.trim().is_empty() || image.chars().any(char::is_whitespace))
        {
            return err("image", format!("{image:?} is not an image reference"));
        }
        if let Some(path) = &self.workspace_path
            && (!path.starts_with('/') || path.split('/').any(|c| c == "..") || path == "/")
        {
            return err(
                "workspace_path",
                format!("{path:?} must be an absolute directory other than /, without `..`"),
            );
        }
        if let Some(cmd) = &self.keepalive_command
            && cmd.is_empty()
        {
            return err("keepalive_command", "must not be empty".into());
        }
        if let Some(shell) = &self.shell
            && !shell.starts_with('/')
        {
            return err("shell", "must be an absolute path".into());
        }
        if let Some(p) = &self.image_pull_policy
            && !matches!(p.as_str(), "Always" | "IfNotPresent" | "Never")
        {
            return err(
                "image_pull_policy",
                format!("is {p:?}; use Always, IfNotPresent or Never"),
            );
        }
        for (k, v) in &self.labels {
            if !is_label_key(k) || !is_label_value(v) {
                return err("labels", format!("{k}={v:?} is not a valid label"));
            }
            if k.starts_with("app.kubernetes.io/") || k.starts_with("mcp-run.dev/") {
                return err(
                    "labels",
                    format!("{k} is set by mcp-run and cannot be overridden"),
                );
            }
        }
        for k in self.annotations.keys() {
            if !is_label_key(k) {
                return err("annotations", format!("{k} is not a valid annotation key"));
            }
        }
        for m in &self.volume_mounts {
            if !self.volumes.iter().any(|v| v.name == m.name) {
                return err(
                    "volume_mounts",
                    format!("mount {:?} names no volume of this profile", m.name),
                );
            }
        }
        if self.warm_pool.size > 0 && !self.caches.is_empty() {
            return err(
                "caches",
                "cannot be combined with a warm pool: a pod's volumes are fixed when it is created, before the run (and its caller) is known".into(),
            );
        }
        for (i, c) in self.caches.iter().enumerate() {
            let path = c.path.trim_end_matches('/');
            if self.caches[..i].iter().any(|o| o.name == c.name) {
                return err("caches", format!("two caches are named {:?}", c.name));
            }
            let clash = self.caches[..i]
                .iter()
                .map(|o| o.path.trim_end_matches('/'))
                .chain(
                    self.volume_mounts
                        .iter()
                        .map(|m| m.mount_path.trim_end_matches('/')),
                )
                .chain(self.workspace_path.iter().map(|w| w.trim_end_matches('/')))
                .find(|o| {
                    *o == path
                        || path.starts_with(&format!("{o}/"))
                        || o.starts_with(&format!("{path}/"))
                });
            if let Some(o) = clash {
                return err(
                    "caches",
                    format!("cache {:?} at {path} overlaps another mount at {o}", c.name),
                );
            }
        }
        if self.warm_pool.size > 0 && self.warm_pool.max_idle_secs == 0 {
            return err("warm_pool.max_idle_secs", "must be at least 1".into());
        }
        if self.non_root() && self.run_as_user == Some(0) {
            return err(
                "run_as_user",
                "is 0 (root) while run_as_non_root is true; set run_as_non_root: false to run as root".into(),
            );
        }
        if let Some(d) = &self.working_dir
            && !d.starts_with('/')
        {
            return err("working_dir", "must be an absolute path".into());
        }
        Ok(())
    }
}

/// RFC 1123 label: what namespaces and pod name parts must be.
pub(crate) fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// A label value: empty, or up to 63 alphanumerics, '-', '_', '.', alphanumeric at both ends.
pub(crate) fn is_label_value(s: &str) -> bool {
    if s.is_empty() {
        return true;
    }
    let ok = |b: u8| b.is_ascii_alphanumeric();
    s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && ok(s.as_bytes()[0])
        && ok(s.as_bytes()[s.len() - 1])
}

/// A label or annotation key: an optional DNS-subdomain prefix and `/`, then a name.
pub(crate) fn is_label_key(s: &str) -> bool {
    let (prefix, name) = match s.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, s),
    };
    let prefix_ok =
        prefix.is_none_or(|p| !p.is_empty() && p.len() <= 253 && p.split('.').all(is_dns_label));
    prefix_ok && !name.is_empty() && is_label_value(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_charts_profile_shape_parses() {
        let yaml = r#"
image: rust:1-slim
image_pull_secrets: [regcred]
keepalive_command: [sleep, infinity]
labels: {team: platform}
node_selector: {kubernetes.io/arch: amd64}
run_as_non_root: true
run_as_user: 1000
runtime_class_name: gvisor
resources: {limits: {memory: 256Mi}, requests: {cpu: 100m}}
tolerations: [{effect: NoSchedule, key: dedicated, operator: Equal, value: builds}]
volume_mounts: [{mountPath: /workspace, name: workspace}]
volumes: [{name: workspace, persistentVolumeClaim: {claimName: workspace}}]
"#;
        let p: Profile = yaml_serde::from_str(yaml).unwrap();
        p.validate().unwrap();
        assert_eq!(
            p.volumes[0]
                .persistent_volume_claim
                .as_ref()
                .unwrap()
                .claim_name,
            "workspace"
        );
        assert_eq!(p.tolerations[0].key.as_deref(), Some("dedicated"));
    }

    #[test]
    fn invalid_profiles_name_the_field() {
        let cases = [
            ("image_pull_policy: Sometimes", "image_pull_policy"),
            ("labels: {app.kubernetes.io/name: x}", "labels"),
            ("labels: {'bad key!': x}", "labels"),
            (
                "volume_mounts: [{mountPath: /w, name: nope}]",
                "volume_mounts",
            ),
            ("keepalive_command: []", "keepalive_command"),
            ("shell: sh", "shell"),
            ("run_as_user: 0", "run_as_user"),
            // A pod's volumes are fixed before its caller is known.
            (
                "{caches: [{name: c, path: /c}], warm_pool: {size: 1}}",
                "caches",
            ),
            (
                "{caches: [{name: c, path: /w/c}], workspace_path: /w}",
                "caches",
            ),
            (
                "{caches: [{name: c, path: /a}, {name: c, path: /b}]}",
                "caches",
            ),
            (
                "{caches: [{name: c, path: /a}, {name: d, path: /a/}]}",
                "caches",
            ),
        ];
        for (yaml, field) in cases {
            let p: Profile = yaml_serde::from_str(yaml).unwrap();
            assert_eq!(p.validate().unwrap_err().0, field, "{yaml}");
        }
    }

    #[test]
    fn label_syntax() {
        assert!(is_label_key("mcp-run.dev/instance"));
        assert!(is_label_key("team"));
        assert!(!is_label_key("/x"));
        assert!(!is_label_key("a/b/"));
        assert!(is_label_value(""));
        assert!(!is_label_value("-a"));
        assert!(!is_label_value(&"a".repeat(64)));
        assert!(is_dns_label("mcp-runners"));
        assert!(!is_dns_label("Runners"));
    }
}

//! The runner pod built from a profile: a pure function, so that its hardening, labels and
//! overrides are unit-tested without a cluster.

pub(crate) mod argv;

pub(crate) mod workspace;

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Capabilities, Container, LocalObjectReference, Pod, PodSecurityContext, PodSpec,
    SeccompProfile, SecurityContext,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::jiff::Timestamp;

use super::config::Profile;

/// The runner container's name.
pub(crate) const CONTAINER: &str = "runner";

pub(crate) const LABEL_NAME: &str = "app.kubernetes.io/name";
pub(crate) const LABEL_COMPONENT: &str = "app.kubernetes.io/component";
pub(crate) const LABEL_MANAGED_BY: &str = "app.kubernetes.io/managed-by";
/// The installation (`kubernetes.instance`): the reaper's boundary.
pub(crate) const LABEL_INSTANCE: &str = "mcp-run.dev/instance";
/// The gateway process lineage that created the pod (its pod name in-cluster, else the host).
pub(crate) const LABEL_GATEWAY: &str = "mcp-run.dev/gateway";
pub(crate) const LABEL_PROFILE: &str = "mcp-run.dev/profile";
/// Warm pool pods: the profile whose pool they are in.
pub(crate) const LABEL_POOL: &str = "mcp-run.dev/pool";
/// Warm pool pods: `idle` until a request claims it, then `claimed`.
pub(crate) const LABEL_STATE: &str = "mcp-run.dev/state";
/// A kept runner's (a session's) pod: a hash of its owner's identity (never the identity).
pub(crate) const LABEL_SESSION_OWNER: &str = "mcp-run.dev/session-owner";
/// A kept runner's pod: a hash of the session's owner and name (never the name).
pub(crate) const LABEL_SESSION: &str = "mcp-run.dev/session";
/// When the pod is past any use (creation + its active deadline), RFC 3339.
pub(crate) const ANNOTATION_EXPIRES: &str = "mcp-run.dev/expires-at";

/// Who creates runner pods: written into every pod so that the reaper and Kubernetes'
/// garbage collector can tell whose it is.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Identity {
    pub instance: String,
    pub gateway: String,
    /// The gateway's own Pod, when it runs in-cluster in the runner namespace.
    pub owner: Option<OwnerReference>,
}

impl Identity {
    /// The label selector of every runner pod of this installation.
    pub(crate) fn instance_selector(&self) -> String {
        format!(
            "{LABEL_MANAGED_BY}=mcp-run,{LABEL_COMPONENT}=runner,{LABEL_INSTANCE}={}",
            self.instance
        )
    }
}

/// Turns a host or pod name into a label value (at most 63 characters, alphanumeric ends).
pub fn label_value(s: &str) -> String {
    let v: String = s
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '-'
            }
        })
        .take(63)
        .collect();
    let v = v.trim_matches(|c: char| !c.is_ascii_alphanumeric());
    if v.is_empty() {
        "unknown".into()
    } else {
        v.into()
    }
}

/// A fresh pod name: `mcp-run-` and 10 random characters (the name is chosen here rather
/// than by `generateName`, so that a pod whose create response was lost can still be deleted).
pub(crate) fn pod_name() -> String {
    use rand::RngExt as _;
    // No vowels: no words in names.
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut rng = rand::rng();
    let suffix: String = (0..10)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect();
    format!("mcp-run-{suffix}")
}

/// Everything that varies per pod.
pub(crate) struct PodRequest<'a> {
    pub name: &'a str,
    pub namespace: &'a str,
    pub profile_name: &'a str,
    pub profile: &'a Profile,
    /// `activeDeadlineSeconds`: the backstop beyond the request's timeout.
    pub active_deadline_secs: i64,
    pub now: Timestamp,
}

/// The runner pod: hardened, labelled, owned.
pub(crate) fn build(req: &PodRequest<'_>, id: &Identity) -> Pod {
    let p = req.profile;
    let mut labels: BTreeMap<String, String> = p.labels.clone();
    for (k, v) in [
        (LABEL_NAME, "mcp-run".to_string()),
        (LABEL_COMPONENT, "runner".into()),
        (LABEL_MANAGED_BY, "mcp-run".into()),
        (LABEL_INSTANCE, id.instance.clone()),
        (LABEL_GATEWAY, id.gateway.clone()),
        (LABEL_PROFILE, label_value(req.profile_name)),
    ] {
        labels.insert(k.into(), v);
    }
    let mut annotations = p.annotations.clone();
    let expires = req
        .now
        .checked_add(std::time::Duration::from_secs(
            req.active_deadline_secs.max(0) as u64,
        ))
        .unwrap_or(req.now);
    annotations.insert(ANNOTATION_EXPIRES.into(), expires.to_string());

    let keepalive = p.keepalive_command.clone().unwrap_or_else(|| {
        // `sleep N` exists in every image with a userland (busybox, coreutils); `infinity`
        // does not. The pod is never needed beyond its deadline.
        vec!["sleep".into(), req.active_deadline_secs.to_string()]
    });
    let (run_as_user, run_as_group) = p.run_as();
    let container = Container {
        name: CONTAINER.into(),
        image: Some(p.image().to_string()),
        image_pull_policy: p.image_pull_policy.clone(),
        command: Some(keepalive),
        resources: workspace::resources(p),
        working_dir: p.working_dir.clone(),
        volume_mounts: workspace::volume_mounts(p),
        stdin: Some(false),
        tty: Some(false),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            privileged: Some(false),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".into()]),
                add: None,
            }),
            read_only_root_filesystem: Some(p.read_only_root_filesystem),
            run_as_user,
            run_as_group,
            run_as_non_root: Some(p.non_root()),
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".into(),
                localhost_profile: None,
            }),
            ..Default::default()
        }),
        termination_message_policy: Some("FallbackToLogsOnError".into()),
        ..Default::default()
    };
    Pod {
        metadata: ObjectMeta {
            name: Some(req.name.into()),
            namespace: Some(req.namespace.into()),
            labels: Some(labels),
            annotations: Some(annotations),
            owner_references: id.owner.clone().map(|o| vec![o]),
            ..Default::default()
        },
        spec: Some(PodSpec {
            containers: vec![container],
            restart_policy: Some("Never".into()),
            automount_service_account_token: Some(false),
            enable_service_links: Some(false),
            active_deadline_seconds: Some(req.active_deadline_secs),
            // Nothing in a runner pod needs to drain: the shortest grace for a deletion that
            // does not name its own (an operator's `kubectl delete`, a namespace going), as
            // the gateway's own deletions (guard.rs). Not 0: the API server takes a grace of
            // 0 as a force deletion, which removes the object before the kubelet has killed
            // the containers; an activeDeadlineSeconds kill uses it too.
            termination_grace_period_seconds: Some(1),
            service_account_name: p.service_account_name.clone(),
            runtime_class_name: p.runtime_class_name.clone(),
            node_selector: (!p.node_selector.is_empty()).then(|| p.node_selector.clone()),
            tolerations: (!p.tolerations.is_empty()).then(|| p.tolerations.clone()),
            image_pull_secrets: (!p.image_pull_secrets.is_empty()).then(|| {
                p.image_pull_secrets
                    .iter()
                    .map(|n| LocalObjectReference { name: n.clone() })
                    .collect()
            }),
            volumes: workspace::volumes(p),
            security_context: Some(PodSecurityContext {
                run_as_user,
                run_as_group,
                run_as_non_root: Some(p.non_root()),
                fs_group: p.fs_group,
                seccomp_profile: Some(SeccompProfile {
                    type_: "RuntimeDefault".into(),
                    localhost_profile: None,
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        status: None,
    }
}

/// The owner reference to the gateway's own Pod (downward API: `MCP_RUN_POD_NAME`,
/// `MCP_RUN_POD_NAMESPACE`, `MCP_RUN_POD_UID`). Owner references cannot cross namespaces, so
/// there is none when the runners live elsewhere.
pub(crate) fn owner_from_env(
    get: impl Fn(&str) -> Option<String>,
    runner_namespace: &str,
) -> Option<OwnerReference> {
    let name = get("MCP_RUN_POD_NAME").filter(|s| !s.is_empty())?;
    let uid = get("MCP_RUN_POD_UID").filter(|s| !s.is_empty())?;
    let ns = get("MCP_RUN_POD_NAMESPACE")?;
    if ns != runner_namespace {
        tracing::info!(
            gateway_namespace = %ns,
            runner_namespace,
            "runner pods are in another namespace: no owner reference (the reaper collects leftovers)"
        );
        return None;
    }
    Some(OwnerReference {
        api_version: "v1".into(),
        kind: "Pod".into(),
        name,
        uid,
        controller: Some(false),
        // Deleting the gateway must not wait for its runners.
        block_owner_deletion: Some(false),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{Toleration, Volume, VolumeMount};

    fn id(owner: bool) -> Identity {
        Identity {
            instance: "prod".into(),
            gateway: "gw-0".into(),
            owner: owner.then(|| OwnerReference {
                api_version: "v1".into(),
                kind: "Pod".into(),
                name: "gw-0".into(),
                uid: "u-1".into(),
                ..Default::default()
            }),
        }
    }

    fn pod(p: &Profile, owner: bool) -> Pod {
        build(
            &PodRequest {
                name: "mcp-run-abc",
                namespace: "runners",
                profile_name: "default",
                profile: p,
                active_deadline_secs: 700,
                now: "2026-11-23T10:00:00Z".parse().unwrap(),
            },
            &id(owner),
        )
    }

    #[test]
    fn default_profile_is_hardened() {
        let pod = pod(&Profile::default(), false);
        let spec = pod.spec.as_ref().unwrap();
        assert_eq!(spec.automount_service_account_token, Some(false));
        // 0 would make every deletion that names no grace a force deletion.
        assert_eq!(spec.termination_grace_period_seconds, Some(1));
        assert_eq!(spec.enable_service_links, Some(false));
        assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
        assert_eq!(spec.active_deadline_seconds, Some(700));
        assert_eq!(
            spec.security_context
                .as_ref()
                .unwrap()
                .seccomp_profile
                .as_ref()
                .unwrap()
                .type_,
            "RuntimeDefault"
        );
        let c = &spec.containers[0];
        assert_eq!(c.name, "runner");
        assert_eq!(c.image.as_deref(), Some("busybox:1.36"));
        assert_eq!(c.command.as_ref().unwrap(), &["sleep", "700"]);
        let sc = c.security_context.as_ref().unwrap();
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        assert_eq!(sc.privileged, Some(false));
        assert_eq!(
            sc.capabilities.as_ref().unwrap().drop.as_ref().unwrap(),
            &["ALL"]
        );
        assert_eq!(sc.seccomp_profile.as_ref().unwrap().type_, "RuntimeDefault");
        assert!(c.env.is_none(), "no environment in the pod spec");
        // Pod Security `restricted`: non-root with a non-zero UID and GID.
        for (non_root, uid, gid) in [(sc.run_as_non_root, sc.run_as_user, sc.run_as_group), {
            let psc = spec.security_context.as_ref().unwrap();
            (psc.run_as_non_root, psc.run_as_user, psc.run_as_group)
        }] {
            assert_eq!((non_root, uid, gid), (Some(true), Some(65532), Some(65532)));
        }
        assert!(pod.metadata.owner_references.is_none());
        assert_eq!(
            pod.metadata.annotations.as_ref().unwrap()[ANNOTATION_EXPIRES],
            "2026-11-23T10:11:40Z"
        );
    }

    #[test]
    fn labels_name_mcp_run_and_the_gateway_and_cannot_be_overridden() {
        let mut p = Profile::default();
        p.labels.insert("team".into(), "a".into());
        // validate() refuses this; build() must still win if it ever got through.
        p.labels.insert(LABEL_INSTANCE.into(), "other".into());
        let pod = pod(&p, true);
        let l = pod.metadata.labels.as_ref().unwrap();
        assert_eq!(l[LABEL_NAME], "mcp-run");
        assert_eq!(l[LABEL_COMPONENT], "runner");
        assert_eq!(l[LABEL_MANAGED_BY], "mcp-run");
        assert_eq!(l[LABEL_INSTANCE], "prod");
        assert_eq!(l[LABEL_GATEWAY], "gw-0");
        assert_eq!(l["team"], "a");
        let o = &pod.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (o.kind.as_str(), o.name.as_str(), o.uid.as_str()),
            ("Pod", "gw-0", "u-1")
        );
    }

    #[test]
    fn profile_overrides_reach_the_pod() {
        let p = Profile {
            image: Some("rust:1-slim".into()),
            keepalive_command: Some(vec!["sleep".into(), "infinity".into()]),
            image_pull_policy: Some("Always".into()),
            image_pull_secrets: vec!["regcred".into()],
            runtime_class_name: Some("gvisor".into()),
            node_selector: [("kubernetes.io/arch".to_string(), "amd64".to_string())].into(),
            tolerations: vec![Toleration {
                key: Some("dedicated".into()),
                ..Default::default()
            }],
            service_account_name: Some("builder".into()),
            run_as_user: Some(1000),
            run_as_non_root: Some(true),
            read_only_root_filesystem: true,
            working_dir: Some("/workspace".into()),
            volumes: vec![Volume {
                name: "ws".into(),
                ..Default::default()
            }],
            volume_mounts: vec![VolumeMount {
                name: "ws".into(),
                mount_path: "/workspace".into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let pod = pod(&p, false);
        let spec = pod.spec.unwrap();
        let c = &spec.containers[0];
        assert_eq!(c.image.as_deref(), Some("rust:1-slim"));
        assert_eq!(c.command.as_ref().unwrap(), &["sleep", "infinity"]);
        assert_eq!(c.image_pull_policy.as_deref(), Some("Always"));
        assert_eq!(c.working_dir.as_deref(), Some("/workspace"));
        assert_eq!(
            c.volume_mounts.as_ref().unwrap()[0].mount_path,
            "/workspace"
        );
        assert_eq!(
            c.security_context
                .as_ref()
                .unwrap()
                .read_only_root_filesystem,
            Some(true)
        );
        assert_eq!(c.security_context.as_ref().unwrap().run_as_user, Some(1000));
        assert_eq!(spec.runtime_class_name.as_deref(), Some("gvisor"));
        assert_eq!(spec.service_account_name.as_deref(), Some("builder"));
        assert_eq!(
            spec.automount_service_account_token,
            Some(false),
            "even with an account"
        );
        assert_eq!(spec.image_pull_secrets.unwrap()[0].name, "regcred");
        assert_eq!(spec.node_selector.unwrap()["kubernetes.io/arch"], "amd64");
        assert_eq!(spec.tolerations.unwrap().len(), 1);
        assert_eq!(spec.security_context.unwrap().run_as_non_root, Some(true));
        assert_eq!(spec.volumes.unwrap()[0].name, "ws");
    }

    #[test]
    fn running_as_root_is_an_explicit_opt_out() {
        let p = Profile {
            run_as_non_root: Some(false),
            ..Default::default()
        };
        let spec = pod(&p, false).spec.unwrap();
        let sc = spec.containers[0].security_context.clone().unwrap();
        assert_eq!(
            (sc.run_as_non_root, sc.run_as_user, sc.run_as_group),
            (Some(false), None, None),
            "the image's user applies"
        );
        let p = Profile {
            run_as_group: Some(2000),
            ..Default::default()
        };
        let sc = pod(&p, false).spec.unwrap().security_context.unwrap();
        assert_eq!((sc.run_as_user, sc.run_as_group), (Some(65532), Some(2000)));
    }

    #[test]
    fn owner_only_in_the_same_namespace() {
        let env = |k: &str| {
            Some(match k {
                "MCP_RUN_POD_NAME" => "gw-0".to_string(),
                "MCP_RUN_POD_UID" => "u-1".into(),
                "MCP_RUN_POD_NAMESPACE" => "tools".into(),
                _ => return None,
            })
        };
        let o = owner_from_env(env, "tools").unwrap();
        assert_eq!(
            (o.name.as_str(), o.uid.as_str(), o.block_owner_deletion),
            ("gw-0", "u-1", Some(false))
        );
        assert!(owner_from_env(env, "runners").is_none());
        assert!(owner_from_env(|_| None, "tools").is_none());
    }

    #[test]
    fn names_and_label_values() {
        let a = pod_name();
        let b = pod_name();
        assert_ne!(a, b);
        assert!(super::super::config::is_dns_label(&a), "{a}");
        assert_eq!(label_value("my.host_name"), "my.host_name");
        assert_eq!(label_value("-x y-"), "x-y");
        assert_eq!(label_value(&"a".repeat(80)).len(), 63);
    }
}

//! Pod Security admission, as the API server's built-in admission plugin enforces it per
//! namespace label `pod-security.kubernetes.io/enforce` (`privileged`, `baseline`,
//! `restricted`). The checks the kube backend's pods can trip are implemented, with the
//! plugin's reasons and detail texts; the answer is its 403:
//! `pods "NAME" is forbidden: violates PodSecurity "restricted:latest": REASON (DETAIL), ...`.

use k8s_openapi::api::core::v1::{Container, Pod, SecurityContext};

use super::status::ApiError;

pub const ENFORCE_LABEL: &str = "pod-security.kubernetes.io/enforce";
pub const VERSION_LABEL: &str = "pod-security.kubernetes.io/enforce-version";

/// Volume types the restricted level allows.
const ALLOWED_VOLUMES: &[&str] = &[
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
];

/// Capabilities a restricted container may add.
const ALLOWED_ADD: &[&str] = &["NET_BIND_SERVICE"];

fn quoted(names: &[String]) -> String {
    names
        .iter()
        .map(|n| format!("{n:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn plural<'a>(n: usize, one: &'a str, many: &'a str) -> &'a str {
    if n == 1 { one } else { many }
}

fn containers(pod: &Pod) -> Vec<&Container> {
    pod.spec
        .as_ref()
        .map(|s| {
            s.init_containers
                .iter()
                .flatten()
                .chain(s.containers.iter())
                .collect()
        })
        .unwrap_or_default()
}

fn sc(c: &Container) -> Option<&SecurityContext> {
    c.security_context.as_ref()
}

/// Checks `pod` against the namespace's enforce level; `Err` is the plugin's 403.
pub fn admit(
    pod: &Pod,
    name: &str,
    level: Option<&str>,
    version: Option<&str>,
) -> Result<(), ApiError> {
    let level = match level {
        Some(l @ ("baseline" | "restricted")) => l,
        _ => return Ok(()),
    };
    let version = version.unwrap_or("latest");
    let mut failures: Vec<(String, String)> = Vec::new();
    let cs = containers(pod);
    let psc = pod.spec.as_ref().and_then(|s| s.security_context.as_ref());
    let names_where = |f: &dyn Fn(&Container) -> bool| -> Vec<String> {
        cs.iter().filter(|c| f(c)).map(|c| c.name.clone()).collect()
    };
    let restricted = level == "restricted";

    // Checks in the plugin's order (sorted by check ID).
    if restricted {
        let bad = names_where(&|c| sc(c).and_then(|s| s.allow_privilege_escalation) != Some(false));
        if !bad.is_empty() {
            failures.push((
                "allowPrivilegeEscalation != false".into(),
                format!(
                    "{} {} must set securityContext.allowPrivilegeEscalation=false",
                    plural(bad.len(), "container", "containers"),
                    quoted(&bad)
                ),
            ));
        }
        let no_drop = names_where(&|c| {
            !sc(c)
                .and_then(|s| s.capabilities.as_ref())
                .and_then(|cap| cap.drop.as_ref())
                .is_some_and(|d| d.iter().any(|x| x == "ALL"))
        });
        let mut details = Vec::new();
        if !no_drop.is_empty() {
            details.push(format!(
                "{} {} must set securityContext.capabilities.drop=[\"ALL\"]",
                plural(no_drop.len(), "container", "containers"),
                quoted(&no_drop)
            ));
        }
        for c in &cs {
            let added: Vec<String> = sc(c)
                .and_then(|s| s.capabilities.as_ref())
                .and_then(|cap| cap.add.as_ref())
                .into_iter()
                .flatten()
                .filter(|a| !ALLOWED_ADD.contains(&a.as_str()))
                .cloned()
                .collect();
            if !added.is_empty() {
                details.push(format!(
                    "container {:?} must not include {} in securityContext.capabilities.add",
                    c.name,
                    quoted(&added)
                ));
            }
        }
        if !details.is_empty() {
            failures.push(("unrestricted capabilities".into(), details.join("; ")));
        }
    }
    let privileged = names_where(&|c| sc(c).and_then(|s| s.privileged) == Some(true));
    if !privileged.is_empty() {
        failures.push((
            "privileged".into(),
            format!(
                "{} {} must not set securityContext.privileged=true",
                plural(privileged.len(), "container", "containers"),
                quoted(&privileged)
            ),
        ));
    }
    if restricted {
        let mut bad_volumes = Vec::new();
        let mut bad_types = Vec::new();
        for v in pod
            .spec
            .as_ref()
            .and_then(|s| s.volumes.as_ref())
            .into_iter()
            .flatten()
        {
            let value = serde_json::to_value(v).unwrap_or_default();
            if let Some(t) = value
                .as_object()
                .into_iter()
                .flat_map(|o| o.keys())
                .find(|k| *k != "name" && !ALLOWED_VOLUMES.contains(&k.as_str()))
            {
                bad_volumes.push(v.name.clone());
                if !bad_types.contains(t) {
                    bad_types.push(t.clone());
                }
            }
        }
        if !bad_volumes.is_empty() {
            failures.push((
                "restricted volume types".into(),
                format!(
                    "{} {} {} restricted volume {} {}",
                    plural(bad_volumes.len(), "volume", "volumes"),
                    quoted(&bad_volumes),
                    plural(bad_volumes.len(), "uses", "use"),
                    plural(bad_types.len(), "type", "types"),
                    quoted(&bad_types)
                ),
            ));
        }
        // runAsNonRoot: true at pod level covers containers that do not say false.
        let pod_nonroot = psc.and_then(|s| s.run_as_non_root);
        let mut details = Vec::new();
        if pod_nonroot == Some(false) {
            details.push("pod must not set securityContext.runAsNonRoot=false".to_string());
        }
        let explicit_false = names_where(&|c| sc(c).and_then(|s| s.run_as_non_root) == Some(false));
        if !explicit_false.is_empty() {
            details.push(format!(
                "{} {} must not set securityContext.runAsNonRoot=false",
                plural(explicit_false.len(), "container", "containers"),
                quoted(&explicit_false)
            ));
        }
        if pod_nonroot != Some(true) {
            let unset = names_where(&|c| sc(c).and_then(|s| s.run_as_non_root).is_none());
            if !unset.is_empty() {
                details.push(format!(
                    "pod or {} {} must set securityContext.runAsNonRoot=true",
                    plural(unset.len(), "container", "containers"),
                    quoted(&unset)
                ));
            }
        }
        if !details.is_empty() {
            failures.push(("runAsNonRoot != true".into(), details.join("; ")));
        }
        let mut details = Vec::new();
        if psc.and_then(|s| s.run_as_user) == Some(0) {
            details.push("pod must not set runAsUser=0".to_string());
        }
        let root = names_where(&|c| sc(c).and_then(|s| s.run_as_user) == Some(0));
        if !root.is_empty() {
            details.push(format!(
                "{} {} must not set runAsUser=0",
                plural(root.len(), "container", "containers"),
                quoted(&root)
            ));
        }
        if !details.is_empty() {
            failures.push(("runAsUser=0".into(), details.join("; ")));
        }
        let ok_type = |t: Option<&str>| matches!(t, Some("RuntimeDefault" | "Localhost"));
        let pod_type = psc
            .and_then(|s| s.seccomp_profile.as_ref())
            .map(|p| p.type_.as_str());
        let mut details = Vec::new();
        if pod_type.is_some() && !ok_type(pod_type) {
            details.push(format!(
                "pod must not set securityContext.seccompProfile.type to {:?}",
                pod_type.unwrap_or_default()
            ));
        }
        let container_type = |c: &Container| {
            sc(c)
                .and_then(|s| s.seccomp_profile.as_ref())
                .map(|p| p.type_.clone())
        };
        let wrong: Vec<String> =
            names_where(&|c| container_type(c).is_some_and(|t| !ok_type(Some(t.as_str()))));
        if !wrong.is_empty() {
            details.push(format!(
                "{} {} must not set securityContext.seccompProfile.type to {}",
                plural(wrong.len(), "container", "containers"),
                quoted(&wrong),
                quoted(
                    &cs.iter()
                        .filter_map(|c| container_type(c))
                        .filter(|t| !ok_type(Some(t.as_str())))
                        .collect::<Vec<_>>()
                )
            ));
        }
        if !ok_type(pod_type) {
            let unset = names_where(&|c| container_type(c).is_none());
            if !unset.is_empty() {
                details.push(format!(
                    "pod or {} {} must set securityContext.seccompProfile.type to \"RuntimeDefault\" or \"Localhost\"",
                    plural(unset.len(), "container", "containers"),
                    quoted(&unset)
                ));
            }
        }
        if !details.is_empty() {
            failures.push(("seccompProfile".into(), details.join("; ")));
        }
    }
    if failures.is_empty() {
        return Ok(());
    }
    let detail = failures
        .iter()
        .map(|(r, d)| format!("{r} ({d})"))
        .collect::<Vec<_>>()
        .join(", ");
    Err(ApiError::forbidden(
        "pods",
        name,
        &format!("violates PodSecurity \"{level}:{version}\": {detail}"),
    ))
}

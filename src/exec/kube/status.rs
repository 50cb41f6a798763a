//! Reading Kubernetes' answers: a pod's state while it starts, and the exec status channel
//! when a command ends. Pure functions, unit-tested on the shapes the API documents.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Status;

use crate::contract::{ErrorBody, ErrorCode};

/// Where a starting pod is.
#[derive(Debug, Clone, PartialEq)]
pub enum PodState {
    /// Not Running yet; the text says what it waits for (for the start-timeout message).
    Waiting(String),
    /// The runner container is running on `node`.
    Running { node: String },
    /// It will never run: the error to report.
    Failed(ErrorBody),
}

/// Waiting reasons of a container that mean the image cannot be had.
const IMAGE_REASONS: &[&str] = &[
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "ErrImageNeverPull",
    "RegistryUnavailable",
    "SignatureValidationFailed",
];

/// Waiting reasons that mean the container as configured cannot start.
const CONFIG_REASONS: &[&str] = &[
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
    "PreCreateHookError",
    "PreStartHookError",
    "PostStartHookError",
];

/// Assesses a pod for `container` from its status as the kubelet and scheduler write it.
pub fn assess(pod: &Pod, container: &str) -> PodState {
    let name = pod.metadata.name.as_deref().unwrap_or("?");
    if pod.metadata.deletion_timestamp.is_some() {
        return PodState::Failed(ErrorBody::new(
            ErrorCode::PodFailed,
            format!("runner pod {name} is being deleted"),
        ));
    }
    let Some(status) = &pod.status else {
        return PodState::Waiting("the pod has no status yet".into());
    };
    let phase = status.phase.as_deref().unwrap_or("Pending");
    if matches!(phase, "Failed" | "Succeeded") {
        let why = [status.reason.as_deref(), status.message.as_deref()]
            .into_iter()
            .flatten()
            .collect::<Vec<_>>()
            .join(": ");
        return PodState::Failed(ErrorBody::new(
            ErrorCode::PodFailed,
            format!(
                "runner pod {name} ended ({phase}{}{why}) before the command ran",
                if why.is_empty() { "" } else { ": " }
            ),
        ));
    }
    let cs = status
        .container_statuses
        .iter()
        .flatten()
        .find(|c| c.name == container);
    if let Some(state) = cs.and_then(|c| c.state.as_ref()) {
        if let Some(w) = &state.waiting {
            let reason = w.reason.as_deref().unwrap_or("");
            let message = w.message.as_deref().unwrap_or("");
            let code = if IMAGE_REASONS.contains(&reason) {
                Some(ErrorCode::ImagePullFailed)
            } else if CONFIG_REASONS.contains(&reason) {
                Some(ErrorCode::ContainerConfigError)
            } else {
                None
            };
            if let Some(code) = code {
                return PodState::Failed(ErrorBody::new(
                    code,
                    format!("runner pod {name}: {reason}: {message}"),
                ));
            }
        }
        if let Some(t) = &state.terminated {
            return PodState::Failed(ErrorBody::new(
                ErrorCode::ContainerConfigError,
                format!(
                    "runner pod {name}: the runner container exited ({}, exit code {}{}): its keep-alive command must keep running",
                    t.reason.as_deref().unwrap_or("Terminated"),
                    t.exit_code,
                    t.message
                        .as_deref()
                        .map(|m| format!(": {}", m.trim()))
                        .unwrap_or_default()
                ),
            ));
        }
        if state.running.is_some() && phase == "Running" {
            let node = pod
                .spec
                .as_ref()
                .and_then(|s| s.node_name.clone())
                .unwrap_or_default();
            return PodState::Running { node };
        }
    }
    for c in status.conditions.iter().flatten() {
        if c.type_ == "PodScheduled" && c.status == "False" {
            let reason = c.reason.as_deref().unwrap_or("");
            let message = c.message.as_deref().unwrap_or("");
            if reason == "Unschedulable" {
                return PodState::Failed(ErrorBody::new(
                    ErrorCode::Unschedulable,
                    format!("runner pod {name}: Unschedulable: {message}"),
                ));
            }
            return PodState::Waiting(format!("not scheduled: {reason} {message}"));
        }
    }
    let waiting = cs
        .and_then(|c| c.state.as_ref())
        .and_then(|s| s.waiting.as_ref())
        .map(|w| {
            format!(
                "container waiting: {} {}",
                w.reason.as_deref().unwrap_or(""),
                w.message.as_deref().unwrap_or("")
            )
        });
    let scheduled = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
    PodState::Waiting(match (waiting, scheduled) {
        (Some(w), _) => w.trim().to_string(),
        (None, Some(node)) => format!("scheduled on {node}, phase {phase}"),
        (None, None) => format!("not scheduled yet, phase {phase}"),
    })
}

/// How an exec ended, from its status channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecEnd {
    /// The command's exit code, or the signal that killed it.
    Exit {
        code: Option<i32>,
        signal: Option<i32>,
    },
    /// The program could not be started; reported the way the local backend reports it:
    /// this text on stderr and this exit code.
    NotStarted { stderr: String, code: i32 },
    /// Anything else: an `error` event.
    Error(String),
}

/// Maps the exec status (`None` when the stream ended without one) for `executable`.
///
/// A non-zero exit is `Failure` / `NonZeroExitCode` with an `ExitCode` cause. Container
/// runtimes report a process killed by signal N as exit code 128+N; it is mapped back to
/// the signal, as the local backend reports it (so a program that itself exits with 129-192
/// is reported as killed by a signal: documented in docs/kubernetes.md). A program that
/// cannot be started is an `InternalError` whose message comes from the OCI runtime.
pub fn exec_end(status: Option<&Status>, executable: &str) -> ExecEnd {
    let Some(s) = status else {
        return ExecEnd::Error("the exec stream ended without an exit status".into());
    };
    if s.status.as_deref() == Some("Success") {
        return ExecEnd::Exit {
            code: Some(0),
            signal: None,
        };
    }
    let message = s.message.clone().unwrap_or_default();
    if s.reason.as_deref() == Some("NonZeroExitCode") {
        let code = s
            .details
            .as_ref()
            .and_then(|d| d.causes.as_ref())
            .into_iter()
            .flatten()
            .find(|c| c.reason.as_deref() == Some("ExitCode"))
            .and_then(|c| c.message.as_deref())
            .and_then(|m| m.trim().parse::<i32>().ok());
        return match code {
            Some(c) if (129..=128 + 64).contains(&c) => ExecEnd::Exit {
                code: None,
                signal: Some(c - 128),
            },
            Some(c) => ExecEnd::Exit {
                code: Some(c),
                signal: None,
            },
            None => ExecEnd::Error(format!("exit status without an exit code: {message}")),
        };
    }
    let lower = message.to_ascii_lowercase();
    let not_started = |what: &str, code| ExecEnd::NotStarted {
        stderr: format!("mcp-run: {executable}: {what}\n"),
        code,
    };
    if lower.contains("executable file not found")
        || (lower.contains("exec:") && lower.contains("no such file or directory"))
    {
        return not_started("command not found", 127);
    }
    if lower.contains("exec:") && lower.contains("permission denied") {
        return not_started("permission denied", 126);
    }
    if lower.contains("exec format error") {
        return not_started("exec format error", 126);
    }
    if lower.contains("is a directory") {
        return not_started("is a directory", 126);
    }
    ExecEnd::Error(format!(
        "exec failed: {}{}",
        s.reason
            .as_deref()
            .map(|r| format!("{r}: "))
            .unwrap_or_default(),
        message
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(json: serde_json::Value) -> Pod {
        serde_json::from_value(json).unwrap()
    }

    fn status(json: serde_json::Value) -> Status {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn running_pod_reports_its_node() {
        let p = pod(serde_json::json!({
            "metadata": {"name": "p"},
            "spec": {"nodeName": "node-1", "containers": [{"name": "runner"}]},
            "status": {"phase": "Running", "containerStatuses": [{"name": "runner", "image": "i", "imageID": "", "ready": true, "restartCount": 0, "state": {"running": {"startedAt": "2026-11-23T10:00:00Z"}}}]}
        }));
        assert_eq!(
            assess(&p, "runner"),
            PodState::Running {
                node: "node-1".into()
            }
        );
    }

    #[test]
    fn waiting_reasons_map_to_error_codes() {
        for (reason, code) in [
            ("ErrImagePull", ErrorCode::ImagePullFailed),
            ("ImagePullBackOff", ErrorCode::ImagePullFailed),
            ("InvalidImageName", ErrorCode::ImagePullFailed),
            (
                "CreateContainerConfigError",
                ErrorCode::ContainerConfigError,
            ),
            ("RunContainerError", ErrorCode::ContainerConfigError),
        ] {
            let p = pod(serde_json::json!({
                "metadata": {"name": "p"},
                "spec": {"nodeName": "n", "containers": [{"name": "runner"}]},
                "status": {"phase": "Pending", "containerStatuses": [{"name": "runner", "image": "i", "imageID": "", "ready": false, "restartCount": 0, "state": {"waiting": {"reason": reason, "message": "Back-off pulling image \"nope:1\""}}}]}
            }));
            match assess(&p, "runner") {
                PodState::Failed(e) => {
                    assert_eq!(e.code, code, "{reason}");
                    assert!(
                        e.message.contains(reason) && e.message.contains("nope:1"),
                        "{}",
                        e.message
                    );
                }
                other => panic!("{reason}: {other:?}"),
            }
        }
        let creating = pod(serde_json::json!({
            "metadata": {"name": "p"},
            "spec": {"nodeName": "n", "containers": [{"name": "runner"}]},
            "status": {"phase": "Pending", "containerStatuses": [{"name": "runner", "image": "i", "imageID": "", "ready": false, "restartCount": 0, "state": {"waiting": {"reason": "ContainerCreating"}}}]}
        }));
        assert!(
            matches!(assess(&creating, "runner"), PodState::Waiting(w) if w.contains("ContainerCreating"))
        );
    }

    #[test]
    fn unschedulable_and_ended_pods_fail() {
        let p = pod(serde_json::json!({
            "metadata": {"name": "p"},
            "spec": {"containers": [{"name": "runner"}]},
            "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes are available: 3 Insufficient cpu."}]}
        }));
        match assess(&p, "runner") {
            PodState::Failed(e) => {
                assert_eq!(e.code, ErrorCode::Unschedulable);
                assert!(e.message.contains("Insufficient cpu"));
            }
            other => panic!("{other:?}"),
        }
        let p = pod(serde_json::json!({
            "metadata": {"name": "p"},
            "status": {"phase": "Failed", "reason": "DeadlineExceeded", "message": "Pod was active on the node longer than the specified deadline"}
        }));
        assert!(
            matches!(assess(&p, "runner"), PodState::Failed(e) if e.code == ErrorCode::PodFailed && e.message.contains("DeadlineExceeded"))
        );
        let p = pod(serde_json::json!({
            "metadata": {"name": "p"},
            "spec": {"nodeName": "n", "containers": [{"name": "runner"}]},
            "status": {"phase": "Running", "containerStatuses": [{"name": "runner", "image": "i", "imageID": "", "ready": false, "restartCount": 0, "state": {"terminated": {"exitCode": 127, "reason": "Error", "message": "sleep: not found"}}}]}
        }));
        assert!(
            matches!(assess(&p, "runner"), PodState::Failed(e) if e.code == ErrorCode::ContainerConfigError && e.message.contains("keep-alive"))
        );
        let p = pod(serde_json::json!({"metadata": {"name": "p"}, "status": {"phase": "Pending"}}));
        assert!(matches!(assess(&p, "runner"), PodState::Waiting(_)));
    }

    #[test]
    fn exec_status_maps_like_the_local_backend() {
        assert_eq!(
            exec_end(
                Some(&status(
                    serde_json::json!({"metadata": {}, "status": "Success"})
                )),
                "x"
            ),
            ExecEnd::Exit {
                code: Some(0),
                signal: None
            }
        );
        let nonzero = |code: &str| {
            status(serde_json::json!({
                "metadata": {}, "status": "Failure",
                "message": format!("command terminated with non-zero exit code: error executing command [sh -c exit {code}], message: ..."),
                "reason": "NonZeroExitCode",
                "details": {"causes": [{"reason": "ExitCode", "message": code}]}
            }))
        };
        assert_eq!(
            exec_end(Some(&nonzero("3")), "x"),
            ExecEnd::Exit {
                code: Some(3),
                signal: None
            }
        );
        assert_eq!(
            exec_end(Some(&nonzero("255")), "x"),
            ExecEnd::Exit {
                code: Some(255),
                signal: None
            }
        );
        assert_eq!(
            exec_end(Some(&nonzero("137")), "x"),
            ExecEnd::Exit {
                code: None,
                signal: Some(9)
            }
        );
        assert_eq!(
            exec_end(Some(&nonzero("143")), "x"),
            ExecEnd::Exit {
                code: None,
                signal: Some(15)
            }
        );
        let internal = |m: &str| {
            status(serde_json::json!({
                "metadata": {}, "status": "Failure", "reason": "InternalError", "code": 500,
                "message": format!("Internal error occurred: error executing command in container: failed to exec in container: failed to start exec \"abc\": OCI runtime exec failed: exec failed: unable to start container process: {m}: unknown"),
                "details": {"causes": [{"message": "..."}]}
            }))
        };
        assert_eq!(
            exec_end(
                Some(&internal(
                    "exec: \"nope\": executable file not found in $PATH"
                )),
                "nope"
            ),
            ExecEnd::NotStarted {
                stderr: "mcp-run: nope: command not found\n".into(),
                code: 127
            }
        );
        assert_eq!(
            exec_end(
                Some(&internal(
                    "exec: \"/x/y\": stat /x/y: no such file or directory"
                )),
                "/x/y"
            ),
            ExecEnd::NotStarted {
                stderr: "mcp-run: /x/y: command not found\n".into(),
                code: 127
            }
        );
        assert_eq!(
            exec_end(
                Some(&internal("exec: \"/etc/hostname\": permission denied")),
                "/etc/hostname"
            ),
            ExecEnd::NotStarted {
                stderr: "mcp-run: /etc/hostname: permission denied\n".into(),
                code: 126
            }
        );
        assert!(
            matches!(exec_end(Some(&internal("cgroup trouble")), "x"), ExecEnd::Error(m) if m.contains("cgroup trouble"))
        );
        assert!(matches!(exec_end(None, "x"), ExecEnd::Error(_)));
    }
}

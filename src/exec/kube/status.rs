//! Reading Kubernetes' answers: a pod's state while it starts, and the exec status channel
//! when a command ends. Pure functions, unit-tested on the shapes the API documents.
//!
//! Size: about 320 lines of code; the rest are table tests of every status and runtime
//! wording it translates.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Status;

use crate::contract::{ErrorBody, ErrorCode, Phase};

/// Why a starting pod will not run (or, as [`Waiting::problem`], may not).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum PodProblem {
    #[error("runner pod {0} is being deleted")]
    Deleting(String),
    /// The runner container stopped (`stopped`: its reason, exit code and message).
    #[error(
        "runner pod {name}: the runner container stopped: {stopped}; its keep-alive command must start and keep running"
    )]
    ContainerStopped { name: String, stopped: String },
    /// The pod's phase is final (`how`: the phase and its reason).
    #[error("runner pod {name} ended ({how}) before the command ran")]
    Ended { name: String, how: String },
    /// An image pull failed (`text`: the pod, the reason and the kubelet's message).
    #[error("{0}")]
    ImagePull(String),
    /// The container as configured cannot start (the same words).
    #[error("{0}")]
    Config(String),
    #[error("runner pod {name}: Unschedulable: {message}")]
    Unschedulable { name: String, message: String },
}

impl PodProblem {
    pub(crate) fn code(&self) -> ErrorCode {
        match self {
            PodProblem::Deleting(_) | PodProblem::Ended { .. } => ErrorCode::PodFailed,
            PodProblem::ContainerStopped { .. } | PodProblem::Config(_) => {
                ErrorCode::ContainerConfigError
            }
            PodProblem::ImagePull(_) => ErrorCode::ImagePullFailed,
            PodProblem::Unschedulable { .. } => ErrorCode::Unschedulable,
        }
    }
}

impl From<PodProblem> for ErrorBody {
    fn from(e: PodProblem) -> Self {
        ErrorBody::new(e.code(), e.to_string())
    }
}

/// Where a starting pod is.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum PodState {
    /// Not Running yet.
    Waiting(Waiting),
    /// The runner container is running on `node`.
    Running { node: String },
    /// It will never run: the error to report.
    Failed(PodProblem),
}

/// A pod on its way: what it waits for, and what would be reported if the start timeout
/// ended now.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Waiting {
    /// The phase to report to the caller.
    pub phase: Phase,
    /// What it waits for, in Kubernetes' words (for the phase and the timeout message).
    pub what: String,
    /// A condition that may still heal (Unschedulable while an autoscaler adds a node, an
    /// image pull failing transiently): the error if it has not healed by the timeout.
    pub problem: Option<PodProblem>,
}

impl Waiting {
    fn state(phase: Phase, what: impl Into<String>) -> PodState {
        PodState::Waiting(Waiting {
            phase,
            what: what.into(),
            problem: None,
        })
    }

    fn troubled(phase: Phase, what: impl Into<String>, problem: PodProblem) -> PodState {
        PodState::Waiting(Waiting {
            phase,
            what: what.into(),
            problem: Some(problem),
        })
    }
}

/// Waiting reasons of a container that mean the image cannot be had (yet).
const IMAGE_REASONS: &[&str] = &[
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "ErrImageNeverPull",
    "RegistryUnavailable",
    "SignatureValidationFailed",
];

/// Image reasons that cannot heal by waiting.
const IMAGE_FATAL_REASONS: &[&str] = &[
    "InvalidImageName",
    "ErrImageNeverPull",
    "SignatureValidationFailed",
];

/// Words of a pull error (containerd, CRI-O, registries) that mean retrying cannot help: the
/// image or manifest does not exist, or the credentials are refused. Anything else (rate
/// limits, timeouts, 5xx) is retried by the kubelet until the start timeout.
const IMAGE_FATAL_WORDS: &[&str] = &[
    "not found",
    "manifest unknown",
    "name unknown",
    "repository does not exist",
    "unauthorized",
    "authentication required",
    "access denied",
    "denied:",
    "forbidden",
    "invalid reference format",
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

/// Whether an image pull problem cannot heal by waiting.
pub(crate) fn image_error_is_fatal(reason: &str, message: &str) -> bool {
    let lower = message.to_ascii_lowercase();
    IMAGE_FATAL_REASONS.contains(&reason) || IMAGE_FATAL_WORDS.iter().any(|w| lower.contains(w))
}

/// Assesses a pod for `container` from its status as the kubelet and scheduler write it.
pub(crate) fn assess(pod: &Pod, container: &str) -> PodState {
    let name = pod.metadata.name.as_deref().unwrap_or("?");
    if pod.metadata.deletion_timestamp.is_some() {
        return PodState::Failed(PodProblem::Deleting(name.to_owned()));
    }
    let Some(status) = &pod.status else {
        return Waiting::state(Phase::Scheduling, "the pod has no status yet");
    };
    let phase = status.phase.as_deref().unwrap_or("Pending");
    let cs = status
        .container_statuses
        .iter()
        .flatten()
        .find(|c| c.name == container);
    let state = cs.and_then(|c| c.state.as_ref());
    // A container that ended says best why (StartError, ContainerCannotRun, a keep-alive
    // command missing from the image), even when the pod's phase already says Failed.
    if let Some(t) = state.and_then(|s| s.terminated.as_ref()) {
        return PodState::Failed(PodProblem::ContainerStopped {
            name: name.to_owned(),
            stopped: format!(
                "{} (exit code {}){}",
                t.reason.as_deref().unwrap_or("Terminated"),
                t.exit_code,
                t.message
                    .as_deref()
                    .map(|m| format!(": {}", m.trim()))
                    .unwrap_or_default()
            ),
        });
    }
    if matches!(phase, "Failed" | "Succeeded") {
        let why = [status.reason.as_deref(), status.message.as_deref()]
            .into_iter()
            .flatten()
            .collect::<Vec<_>>()
            .join(": ");
        return PodState::Failed(PodProblem::Ended {
            name: name.to_owned(),
            how: format!("{phase}{}{why}", if why.is_empty() { "" } else { ": " }),
        });
    }
    let node = pod.spec.as_ref().and_then(|s| s.node_name.clone());
    if let Some(w) = state.and_then(|s| s.waiting.as_ref()) {
        let reason = w.reason.as_deref().unwrap_or("");
        let message = w.message.as_deref().unwrap_or("");
        let text = format!("runner pod {name}: {reason}: {message}");
        if IMAGE_REASONS.contains(&reason) {
            let e = PodProblem::ImagePull(text);
            if image_error_is_fatal(reason, message) {
                return PodState::Failed(e);
            }
            return Waiting::troubled(Phase::PullingImage, format!("{reason}: {message}"), e);
        }
        if CONFIG_REASONS.contains(&reason) {
            return PodState::Failed(PodProblem::Config(text));
        }
        let image = cs.map(|c| c.image.as_str()).unwrap_or("");
        // The kubelet says ContainerCreating while it pulls the image and while it creates
        // the container; until the image is there (imageID), it is pulling.
        let pulled = cs.is_some_and(|c| !c.image_id.is_empty());
        return if reason == "ContainerCreating" && !pulled {
            Waiting::state(
                Phase::PullingImage,
                format!("container waiting: ContainerCreating (image {image})"),
            )
        } else {
            Waiting::state(
                Phase::Starting,
                format!("container waiting: {reason} {message}")
                    .trim()
                    .to_string(),
            )
        };
    }
    if state.is_some_and(|s| s.running.is_some()) {
        if phase == "Running" {
            return PodState::Running {
                node: node.unwrap_or_default(),
            };
        }
        return Waiting::state(Phase::Starting, format!("container running, phase {phase}"));
    }
    for c in status.conditions.iter().flatten() {
        if c.type_ == "PodScheduled" && c.status == "False" {
            let reason = c.reason.as_deref().unwrap_or("");
            let message = c.message.as_deref().unwrap_or("");
            let nominated = status
                .nominated_node_name
                .as_deref()
                .map(|n| format!(" (nominated node {n})"))
                .unwrap_or_default();
            let what = format!("not scheduled: {reason}: {message}{nominated}");
            if reason == "Unschedulable" {
                // Autoscalers, Karpenter and preemption schedule such pods later: an error
                // only if the start timeout ends first.
                return Waiting::troubled(
                    Phase::Scheduling,
                    what,
                    PodProblem::Unschedulable {
                        name: name.to_owned(),
                        message: message.to_owned(),
                    },
                );
            }
            return Waiting::state(Phase::Scheduling, what);
        }
    }
    match node {
        Some(node) => Waiting::state(
            Phase::Scheduled,
            format!("scheduled on {node}, phase {phase}"),
        ),
        None => Waiting::state(
            Phase::Scheduling,
            format!("not scheduled yet, phase {phase}"),
        ),
    }
}

/// Whether a runtime's start error says the executable does not exist, in the wordings of
/// runc (containerd, CRI-O), crun, gVisor's runsc and Kata's agent. Commands run through
/// the wrapper (with `cwd` or `env`) never get here: it finds a missing program itself; and
/// words not known here are not needed, the stream asks the pod (`exists_in_pod`).
fn is_not_found(lower: &str) -> bool {
    lower.contains("executable file not found")
        || (lower.contains("the file ") && lower.contains(" was not found"))
        || lower.contains("not found in $path")
        || lower.contains("executable not found")
        || lower.contains("could not find the executable")
        || lower.contains("cannot find executable")
        || (lower.contains("exec") && lower.contains("no such file or directory"))
}

/// How an exec ended, from its status channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ExecEnd {
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

/// The code of a `NonZeroExitCode` status: its `ExitCode` cause, as the API server words it.
pub(crate) fn nonzero_exit_code(s: &Status) -> Option<i32> {
    if s.reason.as_deref() != Some("NonZeroExitCode") {
        return None;
    }
    s.details
        .as_ref()
        .and_then(|d| d.causes.as_ref())
        .into_iter()
        .flatten()
        .find(|c| c.reason.as_deref() == Some("ExitCode"))
        .and_then(|c| c.message.as_deref())
        .and_then(|m| m.trim().parse().ok())
}

/// Maps the exec status (`None` when the stream ended without one) for `executable`.
///
/// A non-zero exit is `Failure` / `NonZeroExitCode` with an `ExitCode` cause. Container
/// runtimes report a process killed by signal N as exit code 128+N; it is mapped back to
/// the signal, as the local backend reports it (so a program that itself exits with 129-192
/// is reported as killed by a signal: documented in docs/kubernetes.md). A program that
/// cannot be started is an `InternalError` whose message comes from the OCI runtime.
pub(crate) fn exec_end(status: Option<&Status>, executable: &str) -> ExecEnd {
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
        return match nonzero_exit_code(s) {
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
    if is_not_found(&lower) {
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

    fn waiting_pod(reason: &str, message: &str) -> Pod {
        pod(serde_json::json!({
            "metadata": {"name": "p"},
            "spec": {"nodeName": "n", "containers": [{"name": "runner"}]},
            "status": {"phase": "Pending", "containerStatuses": [{"name": "runner", "image": "i", "imageID": "", "ready": false, "restartCount": 0, "state": {"waiting": {"reason": reason, "message": message}}}]}
        }))
    }

    #[test]
    fn waiting_reasons_map_to_error_codes() {
        let missing = "rpc error: code = NotFound desc = failed to pull and unpack image \"nope:1\": failed to resolve reference \"nope:1\": nope:1: not found";
        for (reason, message, code) in [
            ("ErrImagePull", missing, ErrorCode::ImagePullFailed),
            (
                "ImagePullBackOff",
                "Back-off pulling image \"nope:1\": unauthorized: authentication required",
                ErrorCode::ImagePullFailed,
            ),
            ("InvalidImageName", "nope:1", ErrorCode::ImagePullFailed),
            (
                "CreateContainerConfigError",
                "secret \"nope:1\" not found",
                ErrorCode::ContainerConfigError,
            ),
            (
                "RunContainerError",
                "nope:1",
                ErrorCode::ContainerConfigError,
            ),
        ] {
            match assess(&waiting_pod(reason, message), "runner") {
                PodState::Failed(e) => {
                    let e = ErrorBody::from(e);
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
        // A registry's rate limit or a timeout may heal: the kubelet retries, so do we.
        for (reason, message) in [
            (
                "ErrImagePull",
                "failed to pull image \"busybox:1.36\": 429 Too Many Requests - toomanyrequests: You have reached your pull rate limit",
            ),
            (
                "ImagePullBackOff",
                "Back-off pulling image \"busybox:1.36\": dial tcp: i/o timeout",
            ),
        ] {
            match assess(&waiting_pod(reason, message), "runner") {
                PodState::Waiting(w) => {
                    assert_eq!(w.phase, Phase::PullingImage);
                    let p = ErrorBody::from(w.problem.expect("reported if it does not heal"));
                    assert_eq!(p.code, ErrorCode::ImagePullFailed);
                    assert!(p.message.contains(reason), "{}", p.message);
                }
                other => panic!("{reason}: {other:?}"),
            }
        }
        match assess(&waiting_pod("ContainerCreating", ""), "runner") {
            PodState::Waiting(w) => {
                assert!(w.what.contains("ContainerCreating"), "{}", w.what);
                assert_eq!(w.phase, Phase::PullingImage);
                assert!(w.problem.is_none());
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn unschedulable_waits_and_ended_pods_fail() {
        let p = pod(serde_json::json!({
            "metadata": {"name": "p"},
            "spec": {"containers": [{"name": "runner"}]},
            "status": {"phase": "Pending", "nominatedNodeName": "big-1", "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes are available: 3 Insufficient cpu."}]}
        }));
        match assess(&p, "runner") {
            PodState::Waiting(w) => {
                assert_eq!(w.phase, Phase::Scheduling);
                assert!(w.what.contains("big-1"), "{}", w.what);
                let e = ErrorBody::from(w.problem.unwrap());
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
            matches!(assess(&p, "runner"), PodState::Failed(e) if e.code() == ErrorCode::PodFailed && e.to_string().contains("DeadlineExceeded"))
        );
        let p = pod(serde_json::json!({
            "metadata": {"name": "p"},
            "spec": {"nodeName": "n", "containers": [{"name": "runner"}]},
            "status": {"phase": "Running", "containerStatuses": [{"name": "runner", "image": "i", "imageID": "", "ready": false, "restartCount": 0, "state": {"terminated": {"exitCode": 127, "reason": "Error", "message": "sleep: not found"}}}]}
        }));
        assert!(
            matches!(assess(&p, "runner"), PodState::Failed(e) if e.code() == ErrorCode::ContainerConfigError && e.to_string().contains("keep-alive"))
        );
        // A container that never started: the runtime's reason and message, even once the
        // pod's phase is Failed.
        let p = pod(serde_json::json!({
            "metadata": {"name": "p"},
            "spec": {"nodeName": "n", "containers": [{"name": "runner"}]},
            "status": {"phase": "Failed", "containerStatuses": [{"name": "runner", "image": "i", "imageID": "", "ready": false, "restartCount": 0, "state": {"terminated": {"exitCode": 128, "reason": "StartError", "message": "failed to create containerd task: exec: \"sleep\": executable file not found in $PATH"}}}]}
        }));
        match assess(&p, "runner") {
            PodState::Failed(e) => {
                let e = ErrorBody::from(e);
                assert_eq!(e.code, ErrorCode::ContainerConfigError);
                assert!(
                    e.message.contains("StartError")
                        && e.message.contains("executable file not found"),
                    "{}",
                    e.message
                );
            }
            other => panic!("{other:?}"),
        }
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
        // Other runtimes' wordings of "no such program".
        for m in [
            "crun: executable file `nope` not found in $PATH: No such file or directory",
            "OCI runtime exec failed: exec failed: executable not found: \"nope\"",
            "rpc error: code = Internal desc = Could not find the executable nope",
            "failed to start exec \"e9a1\": Others(\"failed to handler message handler request\\n\\nCaused by:\\n    0: start process\\n    4: rpc status: code: INTERNAL message: \\\"the file nope was not found\\\"\"): unknown",
            "runsc: cannot find executable \"nope\" in PATH",
        ] {
            assert_eq!(
                exec_end(Some(&internal(m)), "nope"),
                ExecEnd::NotStarted {
                    stderr: "mcp-run: nope: command not found\n".into(),
                    code: 127
                },
                "{m}"
            );
        }
        assert!(
            matches!(exec_end(Some(&internal("cgroup trouble")), "x"), ExecEnd::Error(m) if m.contains("cgroup trouble"))
        );
        assert!(matches!(exec_end(None, "x"), ExecEnd::Error(_)));
    }
}

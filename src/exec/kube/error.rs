//! Why the Kubernetes backend did not start a command or is not ready: each variant says its wire code once
//! ([`KubeError::code`]); the backend's `Executor` and `KeptRunner` methods turn it into the
//! wire error with `?`.

use super::backoff::{self, Failure};
use super::status::PodProblem;
use crate::contract::{ErrorBody, ErrorCode};

#[derive(Debug, thiserror::Error)]
pub(crate) enum KubeError {
    #[error("the gateway is shutting down")]
    ShuttingDown,
    #[error(
        "{max} runner pods are running (kubernetes.max_concurrent_pods) and {ahead} runs wait for one (kubernetes.max_queued_runs); retry later"
    )]
    QueueFull { max: usize, ahead: usize },
    #[error(
        "no pod slot became free within kubernetes.pod_start_timeout_secs ({queued_secs}s queued; {max} runner pods at once, kubernetes.max_concurrent_pods); retry later"
    )]
    NoSlot { queued_secs: u64, max: usize },
    /// `profiles`: the configured names, joined.
    #[error("unknown profile {name:?}; configured profiles: {profiles}")]
    UnknownProfile { name: String, profiles: String },
    /// The pod will never run.
    #[error(transparent)]
    Pod(#[from] PodProblem),
    /// A problem that might have healed had not by the end of the start budget.
    #[error("{problem} (still so after {secs}s, kubernetes.pod_start_timeout_secs)")]
    StillSo { problem: PodProblem, secs: u64 },
    #[error(
        "runner pod {pod} was not running after {secs}s (kubernetes.pod_start_timeout_secs); last state: {last}"
    )]
    NotRunning {
        pod: String,
        secs: u64,
        last: String,
    },
    #[error("runner pod {0} was deleted while it started")]
    DeletedWhileStarting(String),
    /// The API server answered with a failure (`status`: its HTTP status code).
    #[error("{what}: {message} ({reason}, HTTP {status})")]
    Api {
        what: String,
        message: String,
        reason: String,
        status: u16,
    },
    /// Any other failure of a call (`why`: the error chain, described).
    #[error("{what}: {why}")]
    Call { what: String, why: String },
    #[error("{what} within kubernetes.pod_start_timeout_secs ({attempts} attempts): {last}")]
    OutOfTime {
        what: String,
        attempts: u32,
        last: String,
    },
    #[error("{what}: the Kubernetes API server at {server} is not reachable: {why}")]
    Unreachable {
        what: String,
        server: String,
        why: String,
    },
    #[error("cannot build the exec request: {0}")]
    ExecRequest(String),
    /// A session pod's API call failed (`what`: which, `why`: the error, described).
    #[error("{what}: {why}")]
    SessionPod { what: String, why: String },
    #[error("its pod {0} was deleted")]
    SessionPodDeleted(String),
    /// The session's pod was lost (the reason, as its fate watch recorded it).
    #[error("{0}")]
    SessionLost(String),
    /// Another replica's call holds the session pod (its holder).
    #[error(
        "another call of the session is running (through another gateway replica, {0}); the request asked not to wait: session_busy is fail"
    )]
    SessionBusyFail(String),
    #[error(
        "another call of the session was still running (through another gateway replica) when this call's timeout ran out"
    )]
    SessionBusyTimeout,
    /// Bringing a session pod's tree to the workspace failed (`why`: the step and its cause).
    #[error("cannot bring the tree in session pod {pod} at {root} to the workspace: {why}")]
    SyncKeptTree {
        pod: String,
        root: String,
        why: String,
    },
    /// A cache's claim changed under every attempt to take it.
    #[error(
        "cache {cache}: its claim {claim} changed under every attempt to take it ({times} times); retry later"
    )]
    ClaimConflicts {
        cache: String,
        claim: String,
        times: u32,
    },
    /// The profile (named) has no `workspace_path`.
    #[error(
        "profile {0:?} takes no workspace: set profiles.{0}.workspace_path (docs/workspaces.md)"
    )]
    NoWorkspacePath(String),
    /// Writing a workspace into a runner pod failed (`why`: the step and its cause).
    #[error("cannot write the workspace into runner pod {pod} at {path}: {why}")]
    PlaceWorkspace {
        pod: String,
        path: String,
        why: String,
    },
    /// Readiness: the API server cannot be reached.
    #[error("the Kubernetes API server at {server} is not reachable: {why}")]
    ApiServerUnreachable { server: String, why: String },
    #[error("the Kubernetes API server did not answer within 3s")]
    ApiServerSilent,
    /// Readiness: a permission check kept failing in ways that may heal.
    #[error("no answer in {attempts} attempts: {last}")]
    NoAnswer { attempts: u32, last: String },
    /// Readiness: a permission check failed for good (the error, described).
    #[error("{0}")]
    Refused(String),
    /// Readiness: what the gateway may not do (joined).
    #[error("the gateway may not {missing} in namespace {namespace}")]
    MissingPermissions { missing: String, namespace: String },
}

impl KubeError {
    pub(crate) fn code(&self) -> ErrorCode {
        match self {
            KubeError::ShuttingDown => ErrorCode::ShuttingDown,
            KubeError::SessionPod { .. } => ErrorCode::BackendError,
            KubeError::SessionPodDeleted(_) | KubeError::SessionLost(_) => ErrorCode::SessionLost,
            KubeError::SessionBusyFail(_) | KubeError::SessionBusyTimeout => ErrorCode::SessionBusy,
            KubeError::QueueFull { .. } | KubeError::NoSlot { .. } => ErrorCode::TooManyRequests,
            KubeError::UnknownProfile { .. } => ErrorCode::UnknownProfile,
            KubeError::Pod(p) | KubeError::StillSo { problem: p, .. } => p.code(),
            KubeError::NotRunning { .. } => ErrorCode::PodStartTimeout,
            KubeError::DeletedWhileStarting(_) => ErrorCode::PodFailed,
            KubeError::Api { status, .. } => match status {
                400 | 422 => ErrorCode::ContainerConfigError,
                401 | 403 | 404 | 409 => ErrorCode::StartFailed,
                _ => ErrorCode::BackendUnavailable,
            },
            KubeError::Call { .. }
            | KubeError::OutOfTime { .. }
            | KubeError::Unreachable { .. }
            | KubeError::ApiServerUnreachable { .. }
            | KubeError::ApiServerSilent
            | KubeError::NoAnswer { .. }
            | KubeError::Refused(_)
            | KubeError::MissingPermissions { .. }
            | KubeError::ClaimConflicts { .. } => ErrorCode::BackendUnavailable,
            KubeError::ExecRequest(_)
            | KubeError::PlaceWorkspace { .. }
            | KubeError::SyncKeptTree { .. } => ErrorCode::StartFailed,
            KubeError::NoWorkspacePath(_) => ErrorCode::InvalidRequest,
        }
    }
}

impl From<KubeError> for ErrorBody {
    fn from(e: KubeError) -> Self {
        ErrorBody::new(e.code(), e.to_string())
    }
}

/// A Kubernetes API failure before the stream started.
pub(super) fn api_error(what: &str, e: &kube::Error) -> KubeError {
    match e {
        kube::Error::Api(s) => KubeError::Api {
            what: what.to_owned(),
            message: s.message.clone(),
            reason: s.reason.clone(),
            status: s.code,
        },
        other => KubeError::Call {
            what: what.to_owned(),
            why: backoff::describe(other),
        },
    }
}

impl super::Shared {
    /// The error of a call of the start path that failed for good.
    pub(super) fn start_error(&self, what: &str, f: Failure) -> KubeError {
        match f {
            Failure::Api(e) => api_error(what, &e),
            Failure::OutOfTime { attempts, last } => KubeError::OutOfTime {
                what: what.to_owned(),
                attempts,
                last,
            },
            Failure::Unreachable(why) => self.unreachable(what, &why),
        }
    }

    pub(super) fn unreachable(&self, what: &str, why: &str) -> KubeError {
        KubeError::Unreachable {
            what: what.to_owned(),
            server: self.server.clone(),
            why: why.to_owned(),
        }
    }
}

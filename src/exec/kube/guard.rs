//! Cleanup by construction: the [`PodGuard`] deletes its pod when dropped, on every path, and
//! holds the concurrency permit until the pod is gone; [`Timings`] records the request's
//! phases for the debug log.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::api::DeleteParams;
use tokio::sync::OwnedSemaphorePermit;

use super::backoff::{self, Budget, Failure, WatchEnd};
use super::{DELETE_BUDGET, Shared};

/// How long a released slot waits for its pod to be gone.
const GONE_WAIT: Duration = Duration::from_secs(30);

/// How long killing a call in a kept runner's pod may take.
const KILL_WAIT: Duration = Duration::from_secs(10);

/// The grace period of a runner pod's deletion: the shortest graceful one, as `kubectl delete
/// --now`. Grace 0 would be a force deletion: the API server removes the object at once and
/// the kubelet kills the containers later, so the object's disappearance would say nothing
/// about them. With a grace period the object stays, terminating, until the kubelet has
/// stopped the containers and deletes it itself. The keep-alive ignores SIGTERM (it is the
/// container's init), so the kubelet kills it at the end of the grace period either way.
const DELETE_GRACE_SECS: u32 = 1;

impl Shared {
    /// Marks a pod as used by this gateway (the reaper leaves it alone).
    pub(super) fn track(&self, name: &str) {
        if let Ok(mut live) = self.live.lock() {
            live.insert(name.to_string());
        }
    }

    pub(super) fn untrack(&self, name: &str) {
        if let Ok(mut live) = self.live.lock() {
            live.remove(name);
        }
    }

    /// Deletes a pod (grace 1 s, see [`DELETE_GRACE_SECS`]), retrying what may heal within
    /// [`DELETE_BUDGET`] (the shared backoff: Retry-After honoured); a pod already gone is
    /// fine.
    pub(super) async fn delete(&self, name: &str) -> bool {
        let params = DeleteParams {
            grace_period_seconds: Some(DELETE_GRACE_SECS),
            ..DeleteParams::background()
        };
        let budget = Budget {
            end: tokio::time::Instant::now() + DELETE_BUDGET,
            attempt: Duration::from_secs(10),
            retry_internal: true,
        };
        let deleted = backoff::call("deleting the runner pod", budget, || async {
            self.throttle.acquire().await;
            match self.pods.delete(name, &params).await {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
                Err(e) => Err(e),
            }
        })
        .await;
        match deleted {
            Ok(()) => true,
            Err(e) => {
                let why = match e {
                    Failure::Api(e) => backoff::describe(&e),
                    Failure::OutOfTime { attempts, last } => format!("{attempts} attempts: {last}"),
                    Failure::Unreachable(why) => why,
                };
                tracing::error!(
                    pod = name,
                    "runner pod not deleted ({why}); the reaper will retry"
                );
                false
            }
        }
    }

    /// Kills one call in a kept runner's pod and everything it started (an exec of
    /// [`super::pod::argv::KILL_CALL`]); the pod stays. Bounded: a pod that does not answer
    /// leaves the call to the pod's deadline, the session's end or its loss.
    pub(super) async fn kill_call(&self, pod: &str, id: &str, shell: &str) {
        let params = kube::api::AttachParams::default()
            .container(super::pod::CONTAINER)
            .stderr(false);
        let argv = [shell, "-c", super::pod::argv::KILL_CALL, "mcp-run-kill", id];
        let killed = async {
            self.throttle.acquire().await;
            let mut attached = self.pods.exec(pod, argv, &params).await.ok()?;
            attached.take_status()?.await
        };
        match tokio::time::timeout(KILL_WAIT, killed).await {
            Ok(Some(s)) if s.status.as_deref() == Some("Success") => {}
            other => tracing::warn!(
                pod,
                call = id,
                "killing a session call's processes failed: {other:?}"
            ),
        }
    }

    /// Waits until a deleted pod is gone: the kubelet removes the object once it has stopped
    /// the containers. Bounded, so that a lost node does not hold a slot (or the shutdown)
    /// forever; a watch that fails (429, a cut connection) is resumed, not taken for the
    /// pod's disappearance.
    pub(super) async fn await_gone(&self, name: &str) {
        let end = tokio::time::Instant::now() + GONE_WAIT;
        let gone = backoff::watch_pod(&self.pods, name, end, |p| p.is_none().then_some(())).await;
        match gone {
            Ok(()) => {}
            Err(WatchEnd::Deadline) => tracing::warn!(
                pod = name,
                "runner pod still present {}s after its deletion; slot released",
                GONE_WAIT.as_secs()
            ),
            Err(e) => tracing::warn!(
                pod = name,
                "cannot watch the deleted runner pod ({e:?}); slot released"
            ),
        }
    }
}

/// Deletes its pod when dropped, on every path, and releases the concurrency permit once
/// the pod is gone.
pub(super) struct PodGuard {
    pub(super) shared: Arc<Shared>,
    pub(super) name: String,
    permit: Option<OwnedSemaphorePermit>,
    pub(super) timings: Option<Timings>,
    /// Deleted already (when killed): the drop only releases.
    deleted: bool,
    /// A call in a kept runner's pod (its id): killing it kills the call's processes, not
    /// the pod, and the drop leaves the pod (its runner deletes it).
    call: Option<(String, String)>,
}

impl PodGuard {
    /// Kills the command: deletes the pod, or in a kept runner's pod only the call's
    /// processes.
    pub(super) async fn delete_now(&mut self) {
        match &self.call {
            Some((id, shell)) => self.shared.kill_call(&self.name, id, shell).await,
            None => self.deleted = self.shared.delete(&self.name).await,
        }
    }

    /// Hands the pod over to a kept runner (which deletes it when it closes): the drop no
    /// longer deletes it; the slot goes along.
    pub(super) fn into_kept(mut self) -> Option<OwnedSemaphorePermit> {
        self.call = Some((String::new(), String::new()));
        self.permit.take()
    }

    /// The guard of one call in a kept runner's pod: it neither holds a slot (the runner
    /// does) nor deletes the pod.
    pub(super) fn call(shared: Arc<Shared>, name: String, id: String, shell: String) -> Self {
        Self {
            shared,
            name,
            permit: None,
            timings: None,
            deleted: true,
            call: Some((id, shell)),
        }
    }

    pub(super) fn arm(shared: Arc<Shared>, name: String, permit: OwnedSemaphorePermit) -> Self {
        shared.track(&name);
        Self {
            shared,
            name,
            permit: Some(permit),
            timings: None,
            deleted: false,
            call: None,
        }
    }
}

impl Drop for PodGuard {
    fn drop(&mut self) {
        if self.call.is_some() {
            if let Some(t) = &self.timings {
                tracing::debug!(pod = self.name, phases = %t, "session call phases");
            }
            return;
        }
        let shared = self.shared.clone();
        let name = std::mem::take(&mut self.name);
        let permit = self.permit.take();
        let timings = self.timings.take();
        let already = self.deleted;
        let cleanup = async move {
            if already || shared.delete(&name).await {
                shared.untrack(&name);
                // The slot is free once the pod (and so its containers) is gone, not when the
                // delete call returns: `max_concurrent_pods` bounds real containers.
                shared.await_gone(&name).await;
            }
            if let Some(mut t) = timings {
                t.mark("deleted");
                tracing::debug!(pod = name, phases = %t, "runner pod phases");
            }
            drop(permit);
        };
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                // The tracker may be closed at shutdown; spawning on it still tracks.
                self.shared.deletions.spawn_on(cleanup, &handle);
            }
            Err(_) => tracing::error!(pod = self.name, "no runtime to delete the runner pod"),
        }
    }
}

/// Per-phase timings of one request, logged at debug level when its pod is deleted.
pub(super) struct Timings {
    start: Instant,
    marks: Vec<(&'static str, Duration)>,
}

impl Timings {
    pub(super) fn new() -> Self {
        Self {
            start: Instant::now(),
            marks: Vec::with_capacity(8),
        }
    }

    pub(super) fn mark(&mut self, phase: &'static str) {
        self.marks.push((phase, self.start.elapsed()));
    }

    pub(super) fn since_start(&self) -> Duration {
        self.start.elapsed()
    }
}

impl std::fmt::Display for Timings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, (phase, at)) in self.marks.iter().enumerate() {
            if i > 0 {
                f.write_str(" → ")?;
            }
            write!(f, "{phase} {}ms", at.as_millis())?;
        }
        Ok(())
    }
}

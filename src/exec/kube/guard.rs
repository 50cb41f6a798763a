//! Cleanup by construction: the [`PodGuard`] deletes its pod when dropped, on every path, and
//! holds the concurrency permit until the pod is gone; [`Timings`] records the request's
//! phases for the debug log.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::api::DeleteParams;
use tokio::sync::OwnedSemaphorePermit;

use super::{DELETE_ATTEMPTS, Shared};

/// How long a released slot waits for its pod to be gone.
const GONE_WAIT: Duration = Duration::from_secs(30);

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

    /// Deletes a pod (grace 1 s, see [`DELETE_GRACE_SECS`]), retrying transient failures; a
    /// pod already gone is fine.
    pub(super) async fn delete(&self, name: &str) -> bool {
        let params = DeleteParams {
            grace_period_seconds: Some(DELETE_GRACE_SECS),
            ..DeleteParams::background()
        };
        let mut wait = Duration::from_millis(100);
        for attempt in 1..=DELETE_ATTEMPTS {
            match self.pods.delete(name, &params).await {
                Ok(_) => return true,
                Err(kube::Error::Api(s)) if s.code == 404 => return true,
                Err(e) => {
                    tracing::warn!(pod = name, attempt, "cannot delete runner pod: {e}");
                    tokio::time::sleep(wait).await;
                    wait *= 2;
                }
            }
        }
        tracing::error!(pod = name, "runner pod not deleted; the reaper will retry");
        false
    }

    /// Waits until a deleted pod is gone: the kubelet removes the object once it has stopped
    /// the containers. Bounded, so that a lost node does not hold a slot (or the shutdown)
    /// forever.
    pub(super) async fn await_gone(&self, name: &str) {
        let gone = kube::runtime::wait::await_condition(
            self.pods.clone(),
            name,
            |p: Option<&k8s_openapi::api::core::v1::Pod>| p.is_none(),
        );
        if tokio::time::timeout(GONE_WAIT, gone).await.is_err() {
            tracing::warn!(
                pod = name,
                "runner pod still present {}s after its deletion; slot released",
                GONE_WAIT.as_secs()
            );
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
}

impl PodGuard {
    pub(super) async fn delete_now(&mut self) {
        self.deleted = self.shared.delete(&self.name).await;
    }

    pub(super) fn arm(shared: Arc<Shared>, name: String, permit: OwnedSemaphorePermit) -> Self {
        shared.track(&name);
        Self {
            shared,
            name,
            permit: Some(permit),
            timings: None,
            deleted: false,
        }
    }
}

impl Drop for PodGuard {
    fn drop(&mut self) {
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

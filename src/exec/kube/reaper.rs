//! The reaper: deletes runner pods that nobody will delete otherwise (a gateway that crashed,
//! a deletion that failed), by label and age, and never a pod it does not own.
//!
//! Ownership is the label selector: `app.kubernetes.io/managed-by=mcp-run`,
//! `app.kubernetes.io/component=runner` and `mcp-run.dev/instance=<this installation>`.
//! Within it:
//! - pods of this gateway (`mcp-run.dev/gateway=<its pod name or host>`) that it is not
//!   running are leftovers: all of them at start-up, the untracked ones later;
//! - pods of other replicas of the same installation may be in use, so they are deleted
//!   only once they cannot be: past their `mcp-run.dev/expires-at` (their
//!   `activeDeadlineSeconds` has passed) or finished (Succeeded/Failed), and at least
//!   `reaper_min_age_secs` old.

use std::collections::HashSet;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt as _;
use kube::api::{Api, DeleteParams, ListParams};

use super::kept::session_alive;
use super::pod::{ANNOTATION_EXPIRES, Identity, LABEL_GATEWAY, LABEL_STATE, label_value};

pub(super) struct Reaper {
    pub pods: Api<Pod>,
    pub identity: Identity,
    pub min_age: Duration,
    /// The pods of this gateway's replicas (`server.peer_service`), when known.
    pub replicas: Option<tokio::sync::watch::Receiver<Vec<String>>>,
}

impl Reaper {
    /// At start-up nothing runs yet: every pod of this gateway is a leftover, except the
    /// pods of live sessions. Sessions' pods are judged by their annotations whoever made
    /// them: those whose session is over go now, not at the first sweep (the replicas that
    /// served them may all be gone: a scale to zero, an outage, a rolling update of one).
    pub(super) async fn startup(&self) -> Result<usize, kube::Error> {
        let pods = self
            .pods
            .list(&ListParams::default().labels(&self.identity.instance_selector()))
            .await?;
        let mut n = 0;
        let now = Timestamp::now();
        for p in pods.items {
            let mine = p.labels().get(LABEL_GATEWAY) == Some(&self.identity.gateway);
            let leftover = match session_alive(&p, now) {
                // A live session's pod outlives the gateway that made it: any replica (this
                // one after its restart too) serves it.
                Some(alive) => !alive,
                None => mine,
            };
            if leftover && p.metadata.deletion_timestamp.is_none() && self.delete(&p).await {
                n += 1;
            }
        }
        Ok(n)
    }

    /// One periodic pass; `is_live` says whether this gateway is using a pod.
    pub(super) async fn sweep(
        &self,
        is_live: &(dyn Fn(&str) -> bool + Send + Sync),
    ) -> Result<usize, kube::Error> {
        let pods = self
            .pods
            .list(&ListParams::default().labels(&self.identity.instance_selector()))
            .await?;
        let now = Timestamp::now();
        let listed = self.listed();
        let mut n = 0;
        for p in pods.items {
            if is_leftover(
                &p,
                &self.identity,
                now,
                self.min_age,
                is_live,
                listed.as_ref(),
            ) && self.delete(&p).await
            {
                n += 1;
            }
        }
        Ok(n)
    }

    /// The replicas' gateway labels, once the EndpointSlices list this gateway itself (so
    /// the list is current, not an empty first answer or a watch without permission).
    fn listed(&self) -> Option<HashSet<String>> {
        let replicas = self.replicas.as_ref()?.borrow().clone();
        let listed: HashSet<String> = replicas.iter().map(|r| label_value(r)).collect();
        listed.contains(&self.identity.gateway).then_some(listed)
    }

    async fn delete(&self, p: &Pod) -> bool {
        let name = p.name_any();
        // Preconditioned on the uid and the resourceVersion judged: a pod recreated under the
        // same name, claimed from a warm pool or taken by a session's call meanwhile is not
        // ours to judge (409: the next pass looks again).
        let mut params = DeleteParams::background().grace_period(0);
        if let Some(uid) = p.uid() {
            params = params.preconditions(kube::api::Preconditions {
                uid: Some(uid),
                resource_version: p.resource_version(),
            });
        }
        match self.pods.delete(&name, &params).await {
            Ok(_) => {
                tracing::info!(pod = name, "reaper deleted runner pod");
                true
            }
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => false,
            Err(e) => {
                tracing::warn!(pod = name, "reaper cannot delete runner pod: {e}");
                false
            }
        }
    }
}

/// Whether a pod listed under this installation's selector is a leftover to delete.
/// `listed`: the gateway labels of the replicas the EndpointSlices list now, when known.
pub(super) fn is_leftover(
    p: &Pod,
    me: &Identity,
    now: Timestamp,
    min_age: Duration,
    is_live: &(dyn Fn(&str) -> bool + Send + Sync),
    listed: Option<&HashSet<String>>,
) -> bool {
    if p.metadata.deletion_timestamp.is_some() {
        return false;
    }
    let name = p.name_any();
    let labels = p.labels();
    if labels.get(LABEL_GATEWAY) == Some(&me.gateway) && is_live(&name) {
        return false;
    }
    // A session's pod: whoever made it, it goes once its session is over.
    if let Some(alive) = session_alive(p, now) {
        return !alive;
    }
    let expired = p
        .annotations()
        .get(ANNOTATION_EXPIRES)
        .and_then(|t| t.parse::<Timestamp>().ok())
        .is_some_and(|t| t <= now);
    if labels.get(LABEL_GATEWAY) == Some(&me.gateway) {
        // Our idle warm pool pods wait for requests: only their deadline ends them.
        let idle = labels.get(LABEL_STATE).is_some_and(|s| s == "idle");
        return if idle { expired } else { !is_live(&name) };
    }
    let age = p
        .creation_timestamp()
        .and_then(|t| now.duration_since(t.0).try_into().ok())
        .unwrap_or(Duration::ZERO);
    if age < min_age {
        return false;
    }
    // Made by a replica the EndpointSlices no longer list: its pod is gone (deleted, not
    // restarting), so nothing of it will delete this pod (a run whose deletion it had not
    // sent when it was killed, its idle warm pods). A replica that is starting is listed
    // long before `min_age`.
    if let (Some(listed), Some(gateway)) = (listed, labels.get(LABEL_GATEWAY))
        && !listed.contains(gateway)
    {
        return true;
    }
    let finished = p
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .is_some_and(|ph| ph == "Succeeded" || ph == "Failed");
    expired || finished
}

#[cfg(test)]
mod tests {
    use super::*;

    fn me() -> Identity {
        Identity {
            instance: "prod".into(),
            gateway: "gw-a".into(),
            owner: None,
        }
    }

    fn pod(gateway: &str, created: &str, expires: &str, phase: &str) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": format!("p-{gateway}-{phase}"),
                "creationTimestamp": created,
                "labels": {"mcp-run.dev/gateway": gateway},
                "annotations": {"mcp-run.dev/expires-at": expires}
            },
            "status": {"phase": phase}
        }))
        .unwrap()
    }

    /// A session pod lives while its annotations say so, whoever made it: not ended, within
    /// its lifetime, and held or used within its idle TTL; other pods are not judged so.
    #[test]
    fn session_pods_live_by_their_annotations() {
        let now: Timestamp = "2026-11-23T12:00:00Z".parse().unwrap();
        let session = |extra: serde_json::Value| -> Pod {
            let mut a = serde_json::json!({
                "mcp-run.dev/session-name": "build",
                "mcp-run.dev/expires-at": "2026-11-23T20:00:00Z",
                "mcp-run.dev/idle-ttl-secs": "900",
                "mcp-run.dev/last-used": "2026-11-23T11:50:00Z",
            });
            for (k, v) in extra.as_object().unwrap() {
                a[k] = v.clone();
            }
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "s", "creationTimestamp": "2026-11-23T10:00:00Z",
                             "labels": {"mcp-run.dev/gateway": "gw-b"}, "annotations": a}
            }))
            .unwrap()
        };
        let none_live = |_: &str| false;
        let min = Duration::from_secs(300);
        assert_eq!(
            session_alive(&session(serde_json::json!({})), now),
            Some(true)
        );
        let idle = session(serde_json::json!({"mcp-run.dev/last-used": "2026-11-23T11:40:00Z"}));
        assert_eq!(session_alive(&idle, now), Some(false));
        assert!(is_leftover(&idle, &me(), now, min, &none_live, None));
        let held = session(serde_json::json!({
            "mcp-run.dev/last-used": "2026-11-23T11:00:00Z",
            "mcp-run.dev/busy-until": "2026-11-23T12:05:00Z",
        }));
        assert_eq!(session_alive(&held, now), Some(true));
        assert!(!is_leftover(&held, &me(), now, min, &none_live, None));
        let ended = session(serde_json::json!({"mcp-run.dev/ended": "ended"}));
        assert_eq!(session_alive(&ended, now), Some(false));
        let expired =
            session(serde_json::json!({"mcp-run.dev/expires-at": "2026-11-23T11:59:00Z"}));
        assert_eq!(session_alive(&expired, now), Some(false));
        let other = pod(
            "gw-b",
            "2026-11-23T10:00:00Z",
            "2026-11-23T20:00:00Z",
            "Running",
        );
        assert_eq!(session_alive(&other, now), None);
    }

    #[test]
    fn leftovers() {
        let now: Timestamp = "2026-11-23T12:00:00Z".parse().unwrap();
        let min = Duration::from_secs(300);
        let none_live = |_: &str| false;
        let all_live = |_: &str| true;
        // Mine: leftover unless I run it, whatever its age.
        let mine = pod(
            "gw-a",
            "2026-11-23T11:59:59Z",
            "2026-11-23T13:00:00Z",
            "Running",
        );
        assert!(is_leftover(&mine, &me(), now, min, &none_live, None));
        assert!(!is_leftover(&mine, &me(), now, min, &all_live, None));
        // Another replica's running pod: never, until it expired.
        let theirs = pod(
            "gw-b",
            "2026-11-23T11:00:00Z",
            "2026-11-23T13:00:00Z",
            "Running",
        );
        assert!(!is_leftover(&theirs, &me(), now, min, &none_live, None));
        // ... unless the EndpointSlices list the replicas (me among them) and not its maker:
        // that replica is gone for good. Young pods wait (a replica not listed yet).
        let both: HashSet<String> = ["gw-a".into(), "gw-b".into()].into();
        let without_b: HashSet<String> = ["gw-a".into()].into();
        assert!(!is_leftover(
            &theirs,
            &me(),
            now,
            min,
            &none_live,
            Some(&both)
        ));
        assert!(is_leftover(
            &theirs,
            &me(),
            now,
            min,
            &none_live,
            Some(&without_b)
        ));
        let young_theirs = pod(
            "gw-b",
            "2026-11-23T11:58:00Z",
            "2026-11-23T13:00:00Z",
            "Running",
        );
        assert!(!is_leftover(
            &young_theirs,
            &me(),
            now,
            min,
            &none_live,
            Some(&without_b)
        ));
        let expired = pod(
            "gw-b",
            "2026-11-23T10:00:00Z",
            "2026-11-23T11:30:00Z",
            "Running",
        );
        assert!(is_leftover(&expired, &me(), now, min, &none_live, None));
        // Finished: once old enough.
        let done = pod(
            "gw-b",
            "2026-11-23T11:50:00Z",
            "2026-11-23T13:00:00Z",
            "Failed",
        );
        assert!(is_leftover(&done, &me(), now, min, &none_live, None));
        let young = pod(
            "gw-b",
            "2026-11-23T11:58:00Z",
            "2026-11-23T11:59:00Z",
            "Failed",
        );
        assert!(!is_leftover(&young, &me(), now, min, &none_live, None));
    }
}

//! Finding this gateway's replicas from the Kubernetes API (`server.peer_service`): the
//! EndpointSlices of a headless Service that selects the gateway's pods list every replica's
//! address and peer port. A reflector (kube-runtime's watcher, with its backoff) keeps them
//! in memory, so a replica that starts, moves or goes is known within a watch event, and
//! asking costs no API call. The Role this needs: `get`, `list` and `watch` on
//! `endpointslices.discovery.k8s.io` in the gateway's namespace (the chart's).
//!
//! Every endpoint counts, ready or not and terminating or not: a replica that is draining
//! (no longer ready) still holds the kept outputs of the runs it made. The chart's headless
//! Service publishes not-ready addresses for the same reason. The gateway's own endpoint (its
//! `targetRef` names this pod: `MCP_RUN_POD_NAME`, else the host name) is left out.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt as _;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt as _, watcher};

/// The label the EndpointSlice controller puts on a Service's slices.
pub(crate) const SERVICE_LABEL: &str = "kubernetes.io/service-name";
/// The port of a slice that the peer channel is on (else a slice's only port).
pub(crate) const PORT_NAME: &str = "peer";
/// How long a replica waits, at most, for the first list of its replicas.
const FIRST_LIST: Duration = Duration::from_secs(5);

/// Why the replicas' discovery cannot start (the gateway does not start).
#[derive(Debug, thiserror::Error)]
pub(crate) enum DiscoveryError {
    #[error(
        "{0:?} is not a Service: expected NAME or NAMESPACE/NAME (DNS labels), e.g. mcp-run-peers"
    )]
    NotAService(String),
    #[error("server.peer_service: {0}")]
    Setup(#[from] crate::exec::kube::KubeSetupError),
    #[error("server.peer_service: cannot build the Kubernetes client: {0}")]
    Client(kube::Error),
}

/// Checks `server.peer_service`: `NAME` or `NAMESPACE/NAME`, each a DNS label.
pub(crate) fn parse_service(s: &str) -> Result<(Option<String>, String), DiscoveryError> {
    let (ns, name) = match s.split_once('/') {
        Some((ns, name)) => (Some(ns), name),
        None => (None, s),
    };
    let label = |v: &str| {
        !v.is_empty()
            && v.len() <= 63
            && v.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !v.starts_with('-')
            && !v.ends_with('-')
    };
    if !label(name) || ns.is_some_and(|ns| !label(ns)) {
        return Err(DiscoveryError::NotAService(s.to_owned()));
    }
    Ok((ns.map(str::to_owned), name.to_owned()))
}

/// The replicas listed by a headless Service's EndpointSlices, kept up to date.
pub(crate) struct Discovery {
    store: Store<EndpointSlice>,
    me: Option<String>,
    /// The pods of every replica, this one included, sorted (what the warm pool shares its
    /// size by).
    replicas: tokio::sync::watch::Receiver<Vec<String>>,
}

impl std::fmt::Debug for Discovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Discovery")
            .field("me", &self.me)
            .finish_non_exhaustive()
    }
}

impl Discovery {
    /// Starts watching the EndpointSlices of `service` (see [`parse_service`]) with the
    /// credentials of the `kubernetes:` section. `me` names this replica's pod.
    pub(crate) async fn start(
        kube: &crate::exec::kube::config::KubernetesConfig,
        service: &str,
        me: Option<String>,
    ) -> Result<Self, DiscoveryError> {
        let (ns, name) = parse_service(service)?;
        let config = crate::exec::kube::client_config(kube).await?;
        let ns = ns.unwrap_or_else(|| config.default_namespace.clone());
        let client = kube::Client::try_from(config).map_err(DiscoveryError::Client)?;
        let api: kube::Api<EndpointSlice> = kube::Api::namespaced(client, &ns);
        let (store, writer) = reflector::store();
        let events = reflector::reflector(
            writer,
            watcher(
                api,
                watcher::Config::default().labels(&format!("{SERVICE_LABEL}={name}")),
            ),
        )
        .default_backoff()
        .touched_objects();
        let (replicas_tx, replicas) = tokio::sync::watch::channel(Vec::new());
        let discovery = Self {
            store,
            me,
            replicas,
        };
        let (watched, me) = (discovery.store.clone(), discovery.me.clone());
        tokio::spawn(async move {
            let mut events = std::pin::pin!(events);
            let mut known = BTreeSet::new();
            while let Some(ev) = events.next().await {
                match ev {
                    Ok(_) => {
                        let pods = pods_of(&watched.state());
                        replicas_tx.send_if_modified(|old| {
                            let changed = *old != pods;
                            *old = pods;
                            changed
                        });
                        let now: BTreeSet<String> = urls_of(&watched.state(), me.as_deref())
                            .iter()
                            .map(|u| u.to_string())
                            .collect();
                        if now != known {
                            tracing::info!(
                                service = format!("{ns}/{name}"),
                                replicas = ?now,
                                "this gateway's other replicas, from the Service's EndpointSlices"
                            );
                            known = now;
                        }
                    }
                    Err(e) => tracing::warn!(
                        service = format!("{ns}/{name}"),
                        "cannot watch the EndpointSlices that list this gateway's replicas \
                         (the gateway's Role needs get, list and watch on endpointslices.discovery.k8s.io): {e}"
                    ),
                }
            }
        });
        Ok(discovery)
    }

    /// The pods of all replicas (this one included once listed), sorted, as they change.
    pub(crate) fn replicas(&self) -> tokio::sync::watch::Receiver<Vec<String>> {
        self.replicas.clone()
    }

    /// The other replicas' peer URLs now; waits for the first list if it has not come yet
    /// (at most a few seconds: then none).
    pub(crate) async fn urls(&self) -> Vec<reqwest::Url> {
        let _ = tokio::time::timeout(FIRST_LIST, self.store.wait_until_ready()).await;
        urls_of(&self.store.state(), self.me.as_deref())
    }
}

/// The pods that `slices` list (by their endpoints' `targetRef`), sorted.
fn pods_of(slices: &[Arc<EndpointSlice>]) -> Vec<String> {
    let pods: BTreeSet<String> = slices
        .iter()
        .flat_map(|s| &s.endpoints)
        .filter_map(|ep| ep.target_ref.as_ref()?.name.clone())
        .collect();
    pods.into_iter().collect()
}

/// The peer URLs listed by `slices`, without the endpoint of the pod named `me`.
pub(crate) fn urls_of(slices: &[Arc<EndpointSlice>], me: Option<&str>) -> Vec<reqwest::Url> {
    let mut urls = BTreeSet::new();
    for slice in slices {
        let ports = slice.ports.as_deref().unwrap_or_default();
        let port = ports
            .iter()
            .find(|p| p.name.as_deref() == Some(PORT_NAME))
            .or(if ports.len() == 1 {
                ports.first()
            } else {
                None
            })
            .and_then(|p| p.port)
            .and_then(|p| u16::try_from(p).ok());
        let Some(port) = port else { continue };
        for ep in &slice.endpoints {
            let pod = ep.target_ref.as_ref().and_then(|r| r.name.as_deref());
            if me.is_some() && pod == me {
                continue;
            }
            for addr in &ep.addresses {
                let host = if slice.address_type == "IPv6" {
                    format!("[{addr}]")
                } else {
                    addr.clone()
                };
                if let Ok(url) = reqwest::Url::parse(&format!("http://{host}:{port}/")) {
                    urls.insert(url);
                }
            }
        }
    }
    urls.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(v: serde_json::Value) -> Arc<EndpointSlice> {
        Arc::new(serde_json::from_value(v).unwrap())
    }

    #[test]
    fn services_are_dns_labels() {
        assert_eq!(
            parse_service("mcp-run-peers").unwrap(),
            (None, "mcp-run-peers".into())
        );
        assert_eq!(
            parse_service("tools/mcp-run-peers").unwrap(),
            (Some("tools".into()), "mcp-run-peers".into())
        );
        for bad in ["", "/x", "x/", "Peers", "a/b/c", "-x", "x_y"] {
            assert!(parse_service(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn every_endpoint_but_this_pods_on_the_peer_port() {
        let slices = [
            slice(serde_json::json!({
                "addressType": "IPv4",
                "metadata": {"name": "a"},
                "ports": [{"name": "http", "port": 8080}, {"name": "peer", "port": 8081}],
                "endpoints": [
                    {"addresses": ["10.0.0.1"], "targetRef": {"kind": "Pod", "name": "gw-1"},
                     "conditions": {"ready": true}},
                    {"addresses": ["10.0.0.2"], "targetRef": {"kind": "Pod", "name": "gw-2"},
                     "conditions": {"ready": false, "serving": true, "terminating": true}},
                ]
            })),
            slice(serde_json::json!({
                "addressType": "IPv6",
                "metadata": {"name": "b"},
                "ports": [{"port": 9000}],
                "endpoints": [{"addresses": ["fd00::3"], "targetRef": {"kind": "Pod", "name": "gw-3"}}]
            })),
            // Several ports, none named `peer`: not ours to guess.
            slice(serde_json::json!({
                "addressType": "IPv4",
                "metadata": {"name": "c"},
                "ports": [{"name": "a", "port": 1}, {"name": "b", "port": 2}],
                "endpoints": [{"addresses": ["10.0.0.9"]}]
            })),
        ];
        let urls: Vec<String> = urls_of(&slices, Some("gw-1"))
            .iter()
            .map(|u| u.to_string())
            .collect();
        assert_eq!(urls, ["http://10.0.0.2:8081/", "http://[fd00::3]:9000/"]);
        assert_eq!(urls_of(&slices, None).len(), 3);
        assert_eq!(pods_of(&slices), ["gw-1", "gw-2", "gw-3"]);
    }
}

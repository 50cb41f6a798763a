//! The workspace volume of a runner pod: an `emptyDir` at the profile's `workspace_path`,
//! into which a workspace's tree is written (see `exec::kube::workspace`).

use k8s_openapi::api::core::v1::{EmptyDirVolumeSource, ResourceRequirements, Volume, VolumeMount};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::exec::kube::config::Profile;

/// The name of the `emptyDir` volume holding a pod's workspace.
pub(crate) const VOLUME: &str = "mcp-run-workspace";

/// Whether the profile gets its own workspace volume (none of its mounts is at the path).
fn own_volume(p: &Profile) -> Option<&str> {
    let path = p.workspace_path.as_deref()?;
    let trimmed = path.trim_end_matches('/');
    (!p.volume_mounts
        .iter()
        .any(|m| m.mount_path.trim_end_matches('/') == trimmed))
    .then_some(path)
}

/// The pod's volumes: the profile's, and the workspace `emptyDir` when it has a path.
pub(crate) fn volumes(p: &Profile) -> Option<Vec<Volume>> {
    let mut v = p.volumes.clone();
    if own_volume(p).is_some() {
        v.push(Volume {
            name: VOLUME.into(),
            // Bounded: a command cannot fill the node's disk through its workspace (the
            // kubelet evicts the pod past it).
            empty_dir: Some(EmptyDirVolumeSource {
                size_limit: Some(Quantity(
                    storage_limit(p).unwrap_or(DEFAULT_EPHEMERAL_STORAGE).into(),
                )),
                ..Default::default()
            }),
            ..Default::default()
        });
    }
    (!v.is_empty()).then_some(v)
}

/// The container's mounts: the profile's, and the workspace volume at its path.
pub(crate) fn volume_mounts(p: &Profile) -> Option<Vec<VolumeMount>> {
    let mut m = p.volume_mounts.clone();
    if let Some(path) = own_volume(p) {
        m.push(VolumeMount {
            name: VOLUME.into(),
            mount_path: path.into(),
            ..Default::default()
        });
    }
    (!m.is_empty()).then_some(m)
}

/// The ephemeral storage a runner container may use unless its profile says otherwise
/// (`resources.limits.ephemeral-storage`): its writable layer, logs and the workspace.
pub(crate) const DEFAULT_EPHEMERAL_STORAGE: &str = "4Gi";

fn storage_limit(p: &Profile) -> Option<&str> {
    p.resources
        .as_ref()?
        .limits
        .as_ref()?
        .get("ephemeral-storage")
        .map(|q| q.0.as_str())
}

/// The profile's resources with an `ephemeral-storage` limit of
/// [`DEFAULT_EPHEMERAL_STORAGE`] when it sets none (and a request of 0 then, so that the
/// scheduler does not reserve the whole limit per pod, which a limit alone would imply).
pub(crate) fn resources(p: &Profile) -> Option<ResourceRequirements> {
    let mut r = p.resources.clone().unwrap_or_default();
    let limits = r.limits.get_or_insert_with(Default::default);
    if !limits.contains_key("ephemeral-storage") {
        limits.insert(
            "ephemeral-storage".into(),
            Quantity(DEFAULT_EPHEMERAL_STORAGE.into()),
        );
        r.requests
            .get_or_insert_with(Default::default)
            .entry("ephemeral-storage".into())
            .or_insert_with(|| Quantity("0".into()));
    }
    Some(r)
}

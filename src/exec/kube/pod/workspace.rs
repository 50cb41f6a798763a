//! The workspace volume of a runner pod: an `emptyDir` at the profile's `workspace_path`,
//! into which a workspace's tree is written (see `exec::kube::workspace`).

use k8s_openapi::api::core::v1::{EmptyDirVolumeSource, Volume, VolumeMount};

use crate::exec::kube::config::Profile;

/// The name of the `emptyDir` volume holding a pod's workspace.
pub const VOLUME: &str = "mcp-run-workspace";

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
pub fn volumes(p: &Profile) -> Option<Vec<Volume>> {
    let mut v = p.volumes.clone();
    if own_volume(p).is_some() {
        v.push(Volume {
            name: VOLUME.into(),
            empty_dir: Some(EmptyDirVolumeSource::default()),
            ..Default::default()
        });
    }
    (!v.is_empty()).then_some(v)
}

/// The container's mounts: the profile's, and the workspace volume at its path.
pub fn volume_mounts(p: &Profile) -> Option<Vec<VolumeMount>> {
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

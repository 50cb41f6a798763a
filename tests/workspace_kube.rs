//! Workspaces on the Kubernetes backend, through the API-server double: the tree is
//! streamed into the pod with `tar -x` over exec stdin (fresh and warm-pool pods), the
//! command runs in the same relative directory, and the pod gets an `emptyDir` at the
//! profile's workspace path. (The double runs exec'd commands on this host, so the
//! profile's workspace path is a temporary directory here.)

mod kube_double;
mod support;

use std::os::unix::fs::PermissionsExt as _;
use std::time::Duration;

use kube_double::KubeDouble;
use support::{Gateway, config_file, raw, wait_until};

fn gateway(double: &KubeDouble, dir: &tempfile::TempDir, ws: &std::path::Path) -> Gateway {
    let cfg = config_file(
        dir,
        &format!(
            "workspaces:\n  cache_dir: {cache}\nprofiles:\n  default:\n    workspace_path: {ws}/fresh\n  \
             pooled:\n    workspace_path: {ws}/pooled\n    warm_pool: {{size: 1}}\n  bare: {{}}\n",
            cache = dir.path().join("cache").display(),
            ws = ws.display()
        ),
    );
    let kubeconfig = double.kubeconfig();
    Gateway::start(&[
        "--backend",
        "kube",
        "--kubeconfig",
        kubeconfig.to_str().unwrap(),
        "--config",
        cfg.to_str().unwrap(),
    ])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_tree_is_placed_in_fresh_and_warm_pods() {
    let double = KubeDouble::start();
    let dir = tempfile::tempdir().unwrap();
    let ws = tempfile::tempdir().unwrap();
    for p in ["fresh", "pooled"] {
        std::fs::create_dir_all(ws.path().join(p)).unwrap();
    }
    let gw = gateway(&double, &dir, ws.path());
    let tree = tempfile::tempdir().unwrap();
    let t = tree.path();
    std::fs::create_dir_all(t.join("src/deep")).unwrap();
    std::fs::create_dir_all(t.join(".git")).unwrap();
    std::fs::write(t.join(".gitignore"), "*.o\n").unwrap();
    std::fs::write(t.join("src/deep/a.txt"), "deep\n").unwrap();
    std::fs::write(t.join("src/x.o"), "ignored").unwrap();
    std::fs::write(t.join("run.sh"), "#!/bin/sh\necho ran\n").unwrap();
    std::fs::set_permissions(t.join("run.sh"), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::symlink("../run.sh", t.join("src/link")).unwrap();
    let script = "pwd; cat deep/a.txt; ./link; test ! -e x.o && stat -c %a ../run.sh";
    for profile in ["default", "pooled"] {
        let out = gw
            .run_remote()
            .env("XDG_CACHE_HOME", dir.path())
            .current_dir(t.join("src"))
            .args([
                "--workspace",
                "--profile",
                profile,
                "--",
                "sh",
                "-c",
                script,
            ])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{profile}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let dir = if profile == "default" {
            "fresh"
        } else {
            "pooled"
        };
        assert_eq!(
            stdout,
            format!("{}/{dir}/src\ndeep\nran\n755\n", ws.path().display())
        );
    }
    // The pods got the emptyDir at the workspace path.
    let pod = double
        .created_pods()
        .into_iter()
        .next()
        .expect("a pod was created");
    let spec = pod.spec.unwrap();
    let vol = spec
        .volumes
        .unwrap()
        .into_iter()
        .find(|v| v.name == "mcp-run-workspace")
        .expect("the workspace volume");
    assert!(vol.empty_dir.is_some());
    let mount = spec.containers[0]
        .volume_mounts
        .clone()
        .unwrap()
        .into_iter()
        .find(|m| m.name == "mcp-run-workspace")
        .unwrap();
    assert!(mount.mount_path.ends_with("/fresh") || mount.mount_path.ends_with("/pooled"));

    // A profile without a workspace path, and sync-back (not on this backend yet): 400.
    let sync = gw
        .run_remote()
        .env("XDG_CACHE_HOME", dir.path())
        .current_dir(t)
        .args(["--workspace", "--profile", "bare", "--", "true"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&sync.stderr);
    assert_eq!(sync.status.code(), Some(125), "{stderr}");
    assert!(stderr.contains("workspace_path"), "{stderr}");
    let r = raw(
        &gw,
        serde_json::json!({"executable": "true", "workspace": "ws_x", "profile": "bare"}),
    )
    .await;
    assert_eq!(r.status, 404);
    // Only the warm pool's idle pod remains.
    assert!(
        wait_until(Duration::from_secs(10), || double
            .pod_names("default")
            .len()
            <= 1),
        "pods left: {:?}",
        double.pod_names("default")
    );
}

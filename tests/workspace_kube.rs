//! Workspaces on the Kubernetes backend, through the API-server double: the tree is
//! streamed into the pod with `tar -x` over exec stdin (fresh and warm-pool pods), the
//! command runs in the same relative directory, and the pod gets an `emptyDir` at the
//! profile's workspace path; sync-back brings what the command created or changed back into
//! the caller's tree; all of it as the pod's non-root user. (The double runs exec'd commands
//! on this host, so the profile's workspace path is a temporary directory here.)

use crate::kube_double;
use crate::support;

use std::os::unix::fs::PermissionsExt as _;
use std::time::Duration;

use kube_double::{DoubleOptions, KubeDouble};
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
    // Issue 24.4: bounded, and so is the container's ephemeral storage.
    let size = vol.empty_dir.as_ref().and_then(|e| e.size_limit.clone());
    assert_eq!(size.map(|q| q.0), Some("4Gi".to_string()));
    let limits = spec.containers[0]
        .resources
        .as_ref()
        .and_then(|r| r.limits.clone())
        .unwrap_or_default();
    assert_eq!(
        limits.get("ephemeral-storage").map(|q| q.0.as_str()),
        Some("4Gi")
    );
    let mount = spec.containers[0]
        .volume_mounts
        .clone()
        .unwrap()
        .into_iter()
        .find(|m| m.name == "mcp-run-workspace")
        .unwrap();
    assert!(mount.mount_path.ends_with("/fresh") || mount.mount_path.ends_with("/pooled"));

    // A profile without a workspace path: 400.
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

/// A tree for the sync-back tests, in a directory others can read (the pod's user may not be
/// root).
fn sync_tree() -> tempfile::TempDir {
    let tree = tempfile::tempdir().unwrap();
    let t = tree.path();
    std::fs::set_permissions(t, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::create_dir_all(t.join("src/deep")).unwrap();
    std::fs::write(t.join("src/deep/same.txt"), "same\n").unwrap();
    std::fs::write(t.join("src/deep/edit.txt"), "aaaa\n").unwrap();
    std::fs::write(t.join("src/deep/chmod.sh"), "echo\n").unwrap();
    std::fs::write(t.join("src/keep.txt"), "keep\n").unwrap();
    tree
}

/// What the command does: new files (matching or not), an in-place edit of the same size
/// with the mtime put back (no timestamp can tell), an exec bit, a file outside the globs.
const SYNC_SCRIPT: &str = r#"set -e
    id -u
    mkdir -p out/sub && echo new > out/r.txt && echo deep > out/sub/s.txt && echo no > out/r.log
    t=$(stat -c %y src/deep/edit.txt); printf 'bbbb\n' > src/deep/edit.txt; touch -d "$t" src/deep/edit.txt
    chmod +x src/deep/chmod.sh
    echo changed > src/keep.txt"#;

fn check_synced_back(t: &std::path::Path, out: &std::process::Output) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
    let back: Vec<(&str, u64)> = v["workspace"]["synced_back"]
        .as_array()
        .unwrap_or_else(|| panic!("{v}"))
        .iter()
        .map(|f| (f["path"].as_str().unwrap(), f["mode"].as_u64().unwrap()))
        .collect();
    assert_eq!(
        back,
        [
            ("out/r.txt", 0o644),
            ("src/deep/chmod.sh", 0o755),
            ("src/deep/edit.txt", 0o644)
        ]
    );
    assert_eq!(std::fs::read(t.join("out/r.txt")).unwrap(), b"new\n");
    assert_eq!(
        std::fs::read(t.join("src/deep/edit.txt")).unwrap(),
        b"bbbb\n"
    );
    let mode = std::fs::metadata(t.join("src/deep/chmod.sh"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o755);
    assert_eq!(std::fs::read(t.join("src/keep.txt")).unwrap(), b"keep\n");
    for f in ["out/r.log", "out/sub/s.txt"] {
        assert!(!t.join(f).exists(), "{f} matches no glob");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sync_back_brings_home_what_the_command_created_or_changed() {
    let double = KubeDouble::start();
    let dir = tempfile::tempdir().unwrap();
    let ws = tempfile::tempdir().unwrap();
    for p in ["fresh", "pooled"] {
        std::fs::create_dir_all(ws.path().join(p)).unwrap();
    }
    let gw = gateway(&double, &dir, ws.path());
    for profile in ["default", "pooled"] {
        let tree = sync_tree();
        let out = gw
            .run_remote()
            .env("XDG_CACHE_HOME", dir.path())
            .current_dir(tree.path())
            .args([
                "--workspace",
                "--timeout",
                "60",
                "--profile",
                profile,
                "--output-format",
                "json",
                "--sync-back",
                "out/*.txt",
                "src/deep/*",
                "--",
                "sh",
                "-c",
                SYNC_SCRIPT,
            ])
            .output()
            .unwrap();
        check_synced_back(tree.path(), &out);
    }
    // Nothing matched: an empty list, and the stream format's one-line summary says so.
    let tree = sync_tree();
    let out = gw
        .run_remote()
        .env("XDG_CACHE_HOME", dir.path())
        .current_dir(tree.path())
        .args(["--workspace", "--sync-back", "nothing/*", "--", "true"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains("mcp-run: sync-back from"), "{stderr}");
}

/// The default profile runs as 65532 (runAsNonRoot); the double runs the pod's processes as
/// that user and makes the emptyDir 0777 as a kubelet does: placement and sync-back work
/// without root.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn placement_and_sync_back_work_as_the_non_root_pod_user() {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { nix::libc::geteuid() } != 0 {
        eprintln!("skipped: the double can only switch users when the tests run as root");
        return;
    }
    let double = KubeDouble::start_with(DoubleOptions {
        run_as_pod_user: true,
        ..Default::default()
    });
    let dir = tempfile::tempdir().unwrap();
    let ws = tempfile::tempdir().unwrap();
    // The pod's user must reach the mount points; the double creates the emptyDirs.
    std::fs::set_permissions(ws.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let gw = gateway(&double, &dir, ws.path());
    let tree = sync_tree();
    let out = gw
        .run_remote()
        .env("XDG_CACHE_HOME", dir.path())
        .current_dir(tree.path())
        .args([
            "--workspace",
            "--timeout",
            "60",
            "--output-format",
            "json",
            "--sync-back",
            "out/*.txt",
            "src/deep/*",
            "--",
            "sh",
            "-c",
            SYNC_SCRIPT,
        ])
        .output()
        .unwrap();
    check_synced_back(tree.path(), &out);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        v["outputs"][0]["stdout"].as_str().map(str::trim),
        Some("65532"),
        "{v}"
    );
    let fresh = std::fs::metadata(ws.path().join("fresh")).unwrap();
    assert_eq!(fresh.permissions().mode() & 0o777, 0o777, "an emptyDir");
}

/// `cmd`'s output, or a failure when it takes longer than `limit` (killed then).
fn output_within(mut cmd: std::process::Command, limit: Duration) -> std::process::Output {
    let child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::SIGKILL,
            );
            panic!("still running after {limit:?}");
        }
    }
}

/// The README's image is busybox: placement and sync-back go through busybox's applets
/// (`tar`, `find`, `sh`; Debian's `busybox`, which the double's `busybox-applets` images
/// have). Busybox's `tar -x -f -` reads its stdin to the end, so the placement exec must
/// close stdin (v5) or it waits forever. Images without `tar` or without a shell get an
/// error that says what the image lacks.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn busybox_images_take_workspaces_and_images_without_tar_or_shell_say_so() {
    if !std::path::Path::new(kube_double::BUSYBOX).exists() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI installs busybox (.ci/install.d/containers.sh)"
        );
        eprintln!("SKIPPED: {} is not installed", kube_double::BUSYBOX);
        return;
    }
    busybox_workspaces(false);
}

/// The same in real busybox containers (podman and runc): busybox's tar, find and sh, the
/// pod's user and an `emptyDir` (tmpfs) are real.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn busybox_workspaces_in_real_containers() {
    if let Err(why) = kube_double::podman::available() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI installs podman, runc and busybox-static (.ci/install.d/containers.sh): {why}"
        );
        eprintln!("SKIPPED: no real containers here: {why}");
        return;
    }
    busybox_workspaces(true);
}

fn busybox_workspaces(real: bool) {
    let double = KubeDouble::start_with(DoubleOptions {
        containers: real,
        ..Default::default()
    });
    let dir = tempfile::tempdir().unwrap();
    let ws = tempfile::tempdir().unwrap();
    for p in ["bb", "bare"] {
        std::fs::create_dir_all(ws.path().join(p)).unwrap();
    }
    // In a real container the workspace is the pod's emptyDir, at /workspace.
    let bb = if real {
        "/workspace".to_string()
    } else {
        format!("{}/bb", ws.path().display())
    };
    let cfg = config_file(
        &dir,
        &format!(
            "workspaces:\n  cache_dir: {cache}\nprofiles:\n  default: {{}}\n  busybox:\n    image: registry.example/busybox-applets:1.36\n    workspace_path: {bb}\n  \
             bare:\n    image: registry.example/no-shell:1\n    workspace_path: {ws}/bare\n",
            cache = dir.path().join("cache").display(),
            ws = ws.path().display()
        ),
    );
    let kubeconfig = double.kubeconfig();
    let gw = Gateway::start(&[
        "--backend",
        "kube",
        "--kubeconfig",
        kubeconfig.to_str().unwrap(),
        "--config",
        cfg.to_str().unwrap(),
    ]);
    let tree = sync_tree();
    let mut cmd = gw.run_remote();
    cmd.env("XDG_CACHE_HOME", dir.path())
        .current_dir(tree.path())
        .args([
            "--workspace",
            "--profile",
            "busybox",
            "--output-format",
            "json",
            "--sync-back",
            "out/*.txt",
            "src/deep/*",
            "--",
            "sh",
            "-c",
            // busybox's `touch -d` does not read what its `stat -c %y` prints.
            &format!(
                "{}\n    readlink -f /proc/$$/exe >&2",
                SYNC_SCRIPT.replace(
                    r#"t=$(stat -c %y src/deep/edit.txt); printf 'bbbb\n' > src/deep/edit.txt; touch -d "$t" src/deep/edit.txt"#,
                    r#"touch -r src/deep/edit.txt out/.ref; printf 'bbbb\n' > src/deep/edit.txt; touch -r out/.ref src/deep/edit.txt"#
                )
            ),
        ]);
    let out = output_within(cmd, Duration::from_secs(40));
    check_synced_back(tree.path(), &out);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let exe = v["outputs"][0]["stderr"]
        .as_str()
        .map(str::trim)
        .unwrap_or("");
    assert!(
        exe.ends_with("/busybox"),
        "the command's shell was busybox: {v}"
    );
    if real {
        assert_eq!(
            v["outputs"][0]["stdout"].as_str(),
            Some("65532\n"),
            "as the pod's user"
        );
        assert!(wait_until(Duration::from_secs(15), || double
            .pod_names("default")
            .is_empty()));
        return;
    }

    // No tar in the image: the placement says so.
    let tree = sync_tree();
    let mut cmd = gw.run_remote();
    cmd.env("XDG_CACHE_HOME", dir.path())
        .current_dir(tree.path())
        .args(["--workspace", "--profile", "bare", "--", "true"]);
    let out = output_within(cmd, Duration::from_secs(40));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(125), "{stderr}");
    assert!(
        stderr.contains("cannot write the workspace into runner pod")
            && stderr.contains("\"tar\": executable file not found")
            && stderr.contains("(the image needs `tar`)"),
        "{stderr}"
    );
    // No shell: a command with cwd (run-remote sends its own) cannot be wrapped.
    let mut cmd = gw.run_remote();
    cmd.args(["--profile", "bare", "--cwd", "/tmp", "--", "true"]);
    let out = output_within(cmd, Duration::from_secs(40));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(125), "{stderr}");
    assert!(
        stderr.contains("the runner image has no shell /bin/sh (the profile's `shell`)"),
        "{stderr}"
    );
    assert!(wait_until(Duration::from_secs(10), || double
        .pod_names("default")
        .is_empty()));
}

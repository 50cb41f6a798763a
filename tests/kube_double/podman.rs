//! Pods as real containers (`DoubleOptions::containers`): each running pod's runner
//! container is a podman container (runc; Debian's `podman` and `runc`), so that the user,
//! the read-only root, memory limits and OOM kills, the image's programs and PID 1 are real.
//!
//! - The image is busybox (Debian's `busybox-static`, imported with `podman import`): every
//!   pod runs it, whatever image its spec names.
//! - `podman run -d` with the pod's keep-alive command, `--user` from the security context,
//!   `--read-only` for `readOnlyRootFilesystem`, `--memory` from `limits.memory`, each
//!   `emptyDir` a host directory owned by root, mode 0777, as a kubelet makes them (removed
//!   with the double), explicit ulimits
//!   (cgroup v1 here: podman cannot derive them); `--runtime runc`.
//! - An exec is `podman exec [-i]` in it: stdin only when the exec asked for it, since
//!   `podman exec -i` returns only once its stdin is closed, even when the process exited.
//! - A process the kernel OOM-killed (the memory cgroup's `oom_kill` count grew) ends the
//!   container as a kubelet with cgroup v2's group kill does; the pod's status says
//!   `OOMKilled` a second later, as the kubelet's relist would.
//! - Deleting the pod removes the container; dropping the double removes all of its own.

use std::process::Command;
use std::sync::OnceLock;

use k8s_openapi::api::core::v1::{Container, Pod};

/// The image every pod runs in this mode.
pub const IMAGE: &str = "localhost/mcp-run-double-busybox:1";

/// Whether real containers can run here, or why not (made once per process: the image is
/// imported on first use).
pub fn available() -> Result<(), String> {
    static READY: OnceLock<Result<(), String>> = OnceLock::new();
    READY.get_or_init(prepare).clone()
}

fn prepare() -> Result<(), String> {
    let ok = |c: &mut Command| c.output().is_ok_and(|o| o.status.success());
    if !ok(Command::new("podman").arg("--version")) {
        return Err("podman is not installed".into());
    }
    if !ok(Command::new("podman").args(["image", "exists", IMAGE])) {
        let busybox = std::path::Path::new(super::BUSYBOX);
        let is_static = std::fs::read(busybox).is_ok_and(|b| elf_is_static(&b));
        if !is_static {
            return Err(format!(
                "{} is not a static busybox (Debian: busybox-static)",
                super::BUSYBOX
            ));
        }
        let root = tempfile::tempdir().map_err(|e| e.to_string())?;
        for d in ["bin", "tmp", "proc", "dev", "sys", "etc", "workspace"] {
            std::fs::create_dir_all(root.path().join(d)).map_err(|e| e.to_string())?;
        }
        std::fs::copy(busybox, root.path().join("bin/busybox")).map_err(|e| e.to_string())?;
        let list = Command::new(busybox)
            .arg("--list")
            .output()
            .map_err(|e| e.to_string())?;
        for applet in String::from_utf8_lossy(&list.stdout).lines() {
            if applet != "busybox" {
                let _ = std::os::unix::fs::symlink("busybox", root.path().join("bin").join(applet));
            }
        }
        let tar = Command::new("tar")
            .args(["-C"])
            .arg(root.path())
            .args(["-cf", "-", "."])
            .output()
            .map_err(|e| e.to_string())?;
        let mut import = Command::new("podman")
            .args(["import", "--change", "ENV=PATH=/bin", "-", IMAGE])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| e.to_string())?;
        {
            use std::io::Write as _;
            let mut stdin = import.stdin.take().ok_or("no stdin")?;
            stdin.write_all(&tar.stdout).map_err(|e| e.to_string())?;
        }
        let out = import.wait_with_output().map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(format!(
                "podman import: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
    }
    // A container must really start (user namespaces, cgroups, runc).
    let probe = Command::new("podman")
        .args(["run", "--rm", "--runtime", "runc"])
        .args(ULIMITS)
        .args([IMAGE, "/bin/true"])
        .output()
        .map_err(|e| e.to_string())?;
    if !probe.status.success() {
        return Err(format!(
            "podman cannot run a container here: {}",
            String::from_utf8_lossy(&probe.stderr).trim()
        ));
    }
    Ok(())
}

/// Whether a 64-bit ELF file has no program interpreter (`PT_INTERP`): it runs in an image
/// without a libc.
fn elf_is_static(b: &[u8]) -> bool {
    let u16_at = |o: usize| {
        b.get(o..o + 2)
            .map(|x| u16::from_le_bytes([x[0], x[1]]) as usize)
    };
    let u64_at = |o: usize| {
        b.get(o..o + 8)
            .and_then(|x| x.try_into().ok())
            .map(|x| u64::from_le_bytes(x) as usize)
    };
    if !b.starts_with(b"\x7fELF\x02\x01") {
        return false;
    }
    let (Some(phoff), Some(size), Some(count)) = (u64_at(0x20), u16_at(0x36), u16_at(0x38)) else {
        return false;
    };
    (0..count).all(|i| {
        let at = phoff + i * size;
        b.get(at..at + 4) != Some(&3u32.to_le_bytes()[..])
    })
}

/// cgroup v1 gives podman no defaults for these.
const ULIMITS: [&str; 4] = [
    "--ulimit",
    "nofile=4096:4096",
    "--ulimit",
    "nproc=4096:4096",
];

/// Where one double's `emptyDir`s are, per pod uid and volume name.
fn volumes(owner: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("mcp-run-double-{owner}"))
}

/// The container of a pod.
pub fn name(uid: &str) -> String {
    format!("mcp-run-double-{uid}")
}

/// The label of one double's containers.
pub fn owner_label(owner: &str) -> String {
    format!("mcp-run-double={owner}")
}

/// `(uid, gid)` of a container from its (else the pod's) security context.
pub fn user(pod: &Pod, c: &Container) -> Option<(i64, i64)> {
    let csc = c.security_context.as_ref();
    let psc = pod.spec.as_ref().and_then(|s| s.security_context.as_ref());
    let uid = csc
        .and_then(|s| s.run_as_user)
        .or_else(|| psc.and_then(|s| s.run_as_user))?;
    let gid = csc
        .and_then(|s| s.run_as_group)
        .or_else(|| psc.and_then(|s| s.run_as_group))
        .unwrap_or(0);
    Some((uid, gid))
}

/// podman's `--memory` for a Kubernetes quantity (`32Mi` → `32m`).
fn memory(q: &str) -> String {
    for (k8s, podman) in [("Ki", "k"), ("Mi", "m"), ("Gi", "g")] {
        if let Some(n) = q.strip_suffix(k8s) {
            return format!("{n}{podman}");
        }
    }
    q.to_string()
}

/// Starts the pod's container (`podman run -d`); the error is podman's.
pub fn run(owner: &str, pod: &Pod, c: &Container) -> Result<(), String> {
    let uid = pod.metadata.uid.as_deref().unwrap_or_default();
    let mut cmd = Command::new("podman");
    cmd.args(["run", "-d", "--runtime", "runc", "--name"])
        .arg(name(uid))
        .args(["--label", &owner_label(owner)])
        .args(ULIMITS)
        .args(["--stop-signal", "KILL"]);
    if let Some((u, g)) = user(pod, c) {
        cmd.arg("--user").arg(format!("{u}:{g}"));
    }
    if c.security_context
        .as_ref()
        .and_then(|s| s.read_only_root_filesystem)
        == Some(true)
    {
        cmd.arg("--read-only");
    }
    if let Some(m) = c
        .resources
        .as_ref()
        .and_then(|r| r.limits.as_ref())
        .and_then(|l| l.get("memory"))
    {
        cmd.arg("--memory").arg(memory(&m.0));
    }
    let empty_dirs: Vec<&str> = pod
        .spec
        .iter()
        .flat_map(|s| s.volumes.iter().flatten())
        .filter(|v| v.empty_dir.is_some())
        .map(|v| v.name.as_str())
        .collect();
    for m in c.volume_mounts.iter().flatten() {
        if empty_dirs.contains(&m.name.as_str()) {
            use std::os::unix::fs::PermissionsExt as _;
            let dir = volumes(owner).join(uid).join(&m.name);
            std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777))
                .map_err(|e| e.to_string())?;
            cmd.arg("--mount").arg(format!(
                "type=bind,source={},destination={}",
                dir.display(),
                m.mount_path
            ));
        }
    }
    if let Some(dir) = c.working_dir.as_deref().filter(|d| !d.is_empty()) {
        cmd.arg("--workdir").arg(dir);
    }
    cmd.arg(IMAGE);
    cmd.args(c.command.iter().flatten());
    cmd.args(c.args.iter().flatten());
    let out = cmd.output().map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}

/// The `podman exec` that runs `argv` in the pod's container.
pub fn exec(
    uid: &str,
    argv: &[String],
    env: &[(String, String)],
    cwd: &str,
    stdin: bool,
) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new("podman");
    cmd.arg("exec");
    if stdin {
        cmd.arg("-i");
    }
    cmd.arg("--workdir").arg(cwd);
    for (k, v) in env {
        cmd.arg("--env").arg(format!("{k}={v}"));
    }
    cmd.arg(name(uid)).args(argv);
    cmd
}

/// How many processes the kernel's OOM killer has killed in the container (its memory
/// cgroup's `oom_kill`, cgroup v1 or v2).
pub fn oom_kills(uid: &str) -> Option<u64> {
    let out = Command::new("podman")
        .args(["inspect", "--format", "{{.State.CgroupPath}}", &name(uid)])
        .output()
        .ok()?;
    let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let files = [
        format!("/sys/fs/cgroup/memory{path}/memory.oom_control"),
        format!("/sys/fs/cgroup{path}/memory.events"),
    ];
    files.iter().find_map(|f| {
        let text = std::fs::read_to_string(f).ok()?;
        text.lines()
            .find_map(|l| l.strip_prefix("oom_kill "))
            .and_then(|n| n.trim().parse().ok())
    })
}

/// Kills the container now (its processes die), as a group OOM kill does.
pub fn kill(uid: &str) {
    let _ = Command::new("podman")
        .args(["kill", "--signal", "KILL", &name(uid)])
        .output();
}

/// Removes the pod's container, in the background.
pub fn remove(uid: &str) {
    let name = name(uid);
    std::thread::spawn(move || {
        let _ = Command::new("podman")
            .args(["rm", "-f", "-t", "0", &name])
            .output();
    });
}

/// Removes every container of one double (when it is dropped).
pub fn remove_all(owner: &str) {
    let Ok(out) = Command::new("podman")
        .args(["ps", "-aq", "--filter"])
        .arg(format!("label={}", owner_label(owner)))
        .output()
    else {
        return;
    };
    let ids: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(String::from)
        .collect();
    if !ids.is_empty() {
        let _ = Command::new("podman")
            .args(["rm", "-f", "-t", "0"])
            .args(&ids)
            .output();
    }
    let _ = std::fs::remove_dir_all(volumes(owner));
}

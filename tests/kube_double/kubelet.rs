//! The simulated scheduler and kubelet: a pod's lifecycle steps and its failure injection,
//! and the active deadline.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateRunning, ContainerStateTerminated, ContainerStateWaiting,
    ContainerStatus, HostIP, Pod, PodCondition, PodIP, PodStatus,
};

use super::Shared;
use super::pods::{key, new_uid, now, step};
// ---------------------------------------------------------------------------------------------
// lifecycle (scheduler + kubelet)

pub(super) fn cond(
    type_: &str,
    status: bool,
    reason: Option<&str>,
    message: Option<String>,
) -> PodCondition {
    PodCondition {
        type_: type_.into(),
        status: if status { "True" } else { "False" }.into(),
        reason: reason.map(str::to_string),
        message,
        last_transition_time: Some(now()),
        last_probe_time: None,
        observed_generation: None,
    }
}

pub(super) fn set_cond(status: &mut PodStatus, c: PodCondition) {
    let conds = status.conditions.get_or_insert_with(Vec::new);
    match conds.iter_mut().find(|x| x.type_ == c.type_) {
        Some(x) if x.status == c.status && x.reason == c.reason && x.message == c.message => {}
        Some(x) => *x = c,
        None => conds.push(c),
    }
}

pub(super) fn waiting(reason: &str, message: Option<String>) -> ContainerState {
    ContainerState {
        waiting: Some(ContainerStateWaiting {
            reason: Some(reason.into()),
            message,
        }),
        ..ContainerState::default()
    }
}

pub(super) fn images(pod: &Pod) -> Vec<(String, String)> {
    pod.spec
        .as_ref()
        .map(|s| {
            s.containers
                .iter()
                .map(|c| (c.name.clone(), c.image.clone().unwrap_or_default()))
                .collect()
        })
        .unwrap_or_default()
}

pub(super) fn pull_message(image: &str) -> String {
    format!(
        "rpc error: code = NotFound desc = failed to pull and unpack image \"{image}\": failed to resolve reference \"{image}\": {image}: not found"
    )
}

pub(super) fn unready(names: &[String]) -> String {
    format!("containers with unready status: [{}]", names.join(" "))
}

/// Whether the kubelet's runAsNonRoot check refuses an image that runs as root: the pod or
/// container asks for non-root and names no UID.
fn runs_as_root_against_policy(p: &Pod, c: &k8s_openapi::api::core::v1::Container) -> bool {
    let psc = p.spec.as_ref().and_then(|s| s.security_context.as_ref());
    let csc = c.security_context.as_ref();
    let non_root = csc
        .and_then(|s| s.run_as_non_root)
        .or(psc.and_then(|s| s.run_as_non_root))
        == Some(true);
    let uid = csc
        .and_then(|s| s.run_as_user)
        .or(psc.and_then(|s| s.run_as_user));
    non_root && uid.is_none_or(|u| u == 0)
}

/// Whether the runtime would find a container's main program (in the double's PATH).
fn executable_exists(exe: &str) -> bool {
    if exe.contains('/') {
        return std::path::Path::new(exe).is_file();
    }
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(exe).is_file()))
        .unwrap_or(false)
}

/// What the node's labels say about a nodeSelector.
pub(super) fn node_matches(shared: &Shared, pod: &Pod) -> bool {
    let mut labels: BTreeMap<String, String> = shared.opts.node_labels.clone();
    labels.insert(
        "kubernetes.io/hostname".into(),
        shared.opts.node_name.clone(),
    );
    labels.insert("kubernetes.io/os".into(), "linux".into());
    labels.insert(
        "kubernetes.io/arch".into(),
        std::env::consts::ARCH
            .replace("x86_64", "amd64")
            .replace("aarch64", "arm64"),
    );
    pod.spec
        .as_ref()
        .and_then(|s| s.node_selector.as_ref())
        .is_none_or(|sel| sel.iter().all(|(k, v)| labels.get(k) == Some(v)))
}

pub(super) async fn lifecycle(shared: Arc<Shared>, ns: String, name: String, uid: String) {
    let delay = shared.opts.step_delay;
    let node = shared.opts.node_name.clone();
    tokio::time::sleep(delay).await;

    // 1. The scheduler binds the pod (or says why it cannot).
    let Some(pod) = shared.lock().pods.get(&key(&ns, &name)).cloned() else {
        return;
    };
    let (unschedulable_for, pull_failures) = {
        let mut st = shared.lock();
        (
            st.faults.unschedulable_for.take(),
            std::mem::take(&mut st.faults.pull_failures),
        )
    };
    let preassigned = pod.spec.as_ref().is_some_and(|s| s.node_name.is_some());
    if !preassigned && let Some(wait) = unschedulable_for {
        // Fault injection: no room until an autoscaler adds a node.
        if !step(&shared, &ns, &name, &uid, |p| {
            let s = p.status.get_or_insert_with(PodStatus::default);
            set_cond(s, cond("PodScheduled", false, Some("Unschedulable"), Some(
                "0/1 nodes are available: 1 Insufficient cpu. preemption: 0/1 nodes are available: 1 No preemption victims found for incoming pod.".into())));
        }) {
            return;
        }
        tokio::time::sleep(wait).await;
    }
    if !preassigned {
        if !node_matches(&shared, &pod) {
            step(&shared, &ns, &name, &uid, |p| {
                let s = p.status.get_or_insert_with(PodStatus::default);
                set_cond(s, cond("PodScheduled", false, Some("Unschedulable"), Some(
                    "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector. preemption: 0/1 nodes are available: 1 Preemption is not helpful for scheduling.".into())));
            });
            return;
        }
        if !step(&shared, &ns, &name, &uid, |p| {
            if let Some(s) = p.spec.as_mut() {
                s.node_name = Some(node.clone());
            }
            let s = p.status.get_or_insert_with(PodStatus::default);
            set_cond(s, cond("PodScheduled", true, None, None));
        }) {
            return;
        }
        tokio::time::sleep(delay).await;
    }

    // 2. The kubelet admits it: sandbox being created, containers waiting.
    let names: Vec<String> = images(&pod).into_iter().map(|(n, _)| n).collect();
    let started = now();
    if !step(&shared, &ns, &name, &uid, |p| {
        let imgs = images(p);
        let s = p.status.get_or_insert_with(PodStatus::default);
        s.host_ip = Some("172.18.0.2".into());
        s.host_ips = Some(vec![HostIP {
            ip: "172.18.0.2".into(),
        }]);
        s.start_time = Some(started.clone());
        set_cond(s, cond("PodReadyToStartContainers", false, None, None));
        set_cond(s, cond("Initialized", true, None, None));
        set_cond(
            s,
            cond(
                "Ready",
                false,
                Some("ContainersNotReady"),
                Some(unready(&names)),
            ),
        );
        set_cond(
            s,
            cond(
                "ContainersReady",
                false,
                Some("ContainersNotReady"),
                Some(unready(&names)),
            ),
        );
        set_cond(s, cond("PodScheduled", true, None, None));
        s.container_statuses = Some(
            imgs.iter()
                .map(|(n, i)| ContainerStatus {
                    name: n.clone(),
                    image: i.clone(),
                    image_id: String::new(),
                    ready: false,
                    restart_count: 0,
                    started: Some(false),
                    state: Some(waiting("ContainerCreating", None)),
                    ..ContainerStatus::default()
                })
                .collect(),
        );
    }) {
        return;
    }
    if let Some(secs) = pod.spec.as_ref().and_then(|s| s.active_deadline_seconds) {
        tokio::spawn(deadline(
            shared.clone(),
            ns.clone(),
            name.clone(),
            uid.clone(),
            secs,
        ));
    }
    if images(&pod).iter().any(|(_, i)| i.contains("never-starts")) {
        return;
    }
    tokio::time::sleep(delay).await;
    // Volumes are mounted before containers start (pvcs.rs), retried as the kubelet's volume
    // manager retries; meanwhile the containers wait in ContainerCreating, saying why.
    let mut told = String::new();
    while let Err(why) = super::pvcs::mount(&shared, &pod) {
        let live = if why != told {
            told = why.clone();
            step(&shared, &ns, &name, &uid, |p| {
                let s = p
                    .status
                    .as_mut()
                    .and_then(|s| s.container_statuses.as_mut());
                for c in s.into_iter().flatten() {
                    c.state = Some(waiting("ContainerCreating", Some(why.clone())));
                }
            })
        } else {
            shared.lock().pods.get(&key(&ns, &name)).is_some_and(|p| {
                p.metadata.uid.as_deref() == Some(uid.as_str())
                    && p.metadata.deletion_timestamp.is_none()
            })
        };
        if !live {
            return;
        }
        tokio::time::sleep(delay.max(Duration::from_millis(20))).await;
    }

    // 3. Containers start, or fail to.
    let ip = {
        let mut st = shared.lock();
        st.next_ip += 1;
        format!("10.244.0.{}", st.next_ip % 250 + 2)
    };
    for i in 0..pull_failures {
        // Fault injection: the registry limits the rate of pulls for a while.
        let reason = if i % 2 == 0 {
            "ErrImagePull"
        } else {
            "ImagePullBackOff"
        };
        if !step(&shared, &ns, &name, &uid, |p| {
            for c in p
                .status
                .as_mut()
                .and_then(|s| s.container_statuses.as_mut())
                .into_iter()
                .flatten()
            {
                c.state = Some(waiting(
                    reason,
                    Some(format!(
                        "failed to pull and unpack image \"{}\": failed to copy: httpReadSeeker: failed open: unexpected status code 429 Too Many Requests - Server message: toomanyrequests: You have reached your pull rate limit.",
                        c.image
                    )),
                ));
            }
        }) {
            return;
        }
        tokio::time::sleep(delay).await;
    }
    // Real containers: the runner container starts now (podman's error is the runtime's).
    let mut refused: Option<String> = None;
    let snapshot = if shared.opts.containers {
        shared.lock().pods.get(&key(&ns, &name)).cloned()
    } else {
        None
    };
    if let Some(snapshot) = snapshot
        && !images(&snapshot).iter().any(|(_, i)| {
            ["pull-error", "config-error", "cannot-run", "root-user"]
                .iter()
                .any(|m| i.contains(m))
        })
        && let Some(c) = snapshot
            .spec
            .as_ref()
            .and_then(|s| s.containers.first())
            .cloned()
    {
        let owner = shared.owner.clone();
        refused = tokio::task::spawn_blocking(move || super::podman::run(&owner, &snapshot, &c))
            .await
            .unwrap_or_else(|e| Err(e.to_string()))
            .err();
    }
    let mut pulling = false;
    let mut start_error = false;
    step(&shared, &ns, &name, &uid, |p| {
        let imgs = images(p);
        let snapshot = p.clone();
        let s = p.status.get_or_insert_with(PodStatus::default);
        let mut statuses = Vec::new();
        let mut not_ready = Vec::new();
        for (n, i) in &imgs {
            let mut cs = ContainerStatus {
                name: n.clone(),
                image: i.clone(),
                ready: false,
                started: Some(false),
                ..ContainerStatus::default()
            };
            let spec = snapshot
                .spec
                .as_ref()
                .and_then(|s| s.containers.iter().find(|c| &c.name == n))
                .cloned()
                .unwrap_or_default();
            let keepalive = spec.command.as_ref().and_then(|c| c.first()).cloned();
            if i.contains("pull-error") {
                pulling = true;
                cs.state = Some(waiting("ErrImagePull", Some(pull_message(i))));
            } else if i.contains("root-user") && runs_as_root_against_policy(&snapshot, &spec) {
                let pod_id = format!(
                    "{}_{}({})",
                    snapshot.metadata.name.as_deref().unwrap_or(""),
                    snapshot.metadata.namespace.as_deref().unwrap_or(""),
                    snapshot.metadata.uid.as_deref().unwrap_or("")
                );
                cs.state = Some(waiting(
                    "CreateContainerConfigError",
                    Some(format!(
                        "container has runAsNonRoot and image will run as root (pod: \"{pod_id}\", container: {n})"
                    )),
                ));
            } else if let Some(why) = refused.clone() {
                start_error = true;
                cs.image_id = format!("{i}@sha256:{}", "0".repeat(64));
                cs.state = Some(ContainerState {
                    terminated: Some(ContainerStateTerminated {
                        exit_code: 128,
                        reason: Some("StartError".into()),
                        message: Some(why),
                        started_at: Some(now()),
                        finished_at: Some(now()),
                        ..ContainerStateTerminated::default()
                    }),
                    ..ContainerState::default()
                });
            } else if let Some(exe) =
                keepalive.filter(|e| !shared.opts.containers && !executable_exists(e))
            {
                // The runtime cannot start the main process: the container never runs.
                start_error = true;
                cs.image_id = format!("{i}@sha256:{}", "0".repeat(64));
                cs.container_id = Some(format!("containerd://{}", new_uid().replace('-', "")));
                cs.state = Some(ContainerState {
                    terminated: Some(ContainerStateTerminated {
                        exit_code: 128,
                        reason: Some("StartError".into()),
                        message: Some(format!(
                            "failed to create containerd task: failed to create shim task: OCI runtime create failed: runc create failed: unable to start container process: error during container init: exec: \"{exe}\": executable file not found in $PATH: unknown"
                        )),
                        started_at: Some(now()),
                        finished_at: Some(now()),
                        ..ContainerStateTerminated::default()
                    }),
                    ..ContainerState::default()
                });
            } else if i.contains("cannot-run") {
                // Docker's (and cri-dockerd's) word for a container whose runtime refused to
                // start it, here for a bind mount onto a file of the image.
                start_error = true;
                cs.image_id = format!("{i}@sha256:{}", "0".repeat(64));
                cs.container_id = Some(format!("docker://{}", new_uid().replace('-', "")));
                cs.state = Some(ContainerState {
                    terminated: Some(ContainerStateTerminated {
                        exit_code: 128,
                        reason: Some("ContainerCannotRun".into()),
                        message: Some(
                            "OCI runtime create failed: runc create failed: unable to start container process: error during container init: error mounting \"/var/lib/kubelet/pods/double/volumes/kubernetes.io~empty-dir/work\" to rootfs at \"/etc/hostname\": mount /etc/hostname: not a directory: unknown".into(),
                        ),
                        started_at: Some(now()),
                        finished_at: Some(now()),
                        ..ContainerStateTerminated::default()
                    }),
                    ..ContainerState::default()
                });
            } else if i.contains("config-error") {
                cs.state = Some(waiting(
                    "CreateContainerConfigError",
                    Some("secret \"double-config-error\" not found".into()),
                ));
            } else {
                cs.ready = true;
                cs.started = Some(true);
                cs.image_id = format!("{i}@sha256:{}", "0".repeat(64));
                cs.container_id = Some(format!("containerd://{}", new_uid().replace('-', "")));
                cs.state = Some(ContainerState {
                    running: Some(ContainerStateRunning {
                        started_at: Some(now()),
                    }),
                    ..ContainerState::default()
                });
            }
            if !cs.ready {
                not_ready.push(n.clone());
            }
            statuses.push(cs);
        }
        s.container_statuses = Some(statuses);
        set_cond(s, cond("PodReadyToStartContainers", true, None, None));
        s.pod_ip = Some(ip.clone());
        s.pod_ips = Some(vec![PodIP { ip: ip.clone() }]);
        if start_error {
            s.phase = Some("Failed".into());
        } else if not_ready.is_empty() {
            s.phase = Some("Running".into());
            set_cond(s, cond("Ready", true, None, None));
            set_cond(s, cond("ContainersReady", true, None, None));
        } else {
            set_cond(
                s,
                cond(
                    "Ready",
                    false,
                    Some("ContainersNotReady"),
                    Some(unready(&not_ready)),
                ),
            );
            set_cond(
                s,
                cond(
                    "ContainersReady",
                    false,
                    Some("ContainersNotReady"),
                    Some(unready(&not_ready)),
                ),
            );
        }
    });
    if !pulling {
        return;
    }
    tokio::time::sleep(delay).await;
    // 4. The kubelet backs off from pulling.
    step(&shared, &ns, &name, &uid, |p| {
        let Some(cs) = p
            .status
            .as_mut()
            .and_then(|s| s.container_statuses.as_mut())
        else {
            return;
        };
        for c in cs.iter_mut().filter(|c| c.image.contains("pull-error")) {
            let img = c.image.clone();
            c.state = Some(waiting(
                "ImagePullBackOff",
                Some(format!(
                    "Back-off pulling image \"{img}\": ErrImagePull: {}",
                    pull_message(&img)
                )),
            ));
        }
    });
}

/// `activeDeadlineSeconds`: the kubelet fails the pod and kills its containers.
pub(super) async fn deadline(
    shared: Arc<Shared>,
    ns: String,
    name: String,
    uid: String,
    secs: i64,
) {
    tokio::time::sleep(Duration::from_secs(secs.max(0) as u64)).await;
    let failed = step(&shared, &ns, &name, &uid, |p| {
        let s = p.status.get_or_insert_with(PodStatus::default);
        s.phase = Some("Failed".into());
        s.reason = Some("DeadlineExceeded".into());
        s.message = Some("Pod was active on the node longer than the specified deadline".into());
        let mut names = Vec::new();
        for c in s.container_statuses.iter_mut().flatten() {
            names.push(c.name.clone());
            let started_at = c
                .state
                .as_ref()
                .and_then(|st| st.running.as_ref())
                .and_then(|r| r.started_at.clone());
            c.ready = false;
            c.started = Some(false);
            c.state = Some(ContainerState {
                terminated: Some(ContainerStateTerminated {
                    exit_code: 137,
                    reason: Some("Error".into()),
                    started_at,
                    finished_at: Some(now()),
                    container_id: c.container_id.clone(),
                    ..ContainerStateTerminated::default()
                }),
                ..ContainerState::default()
            });
        }
        set_cond(s, cond("Ready", false, Some("PodFailed"), None));
        set_cond(s, cond("ContainersReady", false, Some("PodFailed"), None));
        set_cond(s, cond("PodReadyToStartContainers", false, None, None));
    });
    if failed {
        shared.kill_execs(Some((&ns, &name)));
    }
}

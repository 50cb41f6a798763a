//! Every object of the plain manifests (`manifests/*.yaml`, the chart rendered with its
//! defaults) and of the chart rendered with every option on
//! (`tests/fixtures/chart-full.yaml`, from `charts/mcp-run/ci/full-values.yaml`) parses into
//! its k8s-openapi type with no field left over, and the install is hardened: least RBAC in
//! the runner namespace only, a non-root gateway with a read-only root filesystem and no
//! capabilities, runner pods closed to ingress.
//!
//! Both files are kept identical to the chart's render by `.ci/chart-check.py`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{
    ConfigMap, Namespace, PodSpec, Secret, Service, ServiceAccount, Volume, VolumeMount,
};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

/// The objects of one install, typed.
#[derive(Default)]
struct Install {
    namespaces: Vec<Namespace>,
    deployments: Vec<Deployment>,
    services: Vec<Service>,
    service_accounts: Vec<ServiceAccount>,
    config_maps: Vec<ConfigMap>,
    secrets: Vec<Secret>,
    /// The runner namespace's Role (pods, exec, claims).
    roles: Vec<Role>,
    /// The gateway namespace's Role that reads the replicas' EndpointSlices.
    peer_roles: Vec<Role>,
    role_bindings: Vec<RoleBinding>,
    network_policies: Vec<NetworkPolicy>,
    pdbs: Vec<PodDisruptionBudget>,
    service_monitors: Vec<Value>,
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Finds where `back` (the typed object serialised again) differs from `input`: a field the
/// type does not know is silently dropped by k8s-openapi, so it shows up here.
fn diff(path: &str, input: &Value, back: &Value, out: &mut Vec<String>) {
    match (input, back) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, va) in a {
                match b.get(k) {
                    Some(vb) => diff(&format!("{path}.{k}"), va, vb, out),
                    None => out.push(format!("{path}.{k}: unknown field (misspelt?)")),
                }
            }
            for k in b.keys().filter(|k| !a.contains_key(*k)) {
                out.push(format!("{path}.{k}: added by the type"));
            }
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            for (i, (va, vb)) in a.iter().zip(b).enumerate() {
                diff(&format!("{path}[{i}]"), va, vb, out);
            }
        }
        (a, b) if a == b => {}
        (a, b) => out.push(format!("{path}: {a} became {b}")),
    }
}

/// Parses `value` as `T`, failing on any field `T` does not have.
fn strict<T: DeserializeOwned + serde::Serialize>(what: &str, value: &Value) -> T {
    let typed: T = serde_json::from_value(value.clone())
        .unwrap_or_else(|e| panic!("{what}: does not parse: {e}"));
    let back = serde_json::to_value(&typed).unwrap();
    let mut problems = Vec::new();
    diff("", value, &back, &mut problems);
    assert!(
        problems.is_empty(),
        "{what}: not exactly its type:\n{}",
        problems.join("\n")
    );
    typed
}

fn load(files: &[PathBuf]) -> Install {
    let mut install = Install::default();
    for file in files {
        let text = std::fs::read_to_string(file).unwrap();
        for doc in yaml_serde::Deserializer::from_str(&text) {
            let value = Value::deserialize(doc)
                .unwrap_or_else(|e| panic!("{}: invalid YAML: {e}", file.display()));
            if value.is_null() {
                continue;
            }
            let kind = value["kind"].as_str().unwrap_or_default().to_owned();
            let api = value["apiVersion"].as_str().unwrap_or_default().to_owned();
            let what = format!(
                "{}: {kind} {}",
                file.display(),
                value["metadata"]["name"].as_str().unwrap_or("?")
            );
            match (api.as_str(), kind.as_str()) {
                ("v1", "Namespace") => install.namespaces.push(strict(&what, &value)),
                ("apps/v1", "Deployment") => install.deployments.push(strict(&what, &value)),
                ("v1", "Service") => install.services.push(strict(&what, &value)),
                ("v1", "ServiceAccount") => install.service_accounts.push(strict(&what, &value)),
                ("v1", "ConfigMap") => install.config_maps.push(strict(&what, &value)),
                ("v1", "Secret") => install.secrets.push(strict(&what, &value)),
                ("rbac.authorization.k8s.io/v1", "Role") => {
                    let role: Role = strict(&what, &value);
                    let discovery = role.rules.iter().flatten().any(|r| {
                        r.api_groups.as_deref() == Some(&["discovery.k8s.io".to_string()][..])
                    });
                    if discovery {
                        install.peer_roles.push(role)
                    } else {
                        install.roles.push(role)
                    }
                }
                ("rbac.authorization.k8s.io/v1", "RoleBinding") => {
                    install.role_bindings.push(strict(&what, &value))
                }
                ("networking.k8s.io/v1", "NetworkPolicy") => {
                    install.network_policies.push(strict(&what, &value))
                }
                ("policy/v1", "PodDisruptionBudget") => install.pdbs.push(strict(&what, &value)),
                // A CRD with no k8s-openapi type; .ci/chart-check.py validates its shape.
                ("monitoring.coreos.com/v1", "ServiceMonitor") => {
                    install.service_monitors.push(value)
                }
                _ => panic!("{what}: unexpected object {api} {kind} (cluster-wide or unknown)"),
            }
        }
    }
    install
}

fn manifests() -> Install {
    let mut files: Vec<PathBuf> = std::fs::read_dir(root().join("manifests"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 2, "manifests/ holds {files:?}");
    load(&files)
}

fn full() -> Install {
    load(&[root().join("tests/fixtures/chart-full.yaml")])
}

fn labels_match(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// The mount of the gateway container at `path`, and its volume.
fn mounted_at<'a>(pod: &'a PodSpec, path: &str) -> (&'a VolumeMount, &'a Volume) {
    let mount = pod.containers[0]
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.mount_path == path)
        .unwrap_or_else(|| panic!("nothing mounted at {path}"));
    let volume = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == mount.name)
        .unwrap_or_else(|| panic!("no volume {}", mount.name));
    (mount, volume)
}

/// The NetworkPolicy whose pod selector matches `labels`.
fn selecting<'a>(i: &'a Install, labels: &BTreeMap<String, String>) -> Option<&'a NetworkPolicy> {
    i.network_policies.iter().find(|np| {
        np.spec
            .as_ref()
            .and_then(|s| s.pod_selector.as_ref())
            .and_then(|s| s.match_labels.as_ref())
            .is_some_and(|m| labels_match(m, labels))
    })
}

/// The gateway config file of the install, as YAML.
fn gateway_config(i: &Install) -> Value {
    assert_eq!(i.config_maps.len(), 1);
    let text = &i.config_maps[0].data.as_ref().unwrap()["config.yaml"];
    yaml_serde::from_str(text).unwrap()
}

/// Bytes of a binary-suffixed quantity (`1536Mi`, `2Gi`, `1000`).
fn quantity_bytes(q: &str) -> u64 {
    let (n, unit) = q.split_at(q.find(|c: char| !c.is_ascii_digit()).unwrap_or(q.len()));
    let n: u64 = n.parse().unwrap_or_else(|_| panic!("quantity {q}"));
    n * match unit {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        other => panic!("unit {other} of {q}"),
    }
}

/// Checks every property the install must have, whatever the values.
fn check_hardening(i: &Install) {
    assert_eq!(i.deployments.len(), 1);
    let deploy = &i.deployments[0];
    let ns = deploy.metadata.namespace.as_deref().unwrap();
    let spec = deploy.spec.as_ref().unwrap();
    let template = &spec.template;
    let pod_labels = template.metadata.as_ref().unwrap().labels.clone().unwrap();
    for key in [
        "app.kubernetes.io/name",
        "app.kubernetes.io/instance",
        "app.kubernetes.io/version",
        "app.kubernetes.io/component",
        "app.kubernetes.io/managed-by",
    ] {
        assert!(pod_labels.contains_key(key), "pod label {key} missing");
    }
    assert!(labels_match(
        spec.selector.match_labels.as_ref().unwrap(),
        &pod_labels
    ));
    let pod = template.spec.as_ref().unwrap();

    // The gateway needs its token to call the API server; its ServiceAccount mounts none
    // for anyone else.
    assert_eq!(pod.automount_service_account_token, Some(true));
    let sa_name = pod.service_account_name.as_deref().unwrap();
    if let Some(sa) = i
        .service_accounts
        .iter()
        .find(|s| s.metadata.name.as_deref() == Some(sa_name))
    {
        assert_eq!(sa.automount_service_account_token, Some(false));
    }

    let psc = pod.security_context.as_ref().unwrap();
    assert_eq!(psc.run_as_non_root, Some(true));
    assert!(psc.run_as_user.is_some_and(|u| u != 0));
    assert_eq!(
        psc.seccomp_profile.as_ref().unwrap().type_,
        "RuntimeDefault"
    );
    assert_eq!(pod.host_network, None);
    assert_eq!(pod.host_pid, None);
    assert_eq!(pod.containers.len(), 1);
    let c = &pod.containers[0];
    let sc = c.security_context.as_ref().unwrap();
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_ne!(sc.privileged, Some(true));
    assert_eq!(sc.run_as_non_root, Some(true));
    let caps = sc.capabilities.as_ref().unwrap();
    assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_string()][..]));
    assert!(caps.add.as_ref().is_none_or(Vec::is_empty));

    // Probes on the gateway's endpoints, on its named port.
    let path = |p: &Option<k8s_openapi::api::core::v1::Probe>| {
        p.as_ref()
            .and_then(|p| p.http_get.as_ref())
            .and_then(|h| h.path.clone())
    };
    assert_eq!(path(&c.liveness_probe).as_deref(), Some("/healthz"));
    assert_eq!(path(&c.readiness_probe).as_deref(), Some("/readyz"));
    let port = &c.ports.as_ref().unwrap()[0];
    assert_eq!(port.name.as_deref(), Some("http"));

    // Run as `serve --backend kube` with the mounted config file.
    let args = c.args.clone().unwrap();
    let arg_after = |flag: &str| {
        let at = args.iter().position(|a| a == flag).unwrap();
        args[at + 1].clone()
    };
    assert_eq!(args[0], "serve");
    assert_eq!(arg_after("--backend"), "kube");
    assert_eq!(
        arg_after("--listen"),
        format!("0.0.0.0:{}", port.container_port)
    );
    let config_path = arg_after("--config");
    let (_, volume) = mounted_at(pod, &config_path);
    assert_eq!(
        volume.config_map.as_ref().unwrap().name,
        i.config_maps[0].metadata.name.clone().unwrap()
    );

    // The MCP output store has a volume of its own, large enough for its bound: kept
    // outputs never fill the small /tmp (and get the gateway evicted).
    let config = gateway_config(i);
    let store = &config["mcp"]["output_store"];
    let store_dir = store["dir"].as_str().expect("mcp.output_store.dir is set");
    let (_, volume) = mounted_at(pod, store_dir);
    let limit = volume
        .empty_dir
        .as_ref()
        .and_then(|e| e.size_limit.as_ref())
        .expect("the output store's emptyDir has a sizeLimit");
    let bound = store["max_bytes"]
        .as_u64()
        .expect("mcp.output_store.max_bytes");
    assert!(
        quantity_bytes(&limit.0) >= bound + 256 * 1024 * 1024,
        "output store volume {} below max_bytes {bound} plus room for running outputs",
        limit.0
    );

    // The downward API gives the gateway its identity.
    let env = c.env.as_ref().unwrap();
    for (var, field) in [
        ("MCP_RUN_POD_NAME", "metadata.name"),
        ("MCP_RUN_POD_NAMESPACE", "metadata.namespace"),
        ("MCP_RUN_POD_UID", "metadata.uid"),
    ] {
        let e = env.iter().find(|e| e.name == var).unwrap();
        let f = e.value_from.as_ref().unwrap().field_ref.as_ref().unwrap();
        assert_eq!(f.field_path, field);
    }

    // The config drives the kube backend in the runner namespace, and the pod outlives the
    // drain.
    let config = gateway_config(i);
    assert_eq!(config["server"]["backend"], "kube");
    assert_eq!(
        config["server"]["listen"],
        format!("0.0.0.0:{}", port.container_port)
    );
    assert!(config["profiles"]["default"]["image"].is_string());
    let grace = config["server"]["shutdown_grace_secs"].as_i64().unwrap();
    assert!(pod.termination_grace_period_seconds.unwrap() > grace);
    let runner_ns = config["kubernetes"]["namespace"].as_str().unwrap();

    // RBAC: one Role in the runner namespace, pods and pods/exec only, bound to the
    // gateway's ServiceAccount; in the gateway's namespace, reading EndpointSlices only (the
    // replicas' discovery).
    assert_eq!(i.roles.len(), 1);
    for role in &i.peer_roles {
        assert_eq!(role.metadata.namespace, i.deployments[0].metadata.namespace);
        let rules = role.rules.as_ref().unwrap();
        assert_eq!(rules.len(), 1);
        assert_eq!(
            rules[0].resources.as_deref(),
            Some(&["endpointslices".to_string()][..])
        );
        assert_eq!(rules[0].verbs, ["get", "list", "watch"]);
        assert!(rules[0].resource_names.is_none());
    }
    let role = &i.roles[0];
    assert_eq!(role.metadata.namespace.as_deref(), Some(runner_ns));
    for rule in role.rules.as_ref().unwrap() {
        assert_eq!(rule.api_groups.as_deref(), Some(&[String::new()][..]));
        assert!(rule.resource_names.is_none() && rule.non_resource_urls.is_none());
        let resources = rule.resources.as_ref().unwrap();
        for verb in &rule.verbs {
            let allowed: &[&str] = match resources.as_slice() {
                [r] if r == "pods" => &["create", "get", "list", "watch", "delete", "patch"],
                [r] if r == "pods/exec" => &["create", "get"],
                // Cache volumes: exactly what the claims' life needs (no update, no
                // deletecollection).
                [r] if r == "persistentvolumeclaims" => {
                    &["create", "get", "list", "watch", "patch", "delete"]
                }
                other => panic!("the Role grants {other:?}"),
            };
            assert!(
                allowed.contains(&verb.as_str()),
                "verb {verb} on {resources:?}"
            );
        }
    }
    let exec = role
        .rules
        .as_ref()
        .unwrap()
        .iter()
        .find(|r| r.resources.as_deref() == Some(&["pods/exec".to_string()][..]))
        .unwrap();
    // WebSocket exec is authorized as `get`, and from Kubernetes 1.35 also as `create`.
    assert!(exec.verbs.contains(&"get".into()) && exec.verbs.contains(&"create".into()));
    assert_eq!(i.role_bindings.len(), 1 + i.peer_roles.len());
    let rb = i
        .role_bindings
        .iter()
        .find(|rb| rb.metadata.namespace.as_deref() == Some(runner_ns))
        .unwrap();
    for peer_role in &i.peer_roles {
        let prb = i
            .role_bindings
            .iter()
            .find(|rb| Some(&rb.role_ref.name) == peer_role.metadata.name.as_ref())
            .expect("the peer Role is bound");
        assert_eq!(prb.subjects.as_ref().unwrap()[0].name, sa_name);
    }
    assert_eq!(rb.role_ref.kind, "Role");
    assert_eq!(Some(&rb.role_ref.name), role.metadata.name.as_ref());
    let subjects = rb.subjects.as_ref().unwrap();
    assert_eq!(subjects.len(), 1);
    assert_eq!(subjects[0].kind, "ServiceAccount");
    assert_eq!(subjects[0].name, sa_name);
    assert_eq!(subjects[0].namespace.as_deref(), Some(ns));

    // The Service reaches the gateway's pods on the named port (the headless peer Service
    // aside).
    let services: Vec<&Service> = i
        .services
        .iter()
        .filter(|s| s.spec.as_ref().unwrap().cluster_ip.as_deref() != Some("None"))
        .collect();
    assert_eq!(services.len(), 1);
    let svc = services[0].spec.as_ref().unwrap();
    assert!(labels_match(svc.selector.as_ref().unwrap(), &pod_labels));
    assert_eq!(
        svc.ports.as_ref().unwrap()[0].target_port,
        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String("http".into()))
    );

    // The disruption budget covers the gateway's pods.
    for pdb in &i.pdbs {
        let selector = pdb.spec.as_ref().unwrap().selector.as_ref().unwrap();
        assert!(labels_match(
            selector.match_labels.as_ref().unwrap(),
            &pod_labels
        ));
    }

    // Runner pods: no ingress at all.
    let runner_labels: BTreeMap<String, String> = [
        ("app.kubernetes.io/name", "mcp-run"),
        ("app.kubernetes.io/component", "runner"),
        ("app.kubernetes.io/managed-by", "mcp-run"),
        ("mcp-run.dev/instance", "some-gateway"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    let runner_np = selecting(i, &runner_labels).expect("a NetworkPolicy selects the runner pods");
    assert_eq!(runner_np.metadata.namespace.as_deref(), Some(runner_ns));
    let np = runner_np.spec.as_ref().unwrap();
    assert!(
        np.policy_types
            .as_ref()
            .unwrap()
            .contains(&"Ingress".into())
    );
    assert!(np.ingress.as_ref().is_none_or(Vec::is_empty));
    let gateway_np = selecting(i, &pod_labels).expect("a NetworkPolicy selects the gateway");
    let ingress = gateway_np.spec.as_ref().unwrap().ingress.as_ref().unwrap();
    assert!(
        ingress
            .iter()
            .all(|r| r.from.as_ref().is_some_and(|f| !f.is_empty()))
    );
}

#[test]
fn default_manifests_parse_strictly_and_are_hardened() {
    let i = manifests();
    check_hardening(&i);
    // The namespace file creates the gateway's namespace; the chart creates the runners'
    // own, where alone the gateway's Role is. Both enforce Pod Security `restricted`.
    assert_eq!(i.namespaces.len(), 2);
    let gw_ns = i.deployments[0].metadata.namespace.clone().unwrap();
    let runner_ns = i.roles[0].metadata.namespace.clone().unwrap();
    assert_ne!(
        gw_ns, runner_ns,
        "no permission in the gateway's own namespace"
    );
    assert_eq!(runner_ns, format!("{gw_ns}-runners"));
    for ns in [&gw_ns, &runner_ns] {
        let n = i
            .namespaces
            .iter()
            .find(|n| n.metadata.name.as_ref() == Some(ns))
            .unwrap_or_else(|| panic!("namespace {ns} is created"));
        assert_eq!(
            n.metadata.labels.as_ref().unwrap()["pod-security.kubernetes.io/enforce"],
            "restricted",
            "{ns}"
        );
    }
    // Defaults: no ServiceMonitor; auth on, with the token from
    // the Secret `mcp-run-auth` and the peer secret from `mcp-run-peer`, which the user
    // creates (none in the file, which is published).
    let pod = i.deployments[0]
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap();
    let secret_volumes: Vec<&str> = pod
        .volumes
        .iter()
        .flatten()
        .filter_map(|v| v.secret.as_ref()?.secret_name.as_deref())
        .collect();
    assert_eq!(secret_volumes, ["mcp-run-auth", "mcp-run-peer"]);
    let verbs: Vec<&String> = i.roles[0]
        .rules
        .as_ref()
        .unwrap()
        .iter()
        .flat_map(|r| &r.verbs)
        .collect();
    // Sessions are on by default: a call holds its session's pod by patching it.
    assert!(verbs.contains(&&"patch".to_string()), "{verbs:?}");
    // No profile declares caches: no PersistentVolumeClaim rule.
    assert!(
        i.roles[0]
            .rules
            .as_ref()
            .unwrap()
            .iter()
            .all(|r| r.resources.as_deref() != Some(&["persistentvolumeclaims".to_string()][..])),
        "{:?}",
        i.roles[0].rules
    );
    assert!(i.secrets.is_empty() && i.service_monitors.is_empty());
    assert_eq!(i.service_accounts.len(), 1);
}

#[test]
fn full_render_parses_strictly_and_is_hardened() {
    let i = full();
    check_hardening(&i);
    let config = gateway_config(&i);
    assert_eq!(config["kubernetes"]["namespace"], "mcp-runners");
    assert_eq!(
        i.roles[0].metadata.namespace.as_deref(),
        Some("mcp-runners")
    );
    // Patch on pods (sessions, and the warm pool's claims).
    assert!(
        i.roles[0].rules.as_ref().unwrap()[0]
            .verbs
            .contains(&"patch".into())
    );
    // The rust profile's caches add the claims' six verbs, and nothing else.
    let pvc = i.roles[0]
        .rules
        .as_ref()
        .unwrap()
        .iter()
        .find(|r| r.resources.as_deref() == Some(&["persistentvolumeclaims".to_string()][..]))
        .expect("a PersistentVolumeClaim rule");
    let mut verbs = pvc.verbs.clone();
    verbs.sort();
    assert_eq!(verbs, ["create", "delete", "get", "list", "patch", "watch"]);
    // The auth Secret is mounted and named to the gateway.
    assert_eq!(i.secrets.len(), 1);
    let pod = i.deployments[0]
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap();
    let c = &pod.containers[0];
    let env = c.env.as_ref().unwrap();
    let file = env
        .iter()
        .find(|e| e.name == "MCP_RUN_AUTH_TOKENS_FILE")
        .and_then(|e| e.value.clone())
        .unwrap();
    let dir = Path::new(&file)
        .parent()
        .unwrap()
        .to_str()
        .unwrap()
        .to_owned();
    let (mount, volume) = mounted_at(pod, &dir);
    assert_eq!(mount.read_only, Some(true));
    assert_eq!(
        volume.secret.as_ref().unwrap().secret_name,
        i.secrets[0].metadata.name
    );
    // The ServiceMonitor scrapes /metrics on the Service's port.
    assert_eq!(i.service_monitors.len(), 1);
    let endpoint = &i.service_monitors[0]["spec"]["endpoints"][0];
    assert_eq!(endpoint["path"], "/metrics");
    assert_eq!(endpoint["port"], "http");
    // Runner egress restricted: DNS plus the configured rule, not everything.
    let runner = i
        .network_policies
        .iter()
        .find(|np| np.metadata.name.as_deref() == Some("gw-runner"))
        .unwrap();
    let egress = runner.spec.as_ref().unwrap().egress.as_ref().unwrap();
    assert_eq!(egress.len(), 2);
    assert!(egress.iter().all(|r| r.to.is_some()));
}

#[test]
fn a_misspelt_field_is_caught() {
    let good = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "x"},
        "spec": {"ports": [{"port": 80, "targetPort": "http"}]}
    });
    let _: Service = strict("good", &good);
    let mut bad = good.clone();
    bad["spec"]["ports"][0]["targetPrt"] = "http".into();
    let caught = std::panic::catch_unwind(|| {
        let _: Service = strict("bad", &bad);
    });
    assert!(caught.is_err());
}

/// The rendered configuration is accepted by the gateway's own loader, and the chart names
/// the installation in `kubernetes.instance` so that the reaper stays within it.
#[test]
fn the_gateway_accepts_the_rendered_config() {
    for i in [manifests(), full()] {
        let text = &i.config_maps[0].data.as_ref().unwrap()["config.yaml"];
        let c = mcp_run::Config::parse(text, Some(Path::new("configmap/config.yaml")))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.kubernetes.instance, "mcp-run", "the release name");
        assert_eq!(c.server.backend, mcp_run::BackendKind::Kube);
        // Auth is on in both: the gateway refuses to start without its tokens.
        assert!(c.auth.required);
        assert!(!c.server.insecure_no_auth);
    }
    let full = full();
    let text = &full.config_maps[0].data.as_ref().unwrap()["config.yaml"];
    let c = mcp_run::Config::parse(text, None).unwrap();
    assert_eq!(c.tools.len(), 1);
    assert!(c.templates.contains_key("make"));
    assert!(!c.policy.executables.deny.is_empty());
    // The caches' bounds and a profile's caches reach the gateway as written.
    assert_eq!(c.caches.storage_class.as_deref(), Some("fast-ssd"));
    assert_eq!(c.caches.access_mode, "ReadWriteOncePod");
    let rust = &c.profiles["rust"];
    assert_eq!(rust.caches.len(), 2);
    assert_eq!(rust.caches[0].env["CARGO_TARGET_DIR"], "target");
}

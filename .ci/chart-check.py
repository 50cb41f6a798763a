#!/usr/bin/env python3
"""Checks of the Helm chart, the plain manifests and the Dockerfile (issue 7).

Run from the repository root inside the virtualenv made by .ci/chart.sh:

    python .ci/chart-check.py          # check; exit 1 on any failure
    python .ci/chart-check.py --write  # regenerate manifests/ and the full-values fixture

What it checks:
- `helm lint --strict` (the Helm 4 library of helm-python-sdk) with the default values and
  with every values file under charts/mcp-run/ci/;
- values.schema.json is a valid JSON schema, accepts the default and CI values, and rejects
  each value of BAD_VALUES (with Helm's own schema validation);
- every object rendered with the default and the CI values validates strictly (no unknown
  field) against the Kubernetes OpenAPI schema of KUBE_VERSION (kubernetes-validate), or
  for CRD kinds, against the small schemas below;
- manifests/mcp-run.yaml and tests/fixtures/chart-full.yaml are exactly the renders;
- hadolint finds nothing in the Dockerfile.
"""

from __future__ import annotations

import base64
import copy
import json
import pathlib
import subprocess
import sys

import helm_python as helm
import jsonschema
import kubernetes_validate
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "mcp-run"
KUBE_VERSION = "1.33.0"  # the Kubernetes API version k8s-openapi is built for (Cargo.toml)
RELEASE = "mcp-run"
NAMESPACE = "mcp-run"

# (what the render is for, values file or None for defaults, output file)
RENDERS = [
    ("default", None, None),
    ("ci/manifests-values.yaml", CHART / "ci" / "manifests-values.yaml", ROOT / "manifests" / "mcp-run.yaml"),
    ("full", CHART / "ci" / "full-values.yaml", ROOT / "tests" / "fixtures" / "chart-full.yaml"),
]

# Each must be refused by values.schema.json: (description, values overriding the defaults).
BAD_VALUES = [
    ("unknown top-level key", {"replicas": 2}),
    ("unknown gateway config key", {"config": {"server": {"listen_addr": "0.0.0.0:1"}}}),
    ("unknown config section", {"config": {"limitz": {}}}),
    ("zero keep-alive", {"config": {"server": {"keepalive_secs": 0}}}),
    ("negative timeout", {"config": {"limits": {"max_timeout_secs": -1}}}),
    ("timeout as a string", {"config": {"limits": {"default_timeout_secs": "10"}}}),
    ("profile without image", {"config": {"profiles": {"gpu": {"runtime_class_name": "x"}}}}),
    ("unknown profile key", {"config": {"profiles": {"default": {"image": "a", "imagee": "b"}}}}),
    ("bad log format", {"logFormat": "xml"}),
    ("bad pull policy", {"image": {"pullPolicy": "Sometimes"}}),
    ("bad service type", {"service": {"type": "Ingress"}}),
    ("port out of range", {"service": {"port": 70000}}),
    ("runner namespace not a DNS label", {"runner": {"namespace": "Runners_1"}}),
    ("token not a string", {"auth": {"enabled": True, "tokens": [123]}}),
    ("replicas below zero", {"replicaCount": -1}),
    ("cache without a path", {"config": {"profiles": {"default": {"image": "a", "caches": [{"name": "c"}]}}}}),
    ("cache size as a number", {"config": {"profiles": {"default": {"image": "a", "caches": [{"name": "c", "path": "/c", "size": 5}]}}}}),
    ("unknown cache scope", {"config": {"profiles": {"default": {"image": "a", "caches": [{"name": "c", "path": "/c", "scope": "global"}]}}}}),
    ("unknown caches key", {"config": {"caches": {"ttl": 5}}}),
]

# CRD kinds kubernetes-validate has no schema for: the fields the chart uses, strictly.
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": "ServiceMonitor"},
            "metadata": {"type": "object"},
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["selector", "endpoints"],
                "properties": {
                    "selector": {"type": "object"},
                    "namespaceSelector": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "matchNames": {"type": "array", "items": {"type": "string"}},
                            "any": {"type": "boolean"},
                        },
                    },
                    "endpoints": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "port": {"type": "string"},
                                "path": {"type": "string"},
                                "scheme": {"enum": ["http", "https"]},
                                "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                                "scrapeTimeout": {
                                    "type": "string",
                                    "pattern": "^[0-9]+(ms|s|m|h)$",
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}

# helm's install order (pkg/release/util/kind_sorter.go), for a stable, applicable file.
INSTALL_ORDER = [
    "PriorityClass", "Namespace", "NetworkPolicy", "ResourceQuota", "LimitRange",
    "PodSecurityPolicy", "PodDisruptionBudget", "ServiceAccount", "Secret", "SecretList",
    "ConfigMap", "StorageClass", "PersistentVolume", "PersistentVolumeClaim",
    "CustomResourceDefinition", "ClusterRole", "ClusterRoleList", "ClusterRoleBinding",
    "ClusterRoleBindingList", "Role", "RoleList", "RoleBinding", "RoleBindingList", "Service",
    "DaemonSet", "Pod", "ReplicationController", "ReplicaSet", "Deployment",
    "HorizontalPodAutoscaler", "StatefulSet", "Job", "CronJob", "IngressClass", "Ingress",
    "APIService", "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration",
]

HEADER = (
    "# Generated by .ci/chart-check.py --write from charts/mcp-run with {what} values\n"
    "# (release {release}, namespace {namespace}). Do not edit: CI checks it is identical.\n"
)


class Checks:
    def __init__(self) -> None:
        self.failures: list[str] = []
        self.passed = 0

    def ok(self, what: str) -> None:
        self.passed += 1
        print(f"ok: {what}")

    def fail(self, what: str, why: str) -> None:
        self.failures.append(f"{what}: {why}")
        print(f"FAIL: {what}: {why}")


def load_values(path: pathlib.Path | None) -> dict | None:
    if path is None:
        return None
    return yaml.safe_load(path.read_text())


def deep_merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def render(chart: helm.Chart, values: dict | None, what: str) -> str:
    """The chart rendered like `helm template`: documents in install order, each with a
    `# Source:` line."""
    files = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    docs = []
    for source in sorted(files):
        if not source.endswith((".yaml", ".yml")):
            continue  # NOTES.txt
        for index, text in enumerate(files[source].split("\n---")):
            text = text.strip("\n")
            obj = yaml.safe_load(text) if text.strip() else None
            if not obj:
                continue
            kind = obj.get("kind", "")
            order = INSTALL_ORDER.index(kind) if kind in INSTALL_ORDER else len(INSTALL_ORDER)
            docs.append((order, source, index, text))
    docs.sort()
    out = HEADER.format(what=what, release=RELEASE, namespace=NAMESPACE)
    for _, source, _, text in docs:
        out += f"---\n# Source: {source}\n{text}\n"
    return out


def validate_objects(checks: Checks, what: str, text: str) -> list[dict]:
    objects = [o for o in yaml.safe_load_all(text) if o]
    if not objects:
        checks.fail(what, "rendered no object")
    for obj in objects:
        name = f"{what}: {obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        key = (obj.get("apiVersion"), obj.get("kind"))
        try:
            if key in CRD_SCHEMAS:
                jsonschema.validate(obj, CRD_SCHEMAS[key])
            else:
                kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        except Exception as e:  # each library has its own error types
            checks.fail(name, f"invalid object: {getattr(e, 'message', e)}")
            continue
        checks.ok(f"{name} valid (Kubernetes {KUBE_VERSION}, strict)")
    return objects


def check_gateway_config(checks: Checks, what: str, objects: list[dict]) -> None:
    """The rendered config file holds only sections the gateway knows."""
    known = {"server", "limits", "kubernetes", "profiles", "local", "mcp", "remote", "templates", "policy", "tools", "auth", "redaction", "workspaces", "caches"}
    for obj in objects:
        if obj["kind"] != "ConfigMap":
            continue
        config = yaml.safe_load(obj["data"]["config.yaml"])
        unknown = set(config) - known
        if unknown:
            checks.fail(f"{what}: gateway config", f"unknown sections {sorted(unknown)}")
        elif config["server"]["backend"] != "kube" or "default" not in config["profiles"]:
            checks.fail(f"{what}: gateway config", "backend is not kube or no default profile")
        else:
            checks.ok(f"{what}: gateway config has only known sections")


def check_auth_default(checks: Checks, chart: helm.Chart) -> None:
    """Auth is on by default: with no tokens given, the chart generates one (48 random
    characters, a new one per render since `helm template` cannot look the live Secret up)
    into the Secret the gateway mounts."""
    tokens = []
    for _ in range(2):
        objects = [o for o in yaml.safe_load_all(render(chart, None, "default")) if o]
        secrets = [o for o in objects if o["kind"] == "Secret" and not o["metadata"]["name"].endswith("-peer")]
        deployment = next(o for o in objects if o["kind"] == "Deployment")
        volumes = deployment["spec"]["template"]["spec"]["volumes"]
        mounted = [v["secret"]["secretName"] for v in volumes
                   if "secret" in v and v["name"] != "peer-secret"]
        if len(secrets) != 1 or mounted != [secrets[0]["metadata"]["name"]]:
            checks.fail("default auth", f"expected one mounted token Secret, got {mounted}")
            return
        annotations = secrets[0]["metadata"].get("annotations", {})
        if annotations.get("mcp-run.dev/token") != "generated":
            checks.fail("default auth", "the Secret is not marked as generated")
            return
        tokens.append(base64.b64decode(secrets[0]["data"]["tokens"]).decode())
    if all(len(t) == 49 and t.endswith("\n") and t[:-1].isalnum() for t in tokens) \
            and tokens[0] != tokens[1]:
        checks.ok("default values: auth on, a generated 48-character token Secret mounted")
    else:
        checks.fail("default auth", "the generated tokens are not 48 random characters")


def check_replicas_default(checks: Checks, chart: helm.Chart) -> None:
    """Replicas by default (docs/deployment.md "Scaling"): two of them, spread across nodes,
    a rollout that surges before it drains, a grace period that covers the preStop sleep and
    the drain, a generated peer secret mounted as the peer_secret_file, the headless Service
    the config names as peer_service, the Role to read its EndpointSlices and nothing else,
    and a NetworkPolicy rule that admits the peer port from the gateway's pods only."""
    what = "default replicas"
    secrets = []
    for _ in range(2):
        objects = [o for o in yaml.safe_load_all(render(chart, None, "default")) if o]
        by_kind = {}
        for o in objects:
            by_kind.setdefault(o["kind"], []).append(o)
        peer = [o for o in by_kind.get("Secret", []) if o["metadata"]["name"] == "mcp-run-peer"]
        if len(peer) != 1:
            checks.fail(what, "no generated peer Secret mcp-run-peer")
            return
        secrets.append(base64.b64decode(peer[0]["data"]["secret"]).decode())
    deployment = by_kind["Deployment"][0]
    spec = deployment["spec"]
    pod = spec["template"]["spec"]
    gateway = pod["containers"][0]
    config = yaml.safe_load(next(o for o in objects if o["kind"] == "ConfigMap")["data"]["config.yaml"])
    selector = spec["selector"]["matchLabels"]
    problems = []
    if not all(len(s) == 48 and s.isalnum() for s in secrets) or secrets[0] == secrets[1]:
        problems.append("the generated peer secrets are not 48 random characters")
    if spec["replicas"] != 2:
        problems.append(f"replicas {spec['replicas']}, expected 2")
    if spec.get("strategy", {}).get("rollingUpdate") != {"maxSurge": 1, "maxUnavailable": 0}:
        problems.append(f"rolling update {spec.get('strategy')}")
    spread = pod.get("topologySpreadConstraints", [])
    if not any(c["topologyKey"] == "kubernetes.io/hostname" and c["labelSelector"]["matchLabels"] == selector
               for c in spread):
        problems.append(f"not spread across nodes: {spread}")
    sleep = gateway.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    grace = config["server"]["shutdown_grace_secs"]
    if sleep <= 0 or pod["terminationGracePeriodSeconds"] != sleep + grace + 15:
        problems.append(f"grace {pod['terminationGracePeriodSeconds']} is not preStop {sleep} + drain {grace} + 15")
    mounts = {m["name"]: m["mountPath"] for m in gateway["volumeMounts"]}
    if mounts.get("peer-secret") != "/etc/mcp-run/peer" \
            or config["server"].get("peer_secret_file") != "/etc/mcp-run/peer/secret":
        problems.append("the peer secret is not mounted as server.peer_secret_file")
    ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
    if config["server"].get("peer_listen") != f"0.0.0.0:{ports.get('peer')}":
        problems.append(f"peer_listen {config['server'].get('peer_listen')} is not the peer port {ports}")
    headless = [o for o in by_kind["Service"] if o["spec"].get("clusterIP") == "None"]
    if len(headless) != 1 or headless[0]["metadata"]["name"] != config["server"].get("peer_service") \
            or headless[0]["spec"]["selector"] != selector or not headless[0]["spec"].get("publishNotReadyAddresses") \
            or [p["targetPort"] for p in headless[0]["spec"]["ports"]] != ["peer"]:
        problems.append("no headless Service (peer port, not-ready addresses) named by server.peer_service")
    roles = [o for o in by_kind["Role"] if o["metadata"]["namespace"] == NAMESPACE]
    rules = [r for o in roles for r in o["rules"]]
    if rules != [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}]:
        problems.append(f"the gateway's namespace grants more (or less) than reading EndpointSlices: {rules}")
    policy = next(o for o in by_kind["NetworkPolicy"] if o["spec"]["podSelector"]["matchLabels"] == selector)
    peer_rules = [r for r in policy["spec"]["ingress"] if any(p["port"] == "peer" for p in r["ports"])]
    if len(peer_rules) != 1 or peer_rules[0]["from"] != [{"podSelector": {"matchLabels": selector}}]:
        problems.append(f"the peer port is not admitted from the gateway's pods only: {peer_rules}")
    if any(p["port"] == "peer" for r in policy["spec"]["ingress"] if r not in peer_rules for p in r["ports"]):
        problems.append("another ingress rule admits the peer port")
    if not by_kind.get("PodDisruptionBudget"):
        problems.append("no PodDisruptionBudget")
    if problems:
        for p in problems:
            checks.fail(what, p)
    else:
        checks.ok("default values: 2 replicas spread across nodes, surge-first rollout, grace = preStop + drain + 15 s, "
                  "generated peer secret, headless peer Service, EndpointSlice-only Role, peer port from gateway pods only")


def main() -> int:
    write = "--write" in sys.argv[1:]
    checks = Checks()
    helm.disable_logging()
    chart = helm.Chart.load(CHART)
    defaults = chart.values

    schema = chart.schema
    if schema is None:
        checks.fail("values.schema.json", "missing")
    else:
        try:
            jsonschema.Draft7Validator.check_schema(schema)
            checks.ok("values.schema.json is a valid draft-07 schema")
        except jsonschema.SchemaError as e:
            checks.fail("values.schema.json", e.message)

    # Every other values file under ci/ is linted and validated too, without a fixture.
    fixtures = {values_file for _, values_file, _ in RENDERS}
    extra = [(f"ci/{p.name}", p, None) for p in sorted((CHART / "ci").glob("*.yaml"))
             if p not in fixtures]
    for what, values_file, output in RENDERS + extra:
        values = load_values(values_file)
        report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE,
                           kube_version=f"v{KUBE_VERSION}")
        problems = report.get("errors", []) + [
            f"{m['path']}: {m['error']}" for m in report.get("messages", []) if m["severity"] >= 2
        ]
        if problems:
            checks.fail(f"helm lint --strict ({what})", "; ".join(problems))
        else:
            checks.ok(f"helm lint --strict ({what})")
        try:
            chart.validate_schema(deep_merge(defaults, values or {}))
            checks.ok(f"values.schema.json accepts the {what} values")
        except helm.HelmError as e:
            checks.fail(f"values.schema.json ({what})", str(e))

        text = render(chart, values, what)
        objects = validate_objects(checks, what, text)
        check_gateway_config(checks, what, objects)
        if output is None:
            continue
        rel = output.relative_to(ROOT)
        if write:
            output.parent.mkdir(parents=True, exist_ok=True)
            output.write_text(text)
            print(f"wrote {rel}")
        elif not output.exists() or output.read_text() != text:
            checks.fail(str(rel), "differs from the chart's render: run "
                        "`.venv/bin/python .ci/chart-check.py --write` and commit")
        else:
            checks.ok(f"{rel} is identical to the chart's render")

    check_auth_default(checks, chart)
    check_replicas_default(checks, chart)

    for why, override in BAD_VALUES:
        try:
            chart.validate_schema(deep_merge(defaults, override))
        except helm.HelmError:
            checks.ok(f"values.schema.json rejects: {why}")
            continue
        checks.fail("values.schema.json", f"accepts a bad value: {why}: {json.dumps(override)}")

    hadolint = pathlib.Path(sys.executable).parent / "hadolint"
    result = subprocess.run([str(hadolint), str(ROOT / "Dockerfile")], capture_output=True,
                            text=True)
    if result.returncode != 0:
        checks.fail("hadolint Dockerfile", (result.stdout + result.stderr).strip())
    else:
        checks.ok("hadolint Dockerfile")

    chart.close()
    print(f"{checks.passed} passed, {len(checks.failures)} failed")
    return 1 if checks.failures else 0


if __name__ == "__main__":
    sys.exit(main())

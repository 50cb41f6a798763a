#!/usr/bin/env python3
"""A real kubectl against the API-server test double (tests/kube_double), as a platform
engineer would try it: run, get -o yaml/json, get -w, wait, exec (stdout and stderr apart, the
exit code, a 20 MB binary round trip both ways, stdin), auth can-i, delete; and the
PersistentVolumeClaims of cache volumes: create (twice), wait until Bound, get by label,
annotate (with a stale resourceVersion too), delete; and the EndpointSlices that replica
discovery watches: create, get (table, by label, -o json), delete.

Usage: kubectl-conformance.py KUBECTL SERVE_BINARY
SERVE_BINARY is the built integration-test binary (tests/main.rs, with tests/kube_double_serve.rs); it serves the double and
prints KUBECONFIG=... until its stdin closes. Every divergence found here is a bug of the double
(fixed in tests/kube_double, not worked around here). Standard library only.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

STEP_TIMEOUT = 30
failures = []
# Every kubectl watch started, stopped at the end whatever happened.
watches = []


def check(ok, what, detail=""):
    if ok:
        print(f"kubectl-conformance: ok: {what}")
    else:
        failures.append(what)
        print(f"kubectl-conformance: FAIL: {what}" + (f"\n{detail}" if detail else ""), file=sys.stderr)


def main():
    kubectl, serve_bin = sys.argv[1], sys.argv[2]
    work = tempfile.mkdtemp(prefix="kubectl-conformance-")
    server = subprocess.Popen(
        [serve_bin, "--ignored", "--nocapture", "--exact", "kube_double_serve::serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=dict(os.environ, KUBE_DOUBLE_DENY="kube-system/pods//delete"),
    )
    try:
        kubeconfig = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = server.stdout.readline()
            if not line:
                break
            if line.startswith("KUBECONFIG="):
                kubeconfig = line.strip().split("=", 1)[1]
                break
        if kubeconfig is None:
            sys.exit("kubectl-conformance: the double did not start")
        # Drain the server's output so that it never blocks on a full pipe.
        threading.Thread(target=server.stdout.read, daemon=True).start()
        env = dict(os.environ, KUBECONFIG=kubeconfig, KUBECACHEDIR=os.path.join(work, "cache"))
        run_checks(kubectl, env, work)
        run_pvc_checks(kubectl, env, work)
        run_endpointslice_checks(kubectl, env, work)
    finally:
        for w in watches:
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()
        server.stdin.close()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        shutil.rmtree(work, ignore_errors=True)
    if failures:
        sys.exit(f"kubectl-conformance: {len(failures)} failed: {'; '.join(failures)}")
    print("kubectl-conformance: all passed")


def kc(kubectl, env, *args, stdin=None, text=True):
    return subprocess.run(
        [kubectl, *args],
        env=env,
        input=stdin,
        capture_output=True,
        text=text,
        timeout=STEP_TIMEOUT,
    )


class Watch:
    """`kubectl get pods -w ARGS`, logging its requests (-v=6) so that we know when its watch
    is established: `ready` is set once the watch request has been answered."""

    def __init__(self, kubectl, env, *args):
        self.proc = subprocess.Popen(
            [kubectl, "get", "pods", "-w", "-v=6", *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        watches.append(self)
        self.ready = threading.Event()
        self.log = []
        self.out = []
        self.threads = [
            threading.Thread(target=self._stderr, daemon=True),
            threading.Thread(target=lambda: self.out.extend(self.proc.stdout), daemon=True),
        ]
        for t in self.threads:
            t.start()

    def _stderr(self):
        for line in self.proc.stderr:
            self.log.append(line.rstrip())
            if "watch=true" in line and "200 OK" in line:
                self.ready.set()

    def wait_for(self, text, timeout=10):
        """Until the output holds `text` (or the deadline passes: the check then says what
        was seen)."""
        deadline = time.monotonic() + timeout
        while text not in "".join(self.out) and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=10)
        for t in self.threads:
            t.join(timeout=10)
        return "".join(self.out), "\n".join(self.log[-20:])


def run_checks(kubectl, env, work):
    def k(*args, **kw):
        return kc(kubectl, env, *args, **kw)

    r = k("version", "-o", "json")
    server_version = json.loads(r.stdout or "{}").get("serverVersion", {}).get("gitVersion")
    check(r.returncode == 0 and server_version, "version reaches the server over TLS", r.stderr)

    r = k("auth", "can-i", "create", "pods")
    check(r.returncode == 0 and r.stdout.strip() == "yes", "auth can-i create pods", r.stdout + r.stderr)
    r = k("auth", "can-i", "create", "pods", "--subresource=exec")
    check(r.returncode == 0 and r.stdout.strip() == "yes", "auth can-i create pods/exec", r.stdout + r.stderr)
    # The double denies this one (KUBE_DOUBLE_DENY below): the review's fields arrived.
    r = k("auth", "can-i", "delete", "pods", "-n", "kube-system")
    check(r.returncode == 1 and r.stdout.strip() == "no", "auth can-i: a denied verb is no", r.stdout + r.stderr)

    # The watches start before the pod exists, so they see it appear and change.
    watch = Watch(kubectl, env, "--output-watch-events",
                  "-o", "jsonpath={.type} {.object.metadata.name} {.object.status.phase}{\"\\n\"}")
    watch_default = Watch(kubectl, env)
    for w in (watch, watch_default):
        check(w.ready.wait(20), "get -w: the watch is established", "\n".join(w.log))

    r = k("run", "conf", "--image=busybox:1.36", "--restart=Never", "--", "sleep", "3600")
    check(r.returncode == 0 and "pod/conf created" in r.stdout, "run", r.stdout + r.stderr)

    r = k("wait", "--for=condition=Ready", "pod/conf", "--timeout=20s")
    check(r.returncode == 0 and "condition met" in r.stdout, "wait --for=condition=Ready", r.stdout + r.stderr)

    r = k("get", "pod", "conf", "-o", "yaml")
    check(
        r.returncode == 0 and "name: conf" in r.stdout and "phase: Running" in r.stdout
        and "image: busybox:1.36" in r.stdout,
        "get -o yaml",
        r.stdout + r.stderr,
    )
    r = k("get", "pod", "conf", "-o", "json")
    pod = json.loads(r.stdout) if r.returncode == 0 else {}
    check(
        pod.get("spec", {}).get("containers", [{}])[0].get("command") is None
        and pod.get("spec", {}).get("containers", [{}])[0].get("args") == ["sleep", "3600"]
        and pod.get("status", {}).get("phase") == "Running",
        "get -o json: args as given, Running",
        r.stdout + r.stderr,
    )
    r = k("get", "pods")
    rows = [l.split() for l in r.stdout.splitlines()]
    check(
        r.returncode == 0 and rows[:1] == [["NAME", "READY", "STATUS", "RESTARTS", "AGE"]]
        and rows[1][:4] == ["conf", "1/1", "Running", "0"],
        "get (server-side table)",
        r.stdout + r.stderr,
    )
    r = k("get", "pod", "conf", "-o", "wide")
    rows = [l.split() for l in r.stdout.splitlines()]
    check(
        r.returncode == 0 and rows[0][5:7] == ["IP", "NODE"] and rows[1][6] == "double-node-1",
        "get -o wide",
        r.stdout + r.stderr,
    )

    # exec: stdout and stderr apart, and the exit code.
    r = k("exec", "conf", "--", "sh", "-c", "echo out; echo err >&2; exit 7")
    check(
        r.returncode == 7 and r.stdout == "out\n" and r.stderr.startswith("err\n")
        and "command terminated with exit code 7" in r.stderr,
        "exec: stdout, stderr and exit code 7",
        f"rc={r.returncode} stdout={r.stdout!r} stderr={r.stderr!r}",
    )
    r = k("exec", "conf", "--", "true")
    check(r.returncode == 0 and r.stdout == "" and r.stderr == "", "exec: exit 0", repr(r))
    r = k("exec", "conf", "--", "no-such-program-kubectl-conformance")
    check(
        r.returncode != 0 and "executable file not found" in r.stderr,
        "exec: a missing executable is an error",
        f"rc={r.returncode} stderr={r.stderr!r}",
    )
    r = k("exec", "conf", "-c", "nope", "--", "true")
    check(r.returncode != 0 and "container nope is not valid" in r.stderr, "exec: unknown container", r.stderr)

    # 20 MB of random bytes, out and in, byte-exact.
    blob = os.urandom(20 * 1024 * 1024)
    want = hashlib.sha256(blob).hexdigest()
    path = os.path.join(work, "blob")
    with open(path, "wb") as f:
        f.write(blob)
    t = time.monotonic()
    r = k("exec", "conf", "--", "cat", path, text=False)
    got = hashlib.sha256(r.stdout).hexdigest()
    check(
        r.returncode == 0 and len(r.stdout) == len(blob) and got == want,
        f"exec: 20 MB binary out, byte-exact ({time.monotonic() - t:.1f} s)",
        f"rc={r.returncode} len={len(r.stdout)} stderr={r.stderr[-300:]!r}",
    )
    t = time.monotonic()
    r = k("exec", "-i", "conf", "--", "cat", stdin=blob, text=False)
    check(
        r.returncode == 0 and len(r.stdout) == len(blob) and hashlib.sha256(r.stdout).hexdigest() == want,
        f"exec -i: 20 MB binary in and out, byte-exact ({time.monotonic() - t:.1f} s)",
        f"rc={r.returncode} len={len(r.stdout)} stderr={r.stderr[-300:]!r}",
    )
    r = k("exec", "-i", "conf", "--", "sha256sum", stdin=blob, text=False)
    check(
        r.returncode == 0 and r.stdout.decode().split()[0] == want,
        "exec -i: the command sees the end of stdin (sha256sum of 20 MB)",
        f"rc={r.returncode} stdout={r.stdout[:200]!r} stderr={r.stderr[-300:]!r}",
    )
    r = k("exec", "-i", "conf", "--", "sh", "-c", "read a; echo got:$a; cat >&2", stdin="hello\nrest\n")
    check(
        r.returncode == 0 and r.stdout == "got:hello\n" and r.stderr == "rest\n",
        "exec -i: stdin read line by line",
        f"rc={r.returncode} stdout={r.stdout!r} stderr={r.stderr!r}",
    )

    r = k("delete", "pod", "conf", "--now")
    check(r.returncode == 0 and 'pod "conf" deleted' in r.stdout, "delete --now (waits until gone)", r.stdout + r.stderr)
    r = k("get", "pod", "conf")
    check(
        r.returncode == 1 and 'Error from server (NotFound): pods "conf" not found' in r.stderr,
        "get after delete: NotFound",
        r.stdout + r.stderr,
    )

    # The watches saw the pod come, run and go; then they are stopped.
    watch.wait_for("DELETED")
    watch_default.wait_for("Terminating")
    out, err = watch.stop()
    lines = [l for l in out.splitlines() if l.strip()]
    check(
        any(l.startswith("ADDED") and "conf Pending" in l for l in lines)
        and any(l.startswith("MODIFIED") and "conf Running" in l for l in lines)
        and any(l.startswith("DELETED") and "conf" in l for l in lines),
        "get -w --output-watch-events: ADDED Pending, MODIFIED Running, DELETED",
        out + err,
    )
    out, err = watch_default.stop()
    statuses = [l.split()[2] for l in out.splitlines()[1:] if l.startswith("conf ")]
    check(
        out.startswith("NAME") and "Running" in statuses and "Terminating" in statuses,
        "get -w (table): sees the pod run, then terminate",
        out + err,
    )



PVC = """apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: conf-cache
  labels: {app.kubernetes.io/component: cache, mcp-run.dev/cache: cargo}
spec:
  accessModes: [ReadWriteOnce]
  resources: {requests: {storage: 1Gi}}
"""


def run_pvc_checks(kubectl, env, work):
    """The claims of cache volumes (tests/kube_double/pvcs.rs), as kubectl sees them."""
    def k(*args, **kw):
        return kc(kubectl, env, *args, **kw)

    path = os.path.join(work, "pvc.yaml")
    with open(path, "w") as f:
        f.write(PVC)
    # --validate=false: kubectl reads the server's OpenAPI document to learn whether it checks
    # fields itself, and the double serves none (a known gap of the double, not of the claims).
    r = k("create", "--validate=false", "-f", path)
    check(r.returncode == 0 and "persistentvolumeclaim/conf-cache created" in r.stdout,
          "pvc: create", r.stdout + r.stderr)
    r = k("create", "--validate=false", "-f", path)
    check(r.returncode != 0 and "AlreadyExists" in r.stderr and "already exists" in r.stderr,
          "pvc: a second create is AlreadyExists", r.stdout + r.stderr)
    r = k("wait", "--for=jsonpath={.status.phase}=Bound", "pvc/conf-cache", "--timeout=20s")
    check(r.returncode == 0 and "condition met" in r.stdout, "pvc: wait until Bound", r.stdout + r.stderr)
    r = k("get", "pvc", "-l", "mcp-run.dev/cache=cargo", "-o", "name")
    check(r.returncode == 0 and r.stdout.strip() == "persistentvolumeclaim/conf-cache",
          "pvc: get by label", r.stdout + r.stderr)
    r = k("get", "pvc", "-l", "mcp-run.dev/cache=npm", "-o", "name")
    check(r.returncode == 0 and r.stdout.strip() == "", "pvc: a selector that matches none", r.stdout + r.stderr)
    r = k("get", "pvc", "conf-cache", "-o", "json")
    pvc = json.loads(r.stdout) if r.returncode == 0 else {}
    check(pvc.get("status", {}).get("capacity", {}).get("storage") == "1Gi"
          and "kubernetes.io/pvc-protection" in pvc.get("metadata", {}).get("finalizers", [])
          and pvc.get("spec", {}).get("storageClassName") == "standard",
          "pvc: get -o json: bound, protected, default class", r.stdout + r.stderr)
    r = k("annotate", "pvc", "conf-cache", "mcp-run.dev/held-by=mcp-run-x")
    check(r.returncode == 0 and "annotated" in r.stdout, "pvc: annotate", r.stdout + r.stderr)
    r = k("annotate", "pvc", "conf-cache", "mcp-run.dev/held-by=mcp-run-y", "--overwrite",
          "--resource-version=1")
    check(r.returncode != 0 and "the object has been modified" in r.stderr,
          "pvc: annotate with a stale resourceVersion is a conflict", r.stdout + r.stderr)
    r = k("get", "pvc", "conf-cache", "-o", "jsonpath={.metadata.annotations.mcp-run\\.dev/held-by}")
    check(r.returncode == 0 and r.stdout == "mcp-run-x", "pvc: the conflicting patch changed nothing",
          r.stdout + r.stderr)
    r = k("delete", "pvc", "conf-cache")
    check(r.returncode == 0 and 'persistentvolumeclaim "conf-cache" deleted' in r.stdout,
          "pvc: delete", r.stdout + r.stderr)
    r = k("get", "pvc", "conf-cache")
    check(r.returncode != 0 and "NotFound" in r.stderr, "pvc: gone after delete", r.stdout + r.stderr)

SLICE_YAML = """\
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: conf-peers-abcde
  labels: {kubernetes.io/service-name: conf-peers}
addressType: IPv4
ports: [{name: peer, port: 8081, protocol: TCP}]
endpoints:
  - addresses: [10.1.0.5]
    conditions: {ready: true}
    targetRef: {kind: Pod, name: gw-1}
"""


def run_endpointslice_checks(kubectl, env, work):
    """The EndpointSlices of the replicas' headless Service (tests/kube_double/endpointslices.rs)."""
    def k(*args, **kw):
        return kc(kubectl, env, *args, **kw)

    path = os.path.join(work, "slice.yaml")
    with open(path, "w") as f:
        f.write(SLICE_YAML)
    # --validate=false: the double serves no OpenAPI document (see run_pvc_checks).
    r = k("create", "--validate=false", "-f", path)
    check(r.returncode == 0 and "endpointslice.discovery.k8s.io/conf-peers-abcde created" in r.stdout,
          "endpointslices: create", r.stdout + r.stderr)
    r = k("get", "endpointslices")
    lines = r.stdout.splitlines()
    check(r.returncode == 0 and len(lines) == 2 and lines[0].split() == ["NAME", "ADDRESSTYPE", "PORTS", "ENDPOINTS", "AGE"]
          and lines[1].split()[:4] == ["conf-peers-abcde", "IPv4", "8081", "10.1.0.5"],
          "endpointslices: get (the API server's columns)", r.stdout + r.stderr)
    r = k("get", "endpointslices", "-l", "kubernetes.io/service-name=conf-peers", "-o", "json")
    items = json.loads(r.stdout).get("items", []) if r.returncode == 0 else []
    check(len(items) == 1 and items[0]["ports"][0]["port"] == 8081
          and items[0]["endpoints"][0]["targetRef"]["name"] == "gw-1",
          "endpointslices: get by label -o json", r.stdout + r.stderr)
    r = k("get", "endpointslices", "-l", "kubernetes.io/service-name=other", "-o", "name")
    check(r.returncode == 0 and r.stdout.strip() == "", "endpointslices: a selector that matches none",
          r.stdout + r.stderr)
    r = k("delete", "endpointslice", "conf-peers-abcde")
    check(r.returncode == 0 and 'endpointslice.discovery.k8s.io "conf-peers-abcde" deleted' in r.stdout,
          "endpointslices: delete", r.stdout + r.stderr)
    r = k("get", "endpointslice", "conf-peers-abcde")
    check(r.returncode != 0 and "NotFound" in r.stderr, "endpointslices: gone after delete", r.stdout + r.stderr)


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# End-to-end test of the deployment on a throw-away kind cluster:
#   create the cluster -> build the image and load it -> check manifests/ against the API
#   server (dry run) -> helm install the chart -> wait for
#   readiness -> through `kubectl port-forward` to the Service: run-remote, the e2e suite
#   (cargo test --test e2e against the installed gateway), MCP over HTTP with curl, the
#   metrics, the NetworkPolicy -> a command survives a rolling restart of the gateway ->
#   check no runner pod is left -> delete the cluster.
#
# Needs: docker, kind (>= 0.24, for NetworkPolicy enforcement), kubectl, helm (3 or 4),
# cargo, curl, jq. Run from anywhere: `e2e/kind.sh`. Environment:
#   KIND_CLUSTER      cluster name (default mcp-run-e2e); the cluster is deleted at the end
#   KIND_NODE_IMAGE   node image (default: the Kubernetes 1.35 image of kind v0.33.0)
#   KEEP_CLUSTER=1    leave the cluster running for debugging
#   E2E_PORT          local port of the port-forward (default 18080)
#   RUNNER_IMAGE      runner image preloaded into the cluster (default busybox:1.36)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

CLUSTER="${KIND_CLUSTER:-mcp-run-e2e}"
# Pinned by digest, as kind's release notes require for images built for a release.
NODE_IMAGE="${KIND_NODE_IMAGE:-kindest/node:v1.35.8@sha256:07b2536e30b803ed61d1677a79df6115f798ce64c80f9e22f6ed45afd09323c0}"
IMAGE="mcp-run:e2e"
RUNNER_IMAGE="${RUNNER_IMAGE:-busybox:1.36}"
NAMESPACE="mcp-run"
RELEASE="mcp-run"
PORT="${E2E_PORT:-18080}"
BASE="http://127.0.0.1:${PORT}"

WORK="$(mktemp -d)"
# kind writes the cluster's credentials here instead of the user's kubeconfig.
export KUBECONFIG="$WORK/kubeconfig"
PF_PID=""

log() { printf '\n== %s\n' "$*"; }
fail() { printf 'e2e FAILED: %s\n' "$*" >&2; exit 1; }

cleanup() {
  local status=$?
  if [ -n "$PF_PID" ]; then kill "$PF_PID" 2>/dev/null || true; fi
  if [ "$status" -ne 0 ] && [ -s "$KUBECONFIG" ]; then
    log "diagnostics"
    kubectl get pods -A -o wide || true
    kubectl -n "$NAMESPACE" describe deployment "$RELEASE" || true
    kubectl -n "$NAMESPACE" logs "deployment/$RELEASE" --tail=200 || true
    [ -f "$WORK/port-forward.log" ] && cat "$WORK/port-forward.log"
  fi
  if [ "${KEEP_CLUSTER:-0}" = "1" ]; then
    echo "cluster $CLUSTER kept; KUBECONFIG=$KUBECONFIG"
  else
    kind delete cluster --name "$CLUSTER" || true
    rm -rf "$WORK"
  fi
  exit "$status"
}
trap cleanup EXIT

for tool in docker kind kubectl helm cargo curl jq; do
  command -v "$tool" >/dev/null || fail "$tool is not installed"
done

log "kind cluster $CLUSTER ($NODE_IMAGE)"
kind create cluster --name "$CLUSTER" --image "$NODE_IMAGE" \
  --config e2e/kind-config.yaml --wait 180s

log "image $IMAGE"
docker build --tag "$IMAGE" .
kind load docker-image "$IMAGE" --name "$CLUSTER"
# Preloaded so that the first runner pod does not wait for (or fail on) a registry pull.
docker pull --quiet "$RUNNER_IMAGE"
kind load docker-image "$RUNNER_IMAGE" --name "$CLUSTER"

log "client binaries"
cargo build --locked --bins
RUN_REMOTE="$ROOT/target/debug/run-remote"

log "plain manifests: validated by the API server (server-side dry run)"
# The namespace is created for real (Pod Security labels included) and the chart is then
# installed into it; the rest of manifests/ is only checked, since Helm must own it.
kubectl apply -f manifests/00-namespace.yaml
kubectl apply --dry-run=server -f manifests/mcp-run.yaml

log "helm install"
helm upgrade --install "$RELEASE" charts/mcp-run \
  --namespace "$NAMESPACE" --create-namespace \
  --set image.repository=mcp-run --set image.tag=e2e --set image.pullPolicy=Never \
  --set-string "config.profiles.default.image=$RUNNER_IMAGE" \
  --wait --timeout 5m
kubectl -n "$NAMESPACE" rollout status "deployment/$RELEASE" --timeout=180s
# Auth is on by default: the chart generated a token into its Secret.
TOKEN="$(kubectl -n "$NAMESPACE" get secret "$RELEASE-auth" -o jsonpath='{.data.tokens}' \
  | base64 -d | head -n 1)"
[ -n "$TOKEN" ] || fail "the chart generated no auth token"
AUTH=(-H "authorization: Bearer $TOKEN")

log "replicas: each gateway pod found the other from the headless Service's EndpointSlices"
# The chart runs two replicas; each watches the EndpointSlices of $RELEASE-peers (its Role
# allows nothing more) and logs the other's peer address once it is listed.
gateways="$(kubectl -n "$NAMESPACE" get pods -l app.kubernetes.io/instance="$RELEASE",app.kubernetes.io/component=gateway -o name)"
[ "$(echo "$gateways" | wc -l)" -eq 2 ] || fail "expected 2 gateway pods, got: $gateways"
for gwpod in $gateways; do
  found=""
  for _ in $(seq 1 60); do
    if kubectl -n "$NAMESPACE" logs "$gwpod" | grep "other replicas, from the Service's EndpointSlices" | grep -q ":8081/"; then
      found=1
      break
    fi
    sleep 1
  done
  [ -n "$found" ] || fail "$gwpod did not find the other replica: $(kubectl -n "$NAMESPACE" logs "$gwpod" | tail -20)"
done

log "port-forward to service/$RELEASE on $BASE"
kubectl -n "$NAMESPACE" port-forward "service/$RELEASE" "$PORT:8080" \
  >"$WORK/port-forward.log" 2>&1 &
PF_PID=$!
ready=""
for _ in $(seq 1 60); do
  if curl -fsS "$BASE/readyz" >/dev/null 2>&1; then ready=1; break; fi
  sleep 1
done
[ -n "$ready" ] || fail "the gateway is not ready through the port-forward"
curl -fsS "$BASE/healthz"; echo

log "run-remote"
export RUN_REMOTE_SERVER="$BASE/raw" RUN_REMOTE_TOKEN="$TOKEN"
code="$(curl -sS -o /dev/null -w '%{http_code}' -H 'content-type: application/json' \
  -d '{"executable":"true"}' "$BASE/raw")"
[ "$code" = 401 ] || fail "a request without the token got $code, not 401"
out="$("$RUN_REMOTE" -- echo hello-from-kind)"
[ "$out" = "hello-from-kind" ] || fail "run-remote printed '$out'"
status=0
"$RUN_REMOTE" -- sh -c 'echo to-stderr >&2; exit 7' 2>"$WORK/stderr" || status=$?
[ "$status" -eq 7 ] || fail "run-remote exited $status, expected 7"
grep -qx to-stderr "$WORK/stderr" || fail "stderr was not streamed"
# The pod context: the command ran in a runner pod of the runner namespace.
curl -fsS "${AUTH[@]}" -H 'content-type: application/json' \
  -d '{"executable":"true"}' "$BASE/raw" >"$WORK/raw.ndjson"
jq -e -s '.[0].type == "started" and .[0].context.backend == "kubernetes"
          and .[0].context.namespace == "'"$NAMESPACE"'" and (.[0].context.pod | length > 0)
          and (.[-1].type == "exit") and .[-1].code == 0' "$WORK/raw.ndjson" >/dev/null \
  || fail "unexpected /raw stream: $(cat "$WORK/raw.ndjson")"

log "e2e suite through the Service"
MCP_RUN_E2E_GATEWAY="$BASE/raw" MCP_RUN_E2E_TOKEN="$TOKEN" MCP_RUN_E2E_IMAGE="$RUNNER_IMAGE" \
  cargo test --locked --test e2e -- --nocapture

log "MCP over streamable HTTP"
# Posts one JSON-RPC message; prints the JSON-RPC answer whether it came as JSON or as
# server-sent events.
SESSION=""
mcp() {
  local headers=("${AUTH[@]}" -H 'content-type: application/json'
                 -H 'accept: application/json, text/event-stream')
  [ -n "$SESSION" ] && headers+=(-H "mcp-session-id: $SESSION" -H 'mcp-protocol-version: 2025-06-18')
  curl -fsS -D "$WORK/mcp.headers" "${headers[@]}" -d "$1" "$BASE/mcp" >"$WORK/mcp.body"
  if grep -qi '^content-type: text/event-stream' "$WORK/mcp.headers"; then
    sed -n 's/^data: *//p' "$WORK/mcp.body" | jq -c 'select(.id != null)' | tail -n 1
  else
    cat "$WORK/mcp.body"
  fi
}
init="$(mcp '{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"kind-e2e","version":"0"}}}')"
echo "$init" | jq -e '.result.serverInfo.name' >/dev/null || fail "initialize: $init"
SESSION="$(grep -i '^mcp-session-id:' "$WORK/mcp.headers" | cut -d: -f2- | tr -d ' \r' || true)"
mcp '{"jsonrpc":"2.0","method":"notifications/initialized"}' >/dev/null
tools="$(mcp '{"jsonrpc":"2.0","id":2,"method":"tools/list"}')"
echo "$tools" | jq -e '.result.tools[] | select(.name == "run_network_tool")' >/dev/null \
  || fail "tools/list has no run_network_tool: $tools"
call="$(mcp '{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"run_network_tool","arguments":{"executable":"echo","args":["mcp-e2e-ok"]}}}')"
echo "$call" | jq -e '(.result.isError // false) == false' >/dev/null || fail "tools/call: $call"
echo "$call" | grep -q 'mcp-e2e-ok' || fail "tools/call output: $call"

log "metrics"
curl -fsS "$BASE/metrics" >"$WORK/metrics"
grep -Eq '^mcp_run_executions_total\{backend="kubernetes",result="success"\} [1-9]' "$WORK/metrics" \
  || fail "no successful kubernetes execution counted"
grep -Eq '^mcp_run_executions_total\{backend="kubernetes",result="failure"\} [1-9]' "$WORK/metrics" \
  || fail "the exit 7 was not counted as a failure"
grep -Eq '^mcp_run_pod_start_duration_seconds_count [1-9]' "$WORK/metrics" \
  || fail "no pod start observed"

log "NetworkPolicy: the gateway refuses pods of other namespaces"
SVC="http://$RELEASE.$NAMESPACE.svc:8080/healthz"
kubectl -n "$NAMESPACE" run np-inside --image="$RUNNER_IMAGE" --image-pull-policy=IfNotPresent \
  --restart=Never --rm -i --quiet -- wget -q -T 5 -O - "$SVC" >/dev/null \
  || fail "a pod of the release namespace cannot reach the gateway"
kubectl create namespace np-outsider >/dev/null
if kubectl -n np-outsider run np-outside --image="$RUNNER_IMAGE" --image-pull-policy=IfNotPresent \
  --restart=Never --rm -i --quiet -- wget -q -T 5 -O - "$SVC" >/dev/null 2>&1; then
  fail "a pod of another namespace reached the gateway"
fi

log "a kube session before the rollout"
"$RUN_REMOTE" --session e2e-keep -- sh -c 'echo kept > /tmp/e2e-keep' \
  || fail "the session's first call failed"
session_pod="$(kubectl get pods -A -l mcp-run.dev/session -o name)"
[ -n "$session_pod" ] || fail "no session pod"

log "graceful shutdown: a running command outlives the replacement of the gateway pod"
# The client runs in the cluster (the image has run-remote) and goes through the Service,
# so that the port-forward, which follows one pod, is not part of the test.
kill "$PF_PID" 2>/dev/null || true
PF_PID=""
# The token from the chart's Secret, never in an argument or the pod spec.
kubectl -n "$NAMESPACE" run drain --image="$IMAGE" --image-pull-policy=Never --restart=Never \
  --overrides='{"spec":{"containers":[{"name":"drain","env":[{"name":"RUN_REMOTE_TOKEN","valueFrom":{"secretKeyRef":{"name":"'"$RELEASE-auth"'","key":"tokens"}}}]}]}}' \
  --command -- /usr/local/bin/run-remote --server "http://$RELEASE.$NAMESPACE.svc:8080/raw" \
  -- sh -c 'sleep 20; echo survived'
runner=""
for _ in $(seq 1 60); do
  runner="$(kubectl -n "$NAMESPACE" get pods -l 'app.kubernetes.io/component=runner,!mcp-run.dev/session' -o name)"
  [ -n "$runner" ] && break
  sleep 1
done
[ -n "$runner" ] || fail "the drain command did not start a runner pod"
# A new gateway pod starts; once it is ready the old one gets SIGTERM and drains for
# config.server.shutdown_grace_secs (30 s), longer than what is left of the command.
kubectl -n "$NAMESPACE" rollout restart "deployment/$RELEASE"
kubectl -n "$NAMESPACE" rollout status "deployment/$RELEASE" --timeout=180s
kubectl -n "$NAMESPACE" wait pod/drain --for=jsonpath='{.status.phase}'=Succeeded --timeout=120s \
  || fail "the command was cut by the restart: $(kubectl -n "$NAMESPACE" logs drain 2>&1)"
[ "$(kubectl -n "$NAMESPACE" logs drain)" = "survived" ] \
  || fail "unexpected output: $(kubectl -n "$NAMESPACE" logs drain 2>&1)"
kubectl -n "$NAMESPACE" delete pod drain --wait=false

log "the session outlived the rollout: same pod, same files, through the new replicas"
kubectl -n "$NAMESPACE" port-forward "service/$RELEASE" "$PORT:8080" \
  >"$WORK/port-forward.log" 2>&1 &
PF_PID=$!
for _ in $(seq 1 60); do
  curl -fsS "$BASE/readyz" >/dev/null 2>&1 && break
  sleep 1
done
[ "$(kubectl get pods -A -l mcp-run.dev/session -o name)" = "$session_pod" ] \
  || fail "the session's pod did not outlive the rollout"
out="$("$RUN_REMOTE" --session e2e-keep -- cat /tmp/e2e-keep)"
[ "$out" = kept ] || fail "the session after the rollout printed '$out'"
"$RUN_REMOTE" sessions list | grep -q e2e-keep || fail "the session is not listed"
"$RUN_REMOTE" sessions end e2e-keep || fail "the session did not end"
kill "$PF_PID" 2>/dev/null || true
PF_PID=""

log "no runner pod left"
left=""
for _ in $(seq 1 60); do
  left="$(kubectl get pods -A -l app.kubernetes.io/component=runner,app.kubernetes.io/managed-by=mcp-run -o name)"
  [ -z "$left" ] && break
  sleep 1
done
[ -z "$left" ] || fail "runner pods left: $left"

log "e2e passed"

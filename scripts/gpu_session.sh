#!/usr/bin/env bash
# One device call that spends a lent GPU's minutes in order of worth (a session has 15 minutes
# of device time, one machine start costs 1-2 of them, one call may run 10):
#   1. gpu_check.sh --quick: must pass on its first run (issue 26's goal);
#   2. the full run's parts after services (--quick ran that part whole): tp, serve (rates
#      4/16/inf, transformers' static batches), split (what the split costs per step), bench
#      (5 shapes), kernels (every case);
#   3. scripts/gpu_kernel_sweep.py: the decode kernel's tile, warps and stages, then its split
#      counts (--splits).
# Each step gets what is left of --total seconds (default 570) at most its own share; what it
# writes lands in $OUT as it ends: quick.json, full.json, sweep.json, splits.json,
# session.log, and the service logs as logs.tgz (the device machine returns at most 8 files).
#
#   bash scripts/gpu_session.sh [--total 570]
set -uo pipefail
cd "$(dirname "$0")/.."
total=570
[ "${1:-}" = "--total" ] && total=$2
out=${OUT:?gpu_session.sh runs on the device machine, where OUT is set}
work=$(mktemp -d /tmp/gpu_session.XXXX)
t0=$(date +%s)
left() { echo $((total - ($(date +%s) - t0))); }
log() { echo "gpu_session: [$(($(date +%s) - t0))s] $*" | tee -a "$out/session.log"; }
export PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv >>"$out/session.log" 2>&1
lscpu | grep -E 'Model name|^CPU\(s\)' >>"$out/session.log"

quick=$(( $(left) < 250 ? $(left) : 250 ))
log "1. gpu_check.sh --quick (cut at ${quick}s)"
GPU_CHECK_TIMEOUT=$quick bash scripts/gpu_check.sh --quick --out "$work/quick.json" >"$work/quick.log" 2>&1
log "   rc=$?: $(grep -E '^(services|kernels|bench|tp|serve|split):' "$work/quick.log" | tr '\n' ' ')"
cp "$work/quick.json" "$out/" 2>/dev/null

sweep=45
full=$(( $(left) - sweep - 15 ))
if [ "$full" -gt 60 ]; then
    serve=$(( full * 38 / 100 )); split=$(( full * 35 / 100 )); bench=$(( full * 7 / 100 ))
    kernels=$(( full * 17 / 100 ))
    log "2. the full parts tp,serve,split,bench,kernels (cut at ${full}s; serve ${serve}, split ${split}, bench ${bench}, kernels ${kernels})"
    GPU_CHECK_TIMEOUT=$full bash scripts/gpu_check.sh --parts tp,serve,split,bench,kernels --budget tp=5 \
        --budget serve=$serve --budget split=$split --budget bench=$bench --budget kernels=$kernels \
        --out "$work/full.json" >"$work/full.log" 2>&1
    log "   rc=$?: $(grep -E '^(services|kernels|bench|tp|serve|split):' "$work/full.log" | tr '\n' ' ')"
    cp "$work/full.json" "$out/" 2>/dev/null
fi

budget=$(( ($(left) - 10) / 2 ))
if [ "$budget" -gt 10 ]; then
    log "3. gpu_kernel_sweep.py: launch settings, then split counts (${budget}s each at most)"
    timeout -k 5 "$budget" python3 scripts/gpu_kernel_sweep.py --out "$out/sweep.json" \
        --budget $(( budget * 6 / 10 )) >"$work/sweep.log" 2>&1
    log "   launch settings rc=$?"
    timeout -k 5 "$budget" python3 scripts/gpu_kernel_sweep.py --splits --out "$out/splits.json" \
        --budget $(( budget * 6 / 10 )) >"$work/splits.log" 2>&1
    log "   split counts rc=$?"
fi
tar czf "$out/logs.tgz" -C "$work" . 2>/dev/null
log "done"

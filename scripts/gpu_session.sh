#!/usr/bin/env bash
# One device call that spends a lent GPU's minutes in order of worth (a session has 15 minutes
# of device time, one machine start costs 1-2 of them, one call may run 10):
#   0. gpu_check.sh --parts steady (issue 42's "before": --steady seconds, default 340, 0 skips):
#      1,000 ShareGPT-like requests at rate inf to the 1.1B and 8B shapes, the GPU's busy share,
#      the decode step against its roofline, transformers' continuous batching beside it;
#   1. gpu_check.sh --quick: must pass on its first run (issue 26's goal);
#   2. the full run's parts after services (--quick ran that part whole): tp, serve (rates
#      4/16/inf, transformers' static batches), split (what the split costs per step), bench
#      (5 shapes), kernels (every case);
#   3. scripts/gpu_kernel_sweep.py: the decode kernel's tile, warps and stages, then its split
#      counts (--splits).
# Each step gets what is left of --total seconds (default 570) at most its own share; what it
# writes lands in $OUT as it ends: steady.json, quick.json, full.json, sweep.json, splits.json,
# session.log, and the service logs as logs.tgz (the device machine returns at most 8 files).
# With steady at 340 s, --quick gets the ~190 s left (it took 172 s on the first H200) and the
# later steps are skipped for want of time.
#
#   bash scripts/gpu_session.sh [--total 570] [--steady 340]
set -uo pipefail
cd "$(dirname "$0")/.."
total=570
steady=340
while [ $# -gt 0 ]; do
    case "$1" in
        --total) total=$2; shift 2 ;;
        --steady) steady=$2; shift 2 ;;
        *) echo "gpu_session.sh: unknown argument $1 (takes --total SECONDS, --steady SECONDS)" >&2; exit 2 ;;
    esac
done
out=${OUT:?gpu_session.sh runs on the device machine, where OUT is set}
work=$(mktemp -d /tmp/gpu_session.XXXX)
t0=$(date +%s)
left() { echo $((total - ($(date +%s) - t0))); }
log() { echo "gpu_session: [$(($(date +%s) - t0))s] $*" | tee -a "$out/session.log"; }
export PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv >>"$out/session.log" 2>&1
lscpu | grep -E 'Model name|^CPU\(s\)' >>"$out/session.log"

if [ "$steady" -gt 0 ]; then
    # the part's seconds, plus start-up (wheels, torch, CUDA) and the report under the outer cut
    log "0. gpu_check.sh --parts steady (part ${steady}s, cut at $((steady + 40))s)"
    GPU_CHECK_TIMEOUT=$((steady + 40)) bash scripts/gpu_check.sh --parts steady --budget steady=$steady \
        --out "$work/steady.json" >"$work/steady.log" 2>&1
    log "   rc=$?: $(grep -E '^(steady|gpu_check)' "$work/steady.log" | tr '\n' ' ')"
    cp "$work/steady.json" "$out/" 2>/dev/null
fi

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

#!/usr/bin/env bash
# The GPU check of pagedserve: one run on one GPU, one JSON file (scripts/gpu_check.py).
#
# Runs on the GPU machine as it is: Python 3.12, torch 2.11, Triton 3.6, transformers 5.17,
# grpcio, protobuf, uvloop, no network. The pure-Python dependencies it may lack are listed in
# scripts/gpu_wheels.txt and travel as wheels in scripts/gpu_wheels/ (made here, with network:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       -d scripts/gpu_wheels -r scripts/gpu_wheels.txt
# under 64 MiB); each one not installed is installed alone (--no-deps, --no-index) into
# $GPU_CHECK_SITE (default .gpu_site), which goes on PYTHONPATH, so one that fails stops no other.
# No model travels: random-weight Llama models are built from transformers' configs.
#
#   bash scripts/gpu_check.sh [--out FILE] [--parts kernels,services,bench,serve] [--quick]
# The JSON goes to --out, else $OUT/gpu_check.json, else bench_results/gpu_check.json; the install
# log and the service logs go next to it. Ends within 8 minutes (parts have time budgets; the
# whole run is cut at GPU_CHECK_TIMEOUT).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${GPU_CHECK_WHEELS:-scripts/gpu_wheels}
SITE=${GPU_CHECK_SITE:-$PWD/.gpu_site}
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false

out_file=${OUT:+$OUT/gpu_check.json}
prev=
for arg in "$@"; do
    case "$arg" in --out=*) out_file=${arg#--out=} ;; esac
    [ "$prev" = "--out" ] && out_file=$arg
    prev=$arg
done
out_dir=$(dirname "${out_file:-bench_results/gpu_check.json}")
mkdir -p "$out_dir"
install_log="$out_dir/gpu_check-install.log"
: >"$install_log"

# the distributions of scripts/gpu_wheels.txt not installed (their metadata is on sys.path)
missing=$("$PY" - <<'PY'
from importlib import metadata
names = [l.strip() for l in open("scripts/gpu_wheels.txt") if l.strip() and not l.startswith("#")]
def have(name):
    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False
print(" ".join(n for n in names if not have(n)))
PY
)
if [ -n "$missing" ]; then
    echo "gpu_check: installing from $WHEELS into $SITE: $missing"
    if [ -d "$WHEELS" ]; then
        failed=
        for dist in $missing; do
            "$PY" -m pip install -q --no-index --no-deps --find-links "$WHEELS" --target "$SITE" "$dist" \
                >>"$install_log" 2>&1 || failed="$failed $dist"
        done
        [ -z "$failed" ] || echo "gpu_check: not installed:$failed (see $install_log); parts that need them will say so"
    else
        echo "gpu_check: no $WHEELS folder; parts that need $missing will fail" | tee -a "$install_log"
    fi
fi
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('gpu_check:', torch.__version__, torch.cuda.get_device_name())"
exec timeout -k 10 "${GPU_CHECK_TIMEOUT:-470}" "$PY" scripts/gpu_check.py ${out_file:+--out "$out_file"} "$@"

#!/usr/bin/env bash
# The GPU check of pagedserve: one run on one GPU, one JSON file (scripts/gpu_check.py).
#
# Runs on the GPU machine as it is: its image's packages (scripts/gpu_image_packages.txt:
# Python 3.12, torch 2.11, Triton 3.6, transformers 5.17, grpcio, protobuf, uvloop,
# prometheus-client), no network. What the GPU path needs beyond them travels as the wheels of
# scripts/gpu_wheels.txt in scripts/gpu_wheels/ (made here by scripts/gpu_wheels.sh, under
# 64 MiB, carried with the working tree); each one the machine lacks, or has below pyproject's
# floor (grpcio and protobuf: the stubs need recent ones), is installed alone (--no-deps,
# --no-index) into $GPU_CHECK_SITE (default .gpu_site), which goes on PYTHONPATH ahead of the
# image's site-packages, so one that fails stops no other. No model travels: random-weight
# Llama models are built from transformers' configs.
#
#   bash scripts/gpu_check.sh [--rehearse] [--out FILE] [--parts services,kernels,bench,tp,serve] [--quick]
# The JSON goes to --out, else $OUT/gpu_check.json, else bench_results/gpu_check.json; the install
# log and the service logs go next to it. The whole run is cut at GPU_CHECK_TIMEOUT (default 470 s,
# 235 s with --quick; the parts' own budgets are in gpu_check.py).
#
# --rehearse (here, without a GPU): the same check in a fresh venv ($GPU_REHEARSE_DIR, default
# .gpu_rehearse) holding only what gpu_image_packages.txt says the image has (the local CPU
# torch 2.13 for the image's 2.11; old grpcio and protobuf, which the wheels must shadow) plus
# the same pinned wheels for this Python: the services run on the CPU, the CUDA parts check
# their imports and arguments (and compile every Triton kernel for sm_90 with the image's
# Triton) and say "skipped: no CUDA", and the JSON is written to $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--rehearse" ]; then
    shift
    base=${GPU_REHEARSE_DIR:-$PWD/.gpu_rehearse}
    rehearse_py=${REHEARSE_PYTHON:-python3}
    rm -rf "$base"
    mkdir -p "$base"
    echo "gpu_check --rehearse: a fresh venv in $base/venv with the image's packages only"
    "$rehearse_py" -m venv "$base/venv"
    vpy="$base/venv/bin/python"
    image=$("$vpy" - <<'PY'
import sys; sys.path.insert(0, "scripts")
import gpu_packages
print(" ".join(spec for _, spec in gpu_packages.image_packages().values() if spec != "-"))
PY
)
    echo "gpu_check --rehearse: pip install $image (log: $base/install.log)"
    # shellcheck disable=SC2086  # one argument per requirement
    if ! "$vpy" -m pip install -q $image >"$base/install.log" 2>&1; then
        echo "gpu_check --rehearse: installing the image's packages failed, see $base/install.log" >&2
        exit 1
    fi
    "$vpy" - <<'PY'
import sys; sys.path.insert(0, "scripts")
import gpu_packages
from importlib import metadata
for name, (image, spec) in gpu_packages.image_packages().items():
    if spec != "-":
        note = "" if image in ("?", "dep") or metadata.version(name).startswith(image) else f"  (the image has {image})"
        print(f"  {name} {metadata.version(name)}{note}")
PY
    pyver=$("$vpy" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    [ "$pyver" = "3.12" ] || echo "gpu_check --rehearse: Python $pyver here (the image has 3.12): the same pins, wheels for $pyver"
    PYTHON="$vpy" bash scripts/gpu_wheels.sh --python-version "$pyver" --dest "$base/wheels"
    export PYTHON="$vpy" GPU_CHECK_WHEELS="$base/wheels" GPU_CHECK_SITE="$base/site" GPU_CHECK_CPU=1
    export GPU_CHECK_TIMEOUT=${GPU_CHECK_TIMEOUT:-900}  # the services part on a shared CPU
    exec bash "$0" --budget services=600 --aot-compile "$@"
fi

PY=${PYTHON:-python3}
WHEELS=${GPU_CHECK_WHEELS:-scripts/gpu_wheels}
SITE=${GPU_CHECK_SITE:-$PWD/.gpu_site}
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false

out_file=${OUT:+$OUT/gpu_check.json}
timeout_s=470
prev=
for arg in "$@"; do
    case "$arg" in --out=*) out_file=${arg#--out=} ;; --quick) timeout_s=235 ;; esac
    [ "$prev" = "--out" ] && out_file=$arg
    prev=$arg
done
out_dir=$(dirname "${out_file:-bench_results/gpu_check.json}")
mkdir -p "$out_dir"
install_log="$out_dir/gpu_check-install.log"
: >"$install_log"

# the distributions of scripts/gpu_wheels.txt missing or below pyproject's floor (on sys.path)
missing=$("$PY" - <<'PY'
import sys; sys.path.insert(0, "scripts")
import gpu_packages
print(" ".join(gpu_packages.to_install()))
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
if [ -n "${GPU_CHECK_CPU:-}" ]; then
    echo "gpu_check: on the CPU (a rehearsal): the CUDA parts will say skipped: no CUDA"
else
    "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('gpu_check:', torch.__version__, torch.cuda.get_device_name())"
fi
exec timeout -k 10 "${GPU_CHECK_TIMEOUT:-$timeout_s}" "$PY" scripts/gpu_check.py ${out_file:+--out "$out_file"} "$@"

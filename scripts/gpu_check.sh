#!/usr/bin/env bash
# The GPU check of pagedserve: one run on one GPU, one JSON file (scripts/gpu_check.py).
#
# Runs on the GPU machine as it is: Python 3.12, torch 2.11, Triton 3.6, transformers 5.17,
# grpcio, protobuf, uvloop, no network. The pure-Python dependencies it may lack are listed in
# scripts/gpu_wheels.txt and travel as wheels in scripts/gpu_wheels/ (made here, with network:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       -d scripts/gpu_wheels -r scripts/gpu_wheels.txt
# under 64 MiB); the ones not importable are installed from that folder only (--no-index).
# No model travels: random-weight Llama models are built from transformers' configs.
#
#   bash scripts/gpu_check.sh [--out FILE] [--parts kernels,services,bench,serve] [--quick]
# Ends within 8 minutes (parts have time budgets; the whole run is cut at GPU_CHECK_TIMEOUT).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=scripts/gpu_wheels
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false

missing=$("$PY" - <<'PY'
import importlib.util
# module -> distribution, for what pagedserve imports on the GPU path
need = {"grpc_health": "grpcio-health-checking", "grpc_reflection": "grpcio-reflection",
        "opentelemetry.sdk": "opentelemetry-sdk", "opentelemetry.exporter.otlp.proto.grpc":
        "opentelemetry-exporter-otlp-proto-grpc", "prometheus_client": "prometheus-client",
        "starlette": "starlette", "uvicorn": "uvicorn", "gguf": "gguf", "jinja2": "jinja2",
        "safetensors": "safetensors", "tokenizers": "tokenizers", "cryptography": "cryptography"}
def have(m):
    try:
        return importlib.util.find_spec(m) is not None
    except ModuleNotFoundError:
        return False
print(" ".join(sorted({d for m, d in need.items() if not have(m)})))
PY
)
if [ -n "$missing" ]; then
    echo "gpu_check: installing from $WHEELS: $missing"
    if [ -d "$WHEELS" ]; then
        "$PY" -m pip install -q --no-index --find-links "$WHEELS" $missing || echo "gpu_check: some wheels missing; parts that need them will say so"
    else
        echo "gpu_check: no $WHEELS folder; parts that need $missing will fail"
    fi
fi
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('gpu_check:', torch.__version__, torch.cuda.get_device_name())"
exec timeout -k 10 "${GPU_CHECK_TIMEOUT:-470}" "$PY" scripts/gpu_check.py "$@"

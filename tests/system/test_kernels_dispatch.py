"""kernels dispatch: CPU tensors take the torch path (or the C++ kernels), which never imports triton;
the fused ops' dispatch (pagedserve/kernels/fused.py) included."""
import os
import subprocess
import sys

from tests.support import ROOT

SCRIPT = """
import sys, torch
from pagedserve import kernels
pool = torch.randn(4, 2, 2, 8, 1, 4)
k, v = pool[:, 0, 0], pool[:, 0, 1]
kernels.store_kv(torch.randn(3, 1, 4), torch.randn(3, 1, 4), k, v, torch.tensor([9, -1, 10]))
kernels.paged_attention(torch.randn(3, 2, 4), k, v, torch.tensor([[1, 2]], dtype=torch.int32),
                        torch.tensor([11], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32), 0.5)
kernels.copy_blocks(pool, pool, [1], [3])
from pagedserve.kernels import fused
import pagedserve.executor.models.gemma
x = torch.randn(40, 8)
for t in (x, x.bfloat16()):
    fused.applies(t) and fused.rms_norm(t, torch.ones(8), 1e-6)
    fused.silu_applies(t) and fused.silu_and_mul(t)
assert "triton" not in sys.modules, "the CPU path imported triton"
print("ok")
"""


def test_cpu_path_does_not_import_triton():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout + done.stderr

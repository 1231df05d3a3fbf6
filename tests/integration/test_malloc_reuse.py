"""reuse_freed_memory: a prefill step's freed activations are reused by the next step, not
faulted in afresh (counted as the process's minor page faults, in a fresh interpreter each:
the setting is process-wide), against a control that keeps glibc's initial threshold."""
import subprocess
import sys

import pytest

from pagedserve.executor import malloc_reuse

# a prefill chunk of 2,048 rows through ten layers of the default model's shapes
CHILD = """
import resource, sys, torch
from pagedserve.executor import malloc_reuse
# both children start from glibc's initial threshold (128 KiB), pinned: left alone glibc raises
# it as blocks are freed, by an amount that depends on what the interpreter did before
malloc_reuse._glibc().mallopt(malloc_reuse.M_MMAP_THRESHOLD, 128 << 10)
applied = malloc_reuse.reuse_freed_memory() if sys.argv[1] == "reuse" else False
T = 2048
def layer(x):
    qkv = torch.empty(T, 960).fill_(1); o = torch.empty(T, 576).fill_(1); del qkv
    x = x + o; del o
    gate_up = torch.empty(T, 3072).fill_(1); h = torch.empty(T, 1536).fill_(1); del gate_up
    down = torch.empty(T, 576).fill_(1); del h
    return x + down
def step():
    x = torch.zeros(T, 576)
    for _ in range(10):
        x = layer(x)
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step(); step()  # the first steps grow the heap
before = faults()
for _ in range(4):
    step()
print(applied, faults() - before)
"""
GATE_UP_PAGES = 2048 * 3072 * 4 // 4096  # one gate/up output


def faults(mode: str) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True)
    applied, count = out.stdout.split()
    return applied == "True", int(count)


@pytest.mark.skipif(malloc_reuse._glibc() is None, reason="not glibc: reuse_freed_memory does nothing there")
def test_a_steps_freed_activations_are_reused_not_faulted_in_again():
    applied, reused = faults("reuse")
    assert applied
    _, fresh = faults("default")
    assert fresh > 4 * GATE_UP_PAGES  # the control: each step's blocks mapped and faulted in afresh
    assert reused < fresh // 4  # reused: most steps fault in none (a few pages when the heap moves)


def test_elsewhere_it_does_nothing(monkeypatch):
    monkeypatch.setattr(malloc_reuse, "_glibc", lambda: None)
    assert malloc_reuse.reuse_freed_memory() is False

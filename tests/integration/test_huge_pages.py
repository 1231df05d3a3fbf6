"""A process that asks (pagedserve/huge_pages.py) before importing torch gets its large
tensors on transparent huge pages, read from its own /proc/self/smaps_rollup; one that
turns it off gets none (where the kernel gives them only on request)."""
import subprocess
import sys

import pytest

CHILD = """
from pagedserve import huge_pages
huge_pages.ask()
import torch
x = [torch.ones(4 << 20) for _ in range(4)]  # 16 MiB each
print(next(int(l.split()[1]) for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages")))
"""


def thp_mode() -> str | None:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")]


def huge_kib(env: dict) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(thp_mode() in (None, "never") or not sys.platform.startswith("linux"),
                    reason="no transparent huge pages on this kernel (/sys/kernel/mm/transparent_hugepage)")
def test_asked_for_the_tensors_get_huge_pages(monkeypatch):
    import os

    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    assert huge_kib(env) >= 32 << 10  # at least two of the four 16 MiB tensors
    if thp_mode() == "madvise":
        assert huge_kib({**env, "THP_MEM_ALLOC_ENABLE": "0"}) == 0

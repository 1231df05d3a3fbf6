"""`pagedserve bench control-plane` end to end at small batch sizes: real memsvc and
zero-cost executor processes, one JSON object keyed by batch size on stdout."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.support import ROOT

KEYS = {"ms_per_step", "schedule_ms", "reserve_ms", "execute_ms", "output_ms"}


def test_control_plane_json(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pagedserve.cli", "bench", "control-plane", "--batch-sizes", "2,8",
         "--output-len", "6", "--json", "--out", str(tmp_path / "cp.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert set(result) == {"2", "8"}
    for row in result.values():
        assert KEYS <= set(row)
        assert row["steps"] >= 6 and row["output_tokens"] > 0
        assert sum(row[k] for k in KEYS - {"ms_per_step"}) <= row["ms_per_step"] * 1.05

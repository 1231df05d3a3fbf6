"""gpu_check's steady part rehearsed on the CPU, as a process (`gpu_check.py --parts steady`):
two tiny shapes, 20 ShareGPT-like requests each through real services with the executor's
steps timed, then transformers' continuous batching on the same model and requests. The
report has every field, with counts that match and no errors; speeds are not judged."""
import json
import os
import subprocess
import sys

from tests.support import REPO
from tests.support.gpu_check import SCRIPTS


def test_the_steady_part_rehearses_on_the_cpu(tmp_path):
    out = tmp_path / "check.json"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, str(SCRIPTS / "gpu_check.py"), "--parts", "steady", "--out", str(out),
                           "--budget", "steady=500"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    part = json.loads(out.read_text())["parts"]["steady"]
    assert part["status"] == "ok" and part["settings"]["device"] == "cpu" and part["copy_gb_per_s"] > 0
    assert list(part["shapes"]) == part["settings"]["shapes"] == ["tiny", "tiny2"]
    for name, shape in part["shapes"].items():
        assert "error" not in shape, shape.get("traceback")
        assert f"steady {name}: pagedserve 20/20 done" in done.stdout
        ps, peer, steps = shape["pagedserve"], shape["transformers_cb"], shape["steps"]
        assert ps["completed"] == 20 and ps["errors"] == {} and not ps["cut"]
        assert ps["output_tokens_received"] == ps["output_tokens_expected"] > 20
        assert 0 < ps["tpot_s"]["median"] <= ps["tpot_s"]["p99"] and ps["ttft_s"]["median"] > 0
        assert peer["completed"] == 20 and peer["errors"] == 0 and peer["wrong_lengths"] == 0 and not peer["cut"]
        assert peer["output_tokens"] == ps["output_tokens_expected"] and peer["output_token_throughput"] > 0
        assert shape["vs_transformers"] > 0 and shape["weight_bytes"] > 0 and shape["kv_bytes_per_token"] > 0
        assert steps["hooked"] in ("Executor.execute", "Executor.launch") and steps["clock"].startswith("host")
        assert steps["steps"] > 0 and steps["max_seqs"] <= 20 and steps["decode_steps"] > 0
        assert steps["decode"]["steps"] == steps["decode_steps"] and steps["decode"]["median_ratio"] > 0
        assert steps["profile"]["steps"] == part["settings"]["profile_steps"]
        assert steps["graphs"] == {"replays": 0, "eager": 0}  # a CPU executor has no CUDA graphs
        assert steps["pending_steps"] == 0  # and its passes are done inside their launch
        assert 0 < steps["profile"]["busy_share"] <= 1
        assert not os.path.exists(shape["model_dir"])  # removed after

"""scripts/gpu_check.sh and gpu_check.py run as processes without a GPU: the shell script's
syntax and its installs, a dry run's JSON, the CUDA parts skipping, the Triton kernel's
comparisons interpreted (TRITON_INTERPRET=1), and the GPU path with every not-carried
package hidden. The in-process checks: tests/unit/benchmarks/test_gpu_check.py,
tests/unit/scripts/."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.support import REPO
from tests.support.gpu_check import SCRIPTS, load_gpu_check as load, load_part
from tests.unit.scripts.test_gpu_imports import hidden_modules


def test_shell_scripts_parse():
    for script in ("gpu_check.sh", "gpu_session.sh", "gpu_wheels.sh"):
        subprocess.run(["bash", "-n", str(SCRIPTS / script)], check=True)


def test_the_session_script_runs_its_three_steps_and_leaves_their_files_in_out(tmp_path):
    """gpu_session.sh without a GPU (GPU_CHECK_CPU): --quick (the services on the CPU), the
    full run's other parts, the sweep (which fails at once without CUDA); what each wrote
    lands in $OUT, at most 8 files (what the device machine returns)."""
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, OUT=str(out), GPU_CHECK_CPU="1", PYTHON=sys.executable,
               GPU_CHECK_SITE=str(tmp_path / "site"),
               PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
    # --steady 0: the steady part's rehearsal is tests/system/test_gpu_check_steady_serve.py's
    done = subprocess.run(["bash", str(SCRIPTS / "gpu_session.sh"), "--total", "400", "--steady", "0"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    files = {p.name for p in out.iterdir()}
    assert {"quick.json", "full.json", "session.log", "logs.tgz"} <= files and len(files) <= 8
    log = (out / "session.log").read_text()
    assert "0. gpu_check.sh --parts steady" not in log
    assert all(step in log for step in ("1. gpu_check.sh --quick", "2. the full parts", "3. gpu_kernel_sweep.py",
                                        "done"))
    quick = json.loads((out / "quick.json").read_text())
    assert quick["parts"]["services"]["status"] == "ok"
    full = json.loads((out / "full.json").read_text())
    assert full["parts"]["services"]["status"] == "skipped" and full["parts"]["split"]["status"] == "skipped"


def test_dry_run_writes_a_valid_skeleton(tmp_path):
    out = tmp_path / "check.json"
    done = subprocess.run([sys.executable, str(SCRIPTS / "gpu_check.py"), "--dry-run", "--out", str(out),
                           "--parts", "kernels,bench", "--budget", "bench=30"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    gc = load()
    assert gc.validate(report) == []
    assert report["dry_run"] is True
    assert {k: v["status"] for k, v in report["parts"].items()} == {
        "kernels": "pending", "services": "skipped", "bench": "pending", "tp": "skipped", "serve": "skipped",
        "split": "skipped", "steady": "skipped"}
    assert json.loads(done.stdout)["budgets"]["bench"] == 30


FAKE_PYTHON = """#!/usr/bin/env bash
# stands for python3: '-' lists missing distributions, pip fails for dist-a, the rest is recorded
echo "$*" >> "$CALLS"
case "$1" in
  -) cat >/dev/null; echo "dist-a dist-b" ;;
  -m) case "$*" in *dist-a*) exit 1 ;; esac ;;
  scripts/gpu_check.py) echo "$PYTHONPATH" > "$CALLS.pythonpath" ;;
esac
exit 0
"""


def test_shell_installs_each_wheel_alone_and_writes_to_out(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    out, calls, wheels = tmp_path / "out", tmp_path / "calls", tmp_path / "wheels"
    wheels.mkdir()
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(fake), "CALLS": str(calls), "OUT": str(out),
           "GPU_CHECK_WHEELS": str(wheels), "GPU_CHECK_SITE": str(tmp_path / "site"), "PYTHONPATH": "/keep"}
    done = subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh"), "--quick"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = calls.read_text().splitlines()
    pips = [line for line in lines if line.startswith("-m pip")]
    assert len(pips) == 2 and all("--no-deps" in p and "--no-index" in p and "--target" in p for p in pips)
    assert "not installed: dist-a" in done.stdout and (out / "gpu_check-install.log").exists()
    assert lines[-1] == f"scripts/gpu_check.py --out {out}/gpu_check.json --quick"
    assert open(f"{calls}.pythonpath").read().split() == [f"{REPO}:{tmp_path / 'site'}:/keep"]
    assert "cryptography" not in (SCRIPTS / "gpu_check.sh").read_text()


REHEARSE_KERNEL = """
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("gc", sys.argv[1]); gc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gc)
from pagedserve.kernels.paged_attention_triton import paged_attention_triton
for q_len, splits in ((1, None), (1, 2), (5, None)):
    a = gc.make_paged(torch, 3, 40, q_len, 4, 2, 16, 16, torch.float32, "cpu", mixed=True, pad=2, poison=True)
    r = gc.compare_attention(torch, paged_attention_triton, a, 0.25, splits)
    assert r["ok"], (q_len, splits, r)
"""


def test_triton_kernel_passes_the_strict_comparison_interpreted():
    """The kernels part's comparison, rehearsed with TRITON_INTERPRET=1 at tiny shapes only."""
    pytest.importorskip("triton")
    done = subprocess.run([sys.executable, "-c", REHEARSE_KERNEL, str(SCRIPTS / "gpu_check_attention.py")], cwd=REPO,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_without_cuda_the_cuda_parts_check_what_they_can_and_skip(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OUT=str(tmp_path), CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, str(SCRIPTS / "gpu_check.py"), "--quick", "--parts", "kernels,bench,serve",
                           "--budget", "serve=40"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    gc = load()
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert gc.validate(report) == [] and report["dry_run"] is False
    parts = report["parts"]
    assert parts["services"] == {"status": "skipped", "reason": "not in --parts"}
    for name in ("kernels", "bench", "serve"):
        assert parts[name]["status"] == "skipped" and parts[name]["reason"] == "no CUDA", (name, parts[name])
        assert f"{name}: skipped: no CUDA" in done.stdout
    assert parts["kernels"]["swap_copy_cpu"] is True
    kernels_part = load_part("gpu_check_kernels")
    assert parts["kernels"]["cases_planned"] == len(kernels_part.kernel_cases(True)) < len(kernels_part.KERNEL_CASES)
    if importlib.util.find_spec("triton"):
        assert set(parts["kernels"]["triton_imports"].values()) == {"ok"}
    # bench serve at each rate (bench split is the split part's, not run with --quick)
    assert parts["serve"]["arguments"]["parsed"] is True and len(parts["serve"]["arguments"]["commands"]) == 3
    assert report["budgets"] == dict(gc.QUICK_BUDGETS, serve=40.0)
    assert report["env"]["cuda_available"] is False and report["env"]["problems"] == []
    assert "the GPU machine's image has torch 2.11" in report["env"]["note"]


INTERPRETED = """
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("gc", sys.argv[1]); gc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gc)
from pagedserve.kernels.paged_attention_triton import paged_attention_triton
for window, softcap, splits in ((None, None, None), (6, None, None), (None, 2.0, 2)):
    a = gc.make_paged(torch, 4, 40, 5, 4, 2, 16, 8, torch.float32, "cpu", mixed=True, pad=2, poison=True,
                      mixed_launch=True, far=2048)
    r = gc.compare_attention(torch, paged_attention_triton, a, 0.25, splits, window, softcap)
    assert r["ok"], (window, softcap, r)
print("ok")
"""


def test_the_triton_kernel_passes_the_new_cases_interpreted():
    """Prefill chunks beside decodes, far blocks, a window, soft-capping: the Triton kernel
    under TRITON_INTERPRET=1 at tiny shapes (the GPU runs them at real ones)."""
    pytest.importorskip("triton")
    done = subprocess.run([sys.executable, "-c", INTERPRETED, str(SCRIPTS / "gpu_check_attention.py")], cwd=REPO,
                          env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


FUSED = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from gpu_check_fused import check_fused
records = check_fused(torch, "cpu", small=True)
assert len(records) == 2 * 3 * 8 and all(r["ok"] for r in records), [r for r in records if not r["ok"]]
assert all(r["wanted_exact_share"] for r in records if r["dtype"] == "float16" and "ulps_vs_torch" in r)
print("ok")
"""


def test_the_fused_kernels_pass_their_comparison_interpreted():
    """The kernels part's fused comparisons (scripts/gpu_check_fused.py) under TRITON_INTERPRET=1
    at the rehearsal's sizes (the GPU runs them at the served models' shapes)."""
    pytest.importorskip("triton")
    done = subprocess.run([sys.executable, "-c", FUSED, str(SCRIPTS)], cwd=REPO,
                          env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


HIDDEN_RUN = r"""
import importlib, importlib.abc, importlib.util, sys, tempfile
from pathlib import Path
HIDE = sys.argv[1].split(",")

class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == h or name.startswith(h + ".") for h in HIDE):
            raise ModuleNotFoundError(f"hidden by the test: {name}", name=name)

sys.meta_path.insert(0, Hide())
from pagedserve.cli import build_parser
build_parser().parse_args(["gateway", "--http-port", "0"])
for name in ("pagedserve.memsvc.server", "pagedserve.executor.server", "pagedserve.gateway.main", "pagedserve.gateway.server", "pagedserve.benchmarks.serve",
             "pagedserve.benchmarks.split", "pagedserve.client", "pagedserve.kernels"):
    importlib.import_module(name)
spec = importlib.util.spec_from_file_location("gpu_check", "scripts/gpu_check.py")
gc = importlib.util.module_from_spec(spec); spec.loader.exec_module(gc)
gc.parse_args(["--quick"])
sys.path.insert(0, "scripts")
import gpu_check_models
import torch
torch.set_num_threads(1)
model = gpu_check_models.build_model(Path(tempfile.mkdtemp()) / "m", hidden=64, layers=1, heads=4, kv_heads=2,
                                     inter=96, vocab=300)
from pagedserve.engine import LLMEngine
from pagedserve.wire.protocol import SamplingParams
out = LLMEngine(model=str(model), kv_tokens=256).generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0))
assert len(out[0].completions[0].token_ids) == 2
leaked = sorted(m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in HIDE))
assert not leaked, leaked
print("ok")
"""


def test_the_gpu_path_runs_without_the_not_carried_packages():
    """The services' modules, the CLI, gpu_check and the in-process serving path import and
    generate with every not-carried package hidden (the rehearsal does it in real processes)."""
    hide = hidden_modules()
    assert {"starlette", "uvicorn", "httpx", "xgrammar", "gguf", "opentelemetry.sdk"} <= set(hide)
    done = subprocess.run([sys.executable, "-c", HIDDEN_RUN, ",".join(hide)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_without_cuda_the_split_part_parses_its_bench_split_commands_and_skips(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OUT=str(tmp_path), CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, str(SCRIPTS / "gpu_check.py"), "--parts", "split"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    part = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]["split"]
    assert part["status"] == "skipped" and part["reason"] == "no CUDA"
    assert part["arguments"] == {"commands": ["batch_32", "one_stream"], "parsed": True}

"""scripts/gpu_check.sh and gpu_check.py, what can be checked without a GPU: shell syntax,
arguments, the JSON skeleton of a dry run, the workload and the helpers' shapes."""
import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from tests.support import REPO

SCRIPTS = REPO / "scripts"


def load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPTS / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shell_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPTS / "gpu_check.sh")], check=True)


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
        "kernels": "pending", "services": "skipped", "bench": "pending", "serve": "skipped"}
    assert json.loads(done.stdout)["budgets"]["bench"] == 30


def test_arguments_are_checked():
    gc = load()
    with pytest.raises(SystemExit):
        gc.parse_args(["--parts", "kernels,nope"])
    with pytest.raises(SystemExit):
        gc.parse_args(["--budget", "kernels"])
    args = gc.parse_args([])
    assert args.parts == gc.PARTS and sum(args.budgets.values()) < 470  # inside the 8-minute cut


def test_validate_names_what_is_wrong():
    gc = load()
    assert gc.validate({"schema": "x", "parts": {}}) == ["schema"] + [f"parts.{n}.status" for n in gc.PARTS]


def test_sharegpt_like_lengths():
    gc = load()
    reqs = gc.sharegpt_like(50, seed=3)
    assert reqs == gc.sharegpt_like(50, seed=3)
    assert all(1 <= len(p) <= 1024 and 1 <= o <= 512 and len(p) + o <= 2048 for p, o in reqs)


def test_make_paged_matches_the_kernel_contract():
    gc = load()
    from kernels.paged_attention_ref import paged_attention_ref

    a = gc.make_paged(torch, 3, 40, 2, 8, 2, 16, 16, torch.float32, "cpu")
    assert a["block_tables"].shape == (3, 3) and a["q"].shape == (6, 8, 16)
    out = paged_attention_ref(**a, scale=0.25)
    assert torch.isfinite(out).all()


def test_wheels_fit_the_carry_limit():
    folder = SCRIPTS / "gpu_wheels"
    names = [line.strip() for line in (SCRIPTS / "gpu_wheels.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert "grpcio-health-checking" in names and "torch" not in names
    if folder.exists():
        assert sum(f.stat().st_size for f in folder.iterdir()) < 64 << 20

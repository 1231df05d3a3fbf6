"""scripts/gpu_check.sh and gpu_check.py, what can be checked without a GPU: shell syntax,
arguments, the JSON skeleton of a dry run, the workload and the helpers' shapes; the mended
defects (output folder, PYTHONPATH, swap wait, deadlines, strict comparisons) with the GPU mocked;
the scripts run as processes: tests/system/test_gpu_check_scripts.py."""
import json

import pytest
import torch

from tests.support.gpu_check import SCRIPTS, load_gpu_check as load, load_part


def test_arguments_are_checked():
    gc = load()
    with pytest.raises(SystemExit):
        gc.parse_args(["--parts", "kernels,nope"])
    with pytest.raises(SystemExit):
        gc.parse_args(["--budget", "kernels"])
    args = gc.parse_args([])
    assert args.parts == gc.DEFAULT_PARTS == [p for p in gc.PARTS if p != "steady"]  # steady only when named
    assert sum(args.budgets[p] for p in args.parts) < 470  # inside the 8-minute cut


def test_validate_names_what_is_wrong():
    gc = load()
    assert gc.validate({"schema": "x", "parts": {}}) == ["schema"] + [f"parts.{n}.status" for n in gc.PARTS]


def test_sharegpt_like_lengths():
    serve = load_part("gpu_check_serve")
    reqs = serve.sharegpt_like(50, seed=3)
    assert reqs == serve.sharegpt_like(50, seed=3)
    assert all(1 <= len(p) <= 1024 and 1 <= o <= 512 and len(p) + o <= 2048 for p, o in reqs)


def test_make_paged_matches_the_kernel_contract():
    attention = load_part("gpu_check_attention")
    from pagedserve.kernels.paged_attention_ref import paged_attention_ref

    a = attention.make_paged(torch, 3, 40, 2, 8, 2, 16, 16, torch.float32, "cpu")
    assert a["block_tables"].shape == (3, 3) and a["q"].shape == (6, 8, 16)
    out = paged_attention_ref(**a, scale=0.25)
    assert torch.isfinite(out).all()


def test_wheels_fit_the_carry_limit():
    folder = SCRIPTS / "gpu_wheels"
    names = [line.split("==")[0] for line in (SCRIPTS / "gpu_wheels.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert "grpcio-health-checking" in names and "torch" not in names
    if folder.exists():
        assert sum(f.stat().st_size for f in folder.iterdir()) < 64 << 20


def test_out_defaults_to_the_device_machines_folder(monkeypatch, tmp_path):
    gc = load()
    monkeypatch.setenv("OUT", str(tmp_path))
    args = gc.parse_args([])
    assert args.out == str(tmp_path / "gpu_check.json") and args.logs == tmp_path / "gpu_check-logs"
    monkeypatch.delenv("OUT")
    assert gc.parse_args([]).out == "bench_results/gpu_check.json"


def test_service_processes_keep_the_pythonpath_set(monkeypatch, tmp_path):
    """Wheels installed with `pip --target` are on PYTHONPATH: the repository goes ahead of
    them, it does not replace them."""
    models, common = load_part("gpu_check_models"), load_part("gpu_check_common")
    monkeypatch.setenv("PYTHONPATH", "/wheels")
    started = []
    monkeypatch.setattr(models.subprocess, "Popen", lambda argv, **kw: started.append(kw["env"]))
    svc = models.Services(tmp_path / "model", "cuda", "float32", log_dir=tmp_path / "logs" / "services")
    svc._start("memsvc", ["memsvc"])
    assert started[0]["PYTHONPATH"] == f"{common.ROOT}{common.os.pathsep}/wheels"
    assert started[0]["PAGEDSERVE_INTERNAL_TOKEN"] == svc.token  # the services are closed
    assert (tmp_path / "logs" / "services" / "memsvc.log").exists()
    monkeypatch.delenv("PYTHONPATH")
    assert common.child_env()["PYTHONPATH"] == str(common.ROOT)


def test_swap_in_waits_for_the_swap_out(monkeypatch):
    import pagedserve.memsvc.host_pool as host_pool

    kernels_part = load_part("gpu_check_kernels")
    calls = []
    copy, finish = host_pool.swap_copy, host_pool.finish_copies
    monkeypatch.setattr(host_pool, "swap_copy", lambda *a: (calls.append("copy"), copy(*a))[1])
    monkeypatch.setattr(host_pool, "finish_copies", lambda pool: (calls.append("wait"), finish(pool))[1])
    assert kernels_part.check_swap(torch, "cpu")
    assert calls == ["copy", "wait", "copy", "wait"]


def test_each_step_is_written_as_it_ends(tmp_path):
    gc = load()
    out = tmp_path / "check.json"
    report = gc.skeleton(gc.parse_args(["--out", str(out)]))
    part = gc.Part(report, "services", gc.time.monotonic() + 60, lambda: gc.write(report, str(out)))
    part.put("greedy_equal", [True])
    written = json.loads(out.read_text())
    assert written["parts"]["services"] == {"status": "running", "greedy_equal": [True]}
    assert gc.validate(written) == [] and not part.over()


def test_a_cut_is_recorded_and_ends_the_run(monkeypatch, tmp_path):
    gc = load()
    out = tmp_path / "check.json"

    def cut(args, part):
        part.put("cases", [1])
        raise gc.Cut("SIGTERM: the outer time limit cut the run")

    monkeypatch.setattr(load_part("gpu_check_kernels"), "part_kernels", cut)
    monkeypatch.setattr(gc, "environment", lambda args: {})
    monkeypatch.setattr(gc.signal, "signal", lambda *a: None)
    assert gc.main(["--out", str(out), "--parts", "kernels,bench"]) == 1
    parts = json.loads(out.read_text())["parts"]
    assert parts["kernels"]["status"] == "error" and parts["kernels"]["cases"] == [1]
    assert parts["bench"]["status"] == "pending"


def test_services_part_honours_its_deadline(monkeypatch, tmp_path):
    gc, services = load(), load_part("gpu_check_services")
    monkeypatch.setattr(services, "build_model", lambda path, **kw: path)
    monkeypatch.setattr(services, "hf_greedy", lambda *a: [[0]] * 4)
    monkeypatch.setattr(services, "hf_sampled", lambda *a, **kw: [[0]] * 4)
    monkeypatch.setattr(services, "Services", None)  # must not be reached
    args = gc.parse_args(["--out", str(tmp_path / "c.json")])
    report = gc.skeleton(args)
    part = gc.Part(report, "services", gc.time.monotonic() - 1, lambda: None)
    assert services.part_services(args, part, tmp_path) == {"status": "failed"}
    assert part.result["reason"] == "time budget, before starting the services"


def test_services_ok_needs_every_step_and_a_real_swap():
    services = load_part("gpu_check_services")
    good = {"greedy_equal": [True] * 4,
            "n4": {"completions": 4, "seeded_repeat_equal": True, "greedy_each_equal_transformers": [True] * 4},
            "beam4": {"equal_to_transformers": True},
            "sigkill_executor": {"errors": [], "sequences_held_at_kill": 3, "same_outputs": [True] * 4},
            "bf16_vs_transformers": {"ok": True},
            "swap_tiny_pool": {"same_outputs": [True] * 4, "swapped_out": 2, "swapped_in": 2}}
    assert services.services_ok(good)
    assert not services.services_ok(dict(good, bf16_vs_transformers={"ok": False}))
    assert not services.services_ok({k: v for k, v in good.items() if k != "beam4"})
    for swaps in ((0, 0), (2, 1)):
        r = dict(good, swap_tiny_pool=dict(good["swap_tiny_pool"], swapped_out=swaps[0], swapped_in=swaps[1]))
        assert not services.services_ok(r)
    assert not services.services_ok(dict(good, sigkill_executor=dict(good["sigkill_executor"],
                                                                     sequences_held_at_kill=0)))


@pytest.mark.parametrize("q_len", [1, 6])
def test_attention_comparison_is_strict(q_len):
    """Mixed lengths, padded tables, NaN past each sequence and in the output before the call:
    the reference passes clean data, a kernel that skips rows or reads past a length fails."""
    attention = load_part("gpu_check_attention")
    from pagedserve.kernels.paged_attention_ref import paged_attention_ref

    args = (torch, 4, 37, q_len, 8, 2, 16, 8, torch.float32, "cpu")
    clean = attention.make_paged(*args, mixed=True, pad=2)
    assert len(set(clean["seq_lens"].tolist())) > 1 and clean["block_tables"].shape[1] == 5 + 2
    assert attention.compare_attention(torch, paged_attention_ref, clean, 0.25)["ok"]
    poisoned = attention.make_paged(*args, mixed=True, pad=2, poison=True)
    assert torch.isnan(poisoned["k_cache"][0]).all()

    def reads_everything(**a):  # attends over whole blocks, the slots past a length included
        lens = torch.full_like(a["seq_lens"], a["block_tables"].shape[1] * 8)
        paged_attention_ref(**dict(a, seq_lens=lens))

    assert not attention.compare_attention(torch, reads_everything, poisoned, 0.25)["ok"]

    def skips_the_last(**a):
        paged_attention_ref(**a)
        a["out"][-1] = a["out"][-2] if len(a["out"]) > 1 else 0

    assert not attention.compare_attention(torch, skips_the_last, clean, 0.25)["ok"]

    def leaves_nan(**a):
        a["out"][:-1] = paged_attention_ref(**dict(a, out=None))[:-1]

    assert not attention.compare_attention(torch, leaves_nan, clean, 0.25)["finite"]

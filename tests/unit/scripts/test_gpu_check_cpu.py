"""scripts/gpu_check.py without CUDA, the rehearsal's cheap parts: the CUDA parts check their
imports and the arguments of the commands they would run, say "skipped: no CUDA" and the
JSON lands in $OUT; the services part's comparisons are equivalent on both sides (EOS may end
a sequence in transformers and in pagedserve alike) and its bfloat16 metric passes a right
answer and fails wrong ones; the kernel cases' inputs (mixed launches, far blocks, windows,
soft-capping) agree with pagedserve/kernels/paged_attention_ref. The services part itself on the CPU is
`scripts/gpu_check.sh --rehearse` (real processes, ~40 s here); the script run as a process:
tests/system/test_gpu_check_scripts.py."""
from __future__ import annotations

import threading
import types

import pytest
import torch

from tests.support.gpu_check import load_gpu_check as load, load_part


def test_budgets_fit_the_device_time():
    gc = load()
    assert sum(gc.QUICK_BUDGETS[p] for p in gc.DEFAULT_PARTS) + 15 <= 235 - 10  # start-up, margin under the cut
    assert sum(gc.DEFAULT_BUDGETS[p] for p in gc.DEFAULT_PARTS) + 15 <= 470
    assert gc.parse_args(["--quick"]).budgets == gc.QUICK_BUDGETS
    assert gc.parse_args([]).budgets == gc.DEFAULT_BUDGETS
    assert gc.PARTS[0] == "services"  # the most decisive first


def test_the_gateway_starts_without_its_http_port(monkeypatch, tmp_path):
    models = load_part("gpu_check_models")
    started = []
    monkeypatch.setattr(models.subprocess, "Popen", lambda argv, **kw: started.append(argv))
    monkeypatch.setattr("pagedserve.client.GenerationClient.serving", lambda self, timeout=1.0: True)
    models.Services(tmp_path / "model", "cpu", "float32", log_dir=tmp_path / "logs").start(1)
    gateway = next(argv for argv in started if "gateway" in argv)
    assert gateway[gateway.index("--http-port") + 1] == "0"


class FakeProc:
    def __init__(self):
        self.signals = []

    def poll(self):
        return None if not self.signals else -15

    def send_signal(self, sig):
        self.signals.append(sig)

    def wait(self, timeout=None):
        return -15


def test_services_that_never_serve_are_stopped_before_the_error(monkeypatch, tmp_path):
    models = load_part("gpu_check_models")
    procs = []
    monkeypatch.setattr(models.subprocess, "Popen", lambda argv, **kw: procs.append(FakeProc()) or procs[-1])
    monkeypatch.setattr("pagedserve.client.GenerationClient.serving", lambda self, timeout=1.0: False)
    with pytest.raises(TimeoutError, match="not SERVING"):
        models.Services(tmp_path / "model", "cpu", "float32", log_dir=tmp_path / "logs").start(0)
    assert len(procs) == 3 and all(p.signals == [models.signal.SIGTERM] for p in procs)


class FakeServices:
    """Services that record each request's sampling and answer one token a completion; a
    request runs until the executor is killed when the check is about to kill it."""
    samplings: list = []

    def __init__(self, model_dir, device, dtype, extra_memsvc=(), log_dir=None):
        self.killed = threading.Event()
        self.procs = {"executor": types.SimpleNamespace(send_signal=lambda s: self.killed.set(), wait=lambda: 0)}

    def start(self, timeout=120):
        return self

    def generate(self, ids, sampling):
        FakeServices.samplings.append((len(ids), sampling))
        if sampling.max_tokens == 128 and not self.killed.is_set():  # the SIGKILL step's requests
            assert self.killed.wait(10)
        return [[7]] * max(sampling.n, 1)

    def generate_scored(self, ids, sampling):
        FakeServices.samplings.append((len(ids), sampling))
        return [7], [-0.5]

    def memsvc_stats(self):
        return types.SimpleNamespace(num_sequences=4, preemption={"num_swapped_out": 1, "num_swapped_in": 1})

    def start_executor(self):
        pass

    def stop(self):
        pass


def test_greedy_comparisons_let_eos_end_a_sequence_on_both_sides(monkeypatch, tmp_path):
    """transformers' min_new_tokens masks EOS, pagedserve's ignore_eos does not: every output
    compared with transformers' is made without either."""
    gc, services = load(), load_part("gpu_check_services")
    hf_calls = []
    monkeypatch.setattr(services, "build_model", lambda path, **kw: path)
    monkeypatch.setattr(services, "hf_greedy", lambda *a, **kw: hf_calls.append(("greedy", a, kw)) or [[7]] * 4)
    monkeypatch.setattr(services, "hf_sampled", lambda *a, **kw: hf_calls.append(("sampled", a, kw)) or [[7]] * 4)
    monkeypatch.setattr(services, "bf16_against_transformers", lambda *a: {"ok": True})
    monkeypatch.setattr(services, "Services", FakeServices)
    FakeServices.samplings = []
    args = gc.parse_args(["--out", str(tmp_path / "c.json")])
    args.device = "cpu"
    part = gc.Part(gc.skeleton(args), "services", gc.time.monotonic() + 60, lambda: None)
    assert services.part_services(args, part, tmp_path) == {"status": "ok"}, part.result
    assert all("min_new_tokens" not in kw for _, _, kw in hf_calls) and len(hf_calls) == 2
    compared = [s for _, s in FakeServices.samplings
                if s.max_tokens in (24, 16, 12) and (s.temperature == 0.0 or s.beam_width > 1)]
    assert len(compared) == 4 + 1 + 1  # the 4 greedy prompts, n=4 greedy, beam 4
    assert not any(s.ignore_eos for s in compared)
    assert any(s.beam_width == 4 for s in compared)


def tiny_model(models, tmp_path, std=0.02):
    return models.build_model(tmp_path / "m", hidden=128, layers=2, heads=4, kv_heads=2, inter=256, vocab=512,
                          max_pos=256, std=std)


def test_bf16_metric_passes_pagedserve_and_fails_wrong_answers(tmp_path):
    models = load_part("gpu_check_models")
    from pagedserve.engine import LLMEngine
    from pagedserve.wire.protocol import SamplingParams

    torch.manual_seed(0)
    model = tiny_model(models, tmp_path)
    prompts = [[5, 9, 11, 40], list(range(20, 52))]
    engine = LLMEngine(model=str(model), dtype="bfloat16", kv_tokens=512)
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0))
    scored = [(o.completions[0].token_ids, o.completions[0].logprobs) for o in outs]
    good = models.bf16_against_transformers(model, prompts, scored, "cpu")
    assert good["ok"] and good["positions"] == 24, good
    off = [(t, [lp - 0.2 for lp in lps]) for t, lps in scored]  # logprobs 0.2 nats off
    assert not models.bf16_against_transformers(model, prompts, off, "cpu")["ok"]
    from transformers import AutoModelForCausalLM

    with torch.inference_mode():
        first = AutoModelForCausalLM.from_pretrained(model).eval()(torch.tensor([prompts[0]])).logits[0, -1]
    tokens, logprobs = scored[0]
    wrong = [([int(first.argmin()), *tokens[1:]], logprobs), scored[1]]  # float32's least likely token
    bad = models.bf16_against_transformers(model, prompts, wrong, "cpu")
    assert not bad["ok"] and bad["max_regret"] > models.BF16_TOLERANCE["max_regret"]


@pytest.mark.parametrize("window, softcap", [(None, None), (7, None), (None, 2.0), (5, 3.0)])
def test_case_inputs_agree_with_the_reference(window, softcap):
    """Mixed launches, far blocks and padded poisoned tables: dense_reference and the torch
    reference agree, so a kernel failing compare_attention is wrong, not the inputs."""
    attention = load_part("gpu_check_attention")
    from pagedserve.kernels.paged_attention_ref import paged_attention_ref

    a = attention.make_paged(torch, 5, 37, 6, 8, 2, 16, 8, torch.float32, "cpu", mixed=True, pad=2, poison=True,
                      mixed_launch=True, far=4096)
    q_lens = (a["query_start_loc"][1:] - a["query_start_loc"][:-1]).tolist()
    assert q_lens[1::2] == [1, 1] and max(q_lens) > 1
    assert a["block_tables"].min() * a["k_cache"].stride(0) >= 4096 and torch.isnan(a["k_cache"][0]).all()
    result = attention.compare_attention(torch, paged_attention_ref, a, 0.25, window=window, softcap=softcap)
    assert result["ok"] and result["finite"], result
    if window or softcap:  # each changes the answer: the reference of the check does not ignore them

        def with_them(**kw):
            return paged_attention_ref(**kw, window=window, softcap=softcap)

        assert not attention.compare_attention(torch, with_them, a, 0.25)["ok"]


def test_every_kernel_case_names_a_shape_and_a_reason():
    kernels_part = load_part("gpu_check_kernels")
    assert all(c.shape in kernels_part.ATTENTION_SHAPES and c.why for c in kernels_part.KERNEL_CASES)
    quick = kernels_part.kernel_cases(True)
    assert quick == kernels_part.KERNEL_CASES[:len(quick)]  # the quick cases are the most important, first
    assert {c.dtype for c in quick} == {"bfloat16", "float16", "float32"} and any(c.mixed_launch for c in quick)
    assert any(c.far for c in kernels_part.KERNEL_CASES) and any(c.window for c in kernels_part.KERNEL_CASES)


def test_the_dense_decode_the_bench_sets_paged_attention_against_is_attention():
    """gpu_check_attention.dense_decode (the bench part's and the sweep's dense launch) over
    make_paged's decode arguments equals the float32 reference, on the CPU."""
    attention = load_part("gpu_check_attention")
    a = attention.make_paged(torch, 3, 48, 1, 4, 2, 16, 16, torch.float32, "cpu")
    out = attention.dense_decode(torch, a, 0.25)()
    torch.testing.assert_close(out.view(3, 4, 16), attention.dense_reference(torch, a, 0.25), atol=1e-5, rtol=1e-5)

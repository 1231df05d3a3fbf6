"""gpu_check's models without a download and what runs them: build_model (a random-weight
Llama with a made-up WordLevel tokenizer), transformers' references (hf_greedy, hf_sampled,
bf16_against_transformers with BF16_TOLERANCE) and Services (memsvc, executor and gateway as
three processes on loopback). Used by the services, serve, tp and split parts.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpu_check_common import ROOT, child_env

from pagedserve.rpc.ports import free_port


def build_model(path: Path, *, hidden, layers, heads, kv_heads, inter, vocab=4096, max_pos=4096, std=0.1,
                seed=0, device="cpu", dtype=None) -> Path:
    """A random-weight Llama saved with a made-up WordLevel tokenizer (no network); its
    weights drawn on `device` (a 1B model is drawn in seconds on a GPU, a minute on a CPU) and
    saved in `dtype` (default float32). EOS is token 2."""
    if (path / "config.json").exists():
        return path
    model = random_llama(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, inter=inter, vocab=vocab,
                         max_pos=max_pos, std=std, seed=seed, device=device)
    if dtype is not None:
        model = model.to(dtype)
    save_model(model, path)
    return path


def random_llama(*, hidden, layers, heads, kv_heads, inter, vocab=4096, max_pos=4096, std=0.1, seed=0,
                 device="cpu", dtype=None):
    """A random-weight LlamaForCausalLM drawn on `device`, in `dtype` from the start when
    given (an 8B model never exists in float32), else float32. EOS is token 2."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=inter, vocab_size=vocab,
                         max_position_embeddings=max_pos, initializer_range=std, bos_token_id=1,
                         eos_token_id=2, tie_word_embeddings=False)
    before = torch.get_default_dtype()
    try:
        if dtype is not None:
            torch.set_default_dtype(dtype)
        with torch.device(device):
            return LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(before)


def save_model(model, path: Path) -> Path:
    """`model` saved (safetensors) with a made-up WordLevel tokenizer over its vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = model.config.vocab_size
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(vocab - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    return path


def hf_greedy(model_dir, prompts, max_new, dtype, device):
    """transformers' greedy output for each prompt, ending at EOS (included) or max_new."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            y = model.generate(x, max_new_tokens=max_new, do_sample=False, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    del model
    torch.cuda.empty_cache()
    return outs


class Services:
    """memsvc, executor and gateway as three processes on loopback (the executor killable),
    closed by a fresh internal token that this process also reads memsvc's stats with."""

    def __init__(self, model_dir, device, dtype, extra_memsvc=(), log_dir=None, extra_gateway=(),
                 executor_cmd=None):
        from pagedserve.rpc.internal_auth import new_token

        self.token = new_token()
        self.ports = {n: free_port() for n in ("memsvc", "executor", "gateway")}
        self.model_dir, self.device, self.dtype = str(model_dir), device, dtype
        self.extra_memsvc, self.extra_gateway = list(extra_memsvc), list(extra_gateway)
        # the executor's command before its `executor ...` arguments (a wrapper that times steps)
        self.executor_cmd = list(executor_cmd or [sys.executable, "-m", "pagedserve.cli"])
        self.log_dir = Path(log_dir or tempfile.mkdtemp())
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs = {}

    def _start(self, name, argv, cmd=None):
        log = open(self.log_dir / f"{name}.log", "ab")
        from pagedserve.rpc.internal_auth import ENV

        env = {**child_env(), ENV: self.token}
        self.procs[name] = subprocess.Popen([*(cmd or [sys.executable, "-m", "pagedserve.cli"]), *argv], cwd=ROOT,
                                            env=env, stdout=log, stderr=subprocess.STDOUT)

    def start_executor(self):
        p = self.ports
        self._start("executor", cmd=self.executor_cmd, argv=["executor", "--port", str(p["executor"]), "--memsvc", f"127.0.0.1:{p['memsvc']}",
                                 "--model", self.model_dir, "--device", self.device, "--dtype", self.dtype])

    def start(self, timeout=120):
        """Start the three services and wait until the gateway serves; on any failure (one
        exits, the time runs out, a cut) every process started is stopped first."""
        from pagedserve.client import GenerationClient

        p = self.ports
        try:
            self._start("memsvc", ["memsvc", "--port", str(p["memsvc"]), *self.extra_memsvc])
            self.start_executor()
            self._start("gateway", ["gateway", "--port", str(p["gateway"]), "--http-port", "0",  # no HTTP API
                                    "--executor", f"127.0.0.1:{p['executor']}",
                                    "--memsvc", f"127.0.0.1:{p['memsvc']}", *self.extra_gateway])
            self.client = GenerationClient(f"127.0.0.1:{p['gateway']}", timeout=120)
            end = time.monotonic() + timeout
            while not self.client.serving():
                for name, proc in self.procs.items():
                    if proc.poll() is not None:
                        raise RuntimeError(f"{name} exited: {self.tail(name)}")
                if time.monotonic() > end:
                    raise TimeoutError("services not SERVING: " + self.tail("executor"))
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        return self

    def tail(self, name, n=2000):
        try:
            return (self.log_dir / f"{name}.log").read_text()[-n:]
        except OSError:
            return ""

    def memsvc_stats(self):
        """memsvc's PoolStats (preemption counts in .preemption)."""
        from pagedserve.rpc.grpc_service import open_channel
        from pagedserve.wire import convert
        from pagedserve.wire.v1 import memory_pb2, memory_pb2_grpc

        with open_channel(f"127.0.0.1:{self.ports['memsvc']}", token=self.token) as channel:
            reply = memory_pb2_grpc.MemoryManagerStub(channel).Stats(memory_pb2.StatsRequest(), timeout=10)
        return convert.stats_from_proto(reply)

    def generate(self, ids, sampling):
        completions = {}
        for d in self.client.generate(ids, sampling):
            completions.setdefault(d.index, []).extend(d.token_ids)
        return [completions[i] for i in sorted(completions)]

    def generate_scored(self, ids, sampling):
        """(tokens, the logprob of each) of a one-completion request with sampling.logprobs."""
        tokens, logprobs = [], []
        for d in self.client.generate(ids, sampling):
            tokens.extend(d.token_ids)
            logprobs.extend(d.logprobs)
        return tokens, logprobs

    def stop(self):
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def hf_sampled(model_dir, ids, dtype, device, **generate):
    """transformers' generate for one prompt, every returned sequence's new tokens (with
    num_beams, each beam's own length: a beam that ended at EOS is not padded)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    with torch.inference_mode():
        y = model.generate(torch.tensor([ids], device=device), pad_token_id=0, return_dict_in_generate=True,
                           **generate)
    del model
    if getattr(y, "beam_indices", None) is not None:
        lengths = (y.beam_indices >= 0).sum(1).tolist()
        return [row[len(ids):len(ids) + n].tolist() for row, n in zip(y.sequences, lengths)]
    return [row[len(ids):].tolist() for row in y.sequences]


# pagedserve's bfloat16 end to end, against transformers with eager attention: each greedy output
# is scored teacher-forced by transformers in float32 (the truth) and in bfloat16 (the yardstick:
# the error bfloat16 arithmetic itself makes, in another order of operations). At every output
# position, the error of pagedserve's logprob of its token against float32's:
#   mean error <= mae_ratio x transformers-bfloat16's mean error (+ 1e-3 nats),
#   every error <= max_error nats, and
#   regret (float32's best logprob there minus that of pagedserve's token) <= max_regret nats:
#   pagedserve picks float32's argmax or a token within max_regret of it (a near tie).
# On the CPU at the check's shape (std 0.02, 2 layers), pagedserve's mean error is 0.0039 against
# transformers-bfloat16's 0.0039, its largest 0.013 and its largest regret 0.007.
BF16_TOLERANCE = {"mae_ratio": 1.5, "max_error": 0.05, "max_regret": 0.05}


def bf16_against_transformers(model_dir, prompts, outputs, device) -> dict:
    """BF16_TOLERANCE's metric for pagedserve's (tokens, logprobs) of each prompt."""
    import torch
    from transformers import AutoModelForCausalLM

    scores = {}
    for dtype in ("float32", "bfloat16"):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype),
                                                     attn_implementation="eager").to(device).eval()
        with torch.inference_mode():
            scores[dtype] = [model(torch.tensor([ids + tokens], device=device)).logits[0, len(ids) - 1:-1]
                             .float().log_softmax(-1).cpu() for ids, (tokens, _) in zip(prompts, outputs)]
        del model
    ps_err, hf_err, regret = [], [], []
    for i, (tokens, logprobs) in enumerate(outputs):
        if len(logprobs) != len(tokens):
            return {"ok": False, "error": f"prompt {i}: {len(tokens)} tokens, {len(logprobs)} logprobs"}
        pos, chosen = torch.arange(len(tokens)), torch.tensor(tokens)
        truth = scores["float32"][i]
        exact = truth[pos, chosen]
        ps_err.append((torch.tensor(logprobs) - exact).abs())
        hf_err.append((scores["bfloat16"][i][pos, chosen] - exact).abs())
        regret.append(truth.max(-1).values - exact)
    ps_err, hf_err, regret = torch.cat(ps_err), torch.cat(hf_err), torch.cat(regret)
    r = dict(positions=len(ps_err), pagedserve_mean_error=ps_err.mean().item(),
             transformers_bf16_mean_error=hf_err.mean().item(), pagedserve_max_error=ps_err.max().item(),
             transformers_bf16_max_error=hf_err.max().item(), max_regret=regret.max().item(),
             float32_argmax_share=(regret <= 0).float().mean().item(), tolerance=BF16_TOLERANCE)
    t = BF16_TOLERANCE
    r["ok"] = (r["pagedserve_mean_error"] <= t["mae_ratio"] * r["transformers_bf16_mean_error"] + 1e-3
               and r["pagedserve_max_error"] <= t["max_error"] and r["max_regret"] <= t["max_regret"])
    return r


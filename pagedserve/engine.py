"""The offline engine: memsvc, executor and the batching loop in one process, by direct calls.

For tests, `pagedserve generate` and the throughput benchmark. The same scheduler and
memory decisions run here as across the services.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Iterator

from pagedserve.engine_config import EngineConfig
from pagedserve.executor import Executor
from pagedserve.gateway.batch_loop import BatchLoop
from pagedserve.gateway.tokenizer import load_tokenizer
from pagedserve.memsvc.memory_manager import MemoryManager
from pagedserve.pool_share.device import on_device, resolve_device, resolve_dtype
from pagedserve.wire.protocol import Delta, PromptLogprob, SamplingParams


@dataclass
class Completion:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)  # positions 1.., if asked
    error: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    completions: list[Completion]
    prompt_tokens: int = 0
    cached_tokens: int = 0


def loop_settings(scheduler, device: str):
    """The batching loop's settings in one process. On a CPU, serial: the forward pass takes
    every core, so there is no wait for the output work to hide in. On a GPU, as configured
    (overlapped by default): the step runs on the device while the loop applies the last
    one's outputs and plans the next (on an H200 the split services' plan-ahead loop ran
    at 0.77x the serial in-process step at batch 32: docs/benchmark-history.md, "On one H200")."""
    if device == "cpu":
        return dataclasses.replace(scheduler, overlap=False)
    return scheduler


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **settings):
        config = config or EngineConfig.of(**settings)
        self.config = config
        ex = config.executor
        self.device = resolve_device(ex.device)
        self.dtype = resolve_dtype(ex.dtype, self.device)
        self.executor = Executor(ex.model, dtype=self.dtype, block_size=ex.block_size, device=self.device,
                                 revision=ex.revision, served_model_name=ex.served_model_name,
                                 linear_backend=ex.linear_backend, model_impl=ex.model_impl,
                                 kv_cache_dtype=ex.kv_cache_dtype,
                                 tensor_parallel_size=ex.tensor_parallel_size,
                                 group_timeout=ex.tensor_parallel_timeout)
        info = self.executor.model_info()
        max_len = min(info.max_model_len, ex.max_model_len or info.max_model_len)
        info.max_model_len = max_len
        # a tensor-parallel group's other ranks map their pools: shared memory, one per rank
        self.memory = MemoryManager(dataclasses.replace(
            config.memory, max_model_len=max_len,
            shared=config.memory.shared or ex.tensor_parallel_size > 1))
        budget = self.executor.kv_budget(ex.gpu_memory_utilization)
        self.executor.attach_pool(self.memory.register_executor(info.kv, budget, device=self.device,
                                                                ranks=ex.tensor_parallel_size))
        self.executor.capture_graphs()  # on a GPU: every decode bucket before the first step
        self.info = info
        self.tokenizer = load_tokenizer(info.tokenizer_dir)
        self.loop = BatchLoop(self.memory, _FixedInfo(self.executor, info),
                              loop_settings(config.scheduler, self.device), self.tokenizer)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop a tensor-parallel group's other ranks and give up a shared pool's name."""
        self.executor.close()
        self.memory.close()

    def encode(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if chat:
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True,
                return_dict=False,
            )
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def add_request(self, prompt: str | list[int], sampling: SamplingParams, *, chat: bool = False,
                    request_id: str | None = None, **kwargs) -> str:
        request_id = request_id or str(next(self._ids))
        self.loop.add_request(request_id, self.encode(prompt, chat), sampling, **kwargs)
        return request_id

    def stream(self) -> Iterator[Delta]:
        """Run steps until every queued request is done, yielding deltas as they come."""
        while self.loop.has_work():
            yield from self.loop.step()

    def generate(self, prompts: list[str | list[int]], sampling: SamplingParams | list[SamplingParams],
                 *, chat: bool = False) -> list[RequestOutput]:
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        ids = [self.add_request(p, sp, chat=chat) for p, sp in zip(prompts, params)]
        outputs = {rid: RequestOutput(rid, [Completion(i) for i in range(sp.n)])
                   for rid, sp in zip(ids, params)}
        for delta in self.stream():
            out = outputs[delta.request_id]
            c = out.completions[delta.index]
            c.text += delta.text
            c.token_ids += delta.token_ids
            c.logprobs += delta.logprobs
            c.top_logprobs += delta.top_logprobs
            c.prompt_logprobs += delta.prompt_logprobs
            c.finish_reason = delta.finish_reason or c.finish_reason
            c.error = delta.error or c.error
            out.prompt_tokens, out.cached_tokens = delta.prompt_tokens, delta.cached_tokens
        return [outputs[rid] for rid in ids]


class _FixedInfo:
    """The executor as the loop sees it, with the engine's capped maximum length; each step
    runs with the engine's GPU current (the overlapped loop calls from a helper thread,
    whose current GPU is otherwise the first)."""

    def __init__(self, executor: Executor, info):
        self._executor, self._info = executor, info

    def model_info(self):
        return self._info

    def execute(self, batch):
        with on_device(self._executor.device):
            return self._executor.execute(batch)

"""The in-process engine's config: the services' own setting dataclasses, and the flags it
takes from them.

Light to import (no torch): `pagedserve generate` and the benchmarks build their parsers
from it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.executor.config import ExecutorConfig
from pagedserve.gateway.scheduler_config import SchedulerConfig
from pagedserve.memsvc.config import MemoryConfig
from pagedserve.wire.settings import add_flags, from_args, to_argv

ENGINE_SETTINGS = {
    ExecutorConfig: ("model", "model_impl", "revision", "served_model_name", "device", "dtype", "block_size",
                     "max_model_len", "linear_backend", "kv_cache_dtype", "tensor_parallel_size",
                     "gpu_memory_utilization"),
    MemoryConfig: ("kv_tokens", "kv_memory", "policy", "prefix_caching", "preemption_mode",
                   "swap_space", "num_blocks", "num_host_blocks"),
    SchedulerConfig: ("max_num_seqs", "max_num_batched_tokens"),
}


@dataclass
class EngineConfig:
    """The executor's, memsvc's pool and the batching loop's settings, of which the engine
    takes the ENGINE_SETTINGS fields (num_blocks and num_host_blocks, exact sizes for tests,
    have no flag)."""

    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @classmethod
    def of(cls, **settings) -> "EngineConfig":
        """From flat setting names (`model=`, `kv_tokens=`, `max_num_seqs=`, ...)."""
        parts = []
        for config_cls, names in ENGINE_SETTINGS.items():
            parts.append(config_cls(**{k: settings.pop(k) for k in names if k in settings}))
        if settings:
            raise TypeError(f"unknown engine settings: {', '.join(sorted(settings))}")
        return cls(*parts)

    @classmethod
    def from_args(cls, args) -> "EngineConfig":
        return cls(*(from_args(c, args) for c in ENGINE_SETTINGS))

    def to_argv(self) -> list[str]:
        """The engine's settings as flags (of `generate`, or of `serve`, which has them all)."""
        return [*to_argv(self.executor, ENGINE_SETTINGS[ExecutorConfig]),
                *to_argv(self.memory, ENGINE_SETTINGS[MemoryConfig]),
                *to_argv(self.scheduler, ENGINE_SETTINGS[SchedulerConfig])]


def add_engine_flags(parser) -> None:
    """The engine's flags: the services' own, declared in their configs."""
    for config_cls, names in ENGINE_SETTINGS.items():
        add_flags(parser, config_cls, only=names)

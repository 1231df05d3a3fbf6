"""The in-process engine's config: the services' own configs, and the flags it takes from them.

Light to import (no torch): `pagedserve generate` and the benchmarks build their parsers
from it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from executor.config import ExecutorConfig
from gateway.config import GatewayConfig
from memsvc.config import MemsvcConfig
from wire.settings import add_flags, from_args, to_argv

ENGINE_SETTINGS = {
    ExecutorConfig: ("model", "device", "dtype", "block_size", "max_model_len", "linear_backend"),
    MemsvcConfig: ("kv_tokens", "kv_memory", "policy", "prefix_caching", "preemption_mode",
                   "swap_space"),
    GatewayConfig: ("max_num_seqs", "max_num_batched_tokens"),
}


@dataclass
class EngineConfig:
    """The services' own configs, of which the engine uses the ENGINE_SETTINGS fields."""

    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    memsvc: MemsvcConfig = field(default_factory=MemsvcConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    num_blocks: int | None = None  # exact pool size, for tests; wins over kv_tokens
    num_host_blocks: int | None = None  # exact swap space, for tests

    @classmethod
    def of(cls, **settings) -> "EngineConfig":
        """From flat setting names (`model=`, `kv_tokens=`, `max_num_seqs=`, ...)."""
        parts = {}
        for config_cls, names in ENGINE_SETTINGS.items():
            mine = {k: settings.pop(k) for k in names if k in settings}
            parts[config_cls] = config_cls(**mine)
        extra = {k: settings.pop(k) for k in ("num_blocks", "num_host_blocks") if k in settings}
        if settings:
            raise TypeError(f"unknown engine settings: {', '.join(sorted(settings))}")
        return cls(parts[ExecutorConfig], parts[MemsvcConfig], parts[GatewayConfig], **extra)

    @classmethod
    def from_args(cls, args) -> "EngineConfig":
        return cls(*(from_args(c, args) for c in ENGINE_SETTINGS))

    def to_argv(self) -> list[str]:
        """The engine's settings as flags (of `generate`, or of `serve`, which has them all)."""
        return [*to_argv(self.executor, ENGINE_SETTINGS[ExecutorConfig]),
                *to_argv(self.memsvc, ENGINE_SETTINGS[MemsvcConfig]),
                *to_argv(self.gateway, ENGINE_SETTINGS[GatewayConfig])]


def add_engine_flags(parser) -> None:
    """The engine's flags: the services' own, declared in their configs."""
    for config_cls, names in ENGINE_SETTINGS.items():
        add_flags(parser, config_cls, only=names)

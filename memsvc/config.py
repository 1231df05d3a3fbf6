"""memsvc's settings: one dataclass, its flags made from it (wire.settings)."""
from __future__ import annotations

from dataclasses import dataclass, field

from wire.health_port import health_port_setting
from wire.metrics import metrics_port_setting
from wire.settings import setting
from wire.step_channel import StepChannelConfig
from wire.tls import TlsConfig
from wire.tracing import TracingConfig

MEMSVC_PORT = 50052
GIB = 1 << 30


@dataclass
class MemsvcConfig:
    host: str = setting("127.0.0.1", "address to listen on (0.0.0.0 accepts other hosts)",
                        env="MEMSVC_HOST", wiring=True)
    port: int = setting(MEMSVC_PORT, "port to listen on (0 picks a free one)", env="MEMSVC_PORT",
                        wiring=True)
    kv_tokens: int | None = setting(None, "KV pool size in token slots, rounded down to whole "
                                    "blocks; wins over --kv-memory")
    kv_memory: float = setting(2.0, "KV pool size in GiB", metavar="GIB")
    policy: str = setting("paged", "allocation policy; the contiguous ones are baselines for "
                          "measurement", choices=["paged", "contiguous-max", "contiguous-pow2",
                                                  "contiguous-oracle"])
    prefix_caching: bool = setting(True, "share the blocks of identical prompt prefixes")
    preemption_mode: str = setting("auto", "when blocks run out, preempt by freeing (recompute), "
                                   "by copying to the host swap space (swap), or per sequence by "
                                   "measured cost (auto)", choices=["recompute", "swap", "auto"])
    swap_space: float = setting(4.0, "host swap space for preempted sequences' blocks, pinned on "
                                "a GPU", metavar="GIB")
    kv_offload: float = setting(0.0, "host memory for the prefix cache's host tier (off at 0): a "
                                "cached block evicted from the pool is copied there when the "
                                "measured copy is cheaper than computing its tokens again, and a "
                                "later prompt with that prefix gets it copied back instead of "
                                "recomputing it; least recently used blocks go first. Separate "
                                "from --swap-space; pinned on a GPU; lost when memsvc restarts",
                                metavar="GIB")
    session_lease: float = setting(10.0, "free a gateway's sequences when it is silent this long",
                                   metavar="SECONDS")
    shm_name: str | None = setting(None, "name of the CPU pool's shared-memory segment under "
                                   "/dev/shm (off: pagedserve-kv-<pid>-<random>)")
    metrics_port: int | None = metrics_port_setting()
    health_port: int | None = health_port_setting()
    tls: TlsConfig = field(default_factory=TlsConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    step_channel: StepChannelConfig = field(default_factory=StepChannelConfig)

    def __post_init__(self) -> None:
        if self.kv_tokens is not None and self.kv_tokens < 1:
            raise ValueError(f"--kv-tokens must be positive, got {self.kv_tokens}")
        if self.kv_memory <= 0:
            raise ValueError(f"--kv-memory must be positive, got {self.kv_memory}")
        if self.swap_space < 0:
            raise ValueError(f"--swap-space must be >= 0, got {self.swap_space}")
        if self.kv_offload < 0:
            raise ValueError(f"--kv-offload must be >= 0 GiB (0 turns the host tier off), got "
                             f"{self.kv_offload}")
        if self.kv_offload and (self.policy != "paged" or not self.prefix_caching):
            raise ValueError("--kv-offload needs --policy paged and prefix caching (the host tier "
                             "holds prefix-cache blocks); drop --kv-offload or those flags")

    def memory_config(self, **extra):
        """The MemoryManager's MemoryConfig; `extra` sets what only a caller in process knows."""
        from memsvc.memory_manager import MemoryConfig

        return MemoryConfig(policy=self.policy, enable_prefix_caching=self.prefix_caching,
                            kv_tokens=self.kv_tokens, kv_budget_bytes=int(self.kv_memory * GIB),
                            shm_name=self.shm_name, session_lease_s=self.session_lease,
                            preemption_mode=self.preemption_mode,
                            swap_space_bytes=int(self.swap_space * GIB),
                            kv_offload_bytes=int(self.kv_offload * GIB), **extra)

"""memsvc's settings: dataclasses whose fields are its flags (pagedserve.wire.settings).

`MemoryConfig` is the pool and its policies, what the MemoryManager reads; memsvc's
process settings (`MemsvcConfig`) and the in-process engine both hold one. Its fields
declared without `setting` have no flag: the engine and tests set them in process.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.memsvc.preemption_policy import PREEMPTION_MODES
from pagedserve.rpc.health_port import health_port_setting
from pagedserve.rpc.internal_auth import check_token, insecure_internal_setting, internal_token_setting
from pagedserve.rpc.metrics import metrics_port_setting
from pagedserve.wire.settings import setting
from pagedserve.rpc.step_channel import StepChannelConfig
from pagedserve.rpc.tls import TlsConfig
from pagedserve.rpc.tracing import TracingConfig

MEMSVC_PORT = 50052
GIB = 1 << 30
CPU_KV_GIB = 2.0  # the pool's size when neither a flag nor the executor's device gives one


@dataclass
class MemoryConfig:
    kv_tokens: int | None = setting(None, "KV pool size in token slots, rounded down to whole "
                                    "blocks; wins over --kv-memory")
    kv_memory: float | None = setting(None, "KV pool size in GiB (off: on a GPU, what the "
                                      "executor's --gpu-memory-utilization leaves; on a CPU, "
                                      f"{CPU_KV_GIB:g} GiB)", metavar="GIB")
    policy: str = setting("paged", "allocation policy; the contiguous ones are baselines for "
                          "measurement", choices=["paged", "contiguous-max", "contiguous-pow2",
                                                  "contiguous-oracle"])
    prefix_caching: bool = setting(True, "share the blocks of identical prompt prefixes")
    preemption_mode: str = setting("auto", "when blocks run out, preempt by freeing (recompute), "
                                   "by copying to the host swap space (swap), or per sequence by "
                                   "measured cost (auto)", choices=list(PREEMPTION_MODES))
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
    num_blocks: int | None = None  # exact pool size; wins over kv_tokens, kv_memory, the executor's budget
    num_host_blocks: int | None = None  # exact swap space; wins over swap_space
    num_offload_blocks: int | None = None  # exact host tier; wins over kv_offload
    offload_policy: str = "auto"  # auto: when the cost model says a hit pays; always (tests)
    max_model_len: int = 8192
    device: str = "cpu"  # default when the executor names none: "cpu", "cuda:N" or a GPU UUID
    shared: bool = False  # pool in shared memory (CPU) or exported by CUDA IPC (GPU)
    watermark: float = 0.01  # fraction of the pool kept free by admission and resumption

    def __post_init__(self) -> None:
        if self.kv_tokens is not None and self.kv_tokens < 1:
            raise ValueError(f"--kv-tokens must be positive, got {self.kv_tokens}")
        if self.kv_memory is not None and self.kv_memory <= 0:
            raise ValueError(f"--kv-memory must be positive, got {self.kv_memory}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"--preemption-mode must be one of {', '.join(PREEMPTION_MODES)}, "
                             f"got {self.preemption_mode!r}")
        if self.swap_space < 0:
            raise ValueError(f"--swap-space must be >= 0, got {self.swap_space}")
        if self.kv_offload < 0:
            raise ValueError(f"--kv-offload must be >= 0 GiB (0 turns the host tier off), got "
                             f"{self.kv_offload}")
        if self.kv_offload and (self.policy != "paged" or not self.prefix_caching):
            raise ValueError("--kv-offload needs --policy paged and prefix caching (the host tier "
                             "holds prefix-cache blocks); drop --kv-offload or those flags")
        if self.session_lease <= 0:
            raise ValueError(f"--session-lease must be positive, got {self.session_lease}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.num_host_blocks is not None and self.num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {self.num_host_blocks}")
        if self.num_offload_blocks is not None and self.num_offload_blocks < 0:
            raise ValueError(f"num_offload_blocks must be >= 0, got {self.num_offload_blocks}")
        if self.offload_policy not in ("auto", "always"):
            raise ValueError(f"offload_policy must be 'auto' or 'always', got {self.offload_policy!r}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")


@dataclass
class MemsvcConfig:
    host: str = setting("127.0.0.1", "address to listen on (0.0.0.0 accepts other hosts)",
                        env="MEMSVC_HOST", wiring=True)
    port: int = setting(MEMSVC_PORT, "port to listen on (0 picks a free one)", env="MEMSVC_PORT",
                        wiring=True)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    metrics_port: int | None = metrics_port_setting()
    health_port: int | None = health_port_setting()
    internal_token: str | None = internal_token_setting()
    insecure_internal: bool = insecure_internal_setting()
    tls: TlsConfig = field(default_factory=TlsConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    step_channel: StepChannelConfig = field(default_factory=StepChannelConfig)

    def __post_init__(self) -> None:
        check_token(self.internal_token)

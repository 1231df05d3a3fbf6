"""The executor's Prometheus metrics: steps run, their size and their time.

- pagedserve:execute_seconds: forward pass and sampling of one step
- pagedserve:execute_batch_sequences, pagedserve:execute_batch_tokens: step sizes
- pagedserve:executed_tokens_total, pagedserve:execute_steps_total
- pagedserve:execute_merged_calls_total: Execute calls that shared a forward pass with
  another (several gateways on one executor, pagedserve.executor.step_merger)
- pagedserve:execute_fed_on_device_total: steps launched before the step they follow had
  sampled on the host's side, reading their fed tokens on the device (pagedserve.step.running_feed)
- pagedserve:execute_simulated_seconds_total: modeled step time slept by a simulated
  accelerator (--simulate, pagedserve.executor.simulated); only on such an executor
- pagedserve:execute_graph_replays_total, pagedserve:execute_eager_steps_total: steps CUDA
  graphs ran (decode steps: pagedserve.executor.cuda_graphs; the others in pieces:
  pagedserve.executor.piecewise_graphs), and steps run eagerly beside graphs; 0 on a CPU,
  which has none
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily

from pagedserve.rpc.metrics import STEP_BUCKETS, new_registry

SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class ExecutorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry if registry is not None else new_registry()
        self.seconds = Histogram("pagedserve:execute_seconds", "Forward pass and sampling of one step.",
                                 buckets=STEP_BUCKETS, registry=r)
        self.sequences = Histogram("pagedserve:execute_batch_sequences", "Sequences in one step.",
                                   buckets=SIZE_BUCKETS, registry=r)
        self.tokens = Histogram("pagedserve:execute_batch_tokens", "Tokens computed in one step.",
                                buckets=SIZE_BUCKETS, registry=r)
        self.tokens_total = Counter("pagedserve:executed_tokens", "Tokens computed.", registry=r)
        self.steps = Counter("pagedserve:execute_steps", "Steps run.", registry=r)
        self.fed_on_device = Counter("pagedserve:execute_fed_on_device", "Steps that read their fed tokens "
                                     "on the device, launched before the last step's reached the host.",
                                     registry=r)
        self.merged_calls = Counter("pagedserve:execute_merged_calls", "Execute calls that shared a "
                                    "forward pass with another.", registry=r)

    def observe(self, sequences: int, tokens: int, seconds: float) -> None:
        self.seconds.observe(seconds)
        self.sequences.observe(sequences)
        self.tokens.observe(tokens)
        self.tokens_total.inc(tokens)
        self.steps.inc()


class SimulatedSeconds:
    """A collector: the simulated executor's `simulated_seconds`, read at each scrape."""

    def __init__(self, executor, registry: CollectorRegistry):
        self.executor = executor
        registry.register(self)

    def collect(self):
        yield CounterMetricFamily("pagedserve:execute_simulated_seconds", "Modeled step time slept "
                                  "by a simulated accelerator.", value=self.executor.simulated_seconds)


class GraphSteps:
    """A collector: the steps CUDA graphs ran and those run eagerly beside them
    (Executor.graph_counts), read at each scrape."""

    def __init__(self, executor, registry: CollectorRegistry):
        self.executor = executor
        registry.register(self)

    def collect(self):
        replays, eager = self.executor.graph_counts()
        yield CounterMetricFamily("pagedserve:execute_graph_replays", "Steps a CUDA graph ran.", value=replays)
        yield CounterMetricFamily("pagedserve:execute_eager_steps", "Steps run eagerly beside CUDA graphs "
                                  "(more tokens or sequences than any graph holds, or a bucket whose "
                                  "check failed).", value=eager)

"""The gateway's settings: a dataclass whose fields are its flags (pagedserve.wire.settings); the
batching loop's are its nested `SchedulerConfig` (pagedserve.gateway.scheduler_config), the grammar budget's
its nested `GrammarBudget` (pagedserve.gateway.grammar_budget)."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.gateway.grammar_budget import GrammarBudget
from pagedserve.gateway.scheduler_config import SchedulerConfig
from pagedserve.rpc.internal_auth import check_token, internal_token_setting
from pagedserve.rpc.metrics import metrics_port_setting
from pagedserve.rpc.tls import TlsConfig
from pagedserve.rpc.tracing import TracingConfig
from pagedserve.wire.served_names import served_model_name_setting
from pagedserve.wire.settings import setting

GATEWAY_PORT = 50051
STOP_AFTER_DRAIN_S = 10.0  # after --drain-timeout, a gateway ends what is left and exits within this


@dataclass
class GatewayConfig:
    host: str = setting("127.0.0.1", "address of the gRPC API", env="GATEWAY_HOST", wiring=True)
    port: int = setting(GATEWAY_PORT, "port of the gRPC API (0 picks a free one)",
                        env="GATEWAY_PORT", wiring=True)
    memsvc: str = setting("127.0.0.1:50052", "memsvc's host:port", metavar="ADDR", wiring=True)
    executor: str = setting("127.0.0.1:50053", "the executor's host:port", metavar="ADDR",
                            wiring=True)
    replica: list[str] = setting([], "an executor replica: its memsvc and executor host:port "
                                 "(replaces --memsvc/--executor; env: space-separated)",
                                 env="REPLICAS", metavar="MEMSVC,EXECUTOR", wiring=True)
    discover: str | None = setting(None, "find replicas by DNS: every address of DNS_NAME (e.g. a "
                                   "headless Service) is a replica, resolved again every 5 s",
                                   metavar="DNS_NAME", wiring=True)
    discover_ports: str = setting("50052,50053", "the ports of memsvc and the executor at each "
                                  "discovered address", metavar="MEMSVC_PORT,EXECUTOR_PORT",
                                  wiring=True)
    routing: str = setting("prefix", "how requests are spread over replicas: prefix-cache "
                           "affinity and load, or in turn", choices=["prefix", "round-robin"])
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_waiting: int = setting(1024, "refuse a request (RESOURCE_EXHAUSTED, HTTP 429) while N "
                               "sequences wait for a step; 0: no bound", metavar="N")
    max_request_bytes: int = setting(4 << 20, "largest request either API accepts: a gRPC message "
                                     "(RESOURCE_EXHAUSTED) or an HTTP body (413)", metavar="BYTES")
    grammar: GrammarBudget = field(default_factory=GrammarBudget)
    chat_template: str | None = setting(None, "a Jinja chat template file to render chat requests "
                                        "with, instead of the model's own (both APIs; read at start)", metavar="FILE")
    served_model_name: list[str] = served_model_name_setting()
    reasoning_parser: str | None = setting(None, "split a <think>-style model's reasoning from its "
                                           "answer in chat requests: the HTTP API's "
                                           "reasoning_content, the gRPC API's "
                                           "GenerateResponse.reasoning",
                                           choices=["qwen3", "deepseek_r1"])
    http_host: str = setting("127.0.0.1", "address of the OpenAI-compatible HTTP API")
    http_port: int = setting(8000, "port of the OpenAI-compatible HTTP API (also serves /metrics), "
                             "0 to turn it off; with --tls-cert it is HTTPS")
    http_write_timeout: float = setting(30.0, "drop a streaming HTTP client that reads nothing for "
                                        "this long while its response waits to be written, and "
                                        "abort its request", metavar="SECONDS")
    metrics_upstream: list[str] = setting([], "another service's Prometheus endpoint to include in "
                                          "the HTTP API's /metrics, each sample labelled "
                                          "service=NAME (serve sets memsvc's and the executor's)",
                                          metavar="NAME=URL", wiring=True)
    api_key: str | None = setting(None, "require this key from clients on both APIs, as "
                                  "'Authorization: Bearer KEY' (off: no key)", secret=True)
    step_retry_timeout: float = setting(60.0, "keep retrying a step while memsvc or the executor "
                                        "restarts this long before failing its requests",
                                        metavar="SECONDS")
    drain_timeout: float = setting(30.0, "on SIGTERM, say NOT_SERVING, refuse new requests "
                                   "(UNAVAILABLE, HTTP 503) and let the running ones of both APIs "
                                   "finish, at most this long; those still running then end with an "
                                   "error (UNAVAILABLE; a stream: an error event and [DONE])",
                                   metavar="SECONDS")
    metrics_port: int | None = metrics_port_setting()
    internal_token: str | None = internal_token_setting()
    tls: TlsConfig = field(default_factory=TlsConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)

    def __post_init__(self) -> None:
        if self.max_waiting < 0:
            raise ValueError(f"--max-waiting must be >= 0, got {self.max_waiting}")
        if self.drain_timeout < 0:
            raise ValueError(f"--drain-timeout must be >= 0, got {self.drain_timeout}")
        if not self.http_write_timeout > 0:
            raise ValueError(f"--http-write-timeout must be positive, got {self.http_write_timeout}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"--max-request-bytes must be >= 1024, got {self.max_request_bytes}")
        check_token(self.internal_token)
        self.upstreams()
        self.replica_addresses()

    def upstreams(self) -> list[tuple[str, str]]:
        """The (name, url) pairs of --metrics-upstream."""
        pairs = []
        for item in self.metrics_upstream:
            name, sep, url = item.partition("=")
            if not sep or not name or not url.startswith(("http://", "https://")):
                raise ValueError(f"--metrics-upstream wants NAME=http://HOST:PORT/metrics, got {item!r}")
            pairs.append((name, url))
        return pairs

    def replica_addresses(self) -> list[tuple[str, str]]:
        """The (memsvc, executor) pairs of --replica; [] when none."""
        pairs = []
        for item in self.replica:
            parts = item.split(",")
            if len(parts) != 2 or not all(parts):
                raise ValueError(f"--replica wants MEMSVC_ADDR,EXECUTOR_ADDR, got {item!r}")
            pairs.append((parts[0], parts[1]))
        return pairs

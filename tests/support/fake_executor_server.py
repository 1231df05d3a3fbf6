"""The model-free executor (tests.support.fake_executor) as a real executor process, for tests that
need many fast steps: `python -m tests.support.fake_executor_server --port P --memsvc ADDR`.

It is pagedserve.executor.server with the model swapped out: it registers with memsvc, maps the
shared pool, checks the pool epoch on Execute, serves health, metrics and traces, and with
`--internal-token` (or its environment variable) calls and is called with that token. Its
ModelInfo names the default model's tokenizer (so the gateway takes text and chat) and
that tokenizer's vocabulary; its outputs are `reference_next` of the context it reads
back from the pool, so a wrong slot, block table or re-mapped pool changes them.
`--fail-token T`: a step computing token T fails before it writes anything (as a step
would that the executor cannot run at all); `--refuse-token U`: a sequence computing U is
left out of its step, as the real executor's screen leaves out a sequence it cannot run
(pagedserve.executor.seq_screen).
"""
from __future__ import annotations

import argparse
import sys
import threading
import time

from pagedserve.executor.config import ExecutorConfig
from pagedserve.executor.seq_screen import run_screened
from pagedserve.executor.pool_register import map_pool, register
from pagedserve.executor.server import SERVICE_NAME, ExecutorService, read_tokenizer_files
from pagedserve.rpc import internal_auth
from pagedserve.rpc.grpc_service import Service, stop_on_signals, wait
from pagedserve.rpc.metrics import serve_metrics
from pagedserve.wire.settings import add_flags, from_args
from pagedserve.rpc.tls import TlsConfig
from pagedserve.rpc.tracing import setup_tracing, shutdown_tracing
from pagedserve.wire.v1 import executor_pb2_grpc
from tests.support.fake_executor import FakeExecutor

TOKENIZER_VOCAB = 49152


class SlowFake(FakeExecutor):
    def __init__(self, block_size: int, max_model_len: int, delay: float, fail_token: int = -1,
                 refuse_token: int = -1):
        super().__init__(block_size, max_model_len)
        self.delay, self.fail_token, self.refuse_token = delay, fail_token, refuse_token

    def execute(self, batch):
        if self.delay:
            time.sleep(self.delay)
        if (batch.token_ids == self.fail_token).any():
            raise RuntimeError(f"the step computes token {self.fail_token} (--fail-token)")
        return run_screened(batch, self._check, super().execute)

    def _check(self, batch) -> None:
        for i in range(batch.num_seqs):
            if (batch.tokens_of(i) == self.refuse_token).any():
                batch.errors.setdefault(i, f"ValueError: token {self.refuse_token} is refused (--refuse-token)")


def main(argv: list[str] | None = None) -> int:
    from pagedserve.executor.model_source import default_model_dir

    p = argparse.ArgumentParser(prog="fake executor")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--memsvc", required=True)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--step-delay", type=float, default=0.0)
    p.add_argument("--fail-token", type=int, default=-1)
    p.add_argument("--refuse-token", type=int, default=-1)
    p.add_argument("--metrics-port", type=int, default=None)
    add_flags(p, TlsConfig)
    add_flags(p, ExecutorConfig, only={"internal_token"})
    args = p.parse_args(argv)
    tls, token = from_args(TlsConfig, args), args.internal_token
    setup_tracing("executor")
    stop = stop_on_signals()
    service = Service([SERVICE_NAME], max_workers=4, interceptors=internal_auth.interceptors(token))
    servicer = ExecutorService()
    executor_pb2_grpc.add_ExecutorServicer_to_server(servicer, service.server)
    service.start(args.host, args.port, tls.server_credentials())
    serve_metrics(servicer.metrics.registry, args.host, args.metrics_port)

    def bring_up():
        try:
            fake = SlowFake(args.block_size, args.max_model_len, args.step_delay, args.fail_token,
                            args.refuse_token)
            fake.info.vocab_size = TOKENIZER_VOCAB
            fake.info.tokenizer_dir = default_model_dir(progress=False)
            handle, pool_id = register(args.memsvc, fake.info, "cpu", 60.0, tls, token=token)
            fake.attach_pool(map_pool(handle))
            servicer.set_ready(fake, fake.info, read_tokenizer_files(fake.info.tokenizer_dir), pool_id)
            service.set_serving(True)
        except Exception as e:
            print(f"fake executor: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            stop.set()

    threading.Thread(target=bring_up, daemon=True).start()
    try:
        wait(stop)
    finally:
        service.stop()
        shutdown_tracing()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The GPU's order of calls through the three services, on the CPU: the executor with
`--hold-readback` keeps each step's sampled tokens pending until the next step is launched
(pagedserve.executor.readback), so the next step reads its fed tokens from them on the device
side (pagedserve.step.running_feed) while the gateway plans ahead. Greedy, seeded sampling,
penalties and n > 1 give the in-process engine's tokens, every block is let go, and the
executor counts the steps that were fed that way."""
import re
import threading
import urllib.request

import pytest

from pagedserve.wire.protocol import SamplingParams
from pagedserve.wire.v1 import generation_pb2 as pb
from pagedserve.wire.v1 import generation_pb2_grpc as pb_grpc
from tests.support.gateway_harness import collect
from tests.support.health import SERVING, wait_for_health
from tests.support.serve_procs import free_port, start, stop

KV_TOKENS = 4096
MAX_SEQS = 8
PROMPTS = ["The capital of France is", "Write a haiku about rain.", "1, 2, 3, 4,", "def fibonacci(n):",
           "Once upon a time", "Q: What is 7 times 8?\nA:"]
SAMPLINGS = {  # name: (the API's, the engine's)
    "greedy": (dict(temperature=0.0), dict(temperature=0.0)),
    "seeded": (dict(temperature=0.8, top_p=0.9, seed=7), dict(temperature=0.8, top_p=0.9, seed=7)),
    "penalty": (dict(temperature=0.0, repetition_penalty=1.3), dict(temperature=0.0, repetition_penalty=1.3)),
    "two": (dict(temperature=0.7, seed=3, n=2), dict(temperature=0.7, seed=3, n=2)),
}
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def services():
    import grpc

    mem_port, ex_port, gw_port, metrics_port = free_port(), free_port(), free_port(), free_port()
    memsvc, executor, gateway = (f"127.0.0.1:{p}" for p in (mem_port, ex_port, gw_port))
    procs = []
    try:
        procs.append(start("memsvc", "--port", str(mem_port), "--kv-tokens", str(KV_TOKENS)))
        wait_for_health(memsvc, SERVING, proc=procs[-1], timeout=60)
        procs.append(start("executor", "--port", str(ex_port), "--memsvc", memsvc, "--hold-readback",
                           "--metrics-port", str(metrics_port)))
        procs.append(start("gateway", "--port", str(gw_port), "--memsvc", memsvc, "--executor", executor,
                           "--max-num-seqs", str(MAX_SEQS), "--http-port", "0"))
        wait_for_health(gateway, SERVING, "pagedserve.v1.Generation", procs[-1], timeout=300)
        yield pb_grpc.GenerationStub(grpc.insecure_channel(gateway)), metrics_port
    finally:
        stop(procs[::-1])


def fed_on_device(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return float(re.search(r"^pagedserve:execute_fed_on_device_total (\S+)$", text, re.M).group(1))


def test_steps_fed_on_the_device_give_the_engines_tokens(services):
    from pagedserve.engine import LLMEngine

    stub, metrics_port = services
    engine = LLMEngine(kv_tokens=KV_TOKENS, max_num_seqs=MAX_SEQS)
    jobs = [(p, name) for name in SAMPLINGS for p in PROMPTS]
    expected = {}
    for name, (_, kw) in SAMPLINGS.items():
        outs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, **kw))
        for p, o in zip(PROMPTS, outs):
            expected[(p, name)] = sorted(c.token_ids for c in o.completions)
    results = {}

    def run(prompt, name):
        sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, **SAMPLINGS[name][0])
        got = collect(stub.Generate(pb.GenerateRequest(prompt=prompt, sampling=sampling), timeout=300))
        results[(prompt, name)] = sorted(c["token_ids"] for c in got.values())

    threads = [threading.Thread(target=run, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert results == expected
    assert fed_on_device(metrics_port) > 0

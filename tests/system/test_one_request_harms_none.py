"""Through the real services (memsvc, the model-free executor process, the gateway, over gRPC
and the step channel): a step that fails on a fresh prompt prefix leaves no prefix-cache hit
on the blocks it never wrote, and a sequence the executor leaves out of a step ends alone
while the others give exactly their tokens. Outputs are checked against what a fresh
computation gives (tests.support.fake_executor.reference_next reads the pool back)."""
import threading

import grpc
import pytest

from pagedserve.wire.v1 import generation_pb2 as pb
from tests.support.fake_loop import expected
from tests.support.reliability_procs import serving_stack

FAIL, REFUSE = 4001, 4002  # tokens the fake executor fails a step on / leaves a sequence out for
SEED = 7


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with serving_stack(str(tmp_path_factory.mktemp("harm")), kv_tokens=4096,
                       executor_args=["--fail-token", str(FAIL), "--refuse-token", str(REFUSE),
                                      "--step-delay", "0.005"],
                       gateway_args=["--step-retry-timeout", "1"]) as s:
        yield s


def generate(stack, prompt, max_tokens, timeout=60):
    """(token ids, cached tokens) of a greedy completion of `prompt` (token ids)."""
    tokens, cached = [], 0
    request = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, seed=SEED, ignore_eos=True))
    for r in stack.gen.Generate(request, timeout=timeout):
        tokens.extend(r.token_ids)
        if r.HasField("usage"):
            cached = r.usage.cached_tokens
    return tokens, cached


def test_a_failed_step_on_a_fresh_prefix_leaves_no_hit(stack):
    prefix = list(range(1000, 1128))  # 8 blocks nobody sent before
    with pytest.raises(grpc.RpcError) as failed:
        generate(stack, prefix + [FAIL], 4)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    small, _ = generate(stack, [5, 6, 7], 3)  # a step that runs: the gateway says so to memsvc
    assert small == expected([5, 6, 7], 3, SEED)
    tokens, cached = generate(stack, prefix + [1], 6)
    assert tokens == expected(prefix + [1], 6, SEED) and cached == 0
    tokens, cached = generate(stack, prefix + [2], 6)  # written now: a hit, and still right
    assert tokens == expected(prefix + [2], 6, SEED) and cached == 128
    stats = stack.wait_unreferenced()
    assert (stats.blocks_referenced, stats.num_sequences) == (0, 0)


def test_a_sequence_left_out_ends_alone_while_the_others_stream_on(stack):
    others = {i: [300 + i] * 20 + [i] for i in range(3)}
    results, errors = {}, []

    def run(i):
        try:
            results[i] = generate(stack, others[i], 40)[0]
        except grpc.RpcError as e:  # noqa: PERF203
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,)) for i in others]
    for t in threads:
        t.start()
    bad_prefix = list(range(2000, 2064))
    with pytest.raises(grpc.RpcError) as refused:
        generate(stack, bad_prefix + [REFUSE], 10)
    for t in threads:
        t.join(60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "refused" in refused.value.details()
    assert not errors and results == {i: expected(p, 40, SEED) for i, p in others.items()}
    tokens, cached = generate(stack, bad_prefix + [3], 5)
    assert tokens == expected(bad_prefix + [3], 5, SEED) and cached == 0
    stats = stack.wait_unreferenced()
    assert (stats.blocks_referenced, stats.num_sequences) == (0, 0)

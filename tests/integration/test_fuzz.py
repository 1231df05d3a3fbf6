"""Property-based fuzzing of the public API (hypothesis) against a gateway on the real model:
whatever the messages hold, nothing crashes, every error is a status code that names the
problem, and afterwards the gateway still serves and memsvc holds no block.
FUZZ_EXAMPLES sets the examples per property (RELIABILITY.md).

Inputs are bounded so that every accepted request is small work (at most 6 tokens, or the
default 16, for at most 3 sequences; out-of-range numbers are ones the gateway refuses):
each call has a HANG_S deadline it never needs, and reaching it fails the test (a hang is a
bug, not a refusal)."""
import os
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pagedserve.gateway.scheduler_config import SchedulerConfig
from pagedserve.wire.v1 import generation_pb2 as pb
from tests.support.gateway_harness import GatewayThread, Serialized, collect, greedy, in_process

REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND}  # NOT_FOUND: a model not served
HANG_S = 120  # far beyond any accepted request's work: DEADLINE_EXCEEDED here is a failure
MAX_MODEL_LEN = 256
MAX_N = 128  # the gateway refuses more (api_request)
FUZZ = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "60")), deadline=None, derandomize=True,
                database=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
U32 = st.integers(0, 2**32 - 1)
# Small, or too big to be accepted: never a long generation.
MAX_TOKENS = st.one_of(st.none(), st.integers(0, 6), st.integers(MAX_MODEL_LEN + 1, 2**32 - 1))
N = st.one_of(st.none(), st.integers(0, 3), st.integers(MAX_N + 1, 2**32 - 1))
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)


@pytest.fixture(scope="module")
def gw():
    from pagedserve.engine import LLMEngine

    engine = LLMEngine(kv_tokens=2048, max_num_seqs=8, max_model_len=MAX_MODEL_LEN)
    memory = Serialized(engine.memory)
    g = GatewayThread(in_process(memory, engine.loop.executor, engine.tokenizer),
                      SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, overlap=False))
    g.wait_ready()
    g.memory = memory
    yield g
    g.close()


def sampling_params():
    small = st.one_of(st.none(), st.integers(0, 6), U32)
    return st.builds(
        lambda max_tokens, temperature, top_p, top_k, min_p, seed, stop, stop_ids, n, ignore_eos, logprobs,
        rep, presence, frequency, beam: pb.SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
            seed=seed, stop=stop, stop_token_ids=stop_ids, n=n, ignore_eos=ignore_eos, logprobs=logprobs,
            repetition_penalty=rep, presence_penalty=presence, frequency_penalty=frequency, beam_width=beam),
        MAX_TOKENS, st.one_of(st.none(), FLOATS, st.just(0.0)),
        st.one_of(st.none(), FLOATS), st.integers(-2**31, 2**31 - 1), FLOATS,
        st.one_of(st.none(), st.integers(0, 2**64 - 1)), st.lists(st.text(max_size=8), max_size=3),
        st.lists(U32, max_size=3), N, st.booleans(), small,
        st.one_of(st.none(), FLOATS), FLOATS, FLOATS, st.integers(0, 3))


def check(call) -> None:
    """A stream either ends every completion with a finish reason or fails with a refusal."""
    try:
        out = collect(call)
    except grpc.RpcError as e:
        assert e.code() in REFUSALS, (e.code(), e.details())
        assert e.details(), e.code()
        return
    assert out and all(c["finish_reason"] in ("stop", "length") for c in out.values()), out


@FUZZ
@given(prompt=st.text(max_size=300), ids=st.lists(U32, max_size=40), use_ids=st.booleans(),
       model=st.sampled_from(["", "SmolLM2-135M-Instruct", "other", "\x00"]), sampling=sampling_params(),
       priority=st.integers(-2**31, 2**31 - 1), request_id=st.text(max_size=20))
def test_generate_never_crashes(gw, prompt, ids, use_ids, model, sampling, priority, request_id):
    req = pb.GenerateRequest(prompt="" if use_ids and ids else prompt, prompt_token_ids=ids if use_ids else [],
                             model=model, sampling=sampling, priority=priority, request_id=request_id)
    check(gw.stub.Generate(req, timeout=HANG_S))


@FUZZ
@given(messages=st.lists(st.tuples(st.sampled_from(["user", "system", "assistant", "", "tool", "ü"]),
                                   st.text(max_size=100)), max_size=4),
       sampling=sampling_params())
def test_chat_never_crashes(gw, messages, sampling):
    req = pb.ChatRequest(messages=[pb.ChatMessage(role=r, content=c) for r, c in messages], sampling=sampling)
    check(gw.stub.Chat(req, timeout=HANG_S))


@FUZZ
@given(text=st.text(max_size=500), special=st.booleans(), model=st.sampled_from(["", "x"]))
def test_tokenize_never_crashes(gw, text, special, model):
    try:
        ids = gw.stub.Tokenize(pb.TokenizeRequest(text=text, add_special_tokens=special, model=model),
                               timeout=HANG_S)
        assert all(0 <= t < 2**32 for t in ids.token_ids)
    except grpc.RpcError as e:
        assert e.code() in REFUSALS, (e.code(), e.details())


@FUZZ
@given(data=st.binary(max_size=200))
def test_random_bytes_get_a_status(gw, data):
    try:  # bytes that parse as a request doing much work are left out (bounded, as above)
        sp = pb.GenerateRequest.FromString(data).sampling
        assume((sp.n if sp.HasField("n") else 1) * max(sp.beam_width, 1) <= 3 and
               (not sp.HasField("max_tokens") or sp.max_tokens <= 6 or sp.max_tokens > MAX_MODEL_LEN))
    except Exception as e:  # DecodeError: not a request at all
        if type(e).__name__ not in ("DecodeError", "EncodeError"):
            raise
    method = gw.channel.unary_stream("/pagedserve.v1.Generation/Generate")
    try:
        for _ in method(data, timeout=HANG_S):
            pass
    except grpc.RpcError as e:
        assert e.code() in REFUSALS, (e.code(), e.details())


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty",
                                   "presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_sampling_numbers_are_refused(gw, field, value):
    with pytest.raises(grpc.RpcError) as e:
        list(gw.stub.Generate(pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(**{field: value})),
                              timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()


def test_a_huge_n_is_refused_before_anything_is_built(gw):
    with pytest.raises(grpc.RpcError) as e:
        list(gw.stub.Generate(pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(n=2**32 - 1)), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n must be between" in e.value.details()


def test_oversized_messages_are_refused(gw):
    with pytest.raises(grpc.RpcError) as e:
        list(gw.stub.Generate(pb.GenerateRequest(prompt="x" * (5 << 20)), timeout=30))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_after_fuzzing_it_still_serves_and_holds_nothing(gw):
    health = health_pb2_grpc.HealthStub(gw.channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    out = collect(gw.stub.Generate(pb.GenerateRequest(prompt="Hello", sampling=greedy(3)), timeout=30))
    assert out[0]["finish_reason"] == "length"
    deadline = time.monotonic() + 10
    while gw.memory.stats().snapshot["blocks_referenced"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gw.memory.stats().snapshot["blocks_referenced"] == 0
    gw.memory.check_integrity()

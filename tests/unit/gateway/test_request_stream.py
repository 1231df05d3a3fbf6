"""pagedserve.gateway.request_stream.RequestStream on a stand-in step runner: choices numbered across
prompts, completions counted, each failure a typed StreamError that aborts every prompt,
telemetry ended once per prompt with the status it ended with."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from pagedserve.gateway.request_stream import RequestStream, StreamError
from pagedserve.gateway.request_intake import RequestError
from pagedserve.gateway.step_runner import BackendError, QueueFull
from pagedserve.wire.protocol import Delta, SamplingParams
from tests.support.fake_runner import FakeRunner


class Telemetry:
    """Records what pagedserve.gateway.request_telemetry.RequestTelemetry would be told."""

    def __init__(self):
        self.started, self.streams, self.finished = [], [], []

    def start(self, request_id, operation, model, sampling, prompt_tokens, metadata=None, public_id=""):
        self.started.append(request_id)
        return request_id

    def streamed(self, record, deltas):
        self.streams.append((record, len(deltas)))

    def finish(self, record, code=None, message=""):
        self.finished.append((record, code))


def stream_of(prompts=((1, 2), (3,)), n=2):
    runner, tel = FakeRunner(), Telemetry()
    stream = RequestStream(runner, [list(p) for p in prompts], SamplingParams(max_tokens=4, n=n),
                           operation="chat", model="m", telemetry=tel)
    return stream, runner, tel


def send(runner, stream, k, *deltas):
    runner.sinks[stream.ids[k]](list(deltas))


def delta(index, finish=None, error=None):
    return Delta("r", index, "x", [7], finish_reason=finish, error=error)


def run(coro):
    return asyncio.run(coro)


def test_choices_are_numbered_across_prompts_and_each_prompt_ends_its_telemetry_once():
    async def main():
        stream, runner, tel = stream_of()
        await stream.start()
        assert sorted(runner.sinks) == sorted(stream.ids) == sorted(tel.started) and stream.open == 4
        send(runner, stream, 1, delta(0), delta(1, "stop"))
        assert await stream.next_batch() == [(2, delta(0)), (3, delta(1, "stop"))]
        send(runner, stream, 1, delta(0, "length"))
        assert await stream.next_batch() == [(2, delta(0, "length"))]
        assert tel.finished == [(stream.ids[1], None)]
        send(runner, stream, 0, delta(0, "stop"), delta(1, "stop"))
        got = [b async for b in stream.batches()]
        assert got == [[(0, delta(0, "stop")), (1, delta(1, "stop"))]]
        assert stream.open == 0 and await stream.next_batch() == []
        assert tel.finished == [(stream.ids[1], None), (stream.ids[0], None)]
        stream.abort()  # after the end: nothing more is recorded
        assert len(tel.finished) == 2
    run(main())


@pytest.mark.parametrize("refusal, kind, code", [
    (RequestError("prompt is empty"), "invalid", grpc.StatusCode.INVALID_ARGUMENT),
    (QueueFull("the request queue is full"), "queue_full", grpc.StatusCode.RESOURCE_EXHAUSTED)])
def test_a_refused_prompt_names_itself_and_aborts_the_queued_ones(refusal, kind, code):
    async def main():
        stream, runner, tel = stream_of()
        original = runner.submit

        def submit(request_id, *args, **kw):
            if request_id == stream.ids[1]:
                runner.refuse = refusal
            return original(request_id, *args, **kw)
        runner.submit = submit
        with pytest.raises(StreamError) as e:
            await stream.start()
        assert (e.value.kind, e.value.code, e.value.prompt) == (kind, code, 1)
        assert str(refusal) in e.value.message
        assert set(runner.aborted) == set(stream.ids)
        assert sorted(tel.finished) == sorted((i, code) for i in stream.ids)
    run(main())


@pytest.mark.parametrize("item, kind, code, text", [
    (BackendError("the model backend failed"), "backend", grpc.StatusCode.UNAVAILABLE, "backend failed"),
    ([delta(0, "error", "the pool has 8 blocks")], "too_large", grpc.StatusCode.RESOURCE_EXHAUSTED,
     "8 blocks"),
    ([delta(0, "error")], "too_large", grpc.StatusCode.RESOURCE_EXHAUSTED, "cannot hold")])
def test_a_failure_while_streaming_is_typed_and_aborts_every_prompt(item, kind, code, text):
    async def main():
        stream, runner, tel = stream_of()
        await stream.start()
        runner.sinks[stream.ids[0]](item)
        with pytest.raises(StreamError) as e:
            await stream.next_batch()
        assert (e.value.kind, e.value.code, e.value.prompt) == (kind, code, 0)
        assert text in e.value.message
        assert set(runner.aborted) == set(stream.ids)
        assert sorted(tel.finished) == sorted((i, code) for i in stream.ids)
    run(main())


def test_abort_is_idempotent_and_ends_the_open_prompts_with_its_code():
    async def main():
        stream, runner, tel = stream_of()
        await stream.start()
        send(runner, stream, 0, delta(0, "stop"), delta(1, "stop"))
        await stream.next_batch()
        stream.abort(grpc.StatusCode.DEADLINE_EXCEEDED)
        stream.abort()
        assert tel.finished == [(stream.ids[0], None), (stream.ids[1], grpc.StatusCode.DEADLINE_EXCEEDED)]
        assert runner.aborted == stream.ids * 2
    run(main())


def test_without_telemetry_and_with_a_salt_the_runner_gets_it():
    async def main():
        runner = FakeRunner()
        seen = {}
        original = runner.submit
        runner.submit = lambda *a, **kw: seen.update(kw) or original(*a, **kw)
        stream = RequestStream(runner, [[1]], SamplingParams(max_tokens=1), operation="chat",
                               model="m", salt="tenant")
        await stream.start()
        assert seen == {"salt": "tenant"}
        send(runner, stream, 0, delta(0, "stop"))
        assert await stream.next_batch() == [(0, delta(0, "stop"))]
        stream.abort()
    run(main())

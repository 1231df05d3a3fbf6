"""A small blocking client of the gateway's Generation service (used by `generate --server`).

Streams come back as gateway Deltas, the same records the offline engine yields, so a
caller can print either the same way. gRPC errors surface as grpc.RpcError.
"""
from __future__ import annotations

from typing import Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.wire.protocol import Delta, SamplingParams
from pagedserve.wire.convert import prompt_logprobs_from_proto, sampling_to_proto
from pagedserve.wire.v1 import generation_pb2 as pb
from pagedserve.wire.v1 import generation_pb2_grpc as pb_grpc


def to_delta(r: pb.GenerateResponse) -> Delta:
    return Delta(
        request_id=r.request_id, index=r.index, text=r.text, token_ids=list(r.token_ids),
        finish_reason=r.finish_reason or None,
        logprobs=[lp.logprob for lp in r.logprobs],
        top_logprobs=[[(t.token_id, t.logprob) for t in lp.top] for lp in r.logprobs if lp.top],
        prompt_logprobs=prompt_logprobs_from_proto(r.prompt_logprobs),
        prompt_tokens=r.usage.prompt_tokens, completion_tokens=r.usage.completion_tokens,
        cached_tokens=r.usage.cached_tokens,
    )


class GenerationClient:
    def __init__(self, address: str, timeout: float | None = None):
        self.address = address
        self.timeout = timeout
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.GenerationStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "GenerationClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def serving(self, timeout: float = 1.0) -> bool:
        """Whether the gateway's health check says SERVING."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        try:
            status = stub.Check(health_pb2.HealthCheckRequest(service="pagedserve.v1.Generation"),
                                timeout=timeout).status
        except grpc.RpcError:
            return False
        return status == health_pb2.HealthCheckResponse.SERVING

    def generate(self, prompt: str | list[int], sampling: SamplingParams, *, chat: bool = False,
                 model: str = "", request_id: str = "", priority: int = 0) -> Iterator[Delta]:
        """Stream the completions of one prompt (a user message rendered by the chat template
        when chat=True)."""
        sp = sampling_to_proto(sampling)
        if chat:
            if not isinstance(prompt, str):
                raise TypeError("a chat prompt is text")
            request = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content=prompt)],
                                     model=model, sampling=sp, priority=priority,
                                     request_id=request_id)
            stream = self.stub.Chat(request, timeout=self.timeout)
        else:
            request = pb.GenerateRequest(model=model, sampling=sp, priority=priority,
                                         request_id=request_id)
            if isinstance(prompt, str):
                request.prompt = prompt
            else:
                request.prompt_token_ids.extend(prompt)
            stream = self.stub.Generate(request, timeout=self.timeout)
        try:
            for r in stream:
                yield to_delta(r)
        finally:
            stream.cancel()

    def list_models(self) -> list[tuple[str, int]]:
        models = self.stub.ListModels(pb.ListModelsRequest(), timeout=self.timeout).models
        return [(m.name, m.max_model_len) for m in models]

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        r = self.stub.Tokenize(pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens),
                               timeout=self.timeout)
        return list(r.token_ids)

"""Errors of the OpenAI-compatible HTTP API, in OpenAI's format and with its HTTP statuses.

Body: {"error": {"message", "type", "param", "code"}}. 400 names the parameter to change in
`param`; 401 is a missing or wrong API key; 404 an unknown model or path; 503 a gateway
that is starting or a backend that failed (retry later).
"""
from __future__ import annotations

from dataclasses import dataclass

import grpc

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
         405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}


@dataclass
class OpenAIError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | None = None

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        kind = TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None) -> OpenAIError:
    return OpenAIError(400, message, param)


def param_path(loc) -> str | None:
    """The parameter at `loc` (keys and indexes into the body) as `param` names it:
    ("messages", 2, "tool_calls", 0) is messages[2].tool_calls[0]; () is None."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out or None


def unavailable(message: str) -> OpenAIError:
    return OpenAIError(503, message, code="service_unavailable")


def model_not_found(requested: str, served: list[str]) -> OpenAIError:
    """vLLM's 404 for a model not served, with the names that are."""
    names = ", ".join(f"`{n}`" for n in served)
    return OpenAIError(404, f"The model `{requested}` does not exist. This server serves {names}.",
                       "model", "model_not_found")


def from_stream_error(e, prompt_param: str, num_prompts: int) -> OpenAIError:
    """pagedserve.gateway.request_stream.StreamError as the HTTP API answers it: a refused prompt is a 400
    naming it (`prompt[k]` when there are several), a full queue 429, a request the KV pool
    can never hold a 400 on max_tokens, a failed backend 503."""
    if e.kind == "invalid":
        where = f"{prompt_param}[{e.prompt}]" if num_prompts > 1 and e.prompt is not None else prompt_param
        return bad_request(f"{where}: {e.message}", prompt_param)
    if e.kind == "queue_full":
        return OpenAIError(429, e.message, code="queue_full")
    if e.kind == "too_large":
        return bad_request(e.message, "max_tokens")
    return unavailable(e.message)


def from_api_error(e, param: str | None) -> OpenAIError:
    """pagedserve.gateway.api_request.ApiError (a gRPC status) as an OpenAIError about `param`."""
    if e.code == grpc.StatusCode.UNAVAILABLE:
        return unavailable(e.message)
    return bad_request(e.message, param)

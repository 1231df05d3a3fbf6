"""The OpenAPI document of the OpenAI-compatible API, generated from its request models
(pagedserve.gateway.openai.models), served at GET /openapi.json: what a client (or a fuzzer) may send.

Contract: `openapi_document()` is an OpenAPI 3.1 document with every POST route's request
body schema (types, ranges and list bounds as the server checks them; unknown parameters
allowed), the GET routes, and OpenAI's error body for 4xx/5xx answers. Built once.
"""
from __future__ import annotations

import functools

from pydantic.json_schema import models_json_schema

from pagedserve.gateway.openai.models import ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

REF = "#/components/schemas/{model}"
ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
POSTS = {"/v1/completions": (CompletionRequest, "a completion (text/event-stream with stream)"),
         "/v1/chat/completions": (ChatRequest, "a chat completion (text/event-stream with stream)"),
         "/tokenize": (TokenizeRequest, "the prompt's token ids"),
         "/detokenize": (DetokenizeRequest, "the tokens' text")}
GETS = {"/v1/models": "the served model", "/v1/models/{model}": "the served model's card",
        "/health": "200 while serving, else 503", "/metrics": "Prometheus metrics"}


def _errors(*statuses: int) -> dict:
    body = {"content": {"application/json": {"schema": {"$ref": REF.format(model="Error")}}}}
    return {str(s): {"description": "an error", **body} for s in statuses}


@functools.lru_cache(maxsize=1)
def openapi_document() -> dict:
    refs, defs = models_json_schema([(model, "validation") for model, _ in POSTS.values()],
                                    ref_template=REF)
    paths = {}
    for path, (model, answer) in POSTS.items():
        paths[path] = {"post": {
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": refs[(model, "validation")]}}},
            "responses": {"200": {"description": answer}, **_errors(400, 401, 404, 413, 429, 503)}}}
    for path, answer in GETS.items():
        get = {"responses": {"200": {"description": answer}, **_errors(401, 404, 503)}}
        if "{model}" in path:
            get["parameters"] = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
        paths[path] = {"get": get}
    schemas = {**defs.get("$defs", {}), "Error": ERROR}
    return {"openapi": "3.1.0", "info": {"title": "pagedserve OpenAI-compatible API", "version": "1"},
            "paths": paths, "components": {"schemas": schemas}}

"""A request body as JSON, checked before any parameter is read.

Contract: `loads(raw)` returns the body's JSON object, or raises OpenAIError 400 when it is
not JSON (or not UTF-8), not an object, nested more than MAX_JSON_DEPTH levels deep (a
body nested far deeper is refused too: the parser's recursion limit is caught), or holds a
string, a key included, that is not valid UTF-8: JSON's "\\ud800" escapes a lone surrogate,
which no protobuf string and no tokenizer takes. `param` names where (messages[2].content);
unknown parameters are checked alike.
"""
from __future__ import annotations

import json

from pagedserve.gateway.openai.errors import bad_request, param_path
from pagedserve.gateway.request_limits import MAX_JSON_DEPTH
from pagedserve.wire.sampling_fields import utf8_problem

TOO_DEEP = f"the request body nests more than {MAX_JSON_DEPTH} levels deep"


def loads(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad_request(TOO_DEEP, None) from None
    except (ValueError, UnicodeDecodeError):
        raise bad_request("the request body is not valid JSON", None) from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None)
    _check(body)
    return body


def _check(body: dict) -> None:
    stack = [(body, (), 1)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise bad_request(f"{TOO_DEEP} (in {path[0]})", str(path[0]))
        for key, item in value.items() if type(value) is dict else enumerate(value):
            if type(key) is str and not key.isascii() and utf8_problem(key):
                where = param_path(path) or "the request body"
                raise bad_request(f"{where}: a key {utf8_problem(key)}", param_path(path))
            kind = type(item)
            if kind is str:
                if not item.isascii() and utf8_problem(item):
                    where = param_path(path + (key,))
                    raise bad_request(f"{where} {utf8_problem(item)}", where)
            elif kind is dict or kind is list:
                stack.append((item, path + (key,), depth + 1))

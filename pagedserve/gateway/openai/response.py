"""Deltas of one request as OpenAI response bodies: whole (text_completion, chat.completion)
or streamed chunks (server-sent events, ending with `data: [DONE]`).

Usage counts each prompt once (prompt_tokens, prompt_tokens_details.cached_tokens) and
every choice's tokens (completion_tokens). Logprobs follow the endpoint's shape: the legacy
{tokens, token_logprobs, top_logprobs, text_offset} for completions, {content: [{token,
logprob, bytes, top_logprobs}]} for chat. With echo, a completion's logprobs start with the
prompt's tokens (the first with null logprob and top_logprobs). Asked for, a completion
choice's `prompt_logprobs` is vLLM's: null for the first prompt token, then per token
{token_id: {logprob, rank, decoded_token}} for the token itself and the top k (streamed: in
the choice's first chunk). A token's text is the tokenizer's decoding of it alone
("token_id:N" when the model has no tokenizer).

Cost: linear in what is sent. A token's text is decoded once per response; a prompt's
`prompt_logprobs` (and, with echo, its tokens' logprobs) are made once per prompt and shared
by its n choices; a choice's text and logprobs grow in place (kept whole only when the
response is not streamed).
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from pagedserve.gateway.reasoning import ReasoningStream, split
from pagedserve.gateway.openai.request import OpenAIRequest
from pagedserve.gateway.openai.tool_calls import parse
from pagedserve.gateway.openai.tool_stream import ToolStream
from pagedserve.wire.protocol import Delta, PromptLogprob

DONE = "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


@dataclass
class ChoiceState:
    """What one choice (an OpenAI `choices[i]`) has accumulated so far."""

    parts: list[str] = field(default_factory=list)  # its text, in pieces (see `text`)
    finish_reason: str | None = None
    logprobs: dict | None = None
    last_logprobs: dict | None = None  # of the latest delta
    started: bool = False  # streaming: the role was sent (chat)
    offset: int = 0  # completions: text_offset of the next token
    completion_tokens: int = 0
    prompt: int = 0  # index of its prompt
    prompt_tokens: int = 0
    cached_tokens: int = 0
    echo_pending: bool = False  # streaming with echo: the prompt text is not sent yet
    prompt_logprobs: list | None = None  # completions, when asked: vLLM's shape
    prompt_pending: bool = False  # streaming: prompt_logprobs not sent yet
    scored: bool = False  # the first token's delta (with the prompt logprobs) was seen
    tool_stream: ToolStream | None = None  # streaming chat with tools: its calls as they come
    reasoning_stream: ReasoningStream | None = None  # streaming chat with --reasoning-parser

    @property
    def text(self) -> str:
        if len(self.parts) > 1:
            self.parts[:] = ["".join(self.parts)]
        return self.parts[0] if self.parts else ""


@dataclass
class Formatter:
    request: OpenAIRequest
    tokenizer: object = None
    id: str = ""
    created: int = 0
    choices: dict[int, ChoiceState] = field(default_factory=dict)
    _texts: dict[int, str] = field(default_factory=dict)  # token id -> its text alone
    _prompt_logprobs: dict[int, list] = field(default_factory=dict)  # prompt index -> vLLM's shape
    _echoed: dict[int, dict] = field(default_factory=dict)  # prompt index -> its tokens' logprobs

    def __post_init__(self) -> None:
        self.id = self.id or ("chatcmpl-" if self.request.chat else "cmpl-") + uuid.uuid4().hex
        self.created = self.created or int(time.time())

    @property
    def object(self) -> str:
        return "chat.completion" if self.request.chat else "text_completion"

    def add(self, index: int, d: Delta) -> ChoiceState:
        """Account for a delta of choice `index` (text, logprobs, finish, usage)."""
        c = self.choices.get(index)
        if c is None:
            c = self.choices[index] = ChoiceState(prompt=index // self.request.sampling.n)
            if self.request.echo:
                c.parts.append(self.request.prompt_texts[c.prompt])
                c.echo_pending = True
        c.parts.append(d.text)
        c.finish_reason = d.finish_reason or c.finish_reason
        c.completion_tokens = d.completion_tokens
        c.prompt_tokens = d.prompt_tokens
        c.cached_tokens = max(c.cached_tokens, d.cached_tokens)
        first = None
        if d.token_ids and not c.scored:  # the first token's delta carries the prompt logprobs
            first, c.scored = d.prompt_logprobs, True
        if first is not None and self.request.prompt_logprobs is not None:
            c.prompt_logprobs = self._prompt_logprobs_of(c.prompt, first)
            c.prompt_pending = True
        if self.request.sampling.logprobs is not None:
            echoed = self._echo_logprobs(c, first) if first is not None and self.request.echo else None
            c.last_logprobs = self._logprobs(c, d)
            if echoed is not None:
                c.last_logprobs = _joined(echoed, c.last_logprobs)
            if not self.request.stream:  # the body sends them whole; a stream, as they come
                if c.logprobs is None:
                    c.logprobs = {k: list(v) for k, v in c.last_logprobs.items()}
                else:
                    for k, v in c.last_logprobs.items():
                        c.logprobs[k].extend(v)
        return c

    def body(self) -> dict:
        """The whole response, once every choice has finished."""
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.request.model, "system_fingerprint": None,
                "choices": [self._choice(i, c) for i, c in sorted(self.choices.items())],
                "usage": self.usage()}

    def chunks(self, index: int, d: Delta) -> list[str]:
        """SSE events for one delta (after `add`); nothing for a delta that adds nothing."""
        c = self.choices[index]
        logprobs = c.last_logprobs
        if not (d.text or d.finish_reason or logprobs):
            return []
        if self.request.chat and (self.request.tools is not None or self.request.reasoning):
            return self._parsed_chunks(index, c, d)
        if self.request.chat:
            delta = {"content": d.text}
            if not c.started:
                delta = {"role": "assistant", **delta}
                c.started = True
            choice = {"index": index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": d.finish_reason}
        else:
            text = d.text
            if c.echo_pending:
                text, c.echo_pending = self.request.prompt_texts[c.prompt] + text, False
            choice = {"index": index, "text": text, "logprobs": logprobs,
                      "finish_reason": d.finish_reason}
            if c.prompt_pending:
                choice["prompt_logprobs"], c.prompt_pending = c.prompt_logprobs, False
        return [sse(self._chunk([choice]))]

    def usage_chunk(self) -> str:
        return sse({**self._chunk([]), "usage": self.usage()})

    def usage(self) -> dict:
        prompts: dict[int, tuple[int, int]] = {}  # prompt index -> (tokens, cached)
        for c in self.choices.values():
            tokens, cached = prompts.get(c.prompt, (0, 0))
            prompts[c.prompt] = (max(tokens, c.prompt_tokens), max(cached, c.cached_tokens))
        prompt_tokens = sum(t for t, _ in prompts.values())
        completion = sum(c.completion_tokens for c in self.choices.values())
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": sum(c for _, c in prompts.values())}}

    def _chunk(self, choices: list[dict]) -> dict:
        chunk = {"id": self.id, "object": self.object + ".chunk" if self.request.chat else self.object,
                 "created": self.created, "model": self.request.model, "system_fingerprint": None,
                 "choices": choices}
        if self.request.include_usage:
            chunk["usage"] = None
        return chunk

    def _parsed_chunks(self, index: int, c: ChoiceState, d: Delta) -> list[str]:
        """The reasoning split off (pagedserve.gateway.reasoning), then content and tool calls as
        they come (pagedserve.gateway.openai.tool_stream), then the finish."""
        text, deltas, called = d.text, [], False
        if self.request.reasoning:
            if c.reasoning_stream is None:
                c.reasoning_stream = ReasoningStream(self.request.reasoning)
            reasoning, text = c.reasoning_stream.step(d.text, bool(d.finish_reason))
            if reasoning and self.request.include_reasoning:
                deltas.append({"reasoning_content": reasoning})
        logprobs = None
        if self.request.tools is not None:
            if c.tool_stream is None:
                c.tool_stream = ToolStream(self.request.tools)
            deltas += c.tool_stream.feed(text)
            if d.finish_reason:
                last, called = c.tool_stream.finish()
                deltas += last
        else:
            if text:
                deltas.append({"content": text})
            logprobs = c.last_logprobs
            if logprobs and not deltas:
                deltas.append({})
        events = []
        for i, delta in enumerate(deltas):
            if not c.started:
                delta, c.started = {"role": "assistant", **delta}, True
            events.append(sse(self._chunk([{"index": index, "delta": delta,
                                            "logprobs": logprobs if i == len(deltas) - 1 else None,
                                            "finish_reason": None}])))
        if d.finish_reason:
            delta = {} if c.started else {"role": "assistant", "content": ""}
            c.started = True
            events.append(sse(self._chunk([{"index": index, "delta": delta, "logprobs": None,
                                            "finish_reason": "tool_calls" if called else d.finish_reason}])))
        return events

    def _choice(self, index: int, c: ChoiceState) -> dict:
        if self.request.chat:
            text, reasoning, finish = c.text, None, c.finish_reason
            if self.request.reasoning:
                reasoning, text = split(self.request.reasoning, text)
            message = {"role": "assistant", "content": text}
            if reasoning is not None and self.request.include_reasoning:
                message["reasoning_content"] = reasoning
            if self.request.tools is not None and text is not None:
                message["content"], calls = parse(text, self.request.tools)
                if calls:
                    message["tool_calls"], finish = calls, "tool_calls"
            return {"index": index, "message": message, "logprobs": c.logprobs, "finish_reason": finish}
        choice = {"index": index, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish_reason}
        if self.request.prompt_logprobs is not None:
            choice["prompt_logprobs"] = c.prompt_logprobs
        return choice

    def _prompt_logprobs_of(self, prompt: int, entries: list[PromptLogprob]) -> list:
        """vLLM's prompt_logprobs of prompt `prompt`, made once for all its choices."""
        out = self._prompt_logprobs.get(prompt)
        if out is None:
            k = self.request.prompt_logprobs
            out = self._prompt_logprobs[prompt] = [None] + [self._prompt_entry(e, k) for e in entries]
        return out

    def _prompt_entry(self, e: PromptLogprob, k: int) -> dict:
        entry = {e.token_id: {"logprob": e.logprob, "rank": e.rank, "decoded_token": self._token(e.token_id)}}
        for rank, (t, v) in enumerate(e.top[:k], 1):
            if t not in entry:
                entry[t] = {"logprob": v, "rank": rank, "decoded_token": self._token(t)}
        return entry

    def _echo_logprobs(self, c: ChoiceState, entries: list[PromptLogprob]) -> dict:
        """The legacy logprobs of the echoed prompt (its first token has none), made once per
        prompt; `c`'s text offsets continue after it."""
        echoed = self._echoed.get(c.prompt)
        if echoed is None:
            k = self.request.sampling.logprobs
            tokens = [self._token(t) for t in self.request.prompts[c.prompt]]
            values, tops = [None] * len(tokens), [None] * len(tokens)
            for i, e in enumerate(entries[:len(tokens) - 1], 1):
                values[i], tops[i] = e.logprob, {self._token(t): v for t, v in e.top[:k]}
            offsets = [0]
            for s in tokens[:-1]:
                offsets.append(offsets[-1] + len(s))
            echoed = self._echoed[c.prompt] = {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                                               "text_offset": offsets}
        c.offset = len(self.request.prompt_texts[c.prompt])  # the completion's text comes after it
        return echoed

    def _logprobs(self, c: ChoiceState, d: Delta) -> dict:
        tokens = [self._token(t) for t in d.token_ids]
        values = [d.logprobs[i] if i < len(d.logprobs) else None for i in range(len(tokens))]
        tops = [[(self._token(t), v) for t, v in (d.top_logprobs[i] if i < len(d.top_logprobs) else [])]
                for i in range(len(tokens))]
        if self.request.chat:
            return {"content": [{"token": s, "logprob": v, "bytes": list(s.encode()),
                                 "top_logprobs": [{"token": ts, "logprob": tv, "bytes": list(ts.encode())}
                                                  for ts, tv in top]}
                                for s, v, top in zip(tokens, values, tops)]}
        offsets = []
        for s in tokens:
            offsets.append(c.offset)
            c.offset += len(s)
        return {"tokens": tokens, "token_logprobs": values,
                "top_logprobs": [dict(top) for top in tops], "text_offset": offsets}

    def _token(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = f"token_id:{token_id}" if self.tokenizer is None else self.tokenizer.decode([token_id])
            self._texts[token_id] = text
        return text


def _joined(old: dict, new: dict) -> dict:
    """`old`'s lists followed by `new`'s, as new lists (`old` may be shared)."""
    return {k: old[k] + new[k] for k in old}

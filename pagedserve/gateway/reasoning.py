"""A `<think>`-style model's reasoning split from its answer (--reasoning-parser), for the chat
requests of both APIs: the HTTP API gives it as `reasoning_content` (streamed:
`delta.reasoning_content`), the answer as `content`; the gRPC API's Chat as
GenerateResponse.reasoning beside `text`.

Parsers, as vLLM names them:
- `qwen3`: an output that starts with `<think>` reasons until `</think>`; one that does not
  (Qwen3 with enable_thinking false) is all answer.
- `deepseek_r1`: the output reasons until `</think>` (its template opens `<think>` in the
  prompt; a `<think>` the model writes itself is dropped); with no `</think>` it is all
  reasoning (cut off while thinking).
The answer starts after `</think>` and the whitespace that follows it. A request with a
grammar gets no split (the grammar applies from the first token: there is no reasoning).

Contract: `parser_for(parser, chat, sampling)`: the parser a request's output goes through
(None: not split), the same rule for both APIs. `ReasoningStream(parser)`; `feed(text)` ->
(reasoning, answer) to send now, holding back only what could be the start of a tag;
`finish()` -> the rest; `step(text, last)` is both. `split(parser, text)` -> (reasoning or
None, answer or None) of a whole output, by the same rules.
"""
from __future__ import annotations

PARSERS = ("qwen3", "deepseek_r1")
START, END = "<think>", "</think>"


def parser_for(parser: str | None, chat: bool, sampling) -> str | None:
    """The parser that splits this request's output: --reasoning-parser's, for a chat request
    without a grammar (`sampling`: its SamplingParams)."""
    return parser if parser and chat and not sampling.guided else None


class ReasoningStream:
    def __init__(self, parser: str):
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}: use one of {', '.join(PARSERS)}")
        self.parser = parser
        self.text = ""
        self.at = 0  # text[:at] is sent
        self.state = "start"  # start, reasoning, gap (whitespace after </think>), answer
        self.reasoned = False  # a reasoning part was found (even empty)

    def feed(self, text: str) -> tuple[str, str]:
        self.text += text
        reasoning, answer = "", ""
        while True:
            text, state = self.text, self.state
            if state == "start":
                head = text.lstrip()
                if START.startswith(head) and len(head) < len(START):
                    return reasoning, answer  # may still be `<think>`
                if head.startswith(START):
                    self.at, self.state = len(text) - len(head) + len(START), "reasoning"
                else:
                    self.state = "reasoning" if self.parser == "deepseek_r1" else "answer"
                self.reasoned = self.state == "reasoning"
            elif state == "reasoning":
                k = text.find(END, self.at)
                end = k if k >= 0 else len(text) - partial_tag(text, END)
                reasoning += text[self.at:end]
                self.at = end
                if k < 0:
                    return reasoning, answer
                self.at, self.state = k + len(END), "gap"
            elif state == "gap":
                rest = text[self.at:]
                if not rest.strip():
                    self.at = len(text)
                    return reasoning, answer
                self.at, self.state = self.at + len(rest) - len(rest.lstrip()), "answer"
            else:
                answer += text[self.at:]
                self.at = len(text)
                return reasoning, answer

    def step(self, text: str, last: bool) -> tuple[str, str]:
        """feed(text), and with the output's `last` piece finish() too."""
        reasoning, answer = self.feed(text)
        if last:
            more_reasoning, more_answer = self.finish()
            reasoning, answer = reasoning + more_reasoning, answer + more_answer
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """What was held back: a `<think>` prefix never completed, an `</think>` prefix."""
        rest, self.at = self.text[self.at:], len(self.text)
        if self.state == "start":
            if self.parser == "deepseek_r1":
                self.reasoned = True
                return rest, ""
            return "", rest
        return (rest, "") if self.state == "reasoning" else ("", "" if self.state == "gap" else rest)


def split(parser: str, text: str) -> tuple[str | None, str | None]:
    s = ReasoningStream(parser)
    reasoning, answer = s.feed(text)
    more_reasoning, more_answer = s.finish()
    reasoning, answer = reasoning + more_reasoning, answer + more_answer
    return (reasoning if s.reasoned else None), (answer if answer or not s.reasoned else None)


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back: the tag may follow)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0

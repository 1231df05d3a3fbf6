"""transformers' greedy continuations as the reference for our engine's, computed cheaply.

`hf_greedy(model, prompt_ids, candidates, new_tokens)` returns what
`model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)` returns for each prompt,
run past EOS (the tests use ignore_eos). Decoding token by token costs a forward pass per
token (~50 ms each for the default model on two cores); instead each candidate (our engine's
output) is checked by one forward pass over prompt + candidate: if transformers' argmax after
every prefix is the candidate's next token and the candidate has new_tokens tokens, the
candidate *is* transformers' greedy continuation (greedy decoding takes the argmax after each
prefix of its own output, and that output is the candidate, by induction). A candidate that
differs anywhere is regenerated the slow way, so a failing test shows transformers' real
continuation. Answers are memoized per model, so parametrizations that produce the same
tokens share one check.
"""
from __future__ import annotations

import weakref

import torch

_checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {key: continuation}


def _greedy_one(model, prompt: list[int], candidate: list[int], new_tokens: int) -> list[int]:
    checked = _checked.setdefault(model, {})
    key = (tuple(prompt), tuple(candidate), new_tokens)
    if key in checked:
        return checked[key]
    if len(candidate) == new_tokens and new_tokens > 0:
        with torch.inference_mode():
            logits = model(torch.tensor([list(prompt) + list(candidate[:-1])])).logits[0]
        if logits[len(prompt) - 1:].argmax(-1).tolist() == list(candidate):
            checked[key] = list(candidate)
            return checked[key]
    eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None  # run past EOS like ignore_eos, without masking it
    try:
        with torch.inference_mode():
            y = model.generate(torch.tensor([list(prompt)]), max_new_tokens=new_tokens, do_sample=False,
                               pad_token_id=0)
    finally:
        model.generation_config.eos_token_id = eos
    checked[key] = y[0, len(prompt):].tolist()
    return checked[key]


def hf_greedy(model, prompt_ids: list[list[int]], candidates: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (one at a time, no padding), new_tokens
    long, past EOS."""
    assert len(prompt_ids) == len(candidates)
    return [_greedy_one(model, p, c, new_tokens) for p, c in zip(prompt_ids, candidates)]

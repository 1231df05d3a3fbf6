"""Batched token sampling for one step.

For each sampled sequence, in this order:
0. logit_bias: each listed token's value added to its logit (ids past the vocabulary skipped);
   min_tokens: while the sequence has fewer output tokens, its end-of-sequence tokens (the
   Sampler's `eos_token_ids`) and stop_token_ids are set to -inf, unless no other token is
   left (a grammar that allows only its end);
1. penalties: repetition (Hugging Face semantics, over prompt + output tokens: a positive
   logit is divided by the penalty, a negative one multiplied), then frequency and presence
   (OpenAI semantics, over output tokens: logit -= frequency * count + presence * [count > 0]);
2. temperature (greedy rows use 1);
3. truncation: top-k, then top-p (the smallest set of most likely tokens whose mass reaches
   top_p), then min-p (drop tokens less likely than min_p times the most likely one), each
   on the distribution left by the previous one;
4. choice: argmax for temperature 0; otherwise inverse-CDF sampling from the softmax with
   one uniform number u derived from (seed, position of the new token) only (a splitmix64
   hash), so the token does not depend on the rest of the batch and is the same after
   recompute.

Logprobs are the log-softmax of the processed distribution, the one the token was drawn
from: after steps 1-3 (tokens removed by truncation have -inf and never appear among the top
logprobs). Stopping (EOS, stop ids, ignore_eos) is the gateway's business: nothing else is
masked.
"""
from __future__ import annotations

import torch

import numpy as np

from pagedserve.step.step_batch import FLAG_PLAIN, StepBatch
from pagedserve.wire.protocol import SampleOutput

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, position: int) -> int:
    """A 63-bit hash of (seed, position) (splitmix64 finalizer)."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


def apply_logit_bias(logits: torch.Tensor, params: list) -> None:
    """In place, for the rows whose sampling params carry a logit_bias: one scatter for the
    batch (no wait on the device)."""
    vocab = logits.shape[-1]
    rows, cols, values = [], [], []
    for i, sp in enumerate(params):
        for t, v in sp.logit_bias.items():
            if 0 <= t < vocab:
                rows.append(i)
                cols.append(t)
                values.append(v)
    if rows:
        dev = logits.device
        logits.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                          torch.tensor(values, dtype=logits.dtype, device=dev), accumulate=True)


def apply_min_tokens(logits: torch.Tensor, params: list, outputs: list[list[int]], eos_token_ids) -> None:
    """In place: the stop tokens of the rows still short of their min_tokens to -inf, except
    in a row where nothing else is allowed; for the batch at once (no wait on the device).
    `outputs`: each row's output tokens so far."""
    vocab = logits.shape[-1]
    rows, cols = [], []
    for i, sp in enumerate(params):
        if len(outputs[i]) < sp.min_tokens:
            for t in {*eos_token_ids, *sp.stop_token_ids}:
                if 0 <= t < vocab:
                    rows.append(i)
                    cols.append(t)
    if not rows:
        return
    dev = logits.device
    rows, cols = torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)
    kept = logits[rows, cols]
    logits[rows, cols] = float("-inf")
    stuck = logits.amax(-1) == float("-inf")  # its only allowed tokens were those: a grammar's end
    logits[rows, cols] = torch.where(stuck[rows], kept, logits[rows, cols])


def apply_penalties(logits: torch.Tensor, params: list, prompts: list[list[int]], outputs: list[list[int]]) -> None:
    """In place, for the rows whose sampling params use penalties (`prompts`, `outputs`: each
    row's tokens so far)."""
    vocab = logits.shape[-1]
    for i, sp in enumerate(params):
        if not sp.uses_penalties:
            continue
        row = logits[i]
        output = outputs[i]
        if sp.repetition_penalty != 1.0:
            seen = torch.tensor(prompts[i] + output, dtype=torch.int64, device=row.device).unique()
            if seen.numel():
                scores = row[seen]
                p = sp.repetition_penalty
                row[seen] = torch.where(scores > 0, scores / p, scores * p)
        if (sp.frequency_penalty or sp.presence_penalty) and output:
            ids = torch.tensor(output, dtype=torch.int64, device=row.device)
            counts = torch.bincount(ids, minlength=vocab)
            counts = counts[:vocab].to(row.dtype)
            row -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(row.dtype)


def apply_truncation(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     min_p: torch.Tensor) -> torch.Tensor:
    """Set removed tokens to -inf. top_k int64 [S] (<= 0: off), top_p / min_p float [S]."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    if (top_k > 0).any():
        k = torch.where(top_k > 0, top_k, vocab)
        sorted_logits.masked_fill_(ranks >= k[:, None], float("-inf"))
    if (top_p < 1).any():
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs
        limit = torch.where(top_p < 1, top_p, float("inf"))
        sorted_logits.masked_fill_(before >= limit[:, None], float("-inf"))
    if (min_p > 0).any():
        probs = sorted_logits.softmax(-1)
        sorted_logits.masked_fill_(probs < min_p[:, None] * probs[:, :1], float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, position)."""
    return (mix_seed(seed, position) >> 10) / float(1 << 53)


class Sampler:
    """__call__(logits [S, vocab], batch, rows) -> one SampleOutput per row of `logits`, the
    batch's rows `rows` in order. `eos_token_ids`: the model's end-of-sequence tokens,
    masked with min_tokens."""

    def __init__(self, eos_token_ids=()):
        self.eos_token_ids = list(eos_token_ids)

    def __call__(self, logits: torch.Tensor, batch: StepBatch, rows: np.ndarray) -> list[SampleOutput]:
        assert logits.shape[0] == len(rows), (logits.shape, len(rows))
        ids = batch.seq_ids
        if (batch.flags[rows] & FLAG_PLAIN).all():
            # the common serving case: one argmax over the batch, no copy of the logits
            tokens = logits.argmax(-1).tolist()
            return [SampleOutput(ids[i], t) for i, t in zip(rows.tolist(), tokens)]
        params = [batch.held[i].sampling for i in rows]
        logits = logits.float().clone()
        if any(p.logit_bias for p in params):
            apply_logit_bias(logits, params)
        if any(p.uses_penalties for p in params):
            outputs = [batch.output_of(i) for i in rows]
            if any(p.min_tokens for p in params):
                apply_min_tokens(logits, params, outputs, self.eos_token_ids)
            apply_penalties(logits, params, [batch.prompt_of(i) for i in rows], outputs)
        dev = logits.device
        temps = batch.temperature[rows]
        if (temps != 1).any():
            logits /= torch.from_numpy(temps).to(dev)[:, None]
        top_k, top_p, min_p = batch.top_k[rows], batch.top_p[rows], batch.min_p[rows]
        cut = np.flatnonzero((top_k > 0) | (top_p < 1) | (min_p > 0))
        if len(cut):
            at = torch.from_numpy(cut).to(dev)
            logits[at] = apply_truncation(logits[at], torch.from_numpy(top_k[cut]).to(dev),
                                          torch.from_numpy(top_p[cut]).to(dev), torch.from_numpy(min_p[cut]).to(dev))

        tokens = logits.argmax(-1)
        drawn = [k for k, p in enumerate(params) if not p.greedy]
        if drawn:
            at = torch.tensor(drawn, device=dev)
            cdf = logits[at].softmax(-1).double().cumsum(-1)
            ends = batch.start_pos + batch.num_tokens
            u = torch.tensor([uniform(batch.held[rows[k]].seed, int(ends[rows[k]]))
                              for k in drawn], dtype=torch.float64, device=dev)
            picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
            tokens[at] = picked[:, 0].clamp_(max=logits.shape[-1] - 1)

        tokens = tokens.tolist()
        out = []
        for k, i in enumerate(rows.tolist()):
            token = tokens[k]
            o = SampleOutput(ids[i], token)
            n = params[k].logprobs
            if n is not None:
                logprobs = logits[k].log_softmax(-1)
                o.logprob = float(logprobs[token])
                if n:
                    values, top = logprobs.topk(n)
                    o.top_logprobs = [(t, v) for t, v in zip(top.tolist(), values.tolist())
                                      if v != float("-inf")]
            out.append(o)
        return out

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

from pagedserve.wire.protocol import SampleOutput, SeqStep

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, position: int) -> int:
    """A 63-bit hash of (seed, position) (splitmix64 finalizer)."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


def apply_logit_bias(logits: torch.Tensor, seqs: list[SeqStep]) -> None:
    """In place, for the rows whose sampling params carry a logit_bias: one scatter for the
    batch (no wait on the device)."""
    vocab = logits.shape[-1]
    rows, cols, values = [], [], []
    for i, s in enumerate(seqs):
        for t, v in s.sampling.logit_bias.items():
            if 0 <= t < vocab:
                rows.append(i)
                cols.append(t)
                values.append(v)
    if rows:
        dev = logits.device
        logits.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                          torch.tensor(values, dtype=logits.dtype, device=dev), accumulate=True)


def apply_min_tokens(logits: torch.Tensor, seqs: list[SeqStep], eos_token_ids) -> None:
    """In place: the stop tokens of the rows still short of their min_tokens to -inf, except
    in a row where nothing else is allowed; for the batch at once (no wait on the device)."""
    vocab = logits.shape[-1]
    rows, cols = [], []
    for i, s in enumerate(seqs):
        if len(s.output_token_ids) < s.sampling.min_tokens:
            for t in {*eos_token_ids, *s.sampling.stop_token_ids}:
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


def apply_penalties(logits: torch.Tensor, seqs: list[SeqStep]) -> None:
    """In place, for the rows whose sampling params use penalties."""
    vocab = logits.shape[-1]
    for i, s in enumerate(seqs):
        sp = s.sampling
        if not sp.uses_penalties:
            continue
        row = logits[i]
        if sp.repetition_penalty != 1.0:
            seen = torch.tensor(s.prompt_token_ids + s.output_token_ids, dtype=torch.int64,
                                device=row.device).unique()
            if seen.numel():
                scores = row[seen]
                p = sp.repetition_penalty
                row[seen] = torch.where(scores > 0, scores / p, scores * p)
        if (sp.frequency_penalty or sp.presence_penalty) and s.output_token_ids:
            ids = torch.tensor(s.output_token_ids, dtype=torch.int64, device=row.device)
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


def _plain_greedy(p) -> bool:
    """Greedy with nothing that could change the argmax (penalties; truncation, on ties) or
    asks for the distribution (logprobs)."""
    return (p.greedy and not p.uses_penalties and p.logprobs is None and not p.logit_bias
            and p.top_k <= 0 and p.top_p >= 1 and p.min_p <= 0)


def uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, position)."""
    return (mix_seed(seed, position) >> 10) / float(1 << 53)


class Sampler:
    """__call__(logits [S, vocab], seqs) -> one SampleOutput per row, in order.
    `eos_token_ids`: the model's end-of-sequence tokens, masked with min_tokens."""

    def __init__(self, eos_token_ids=()):
        self.eos_token_ids = list(eos_token_ids)

    def __call__(self, logits: torch.Tensor, seqs: list[SeqStep]) -> list[SampleOutput]:
        assert logits.shape[0] == len(seqs), (logits.shape, len(seqs))
        params = [s.sampling for s in seqs]
        if all(_plain_greedy(p) for p in params):
            # the common serving case: one argmax over the batch, no copy of the logits
            tokens = logits.argmax(-1).tolist()
            return [SampleOutput(seq_id=s.seq_id, token_id=t) for s, t in zip(seqs, tokens)]
        logits = logits.float().clone()
        if any(p.logit_bias for p in params):
            apply_logit_bias(logits, seqs)
        if any(p.min_tokens for p in params):
            apply_min_tokens(logits, seqs, self.eos_token_ids)
        apply_penalties(logits, seqs)
        dev = logits.device
        temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=dev)
        if (temps != 1).any():
            logits /= temps[:, None]
        cut = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1 or p.min_p > 0]
        if cut:
            rows = torch.tensor(cut, device=dev)
            logits[rows] = apply_truncation(
                logits[rows],
                torch.tensor([params[i].top_k for i in cut], dtype=torch.int64, device=dev),
                torch.tensor([params[i].top_p for i in cut], dtype=torch.float32, device=dev),
                torch.tensor([params[i].min_p for i in cut], dtype=torch.float32, device=dev),
            )

        tokens = logits.argmax(-1)
        drawn = [i for i, p in enumerate(params) if not p.greedy]
        if drawn:
            rows = torch.tensor(drawn, device=dev)
            cdf = logits[rows].softmax(-1).double().cumsum(-1)
            u = torch.tensor([uniform(seqs[i].seed, seqs[i].start_pos + len(seqs[i].token_ids))
                              for i in drawn], dtype=torch.float64, device=dev)
            picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
            tokens[rows] = picked[:, 0].clamp_(max=logits.shape[-1] - 1)

        tokens = tokens.tolist()
        out = []
        for i, s in enumerate(seqs):
            token = tokens[i]
            o = SampleOutput(seq_id=s.seq_id, token_id=token)
            k = params[i].logprobs
            if k is not None:
                logprobs = logits[i].log_softmax(-1)
                o.logprob = float(logprobs[token])
                if k:
                    values, ids = logprobs.topk(k)
                    o.top_logprobs = [(t, v) for t, v in zip(ids.tolist(), values.tolist())
                                      if v != float("-inf")]
            out.append(o)
        return out

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

from pagedserve.executor.readback import Logprobs, Readback
from pagedserve.executor.staging import to_device
from pagedserve.kernels.argmax_cpu import greedy_ids
from pagedserve.step.step_batch import FLAG_PLAIN, StepBatch
from pagedserve.wire.step_outputs import StepOutputs

_MASK64 = (1 << 64) - 1
_C1, _C2, _C3 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
TOP_P_CANDIDATES = 1024  # top-p without top-k looks among this many most likely tokens first


def mix_seeds(seeds, positions) -> np.ndarray:
    """63-bit hashes of (seed, position) pairs (splitmix64's finalizer), uint64."""
    x = np.asarray(seeds, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = x * _C1 + np.asarray(positions, dtype=np.uint64) * _C2 + np.uint64(1)
        x = (x ^ (x >> np.uint64(30))) * _C2
        x = (x ^ (x >> np.uint64(27))) * _C3
    return (x ^ (x >> np.uint64(31))) >> np.uint64(1)


def mix_seed(seed: int, position: int) -> int:
    """A 63-bit hash of (seed, position)."""
    return int(mix_seeds([seed & _MASK64], [position & _MASK64])[0])


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
        logits.index_put_((to_device(rows, dev), to_device(cols, dev)), to_device(values, dev, logits.dtype),
                          accumulate=True)


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
    rows, cols = to_device(rows, dev), to_device(cols, dev)
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
            seen = to_device(prompts[i] + output, row.device, torch.int64).unique()
            if seen.numel():
                scores = row[seen]
                p = sp.repetition_penalty
                row[seen] = torch.where(scores > 0, scores / p, scores * p)
        if (sp.frequency_penalty or sp.presence_penalty) and output:
            ids = to_device(output, row.device, torch.int64)
            counts = torch.bincount(ids, minlength=vocab)
            counts = counts[:vocab].to(row.dtype)
            row -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(row.dtype)


def apply_truncation(logits: torch.Tensor, top_k, top_p, min_p) -> torch.Tensor:
    """`logits` with the removed tokens at -inf (a new tensor). top_k [S] (<= 0: off), top_p and
    min_p [S], on the host (numpy or CPU tensors). No full-vocabulary sort where it can be
    avoided: top-k and top-p look among the max(top_k) most likely tokens, or for top-p alone
    among TOP_P_CANDIDATES, and only a row whose candidates do not reach its top_p is sorted
    whole (on a GPU, telling which rows those are is the one wait on the device)."""
    top_k, top_p, min_p = (np.asarray(x.cpu() if torch.is_tensor(x) else x) for x in (top_k, top_p, min_p))
    vocab = logits.shape[-1]
    out = logits.clone()
    k = np.where(top_k > 0, np.minimum(top_k, vocab), vocab)
    rows = np.flatnonzero((top_k > 0) | (top_p < 1))
    if len(rows):
        width = int(k[rows].max()) if (top_k[rows] > 0).all() else max(min(vocab, TOP_P_CANDIDATES),
                                                                      int(k[rows][top_k[rows] > 0].max(initial=0)))
        kept, short = _top_k_top_p(logits[rows], k[rows], top_p[rows], width)
        if short.any():  # the candidates hold less than top_p: those rows sorted whole
            kept[short] = _top_k_top_p(logits[rows[short]], k[rows[short]], top_p[rows[short]], vocab)[0]
        out[to_device(rows, logits.device)] = kept
    rows = np.flatnonzero(min_p > 0)
    if len(rows):  # a token less likely than min_p x the most likely one: exp(l - max) < min_p
        at = to_device(rows, logits.device)
        sub = out[at]
        ratio = (sub - sub.amax(-1, keepdim=True)).exp()
        out[at] = sub.masked_fill_(ratio < to_device(min_p[rows], sub.device, sub.dtype)[:, None], float("-inf"))
    return out


def _top_k_top_p(logits: torch.Tensor, k: np.ndarray, top_p: np.ndarray, width: int
                 ) -> tuple[torch.Tensor, np.ndarray]:
    """Top-k then top-p over each row's `width` most likely tokens (k <= width for a row with
    top-k); and which rows without top-k had candidates holding less than their top_p."""
    dev, vocab = logits.device, logits.shape[-1]
    values, order = logits.topk(width, dim=-1)  # most likely first
    ranks = torch.arange(width, device=dev)[None, :]
    values.masked_fill_(ranks >= to_device(k, dev)[:, None], float("-inf"))
    short = np.zeros(len(k), dtype=bool)
    if (top_p < 1).any():
        has_k = to_device(k < vocab, dev)
        total = torch.where(has_k, values.logsumexp(-1), logits.logsumexp(-1))  # the distribution top-k left
        probs = (values - total[:, None]).exp()
        mass = probs.cumsum(-1)
        limit = to_device(np.where(top_p < 1, top_p, np.inf), probs.device, probs.dtype)
        values.masked_fill_(mass - probs >= limit[:, None], float("-inf"))
        if width < vocab:
            short = (~has_k & (mass[:, -1] < limit)).cpu().numpy()
    return torch.full_like(logits, float("-inf")).scatter_(-1, order, values), short


def uniforms(seeds, positions) -> np.ndarray:
    """Uniform numbers in [0, 1), float64, each depending only on its (seed, position)."""
    return (mix_seeds(seeds, positions) >> np.uint64(10)).astype(np.float64) / float(1 << 53)


class Sampler:
    """__call__(logits [S, vocab], batch, rows) -> StepOutputs (pagedserve.wire.step_outputs),
    one entry per row of `logits`, the batch's rows `rows` in order; a row that asks for
    logprobs is in its `more`. `eos_token_ids`: the model's end-of-sequence tokens,
    masked with min_tokens. The batch's columns are read on the host and sent to the device
    without a wait (pagedserve.executor.staging.to_device); the tokens and logprobs come back
    through a Readback. The one wait on the device is a top-p row's (apply_truncation)."""

    def __init__(self, eos_token_ids=()):
        self.eos_token_ids = list(eos_token_ids)

    def __call__(self, logits: torch.Tensor, batch: StepBatch, rows: np.ndarray) -> StepOutputs:
        return self.sample(logits, batch, rows).outputs()

    def sample(self, logits: torch.Tensor, batch: StepBatch, rows: np.ndarray, held: bool = False,
               greedy: torch.Tensor | None = None) -> Readback:
        """The tokens (and logprobs) on their way to the host (pagedserve.executor.readback;
        `held` as there): no wait on the device but apply_truncation's for a top-p row.
        `greedy`: each row's most likely token of `logits`, where a CUDA graph chose it."""
        assert logits.shape[0] == len(rows), (logits.shape, len(rows))
        ids = list(map(batch.seq_ids.__getitem__, rows.tolist()))
        if (batch.flags[rows] & FLAG_PLAIN).all():
            # the common serving case: one argmax over the batch, no copy of the logits
            return Readback(ids, greedy_ids(logits) if greedy is None else greedy, held=held)
        params = [batch.held[i].sampling for i in rows]
        logits = logits.to(torch.float32, copy=True)
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
            logits /= to_device(temps, dev)[:, None]
        top_k, top_p, min_p = batch.top_k[rows], batch.top_p[rows], batch.min_p[rows]
        cut = np.flatnonzero((top_k > 0) | (top_p < 1) | (min_p > 0))
        if len(cut):
            at = to_device(cut, dev)
            logits[at] = apply_truncation(logits[at], top_k[cut], top_p[cut], min_p[cut])

        tokens = greedy_ids(logits)
        drawn = np.flatnonzero([not p.greedy for p in params])
        if len(drawn):
            at = to_device(drawn, dev)
            cdf = logits[at].softmax(-1).double().cumsum(-1)
            picked_rows = rows[drawn]
            u = uniforms([batch.held[i].seed & _MASK64 for i in picked_rows],
                         (batch.start_pos + batch.num_tokens)[picked_rows])
            u = to_device(u, dev)
            picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
            tokens[at] = picked[:, 0].clamp_(max=logits.shape[-1] - 1)
        return Readback(ids, tokens, self._logprobs(logits, tokens, params), held=held)

    @staticmethod
    def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: list) -> Logprobs | None:
        """The chosen token's logprob and the top n, for the rows that ask, in one pass."""
        asked = [k for k, p in enumerate(params) if p.logprobs is not None]
        if not asked:
            return None
        at = to_device(asked, logits.device)
        logprobs = logits[at].log_softmax(-1)
        chosen = logprobs.gather(1, tokens[at][:, None])[:, 0]
        counts = [params[k].logprobs for k in asked]
        most = max(counts)
        values, top = logprobs.topk(most) if most else (logprobs[:, :0], logprobs[:, :0].long())
        return Logprobs(asked, counts, chosen, values, top)

"""The general path of `Scheduler.plan`, in priority order within the step's budgets
(sequences and tokens): `running` gives the running sequences' columns (then the swapped-out
ones to resume), each its next decode token or prompt chunk, a token the running step
samples PENDING (held in `Scheduler.pending`); `waiting` gives the new sequences' entries,
each its whole prompt (memsvc grants what fits, chunked by the token budget left). See
docs/ARCHITECTURE.md, "One step"."""
from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.wire.pending_token import PENDING
from pagedserve.wire.reserve_messages import PlanEntry
from pagedserve.wire.step_delta import StepDelta

if TYPE_CHECKING:
    from pagedserve.gateway.scheduler import Scheduler


def running(sched: Scheduler, ahead_of: StepDelta | None, budget: int, max_seqs: int
            ) -> tuple[list[str], list[int], list[int], int]:
    """The plan's running sequences (swapped-out ones to resume among them): their ids,
    token counts and tokens (PENDING: the token `ahead_of` samples, held in `pending`),
    and the budget left."""
    inflight = ahead_of.progress() if ahead_of is not None else None
    run_ids: list[str] = []
    run_counts: list[int] = []
    run_tokens: list[int] = []
    hold = sched.pending.hold
    for seq in sched.running + sched.swapped:
        if len(run_ids) >= max_seqs:
            break
        out, prompt = seq.output_token_ids, seq.prompt_token_ids
        plen = len(prompt)
        num_tokens = plen + len(out)
        computed = seq.num_computed
        limit = num_tokens if seq.fork_at is None else seq.fork_at
        step = inflight.get(seq.seq_id) if inflight else None
        if step is not None:
            computed, samples = step
            if samples:
                if seq.tokens_left() <= 1:
                    continue  # its next token is its last
                limit += 1
        n = min(limit - computed, budget)
        if n < 1:
            continue
        known = min(n, num_tokens - computed)  # the rest is the token the step samples
        run_ids.append(seq.seq_id)
        run_counts.append(n)
        if computed >= plen:
            run_tokens += out[computed - plen : computed - plen + known]
        else:
            run_tokens += (prompt + out)[computed : computed + known]
        if known < n:
            run_tokens.append(PENDING)
            hold(seq.seq_id, computed + known)
        budget -= n
    return run_ids, run_counts, run_tokens, budget


def waiting(sched: Scheduler, budget: int, room: int) -> list[PlanEntry]:
    """The plan's new sequences, at most `room` of them, within `budget` tokens."""
    entries: list[PlanEntry] = []
    for seq in sched.waiting:
        if budget < 1 or len(entries) >= room:
            break
        if not sched.config.enable_chunked_prefill and seq.compute_limit > budget:
            break
        entries.append(PlanEntry(seq.seq_id, seq.all_token_ids[: seq.compute_limit], True,
                                 seq.max_len, max_new_tokens=budget, final_len=seq.final_len,
                                 salt=seq.salt,
                                 skip_prefix_cache=seq.sampling.prompt_logprobs is not None))
        budget -= min(seq.compute_limit, budget)
    return entries

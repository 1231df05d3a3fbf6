"""The gateway's half of the per-step delta to the executor (executor.sequence_state holds
the other): encode a StepBatch as changes against what the executor already holds.

`encode_step(batch, sent, session_id, incarnation)` sends a sequence's constant state once
(sampling parameters, seed, prompt length, token history when penalties need it, the whole
prompt when prompt logprobs do) and then
only its tokens to compute (a FED token, wire.step_feed, as `fed`) and the change to its
block table; `sent` is the caller's record
of the block tables the executor holds. An executor that answers FAILED_PRECONDITION with
STATE_LOST in the details (it restarted, or lost a sequence) gets everything again: clear
`sent` and encode the same batch once more.
"""
from __future__ import annotations

from wire import convert
from wire.protocol import StepBatch
from wire.step_feed import FED
from wire.v1 import executor_pb2

STATE_LOST = "executor state lost"  # in FAILED_PRECONDITION details: resend every state


def encode_step(batch: StepBatch, sent: dict[str, list[int]], session_id: str, incarnation: str
                ) -> tuple[executor_pb2.ExecuteRequest, dict[str, list[int]]]:
    """The ExecuteRequest for `batch` against what the executor holds, and the updates to
    `sent` to apply once the executor answered (`commit`): `sent` maps each sequence whose
    state went out to its block table as last sent. A sequence not in `sent` (or in
    `batch.forget`) goes with its full state. Nothing changes here, so a request that fails
    can be encoded again."""
    forget = set(batch.forget)
    updates: dict[str, list[int]] = {}
    ids, starts, ntok, toks, samples, tstarts, nnew, newb, states = [], [], [], [], [], [], [], [], []
    fed: list[bool] = []
    any_fed = False
    sampling: dict[int, object] = {}
    for s in batch.seqs:
        table = s.block_table
        seq_id = s.seq_id
        prev = sent.get(seq_id) if seq_id not in forget else None
        if prev is None:
            sp = sampling.get(id(s.sampling))
            if sp is None:
                sp = sampling[id(s.sampling)] = convert.sampling_to_proto(s.sampling)
            if s.sampling.uses_penalties:
                history = (s.prompt_token_ids + s.output_token_ids)[:s.start_pos]
                prompt_len = len(s.prompt_token_ids)
            else:
                history, prompt_len = [], 0
            prompt = s.prompt_token_ids if s.sampling.prompt_logprobs is not None else None
            states.append(executor_pb2.SeqState(seq_id=seq_id, sampling=sp, seed=s.seed,
                                                prompt_len=prompt_len, history=history, prompt=prompt))
            updates[seq_id] = list(table)
            tstart, new = 0, table
        else:
            n = len(prev)
            if len(table) == n and (not n or table[-1] == prev[-1]) and table == prev:
                tstart, new = n, ()
            elif len(table) >= n and table[:n] == prev:
                tstart, new = n, table[n:]
                updates[seq_id] = list(table)
            else:
                tstart, new = 0, table
                updates[seq_id] = list(table)
        ids.append(seq_id)
        starts.append(s.start_pos)
        ntok.append(len(s.token_ids))
        own = s.token_ids[0] == FED
        fed.append(own)
        if own:
            any_fed = True
        else:
            toks.extend(s.token_ids)
        samples.append(s.sample)
        tstarts.append(tstart)
        nnew.append(len(new))
        newb.extend(new)
    request = executor_pb2.ExecuteRequest(
        pool_epoch=batch.pool_epoch, session_id=session_id, incarnation=incarnation,
        forget=batch.forget, seq_ids=ids, start_pos=starts, num_tokens=ntok, token_ids=toks,
        sample=samples, table_start=tstarts, num_new_blocks=nnew, new_blocks=newb, states=states,
        fed=fed if any_fed else (), step=batch.step)
    return request, updates


def commit(sent: dict[str, list[int]], batch: StepBatch, updates: dict[str, list[int]]) -> None:
    """The executor answered `batch`: record what it now holds."""
    for seq_id in batch.forget:
        sent.pop(seq_id, None)
    sent.update(updates)

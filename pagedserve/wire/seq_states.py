"""What goes with a sequence the executor does not hold yet (pagedserve.wire.step_delta's
`encode_delta`): its constant state (`SeqState`: sampling parameters, seed, the token history
where penalties need it, the prompt where prompt logprobs do) and its whole block table, asked
of memsvc where the step holds only a change to it. See docs/ARCHITECTURE.md, "One step".
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from pagedserve.wire import convert
from pagedserve.wire.protocol import SamplingParams
from pagedserve.wire.v1 import executor_pb2

if TYPE_CHECKING:
    from pagedserve.wire.step_delta import StepDelta


class SeqSource(Protocol):
    """What the step message reads from the gateway's sequence when its state must go."""

    sampling: SamplingParams
    seed: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]


def _whole_tables(step: StepDelta, sent: set[str], tables) -> dict[str, list[int]]:
    """memsvc's whole table of each sequence whose state goes while the step holds only a
    change to its table."""
    need = [s for s, t in zip(step.seq_ids, step.table_start) if t and s not in sent]
    if not need:
        return {}
    if tables is None:
        raise ValueError(f"sequences {need[:3]}: their state must go with their whole block tables, "
                         "and no `tables` (memsvc's MemoryClient.tables) was given to ask for them")
    return dict(zip(need, tables(need)))


def with_states(step: StepDelta, sent: set[str], tables) -> tuple[list, list[int], list[int], list[int]]:
    """The SeqStates of the step's sequences not in `sent` (added to it), and the step's
    table columns where each of them goes with its whole table: (states, table_start,
    num_new_blocks, new_blocks)."""
    ids, states = step.seq_ids, []
    whole = _whole_tables(step, sent, tables)
    tstarts, nnew, newb = [], [], []
    sampling: dict[int, tuple] = {}  # id -> (its proto, uses_penalties, wants the prompt)
    at = 0
    for i, seq_id in enumerate(ids):
        tstart, k = step.table_start[i], step.num_new_blocks[i]
        new = step.new_blocks[at:at + k]
        at += k
        if seq_id not in sent:
            seq = step.seqs[i]
            if seq is None:
                raise ValueError(f"sequence {seq_id}: its state must go, but the step does not carry it")
            sp = seq.sampling
            known = sampling.get(id(sp))  # the sequences of one request share their sampling
            if known is None:
                known = sampling[id(sp)] = (convert.sampling_to_proto(sp), sp.uses_penalties,
                                            sp.prompt_logprobs is not None)
            proto, penalties, with_prompt = known
            prompt = seq.prompt_token_ids
            if penalties:
                history, prompt_len = (prompt + seq.output_token_ids)[:step.start_pos[i]], len(prompt)
            else:
                history, prompt_len = None, 0
            states.append(executor_pb2.SeqState(
                seq_id=seq_id, sampling=proto, seed=seq.seed, prompt_len=prompt_len, history=history,
                prompt=prompt if with_prompt else None))
            if tstart:
                tstart, new = 0, whole[seq_id]
            sent.add(seq_id)
        tstarts.append(tstart)
        nnew.append(len(new))
        newb += new
    return states, tstarts, nnew, newb

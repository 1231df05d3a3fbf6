"""Protobuf <-> dataclass conversion for a step's messages: Reserve (`Plan` and
`ReserveResult`, pagedserve/wire/reserve_messages.py) and Execute's outputs (`SampleOutput`);
the others' are in pagedserve/wire/convert.py.

Runs on every step for every sequence, so it stays close to the metal: messages are built
with keyword constructors (repeated fields filled from lists in C) and read back with
`list(...)`; a column of sequence ids travels as one string, the ids joined by newlines
(pagedserve.wire.id_columns). A Reserve column whose every value is the same in a steady
step (one PENDING token each, one token granted, none cached, no new block) travels as a
flag, the column empty (`constant`, `column`); new sequences: pagedserve.wire.new_sequences.
"""
from __future__ import annotations

from pagedserve.wire.convert import prompt_logprobs_from_proto, prompt_logprobs_to_proto
from pagedserve.wire.id_columns import column, constant, join_ids, split_ids
from pagedserve.wire.new_sequences import NEW_FIELDS, new_from_proto, new_to_proto
from pagedserve.wire.pending_token import PENDING
from pagedserve.wire.protocol import SampleOutput
from pagedserve.wire.step_outputs import StepOutputs
from pagedserve.wire.reserve_messages import Fills, Grants, Plan, Preemption, Rejection, ReserveResult
from pagedserve.wire.v1 import executor_pb2, generation_pb2, memory_pb2

# -- Reserve -----------------------------------------------------------------------------

def plan_to_proto(plan: Plan, session_id: str = "") -> memory_pb2.ReserveRequest:
    """The fills' ids travel once where they are the running ids (a steady step)."""
    fills, n = plan.fills, len(plan.run_ids)
    one_pending = constant(plan.run_counts, 1, n) and constant(plan.run_tokens, PENDING, n)
    run_ids, joined_runs = join_ids(plan.run_ids)
    fills_run_ids = bool(fills) and fills.seq_ids == plan.run_ids
    fill_ids, joined_fills = ([], "") if fills_run_ids else join_ids(fills.seq_ids)
    new = new_to_proto(plan.entries) if plan.entries else {}
    return memory_pb2.ReserveRequest(
        session_id=session_id, free=plan.free, step_tokens=plan.step_tokens, step_seconds=plan.step_seconds,
        fork_parents=[p for p, _ in plan.forks], fork_children=[c for _, c in plan.forks],
        ahead=plan.ahead, fill_seq_ids=fill_ids, joined_fill_seq_ids=joined_fills, fills_run_ids=fills_run_ids,
        fill_positions=fills.positions, fill_token_ids=fills.token_ids,
        run_seq_ids=run_ids, joined_run_seq_ids=joined_runs,
        run_one_pending_each=one_pending, run_num_tokens=None if one_pending else plan.run_counts,
        run_token_ids=None if one_pending else plan.run_tokens,
        written=plan.written, void=plan.void, failed=plan.failed, **new,
    )


def plan_from_proto(m: memory_pb2.ReserveRequest) -> Plan:
    """ValueError where the packed arrays do not agree in length."""
    ids = split_ids(m.run_seq_ids, m.joined_run_seq_ids)
    one_pending = m.run_one_pending_each
    counts = column(m.run_num_tokens, one_pending, 1, len(ids), "run_num_tokens")
    tokens = column(m.run_token_ids, one_pending, PENDING, len(ids), "run_token_ids")
    if len(counts) != len(ids) or sum(counts) != len(tokens):
        raise ValueError("run_seq_ids, run_num_tokens and run_token_ids do not agree")
    if m.fills_run_ids and (m.fill_seq_ids or m.joined_fill_seq_ids):
        raise ValueError("fills_run_ids says the fills' sequences are run_seq_ids: send no fill_seq_ids with it")
    fill_ids = list(ids) if m.fills_run_ids else split_ids(m.fill_seq_ids, m.joined_fill_seq_ids)
    if not len(fill_ids) == len(m.fill_positions) == len(m.fill_token_ids):
        raise ValueError("fill_seq_ids, fill_positions and fill_token_ids must have the same length")
    if len(m.fork_parents) != len(m.fork_children):
        raise ValueError("fork_parents and fork_children must have the same length")
    new = any([len(getattr(m, name)) for name in NEW_FIELDS])
    return Plan(entries=new_from_proto(m) if new else [], free=list(m.free), step_tokens=m.step_tokens,
                step_seconds=m.step_seconds, forks=list(zip(m.fork_parents, m.fork_children)),
                ahead=m.ahead, fills=Fills(fill_ids, list(m.fill_positions), list(m.fill_token_ids)),
                written=m.written, void=m.void, failed=list(m.failed),
                run_ids=ids, run_counts=counts, run_tokens=tokens)


def reserve_result_to_proto(r: ReserveResult) -> memory_pb2.ReserveResponse:
    g, n = r.grants, len(r.grants.seq_ids)
    ids, joined = join_ids(g.seq_ids)
    decode = constant(g.num_tokens, 1, n) and constant(g.num_cached, 0, n)
    no_new = constant(g.num_new_blocks, 0, n)
    return memory_pb2.ReserveResponse(
        grant_seq_ids=ids, joined_grant_seq_ids=joined, grant_start_pos=g.start_pos,
        grants_one_token_uncached=decode, grant_num_tokens=None if decode else g.num_tokens,
        grant_table_start=g.table_start, grants_no_new_blocks=no_new,
        grant_num_new_blocks=None if no_new else g.num_new_blocks, grant_new_blocks=g.new_blocks,
        grant_num_cached=None if decode else g.num_cached,
        preempted=[memory_pb2.Preemption(seq_id=p.seq_id, mode=p.mode) for p in r.preempted],
        rejected=[memory_pb2.Rejection(seq_id=x.seq_id, reason=x.reason) for x in r.rejected],
        waiting=r.waiting, resumed=r.resumed, pool_epoch=r.pool_epoch, deferred=r.deferred,
        copy_src=[c[0] for c in r.block_copies], copy_dst=[c[1] for c in r.block_copies],
        stamp=r.stamp,
    )


def reserve_result_from_proto(m: memory_pb2.ReserveResponse) -> ReserveResult:
    """ValueError where the packed arrays do not agree in length."""
    if len(m.copy_src) != len(m.copy_dst):
        raise ValueError(f"copy_src has {len(m.copy_src)} blocks, copy_dst {len(m.copy_dst)}")
    ids = split_ids(m.grant_seq_ids, m.joined_grant_seq_ids)
    n, decode = len(ids), m.grants_one_token_uncached
    grants = Grants(ids, list(m.grant_start_pos), column(m.grant_num_tokens, decode, 1, n, "grant_num_tokens"),
                    list(m.grant_table_start),
                    column(m.grant_num_new_blocks, m.grants_no_new_blocks, 0, n, "grant_num_new_blocks"),
                    list(m.grant_new_blocks), column(m.grant_num_cached, decode, 0, n, "grant_num_cached"))
    grants.check()
    return ReserveResult(
        grants=grants,
        preempted=[Preemption(p.seq_id, p.mode) for p in m.preempted],
        rejected=[Rejection(x.seq_id, x.reason) for x in m.rejected],
        waiting=list(m.waiting),
        resumed=list(m.resumed),
        pool_epoch=m.pool_epoch,
        deferred=m.deferred,
        block_copies=list(zip(m.copy_src, m.copy_dst)),
        stamp=m.stamp,
    )


# -- Execute's outputs ---------------------------------------------------------------


def outputs_to_proto(outputs: StepOutputs | list[SampleOutput], incarnation: str = "") -> executor_pb2.ExecuteResponse:
    """Tokens alone (packed) when no output carries more than its sampled token."""
    outputs = StepOutputs.of(outputs)
    if not outputs.more:
        return executor_pb2.ExecuteResponse(tokens=outputs.tokens, incarnation=incarnation)
    SO, TL = executor_pb2.SampleOutput, generation_pb2.TopLogprob
    return executor_pb2.ExecuteResponse(outputs=[
        SO(seq_id=o.seq_id, token_id=o.token_id if o.sampled else 0, logprob=o.logprob,
           top_logprobs=[TL(token_id=t, logprob=lp) for t, lp in o.top_logprobs] if o.top_logprobs else None,
           prompt_only=not o.sampled,
           prompt_logprobs=prompt_logprobs_to_proto(o.prompt_logprobs) if o.prompt_logprobs else None,
           error=o.error)
        for o in outputs
    ], incarnation=incarnation)


def outputs_from_proto(m: executor_pb2.ExecuteResponse, sampled_ids: list[str] | None = None) -> StepOutputs:
    """`sampled_ids`: the ids of the batch's sequences with sample set, in order (for a
    response that carries tokens alone). A prompt-only output has token_id -1."""
    if m.tokens:
        if sampled_ids is None or len(sampled_ids) != len(m.tokens):
            raise ValueError(f"the executor sent {len(m.tokens)} tokens for "
                             f"{'?' if sampled_ids is None else len(sampled_ids)} sampled sequences")
        return StepOutputs(sampled_ids, list(m.tokens))
    return StepOutputs.of([
        SampleOutput(o.seq_id, -1 if o.prompt_only else o.token_id,
                     o.logprob if o.HasField("logprob") else None,
                     [(t.token_id, t.logprob) for t in o.top_logprobs], not o.prompt_only,
                     prompt_logprobs_from_proto(o.prompt_logprobs), o.error)
        for o in m.outputs
    ])

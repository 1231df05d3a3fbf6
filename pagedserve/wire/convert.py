"""Protobuf <-> dataclass conversion for the messages of pagedserve/wire/protocol.py and
pagedserve/wire/reserve_messages.py.

Runs on every step for every sequence, so it stays close to the metal: messages are built
with keyword constructors (repeated fields filled from lists in C) and read back with
`list(...)`; a column of sequence ids travels as one string, the ids joined by newlines
(`join_ids`, `split_ids`; in its repeated field when an id holds a newline); sequences that
share a SamplingParams share one message going out, and consecutive equal sampling
messages share one SamplingParams coming back.

Proto3 conventions at this boundary: an empty string means None for optional text
(chat_template); SamplingParams fields follow the comments in generation.proto (0 means
the default for max_tokens and n; unset optional fields mean their defaults).
"""
from __future__ import annotations

import dataclasses

from pagedserve.wire.protocol import (
    KVGeometry,
    ModelInfo,
    PoolStats,
    PromptLogprob,
    SampleOutput,
    SamplingParams,
)
from pagedserve.wire.reserve_messages import Grants, Plan, PlanEntry, Preemption, Rejection, ReserveResult
from pagedserve.wire.sampling_fields import DEFAULTS
from pagedserve.wire.v1 import executor_pb2, generation_pb2, memory_pb2

# -- id columns ----------------------------------------------------------------------------


def join_ids(ids: list[str]) -> tuple[list[str], str]:
    """(repeated, joined): a column of ids for its two proto fields. Joined by newlines
    unless an id holds one (or the column is [""], which would join to nothing)."""
    joined = "\n".join(ids)
    if joined and joined.count("\n") == len(ids) - 1:
        return [], joined
    return ids, ""


def split_ids(repeated, joined: str) -> list[str]:
    """The column `join_ids` sent."""
    return joined.split("\n") if joined else list(repeated)


# -- sampling and geometry ---------------------------------------------------------------


_SAMPLING = generation_pb2.SamplingParams.DESCRIPTOR.fields_by_name
_SAMPLING_FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]
missing = [name for name in _SAMPLING_FIELDS if name not in _SAMPLING]
assert not missing, f"SamplingParams fields with no field in generation.proto's SamplingParams: {missing}"


def sampling_to_proto(sp: SamplingParams) -> generation_pb2.SamplingParams:
    """Field by field, by name (a field unset where it is None)."""
    return generation_pb2.SamplingParams(**{name: v for name in _SAMPLING_FIELDS
                                            if (v := getattr(sp, name)) is not None})


def _f32(x: float) -> float:
    """Recover the decimal a client most likely sent from its float32 wire value (0.7, not 0.69999998)."""
    return float(f"{x:.7g}")


def _sampling_value(m: generation_pb2.SamplingParams, name: str):
    fd = _SAMPLING[name]
    if fd.has_presence and not m.HasField(name):
        return DEFAULTS[name]
    v = getattr(m, name)
    if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
        return {k: _f32(x) for k, x in v.items()}
    if fd.is_repeated:
        return list(v)
    if fd.type == fd.TYPE_FLOAT:
        return _f32(v)
    if not v and not fd.has_presence:  # 0: unset, where a field cannot say so (beam_width)
        return DEFAULTS[name]
    return v


def sampling_from_proto(m: generation_pb2.SamplingParams) -> SamplingParams:
    """Field by field, by name; unset fields (optional ones not set, others left 0, as a
    beam_width of 0) take their defaults from pagedserve.wire.sampling_fields. The message is
    not validated here (SamplingParams.validate)."""
    return SamplingParams(**{name: _sampling_value(m, name) for name in _SAMPLING_FIELDS})


def geometry_to_proto(g: KVGeometry) -> memory_pb2.KVGeometry:
    return memory_pb2.KVGeometry(num_layers=g.num_layers, num_kv_heads=g.num_kv_heads,
                                 head_size=g.head_size, block_size=g.block_size, dtype=g.dtype,
                                 window=g.window)


def geometry_from_proto(m: memory_pb2.KVGeometry) -> KVGeometry:
    return KVGeometry(m.num_layers, m.num_kv_heads, m.head_size, m.block_size, m.dtype or "float32", m.window)


def model_info_to_proto(info: ModelInfo, tokenizer_files: dict[str, bytes] | None = None
                        ) -> executor_pb2.ModelInfoResponse:
    """`tokenizer_files` (name -> content) travel instead of `tokenizer_dir`."""
    files = [executor_pb2.TokenizerFile(name=k, content=v) for k, v in (tokenizer_files or {}).items()]
    return executor_pb2.ModelInfoResponse(
        name=info.name, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
        eos_token_ids=info.eos_token_ids, chat_template=info.chat_template or "",
        kv=geometry_to_proto(info.kv), tokenizer_files=files, max_num_seqs=info.max_num_seqs,
    )


def model_info_from_proto(m: executor_pb2.ModelInfoResponse, tokenizer_dir: str = "") -> ModelInfo:
    return ModelInfo(
        name=m.name, max_model_len=m.max_model_len, vocab_size=m.vocab_size,
        eos_token_ids=list(m.eos_token_ids), chat_template=m.chat_template or None,
        tokenizer_dir=tokenizer_dir, kv=geometry_from_proto(m.kv), max_num_seqs=m.max_num_seqs,
    )


# -- Reserve -----------------------------------------------------------------------------


def plan_to_proto(plan: Plan, session_id: str = "") -> memory_pb2.ReserveRequest:
    fill_ids, positions, tokens = zip(*plan.fills) if plan.fills else ((), (), ())
    fill_ids, joined_fills = join_ids(list(fill_ids))
    run_ids, joined_runs = join_ids(plan.run_ids)
    return memory_pb2.ReserveRequest(
        session_id=session_id, free=plan.free, step_tokens=plan.step_tokens, step_seconds=plan.step_seconds,
        fork_parents=[p for p, _ in plan.forks], fork_children=[c for _, c in plan.forks],
        ahead=plan.ahead, fill_seq_ids=fill_ids, joined_fill_seq_ids=joined_fills, fill_positions=positions,
        fill_token_ids=tokens, run_seq_ids=run_ids, joined_run_seq_ids=joined_runs,
        run_num_tokens=plan.run_counts, run_token_ids=plan.run_tokens,
        entries=[memory_pb2.PlanEntry(seq_id=e.seq_id, token_ids=e.token_ids, max_len=e.max_len,
                                      max_new_tokens=e.max_new_tokens, final_len=e.final_len, salt=e.salt,
                                      skip_prefix_cache=e.skip_prefix_cache) for e in plan.entries],
        written=plan.written, void=plan.void, failed=plan.failed,
    )


def plan_from_proto(m: memory_pb2.ReserveRequest) -> Plan:
    """ValueError where the packed arrays do not agree in length."""
    ids = split_ids(m.run_seq_ids, m.joined_run_seq_ids)
    counts, tokens = list(m.run_num_tokens), list(m.run_token_ids)
    if len(counts) != len(ids) or sum(counts) != len(tokens):
        raise ValueError("run_seq_ids, run_num_tokens and run_token_ids do not agree")
    fill_ids = split_ids(m.fill_seq_ids, m.joined_fill_seq_ids)
    if not len(fill_ids) == len(m.fill_positions) == len(m.fill_token_ids):
        raise ValueError("fill_seq_ids, fill_positions and fill_token_ids must have the same length")
    if len(m.fork_parents) != len(m.fork_children):
        raise ValueError("fork_parents and fork_children must have the same length")
    entries = [PlanEntry(e.seq_id, list(e.token_ids), True, e.max_len, e.max_new_tokens,
                         e.final_len if e.HasField("final_len") else None,
                         e.salt if e.HasField("salt") else None, e.skip_prefix_cache)
               for e in m.entries]
    return Plan(entries=entries, free=list(m.free), step_tokens=m.step_tokens,
                step_seconds=m.step_seconds, forks=list(zip(m.fork_parents, m.fork_children)),
                ahead=m.ahead, fills=list(zip(fill_ids, m.fill_positions, m.fill_token_ids)),
                written=m.written, void=m.void, failed=list(m.failed),
                run_ids=ids, run_counts=counts, run_tokens=tokens)


def reserve_result_to_proto(r: ReserveResult) -> memory_pb2.ReserveResponse:
    g = r.grants
    ids, joined = join_ids(g.seq_ids)
    return memory_pb2.ReserveResponse(
        grant_seq_ids=ids, joined_grant_seq_ids=joined, grant_start_pos=g.start_pos,
        grant_num_tokens=g.num_tokens, grant_table_start=g.table_start, grant_num_new_blocks=g.num_new_blocks,
        grant_new_blocks=g.new_blocks, grant_num_cached=g.num_cached,
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
    grants = Grants(split_ids(m.grant_seq_ids, m.joined_grant_seq_ids), list(m.grant_start_pos),
                    list(m.grant_num_tokens), list(m.grant_table_start), list(m.grant_num_new_blocks),
                    list(m.grant_new_blocks), list(m.grant_num_cached))
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


def tables_from_proto(m: memory_pb2.TablesResponse, n: int) -> list[list[int]]:
    """`n` block tables; ValueError where the packed arrays do not agree."""
    if len(m.num_blocks) != n or sum(m.num_blocks) != len(m.blocks):
        raise ValueError(f"num_blocks ({len(m.num_blocks)} tables, {sum(m.num_blocks)} blocks) does not "
                         f"match the {n} sequences asked for and the {len(m.blocks)} blocks sent")
    blocks, out, at = list(m.blocks), [], 0
    for k in m.num_blocks:
        out.append(blocks[at:at + k])
        at += k
    return out


# -- Execute -----------------------------------------------------------------------------


def prompt_logprobs_to_proto(entries: list[PromptLogprob]) -> list[generation_pb2.TokenLogprob]:
    TLP, TL = generation_pb2.TokenLogprob, generation_pb2.TopLogprob
    return [TLP(token_id=e.token_id, logprob=e.logprob, rank=e.rank,
                top=[TL(token_id=t, logprob=lp) for t, lp in e.top]) for e in entries]


def prompt_logprobs_from_proto(entries) -> list[PromptLogprob]:
    return [PromptLogprob(e.token_id, e.logprob, e.rank, [(t.token_id, t.logprob) for t in e.top])
            for e in entries]


def outputs_to_proto(outputs: list[SampleOutput], incarnation: str = "") -> executor_pb2.ExecuteResponse:
    """Tokens alone (packed) when every output is a sampled token without logprobs."""
    tokens = [o.token_id for o in outputs if o.logprob is None and o.sampled and not o.top_logprobs
              and not o.prompt_logprobs and not o.error]
    if len(tokens) == len(outputs):
        return executor_pb2.ExecuteResponse(tokens=tokens, incarnation=incarnation)
    SO, TL = executor_pb2.SampleOutput, generation_pb2.TopLogprob
    return executor_pb2.ExecuteResponse(outputs=[
        SO(seq_id=o.seq_id, token_id=o.token_id if o.sampled else 0, logprob=o.logprob,
           top_logprobs=[TL(token_id=t, logprob=lp) for t, lp in o.top_logprobs] if o.top_logprobs else None,
           prompt_only=not o.sampled,
           prompt_logprobs=prompt_logprobs_to_proto(o.prompt_logprobs) if o.prompt_logprobs else None,
           error=o.error)
        for o in outputs
    ], incarnation=incarnation)


def outputs_from_proto(m: executor_pb2.ExecuteResponse, sampled_ids: list[str] | None = None
                       ) -> list[SampleOutput]:
    """`sampled_ids`: the ids of the batch's sequences with sample set, in order (for a
    response that carries tokens alone). A prompt-only output has token_id -1."""
    if m.tokens:
        if sampled_ids is None or len(sampled_ids) != len(m.tokens):
            raise ValueError(f"the executor sent {len(m.tokens)} tokens for "
                             f"{'?' if sampled_ids is None else len(sampled_ids)} sampled sequences")
        return list(map(SampleOutput, sampled_ids, m.tokens))
    return [
        SampleOutput(o.seq_id, -1 if o.prompt_only else o.token_id,
                     o.logprob if o.HasField("logprob") else None,
                     [(t.token_id, t.logprob) for t in o.top_logprobs], not o.prompt_only,
                     prompt_logprobs_from_proto(o.prompt_logprobs), o.error)
        for o in m.outputs
    ]


# -- Stats -------------------------------------------------------------------------------

_SNAPSHOT_FIELDS = ("num_blocks", "blocks_free", "blocks_cached", "blocks_referenced", "token_state",
                    "reserved", "internal_fragmentation", "external_fragmentation", "free")
_PREEMPTION_FIELDS = ("num_swapped_out", "num_swapped_in", "num_recomputed", "num_swap_fallbacks",
                      "host_blocks", "host_blocks_free", "swap_seconds_per_block",
                      "recompute_seconds_per_token", "preemption_mode",
                      "host_tier_blocks", "host_tier_blocks_used", "host_tier_lookups",
                      "host_tier_hits", "host_tier_offloaded", "host_tier_restored",
                      "host_tier_dropped", "host_tier_evicted", "host_tier_tokens_restored")


def stats_to_proto(stats: PoolStats, block_size: int, num_sequences: int | None = None,
                   num_sessions: int | None = None) -> memory_pb2.StatsResponse:
    """`num_sequences` / `num_sessions`: instead of the stats' own."""
    snap = stats.snapshot
    preemption = {k: v for k, v in stats.preemption.items() if k in _PREEMPTION_FIELDS}
    if num_sequences is None:
        num_sequences = stats.num_sequences
    if num_sessions is None:
        num_sessions = stats.num_sessions
    return memory_pb2.StatsResponse(
        block_size=block_size, **{k: int(snap[k]) for k in _SNAPSHOT_FIELDS},
        prefix_cache_queries=stats.prefix_cache_queries, prefix_cache_hits=stats.prefix_cache_hits,
        num_preemptions=stats.num_preemptions, num_sequences=num_sequences, num_sessions=num_sessions,
        **preemption,
    )


def stats_from_proto(m: memory_pb2.StatsResponse) -> PoolStats:
    snap = {k: getattr(m, k) for k in _SNAPSHOT_FIELDS}
    snap["total_slots"] = m.num_blocks * m.block_size
    snap["token_state_fraction"] = m.token_state / snap["total_slots"] if snap["total_slots"] else 0.0
    preemption = {k: getattr(m, k) for k in _PREEMPTION_FIELDS}
    lookups = preemption["host_tier_lookups"]
    preemption["host_tier_hit_rate"] = preemption["host_tier_hits"] / lookups if lookups else 0.0
    return PoolStats(snap, m.prefix_cache_queries, m.prefix_cache_hits, m.num_preemptions,
                     m.num_sequences, m.num_sessions, preemption)

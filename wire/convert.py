"""Protobuf <-> dataclass conversion for the messages of wire/protocol.py.

Runs on every step for every sequence, so it stays close to the metal: messages are built
with keyword constructors (repeated fields filled from lists in C) and read back with
`list(...)`; sequences that share a SamplingParams share one message going out, and
consecutive equal sampling messages share one SamplingParams coming back.

Proto3 conventions at this boundary: an empty string means None for optional text
(chat_template); SamplingParams fields follow the comments in generation.proto (0 means
the default for max_tokens and n; unset optional fields mean their defaults).
"""
from __future__ import annotations

from wire.protocol import (
    Grant,
    KVGeometry,
    ModelInfo,
    Plan,
    PlanEntry,
    PoolStats,
    Preemption,
    Rejection,
    ReserveResult,
    SampleOutput,
    SamplingParams,
    SeqStep,
    StepBatch,
)
from wire.v1 import executor_pb2, generation_pb2, memory_pb2

# -- sampling and geometry ---------------------------------------------------------------


def sampling_to_proto(sp: SamplingParams) -> generation_pb2.SamplingParams:
    return generation_pb2.SamplingParams(
        max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
        min_p=sp.min_p, seed=sp.seed, stop=sp.stop, stop_token_ids=sp.stop_token_ids,
        n=sp.n, ignore_eos=sp.ignore_eos, logprobs=sp.logprobs,
        repetition_penalty=sp.repetition_penalty, presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty, beam_width=sp.beam_width,
        length_penalty=sp.length_penalty, early_stopping=sp.early_stopping,
        guided_kind=sp.guided_kind, guided_spec=sp.guided_spec,
    )


def _f32(x: float) -> float:
    """Recover the decimal a client most likely sent from its float32 wire value (0.7, not 0.69999998)."""
    return float(f"{x:.7g}")


def sampling_from_proto(m: generation_pb2.SamplingParams) -> SamplingParams:
    has = m.HasField
    return SamplingParams(
        max_tokens=m.max_tokens if has("max_tokens") else 16,
        temperature=_f32(m.temperature) if has("temperature") else 1.0,
        top_p=_f32(m.top_p) if has("top_p") else 1.0,
        top_k=m.top_k,
        min_p=_f32(m.min_p),
        repetition_penalty=_f32(m.repetition_penalty) if has("repetition_penalty") else 1.0,
        presence_penalty=_f32(m.presence_penalty),
        frequency_penalty=_f32(m.frequency_penalty),
        seed=m.seed if has("seed") else None,
        stop=list(m.stop),
        stop_token_ids=list(m.stop_token_ids),
        ignore_eos=m.ignore_eos,
        logprobs=m.logprobs if has("logprobs") else None,
        n=m.n if has("n") else 1,
        beam_width=m.beam_width or 1,
        length_penalty=_f32(m.length_penalty) if has("length_penalty") else 1.0,
        early_stopping=m.early_stopping,
        guided_kind=m.guided_kind,
        guided_spec=m.guided_spec,
    )


def geometry_to_proto(g: KVGeometry) -> memory_pb2.KVGeometry:
    return memory_pb2.KVGeometry(num_layers=g.num_layers, num_kv_heads=g.num_kv_heads,
                                 head_size=g.head_size, block_size=g.block_size, dtype=g.dtype)


def geometry_from_proto(m: memory_pb2.KVGeometry) -> KVGeometry:
    return KVGeometry(m.num_layers, m.num_kv_heads, m.head_size, m.block_size, m.dtype or "float32")


def model_info_to_proto(info: ModelInfo, tokenizer_files: dict[str, bytes] | None = None
                        ) -> executor_pb2.ModelInfoResponse:
    """`tokenizer_files` (name -> content) travel instead of `tokenizer_dir`."""
    files = [executor_pb2.TokenizerFile(name=k, content=v) for k, v in (tokenizer_files or {}).items()]
    return executor_pb2.ModelInfoResponse(
        name=info.name, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
        eos_token_ids=info.eos_token_ids, chat_template=info.chat_template or "",
        kv=geometry_to_proto(info.kv), tokenizer_files=files,
    )


def model_info_from_proto(m: executor_pb2.ModelInfoResponse, tokenizer_dir: str = "") -> ModelInfo:
    return ModelInfo(
        name=m.name, max_model_len=m.max_model_len, vocab_size=m.vocab_size,
        eos_token_ids=list(m.eos_token_ids), chat_template=m.chat_template or None,
        tokenizer_dir=tokenizer_dir, kv=geometry_from_proto(m.kv),
    )


# -- Reserve -----------------------------------------------------------------------------


def plan_to_proto(plan: Plan, session_id: str = "") -> memory_pb2.ReserveRequest:
    PE = memory_pb2.PlanEntry
    entries = [PE(seq_id=e.seq_id, token_ids=e.token_ids, new=e.new, max_len=e.max_len,
                  max_new_tokens=e.max_new_tokens, final_len=e.final_len, salt=e.salt)
               for e in plan.entries]
    return memory_pb2.ReserveRequest(session_id=session_id, entries=entries, free=plan.free,
                                     step_tokens=plan.step_tokens, step_seconds=plan.step_seconds)


def plan_from_proto(m: memory_pb2.ReserveRequest) -> Plan:
    entries = [PlanEntry(seq_id=e.seq_id, token_ids=list(e.token_ids), new=e.new, max_len=e.max_len,
                         max_new_tokens=e.max_new_tokens,
                         final_len=e.final_len if e.HasField("final_len") else None,
                         salt=e.salt if e.HasField("salt") else None)
               for e in m.entries]
    return Plan(entries=entries, free=list(m.free), step_tokens=m.step_tokens,
                step_seconds=m.step_seconds)


def reserve_result_to_proto(r: ReserveResult) -> memory_pb2.ReserveResponse:
    G = memory_pb2.Grant
    return memory_pb2.ReserveResponse(
        grants=[G(seq_id=g.seq_id, start_pos=g.start_pos, num_tokens=g.num_tokens,
                  slot_mapping=g.slot_mapping, block_table=g.block_table,
                  num_cached_tokens=g.num_cached_tokens) for g in r.grants],
        preempted=[memory_pb2.Preemption(seq_id=p.seq_id, mode=p.mode) for p in r.preempted],
        rejected=[memory_pb2.Rejection(seq_id=x.seq_id, reason=x.reason) for x in r.rejected],
        waiting=r.waiting, resumed=r.resumed, pool_epoch=r.pool_epoch,
    )


def reserve_result_from_proto(m: memory_pb2.ReserveResponse) -> ReserveResult:
    return ReserveResult(
        grants=[Grant(g.seq_id, g.start_pos, g.num_tokens, list(g.slot_mapping),
                      list(g.block_table), g.num_cached_tokens) for g in m.grants],
        preempted=[Preemption(p.seq_id, p.mode) for p in m.preempted],
        rejected=[Rejection(x.seq_id, x.reason) for x in m.rejected],
        waiting=list(m.waiting),
        resumed=list(m.resumed),
        pool_epoch=m.pool_epoch,
    )


# -- Execute -----------------------------------------------------------------------------


def batch_to_proto(batch: StepBatch) -> executor_pb2.ExecuteRequest:
    S = executor_pb2.SeqStep
    sampling: dict[int, generation_pb2.SamplingParams] = {}
    seqs = []
    for s in batch.seqs:
        sp = sampling.get(id(s.sampling))
        if sp is None:
            sp = sampling[id(s.sampling)] = sampling_to_proto(s.sampling)
        seqs.append(S(seq_id=s.seq_id, token_ids=s.token_ids, start_pos=s.start_pos,
                      slot_mapping=s.slot_mapping, block_table=s.block_table, sample=s.sample,
                      sampling=sp, seed=s.seed, prompt_token_ids=s.prompt_token_ids,
                      output_token_ids=s.output_token_ids))
    return executor_pb2.ExecuteRequest(seqs=seqs, pool_epoch=batch.pool_epoch)


def batch_from_proto(m: executor_pb2.ExecuteRequest) -> StepBatch:
    prev, sp = None, None
    seqs = []
    for s in m.seqs:
        if prev is None or s.sampling != prev:
            prev = s.sampling
            sp = sampling_from_proto(prev)
        seqs.append(SeqStep(s.seq_id, list(s.token_ids), s.start_pos, list(s.slot_mapping),
                            list(s.block_table), s.sample, sp, s.seed,
                            list(s.prompt_token_ids), list(s.output_token_ids)))
    return StepBatch(seqs, m.pool_epoch)


def outputs_to_proto(outputs: list[SampleOutput]) -> executor_pb2.ExecuteResponse:
    SO, TL = executor_pb2.SampleOutput, generation_pb2.TopLogprob
    return executor_pb2.ExecuteResponse(outputs=[
        SO(seq_id=o.seq_id, token_id=o.token_id, logprob=o.logprob,
           top_logprobs=[TL(token_id=t, logprob=lp) for t, lp in o.top_logprobs] if o.top_logprobs else None)
        for o in outputs
    ])


def outputs_from_proto(m: executor_pb2.ExecuteResponse) -> list[SampleOutput]:
    return [
        SampleOutput(o.seq_id, o.token_id, o.logprob if o.HasField("logprob") else None,
                     [(t.token_id, t.logprob) for t in o.top_logprobs])
        for o in m.outputs
    ]


# -- Stats -------------------------------------------------------------------------------

_SNAPSHOT_FIELDS = ("num_blocks", "blocks_free", "blocks_cached", "blocks_referenced", "token_state",
                    "reserved", "internal_fragmentation", "external_fragmentation", "free")
_PREEMPTION_FIELDS = ("num_swapped_out", "num_swapped_in", "num_recomputed", "num_swap_fallbacks",
                      "host_blocks", "host_blocks_free", "swap_seconds_per_block",
                      "recompute_seconds_per_token", "preemption_mode")


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
    return PoolStats(snap, m.prefix_cache_queries, m.prefix_cache_hits, m.num_preemptions,
                     m.num_sequences, m.num_sessions, {k: getattr(m, k) for k in _PREEMPTION_FIELDS})

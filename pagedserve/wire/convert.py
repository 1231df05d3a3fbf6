"""Protobuf <-> dataclass conversion for the messages of pagedserve/wire/protocol.py but a
step's (those are in pagedserve/wire/step_convert.py): sampling parameters, the KV geometry,
model info, block tables, prompt logprobs and pool stats. SamplingParams go field by field,
by name, so a field missing from the proto fails at import.

Proto3 conventions at this boundary: an empty string means None for optional text
(chat_template); SamplingParams fields follow the comments in generation.proto (0 means
the default for max_tokens and n; unset optional fields mean their defaults).
"""
from __future__ import annotations

import dataclasses

from pagedserve.wire.protocol import KVGeometry, ModelInfo, PoolStats, PromptLogprob, SamplingParams
from pagedserve.wire.sampling_fields import DEFAULTS
from pagedserve.wire.v1 import executor_pb2, generation_pb2, memory_pb2

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

"""A Reserve's new sequences on the wire (pagedserve.wire.step_convert sends the rest of the
plan): the ReserveRequest's new_* columns, the ids joined by newlines, where none has a
final_len or a salt; a PlanEntry message each otherwise. Only a step that admits runs this.
"""
from __future__ import annotations

from itertools import chain

from pagedserve.wire.id_columns import join_ids
from pagedserve.wire.reserve_messages import PlanEntry
from pagedserve.wire.v1 import memory_pb2

_NEW_COLUMNS = ("new_num_tokens", "new_token_ids", "new_max_len", "new_max_new_tokens", "new_skip_prefix_cache")
NEW_FIELDS = ("entries", "joined_new_seq_ids", *_NEW_COLUMNS)  # none set: the plan admits none


def new_to_proto(entries: list[PlanEntry]) -> dict:
    """A plan's new sequences as ReserveRequest's fields: the new_* columns where none has a
    final_len or a salt and their ids join (`join_ids`); else `entries`, a PlanEntry each."""
    repeated, joined = join_ids([e.seq_id for e in entries])
    if repeated or any([e.final_len is not None or e.salt is not None for e in entries]):
        return dict(entries=[
            memory_pb2.PlanEntry(seq_id=e.seq_id, token_ids=e.token_ids, max_len=e.max_len,
                                 max_new_tokens=e.max_new_tokens, final_len=e.final_len, salt=e.salt,
                                 skip_prefix_cache=e.skip_prefix_cache) for e in entries])
    return dict(joined_new_seq_ids=joined, new_num_tokens=[len(e.token_ids) for e in entries],
                new_token_ids=list(chain.from_iterable([e.token_ids for e in entries])),
                new_max_len=[e.max_len for e in entries], new_max_new_tokens=[e.max_new_tokens for e in entries],
                new_skip_prefix_cache=[e.skip_prefix_cache for e in entries])


def new_from_proto(m: memory_pb2.ReserveRequest) -> list[PlanEntry]:
    """The new sequences, from their columns or their messages (ValueError where the
    columns do not agree, or come with messages)."""
    if not m.joined_new_seq_ids:
        if any(len(getattr(m, name)) for name in _NEW_COLUMNS):
            raise ValueError("new_* columns without joined_new_seq_ids: send their ids with them")
        return [PlanEntry(e.seq_id, list(e.token_ids), True, e.max_len, e.max_new_tokens,
                          e.final_len if e.HasField("final_len") else None,
                          e.salt if e.HasField("salt") else None, e.skip_prefix_cache)
                for e in m.entries]
    if m.entries:
        raise ValueError("entries and joined_new_seq_ids: send the new sequences one way, not both")
    ids, counts, tokens = m.joined_new_seq_ids.split("\n"), list(m.new_num_tokens), list(m.new_token_ids)
    if (not len(ids) == len(counts) == len(m.new_max_len) == len(m.new_max_new_tokens) == len(m.new_skip_prefix_cache)
            or sum(counts) != len(tokens)):
        raise ValueError("joined_new_seq_ids and the new_* columns do not agree")
    entries, at = [], 0
    for seq_id, k, max_len, max_new, skip in zip(ids, counts, m.new_max_len, m.new_max_new_tokens,
                                                 m.new_skip_prefix_cache):
        entries.append(PlanEntry(seq_id, tokens[at:at + k], True, max_len, max_new, None, None, skip))
        at += k
    return entries

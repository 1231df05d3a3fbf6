"""Fair sharing of one pool between gateway sessions.

Several gateways (sessions) may drive one pool. Preemption already stays inside the asking
session: a Reserve's plan names only that session's sequences, so memsvc can only preempt
those. What remains is admission: a session that holds at least its share of the pool
(num_blocks / sessions holding sequences, itself included) admits no new sequence until
it holds less, so a busy gateway cannot take the blocks another one needs to start. Its
new sequences stay waiting (ReserveResult.waiting); running ones still grow, preempting
within their own session when blocks run out.
"""
from __future__ import annotations


def over_share(manager, session_id: str) -> bool:
    """Whether `session_id` holds its fair share of the pool's blocks or more."""
    sessions = manager.sessions.by_id
    mine = sessions.get(session_id)
    if mine is None or not mine.seqs:
        return False
    active = sum(1 for s in sessions.values() if s.seqs)
    if active <= 1:
        return False
    allocator = manager.allocator
    held = sum(len(allocator.block_table(s)) for s in mine.seqs if allocator.has_sequence(s))
    return held >= manager.pool.shape[0] / active

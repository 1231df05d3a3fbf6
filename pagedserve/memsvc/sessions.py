"""Sessions: which gateway owns which sequences, and when a gateway has gone away.

A session is any Reserve/Free/Fork that carries its id; each one renews its lease. A
session's sequence ids live in their own namespace (two gateways may both use "0/0"):
memsvc keys them internally as `<session>|<seq_id>` (`internal`), and maps a Reserve's
answer back through the table `enter` returns, never by reading an internal key. When a
session is not heard from for a lease, `lapsed` names it and the memory manager frees what
it owned.

Not thread-safe: the caller serializes access (memsvc's server holds one lock).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedserve.wire.protocol import Plan, ReserveResult


@dataclass
class Session:
    session_id: str
    last_seen: float
    seqs: set[str] = field(default_factory=set)  # internal ids


class Sessions:
    def __init__(self, lease_s: float = 10.0):
        if lease_s <= 0:
            raise ValueError(f"session lease must be positive, got {lease_s}")
        self.lease_s = lease_s
        self.by_id: dict[str, Session] = {}

    def touch(self, session_id: str, now: float | None = None) -> Session:
        now = time.monotonic() if now is None else now
        session = self.by_id.get(session_id)
        if session is None:
            session = self.by_id[session_id] = Session(session_id, now)
        session.last_seen = now
        return session

    @staticmethod
    def internal(session_id: str, seq_id: str) -> str:
        """The key memsvc holds the session's sequence under."""
        return f"{session_id}|{seq_id}"

    def internal_ids(self, session_id: str, seq_ids) -> list[str]:
        prefix = self.internal(session_id, "")
        return [prefix + s for s in seq_ids]

    def enter(self, session_id: str, plan: Plan) -> dict[str, str]:
        """Rewrite the plan's sequence ids in place into the session's namespace, but for
        `fills` (the caller maps them with `internal_ids`); return the way back for `leave`:
        internal key -> the session's sequence id."""
        internal = self.internal
        back = {}
        for entry in plan.entries:
            key = internal(session_id, entry.seq_id)
            back[key] = entry.seq_id
            entry.seq_id = key
        keys = self.internal_ids(session_id, plan.run_ids)
        back.update(zip(keys, plan.run_ids))
        plan.run_ids = keys
        plan.free = [internal(session_id, s) for s in plan.free]
        plan.forks = [(internal(session_id, p), internal(session_id, c)) for p, c in plan.forks]
        return back

    def leave(self, session_id: str, plan: Plan, lost: list[str], result: ReserveResult, alive,
              back: dict[str, str]) -> None:
        """Record what the session owns after a reserve (`lost`: running sequences memsvc no
        longer held) and map the result's ids back through `back` (what `enter` returned
        for this plan).

        `alive(internal_id)` says whether memsvc still holds the sequence.
        """
        seqs = self.touch(session_id).seqs
        seqs.difference_update(plan.free)
        seqs.difference_update(lost)
        seqs.difference_update(p.seq_id for p in result.preempted if not alive(p.seq_id))
        for entry in plan.entries:  # (a running sequence is the session's already)
            if alive(entry.seq_id):
                seqs.add(entry.seq_id)
            else:
                seqs.discard(entry.seq_id)
        grants = result.grants
        grants.seq_ids = list(map(back.__getitem__, grants.seq_ids))
        for item in (*result.preempted, *result.rejected):
            item.seq_id = back[item.seq_id]
        result.waiting = [back[s] for s in result.waiting]
        result.resumed = [back[s] for s in result.resumed]

    def own(self, session_id: str, internal_id: str) -> None:
        self.touch(session_id).seqs.add(internal_id)

    def disown(self, session_id: str, internal_id: str) -> None:
        self.touch(session_id).seqs.discard(internal_id)

    def lapsed(self, now: float | None = None) -> list[Session]:
        """Remove and return the sessions not heard from for longer than the lease."""
        now = time.monotonic() if now is None else now
        gone = [s for s in self.by_id.values() if now - s.last_seen > self.lease_s]
        for s in gone:
            del self.by_id[s.session_id]
        return gone

    def num_sequences(self) -> int:
        return sum(len(s.seqs) for s in self.by_id.values())

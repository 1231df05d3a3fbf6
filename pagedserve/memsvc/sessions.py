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

from pagedserve.wire.reserve_messages import Fills, Plan, ReserveResult


@dataclass
class Session:
    session_id: str
    last_seen: float
    seqs: set[str] = field(default_factory=set)  # internal ids
    # the running ids of its last plan and their internal keys: most plans name the same
    run: tuple[list[str], list[str]] = ((), ())


@dataclass
class Back:
    """The way back from the internal keys of one plan to the session's ids: the running
    sequences' `keys` are `ids` in order; `entries` maps the new sequences'."""

    entries: dict[str, str]
    keys: list[str]
    ids: list[str]
    _all: dict[str, str] | None = None

    def all(self) -> dict[str, str]:
        """internal key -> the session's id, for every sequence of the plan."""
        if self._all is None:
            self._all = {**self.entries, **dict(zip(self.keys, self.ids))}
        return self._all


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

    def enter(self, session_id: str, plan: Plan) -> Back:
        """Rewrite the plan's sequence ids in place into the session's namespace, but for
        `fills` (the caller maps them: `fill_ids`); return the way back for `leave`."""
        internal = self.internal
        back = Back({}, self._run_keys(session_id, plan.run_ids), plan.run_ids)
        for entry in plan.entries:
            key = internal(session_id, entry.seq_id)
            back.entries[key] = entry.seq_id
            entry.seq_id = key
        plan.run_ids = back.keys
        plan.free = [internal(session_id, s) for s in plan.free]
        plan.forks = [(internal(session_id, p), internal(session_id, c)) for p, c in plan.forks]
        return back

    def _run_keys(self, session_id: str, run_ids: list[str]) -> list[str]:
        """`internal_ids` of a plan's running ids: the last plan's where it named the same."""
        session = self.by_id.get(session_id)
        if session is None:
            return self.internal_ids(session_id, run_ids)
        ids, keys = session.run
        if ids != run_ids:
            keys = self.internal_ids(session_id, run_ids)
            session.run = (list(run_ids), keys)
        return list(keys)  # (the plan's own list: the caller may change it)

    def fill_ids(self, session_id: str, fills: Fills, back: Back) -> list[str]:
        """The internal keys of the fills' sequences: those `enter` made for the running
        sequences where they are the same ids in the same order, as in a steady step."""
        seq_ids = fills.seq_ids
        return back.keys if seq_ids == back.ids else self.internal_ids(session_id, seq_ids)

    def leave(self, session_id: str, plan: Plan, lost: list[str], result: ReserveResult, alive,
              back: Back) -> None:
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
        granted, k = grants.seq_ids, len(back.keys)
        if granted[:k] == back.keys:  # every running sequence granted, in order
            grants.seq_ids = back.ids + [back.entries[s] for s in granted[k:]]
        else:
            grants.seq_ids = list(map(back.all().__getitem__, granted))
        if result.preempted or result.rejected or result.waiting or result.resumed:
            way = back.all()
            for item in (*result.preempted, *result.rejected):
                item.seq_id = way[item.seq_id]
            result.waiting = [way[s] for s in result.waiting]
            result.resumed = [way[s] for s in result.resumed]

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

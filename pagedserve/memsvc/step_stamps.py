"""Each Reserve's stamp, per gateway session, until the session says whether its step ran.

Every Reserve gets a stamp, increasing, from a random start (so that a stamp a gateway
heard from an earlier memsvc process names nothing here). A later plan of the same session
settles the open stamps: `written` W confirms every open stamp up to W (a session's steps
run in the order reserved, so the step reserved at W running means every earlier one ran
or failed, and a failure is told first); `void` drops every other open stamp (a step
failed and the steps in flight were given up). A W above every stamp this process gave
the session is not ours: it confirms nothing. See pagedserve.memsvc.unwritten_keys.
"""
from __future__ import annotations

import random


class StepStamps:
    def __init__(self, start: int | None = None) -> None:
        self.next = random.getrandbits(62) + 1 if start is None else start
        self.open: dict[str, list[int]] = {}  # session -> stamps not settled, increasing
        self.last: dict[str, int] = {}  # session -> the last stamp it was given

    def begin(self, session: str) -> int:
        stamp = self.next
        self.next += 1
        self.open.setdefault(session, []).append(stamp)
        self.last[session] = stamp
        return stamp

    def settle(self, session: str, written: int, void: bool) -> tuple[list[int], list[int]]:
        """(confirmed, dropped) open stamps of the session."""
        stamps = self.open.get(session)
        if not stamps:
            return [], []
        if written > self.last.get(session, 0):
            written = 0
        k = 0
        while k < len(stamps) and stamps[k] <= written:
            k += 1
        confirmed, rest = stamps[:k], stamps[k:]
        dropped = rest if void else []
        self.open[session] = [] if void else rest
        return confirmed, dropped

    def begin_act(self, allocator, session: str, written: int, void: bool, failed: list[str]) -> int:
        """Settle what a session's plan says of its earlier steps on `allocator` (`failed`:
        the allocator's ids), then stamp this Reserve's acts; returns the stamp."""
        if failed:
            allocator.drop_unwritten(seq_ids=failed)
        confirmed, dropped = self.settle(session, written, void)
        allocator.confirm_written(confirmed)
        allocator.drop_unwritten(dropped)
        stamp = self.begin(session)
        allocator.begin_act(stamp)
        return stamp

    def end(self, session: str) -> list[int]:
        """The session is gone: its open stamps, never to be confirmed."""
        self.last.pop(session, None)
        return self.open.pop(session, [])

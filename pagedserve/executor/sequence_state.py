"""What the executor keeps per running sequence, so that a step carries only what changed.

Across processes the gateway sends a sequence's constant state once (`SeqState`: sampling
parameters, seed, prompt length and, when penalties need it, the tokens before its first
step; the whole prompt when prompt logprobs need it) and then, per step, only the tokens to
compute and the change to its block table (`table_start`, `new_blocks`); finished and
preempted sequences come in `forget`. Each gateway's sequences live in a running set
(pagedserve.step.running_set), which turns such an ExecuteRequest into the StepBatch the
model runner takes.

State is scoped by the gateway's `session_id` (two gateways may both run "0/0") and
belongs to this process: `incarnation` names it, a request that names another (the
executor restarted) or mentions a sequence this process does not hold raises StateLost,
which the server answers FAILED_PRECONDITION and the gateway answers by resending every
sequence's full state. Sessions not heard from for `idle_s` are dropped.
"""
from __future__ import annotations

import threading
import time
import uuid

from pagedserve.step.running_set import Applied, RunningSet, StateLost
from pagedserve.wire import convert, id_columns
from pagedserve.wire.step_delta import STATE_LOST
from pagedserve.wire.step_feed import StepOrder

SESSION_IDLE_S = 600.0


class _Session:
    """One gateway's running set and the order of its steps."""

    __slots__ = ("running", "order", "changing", "joined_ids")

    def __init__(self, block_size: int):
        self.running = RunningSet(block_size)
        self.order = StepOrder(joined=True)
        self.changing = threading.Lock()  # a retry goes out of order: never two expands at once
        self.joined_ids: tuple[str, list[str]] = ("", [])  # the last joined id column, split

    def ids(self, m) -> list[str]:
        """The step's id column; most steps send the last one's again: split once (read only)."""
        joined = m.joined_seq_ids
        if joined and joined == self.joined_ids[0]:
            return self.joined_ids[1]
        ids = id_columns.split_ids(m.seq_ids, joined)
        if joined:
            self.joined_ids = (joined, ids)
        return ids


class Expanded:
    """An ExecuteRequest as the StepBatch to run, with what `fill` and `record` need."""

    __slots__ = ("applied", "session")

    def __init__(self, applied: Applied, session: _Session):
        self.applied, self.session = applied, session

    @property
    def batch(self):
        return self.applied.batch


class SequenceStates:
    def __init__(self, block_size: int, incarnation: str | None = None, idle_s: float = SESSION_IDLE_S,
                 clock=time.monotonic):
        self.block_size = block_size
        self.incarnation = incarnation or uuid.uuid4().hex
        self.idle_s = idle_s
        self.clock = clock
        self.sessions: dict[str, _Session] = {}
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()
        self._next_sweep = clock() + idle_s

    def num_sequences(self) -> int:
        return sum(len(s.running) for s in self.sessions.values())

    def order(self, session_id: str) -> StepOrder:
        """The order of the session's steps: wait for a step's turn before `expand`; it
        passes once `fill` ran (or failed)."""
        return self._session(session_id).order

    def _session(self, session_id: str) -> _Session:
        now = self.clock()
        with self._lock:
            if now >= self._next_sweep:
                for sid in [k for k, t in self._seen.items() if now - t > self.idle_s]:
                    self._seen.pop(sid, None)
                    self.sessions.pop(sid, None)
                self._next_sweep = now + self.idle_s
            self._seen[session_id] = now
            session = self.sessions.get(session_id)
            if session is None:
                session = self.sessions[session_id] = _Session(self.block_size)
            return session

    def expand(self, m) -> Expanded:
        """The StepBatch of an ExecuteRequest; applies its changes to the running set. A fed
        token (pagedserve.wire.step_feed) is PENDING until `fill`. StateLost: see the module
        docstring; ValueError: a change that does not fit."""
        if m.incarnation and m.incarnation != self.incarnation:
            raise StateLost(f"{STATE_LOST}: this executor process ({self.incarnation[:8]}) is not the "
                            f"one the state was sent to ({m.incarnation[:8]}): send every sequence's state")
        session = self._session(m.session_id)
        with session.changing:
            return Expanded(self._apply(session, m), session)

    @staticmethod
    def _apply(session: _Session, m) -> Applied:
        running = session.running
        forget = list(m.forget)
        if forget:
            running.forget(forget)
        prev, sp = None, None
        for state in m.states:
            if prev is None or state.sampling != prev:
                prev = state.sampling
                sp = convert.sampling_from_proto(prev)
            history = state.history  # admit copies the prompt where it keeps it
            running.admit(state.seq_id, sp, state.seed, state.prompt_len, list(history) if history else [],
                          state.prompt)
        if len(m.copy_src) != len(m.copy_dst):
            raise ValueError(f"copy_src has {len(m.copy_src)} blocks, copy_dst {len(m.copy_dst)}")
        fields = {"pool_epoch": m.pool_epoch, "forget": forget, "copies": list(zip(m.copy_src, m.copy_dst))}
        if m.decode:
            if m.num_tokens or m.token_ids or m.sample or m.fed:
                raise ValueError("a decode step leaves num_tokens, token_ids, sample and fed empty")
            return running.apply_decode(session.ids(m), m.start_pos, m.table_start, m.num_new_blocks,
                                        m.new_blocks, **fields)
        return running.apply(session.ids(m), m.start_pos, m.num_tokens, m.token_ids, m.fed, m.sample,
                             m.table_start, m.num_new_blocks, m.new_blocks, **fields)

    @staticmethod
    def fill(step: Expanded) -> None:
        """Just before the step runs: its fed tokens from the session's last samples
        (pagedserve.wire.step_feed.FedTokenUnknown if one is not held)."""
        step.session.running.fill(step.applied)

    @staticmethod
    def record(step: Expanded, outputs) -> None:
        step.session.running.record(step.applied, outputs)

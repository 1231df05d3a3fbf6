"""What the executor keeps per running sequence, so that a step carries only what changed.

Across processes the gateway sends a sequence's constant state once (`SeqState`: sampling
parameters, seed, prompt length and, when penalties need it, the tokens before its first
step; the whole prompt when prompt logprobs need it) and then, per step, only the tokens to compute and the change to its block table
(`table_start`, `new_blocks`); finished and preempted sequences come in `forget`.
`SequenceStates.expand` turns such an ExecuteRequest back into the full StepBatch the model
runner takes (slot mapping from the block table, token history for penalties), so the
model-runner side never sees the difference.

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

from pagedserve.wire import convert
from pagedserve.wire.held_seqs import HeldSeq, step_of
from pagedserve.wire.pending_token import PENDING
from pagedserve.wire.protocol import StepBatch
from pagedserve.wire.step_delta import STATE_LOST
from pagedserve.wire.step_feed import LastSampled, StepOrder

SESSION_IDLE_S = 600.0


class StateLost(LookupError):
    """The request relies on state this executor process does not hold."""


class _Session:
    """One gateway's sequences, the last token each sampled, and the order of its steps."""

    __slots__ = ("seqs", "feed", "order")

    def __init__(self):
        self.seqs: dict[str, HeldSeq] = {}
        self.feed = LastSampled()
        self.order = StepOrder(joined=True)


class Expanded:
    """An ExecuteRequest as the StepBatch to run, with what `fill` and `record` need."""

    __slots__ = ("batch", "session", "histories")

    def __init__(self, batch: StepBatch, session: _Session, histories: list):
        self.batch, self.session, self.histories = batch, session, histories


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
        return sum(len(s.seqs) for s in self.sessions.values())

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
                session = self.sessions[session_id] = _Session()
            return session

    def expand(self, m) -> Expanded:
        """The full StepBatch of an ExecuteRequest; applies its changes to the state. A fed
        token (pagedserve.wire.step_feed) is PENDING until `fill`. StateLost: see the module docstring;
        ValueError: a change that does not fit."""
        if m.incarnation and m.incarnation != self.incarnation:
            raise StateLost(f"{STATE_LOST}: this executor process ({self.incarnation[:8]}) is not the "
                            f"one the state was sent to ({m.incarnation[:8]}): send every sequence's state")
        holder = self._session(m.session_id)
        session = holder.seqs
        for seq_id in m.forget:
            session.pop(seq_id, None)
        prev, sp = None, None
        for state in m.states:
            if prev is None or state.sampling != prev:
                prev = state.sampling
                sp = convert.sampling_from_proto(prev)
            history = list(state.history) if sp.uses_penalties else None
            prompt = list(state.prompt) if sp.prompt_logprobs is not None else None
            session[state.seq_id] = HeldSeq(sp, state.seed, state.prompt_len, history, prompt)
        bs = self.block_size
        token_ids, new_blocks = list(m.token_ids), list(m.new_blocks)  # list slices are cheaper
        seqs = []
        at = bat = 0
        fed = m.fed or [False] * len(m.seq_ids)
        histories = []
        for seq_id, start, n, sample, table_start, nb, own in zip(
                m.seq_ids, m.start_pos, m.num_tokens, m.sample, m.table_start, m.num_new_blocks, fed):
            held = session.get(seq_id)
            if held is None:
                raise StateLost(f"{STATE_LOST}: sequence {seq_id!r} is unknown to this executor: "
                                "send its state")
            if own:
                if n != 1:
                    raise ValueError(f"sequence {seq_id}: a fed step computes one token, not {n}")
                tokens = [PENDING]
            else:
                tokens = token_ids[at:at + n]
                at += n
            if nb:
                blocks = new_blocks[bat:bat + nb]
                bat += nb
            else:
                blocks = ()
            if own and held.tokens is not None:
                histories.append((len(seqs), held.tokens))
            seqs.append(step_of(held, seq_id, tokens, start, sample, table_start, blocks, bs))
        if at != len(token_ids) or bat != len(new_blocks):
            raise ValueError("token_ids or new_blocks do not add up to the per-sequence counts")
        if len(m.copy_src) != len(m.copy_dst):
            raise ValueError(f"copy_src has {len(m.copy_src)} blocks, copy_dst {len(m.copy_dst)}")
        return Expanded(StepBatch(seqs, m.pool_epoch, list(m.forget), copies=list(zip(m.copy_src, m.copy_dst))),
                        holder, histories)

    @staticmethod
    def fill(step: Expanded) -> None:
        """Just before the step runs: its fed tokens from the session's last samples
        (pagedserve.wire.step_feed.FedTokenUnknown if one is not held), into the token histories too."""
        step.session.feed.fill(step.batch)
        seqs = step.batch.seqs
        for i, history in step.histories:
            s = seqs[i]
            history[s.start_pos] = s.token_ids[0]

    @staticmethod
    def record(step: Expanded, outputs) -> None:
        step.session.feed.record(step.batch, outputs)

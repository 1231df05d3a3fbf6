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

from wire import convert
from wire.protocol import SeqStep, StepBatch
from wire.step_delta import STATE_LOST
SESSION_IDLE_S = 600.0


class StateLost(LookupError):
    """The request relies on state this executor process does not hold."""


class _Seq:
    __slots__ = ("sampling", "seed", "prompt_len", "table", "tokens", "prompt")

    def __init__(self, sampling, seed: int, prompt_len: int, history: list[int] | None,
                 prompt: list[int] | None = None):
        self.sampling = sampling
        self.seed = seed
        self.prompt_len = prompt_len
        self.table: list[int] = []
        self.tokens = history  # None unless penalties need the token history
        self.prompt = prompt  # None unless prompt logprobs need the whole prompt


class SequenceStates:
    def __init__(self, block_size: int, incarnation: str | None = None, idle_s: float = SESSION_IDLE_S,
                 clock=time.monotonic):
        self.block_size = block_size
        self.incarnation = incarnation or uuid.uuid4().hex
        self.idle_s = idle_s
        self.clock = clock
        self.sessions: dict[str, dict[str, _Seq]] = {}
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()
        self._next_sweep = clock() + idle_s

    def num_sequences(self) -> int:
        return sum(len(s) for s in self.sessions.values())

    def _session(self, session_id: str) -> dict[str, _Seq]:
        now = self.clock()
        with self._lock:
            if now >= self._next_sweep:
                for sid in [s for s, t in self._seen.items() if now - t > self.idle_s]:
                    self._seen.pop(sid, None)
                    self.sessions.pop(sid, None)
                self._next_sweep = now + self.idle_s
            self._seen[session_id] = now
            return self.sessions.setdefault(session_id, {})

    def expand(self, m) -> StepBatch:
        """The full StepBatch of an ExecuteRequest; applies its changes to the state.
        StateLost: see the module docstring; ValueError: a change that does not fit."""
        if m.incarnation and m.incarnation != self.incarnation:
            raise StateLost(f"{STATE_LOST}: this executor process ({self.incarnation[:8]}) is not the "
                            f"one the state was sent to ({m.incarnation[:8]}): send every sequence's state")
        session = self._session(m.session_id)
        for seq_id in m.forget:
            session.pop(seq_id, None)
        prev, sp = None, None
        for state in m.states:
            if prev is None or state.sampling != prev:
                prev = state.sampling
                sp = convert.sampling_from_proto(prev)
            history = list(state.history) if sp.uses_penalties else None
            prompt = list(state.prompt) if sp.prompt_logprobs is not None else None
            session[state.seq_id] = _Seq(sp, state.seed, state.prompt_len, history, prompt)
        bs = self.block_size
        token_ids, new_blocks = list(m.token_ids), list(m.new_blocks)  # list slices are cheaper
        seqs = []
        at = bat = 0
        for seq_id, start, n, sample, table_start, nb in zip(
                m.seq_ids, m.start_pos, m.num_tokens, m.sample, m.table_start, m.num_new_blocks):
            st = session.get(seq_id)
            if st is None:
                raise StateLost(f"{STATE_LOST}: sequence {seq_id!r} is unknown to this executor: "
                                "send its state")
            tokens = token_ids[at:at + n]
            at += n
            table = st.table
            if table_start > len(table):
                raise ValueError(f"sequence {seq_id}: block table change at {table_start}, "
                                 f"but it holds {len(table)} blocks")
            if nb or table_start < len(table):
                del table[table_start:]
                table.extend(new_blocks[bat:bat + nb])
                bat += nb
            try:
                if n == 1:  # a decode step
                    slots = [table[start // bs] * bs + start % bs]
                else:
                    slots = [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            except IndexError:
                raise ValueError(f"sequence {seq_id}: {len(table)} blocks in its table, "
                                 f"{-(-(start + n) // bs)} needed for {start + n} tokens") from None
            history = st.tokens
            if history is not None:
                del history[start:]
                history.extend(tokens)
                pl = st.prompt_len
                prompt, output = history[:pl], history[pl:]
            else:
                prompt, output = [], []
            if st.prompt is not None:
                prompt = st.prompt
            seqs.append(SeqStep(seq_id, tokens, start, slots, table, sample, st.sampling, st.seed,
                                prompt, output))
        if at != len(token_ids) or bat != len(new_blocks):
            raise ValueError("token_ids or new_blocks do not add up to the per-sequence counts")
        return StepBatch(seqs, m.pool_epoch, list(m.forget))

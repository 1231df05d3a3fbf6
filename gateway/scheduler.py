"""Continuous batching at the iteration level: which sequences compute which tokens this step.

The scheduler proposes (a plan in priority order), memsvc decides what fits (grants,
preemptions), the executor computes, and the scheduler applies the sampled tokens.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from gateway.sequence import Sequence, SeqStatus
from pagedserve.protocol import Plan, PlanEntry, ReserveResult, SampleOutput, SeqStep, StepBatch


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )


@dataclass
class SeqUpdate:
    """What one step did to a sequence: a new token, and whether it finished."""

    seq: Sequence
    token_id: int | None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finished: bool = False


class Scheduler:
    def __init__(self, config: SchedulerConfig, eos_token_ids: list[int]):
        self.config = config
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self.running: list[Sequence] = []  # sorted by sort_key
        self.seqs: dict[str, Sequence] = {}
        self.to_free: list[str] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self.seqs:
            raise ValueError(f"sequence {seq.seq_id} already exists")
        self.seqs[seq.seq_id] = seq
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def abort(self, seq_id: str, reason: str = "abort") -> Sequence | None:
        """Stop a sequence; its blocks are freed by the next reserve."""
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return None
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
            self.to_free.append(seq_id)
        if seq.status is not SeqStatus.FINISHED:
            seq.finish(reason)
        return seq

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.to_free)

    def plan(self) -> Plan:
        budget = self.config.max_num_batched_tokens
        entries: list[PlanEntry] = []
        for seq in self.running:
            pending = seq.num_tokens - seq.num_computed
            n = min(pending, budget)
            if n < 1 or len(entries) >= self.config.max_num_seqs:
                continue
            start = seq.num_computed
            entries.append(PlanEntry(seq.seq_id, seq.all_token_ids[start : start + n], False,
                                     seq.max_len, final_len=seq.final_len, salt=seq.salt))
            budget -= n
        for seq in self.waiting:
            if budget < 1 or len(entries) >= self.config.max_num_seqs:
                break
            if not self.config.enable_chunked_prefill and seq.num_tokens > budget:
                break
            entries.append(PlanEntry(seq.seq_id, seq.all_token_ids, True, seq.max_len,
                                     max_new_tokens=budget, final_len=seq.final_len, salt=seq.salt))
            budget -= min(seq.num_tokens, budget)
        plan = Plan(entries=entries, free=self.to_free)
        self.to_free = []
        return plan

    def on_reserved(self, result: ReserveResult) -> tuple[StepBatch, list[Sequence]]:
        """Apply memsvc's answer; return the batch to execute and the sequences rejected."""
        for p in result.preempted:
            seq = self.seqs[p.seq_id]
            self.running.remove(seq)
            seq.status = SeqStatus.WAITING
            seq.num_computed = 0
            seq.num_preemptions += 1
            self.num_preemptions += 1
            bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)
        rejected = []
        for r in result.rejected:
            seq = self.seqs.pop(r.seq_id)
            self.waiting.remove(seq)
            seq.finish("error", r.reason)
            rejected.append(seq)
        steps = []
        for g in result.grants:
            seq = self.seqs[g.seq_id]
            if seq.status is SeqStatus.WAITING:
                self.waiting.remove(seq)
                bisect.insort(self.running, seq, key=lambda s: s.sort_key)
                seq.status = SeqStatus.RUNNING
                seq.num_computed = g.num_cached_tokens
                if seq.num_cached_tokens < 0:
                    seq.num_cached_tokens = g.num_cached_tokens
            assert g.start_pos == seq.num_computed, (g, seq.num_computed)
            end = g.start_pos + g.num_tokens
            needs_history = seq.sampling.uses_penalties
            steps.append(SeqStep(
                seq_id=seq.seq_id, token_ids=seq.all_token_ids[g.start_pos:end],
                start_pos=g.start_pos, slot_mapping=g.slot_mapping, block_table=g.block_table,
                sample=end == seq.num_tokens, sampling=seq.sampling, seed=seq.seed,
                prompt_token_ids=seq.prompt_token_ids if needs_history else [],
                output_token_ids=seq.output_token_ids if needs_history else [],
            ))
        return StepBatch(steps), rejected

    def on_sampled(self, batch: StepBatch, outputs: list[SampleOutput]) -> list[SeqUpdate]:
        by_id = {o.seq_id: o for o in outputs}
        updates = []
        for step in batch.seqs:
            seq = self.seqs.get(step.seq_id)
            if seq is None:  # aborted while the step ran
                continue
            seq.num_computed = step.start_pos + len(step.token_ids)
            out = by_id.get(step.seq_id)
            if out is None:
                continue
            seq.output_token_ids.append(out.token_id)
            reason = self._finish_reason(seq, out.token_id)
            if reason:
                seq.finish(reason)
                self.running.remove(seq)
                del self.seqs[seq.seq_id]
                self.to_free.append(seq.seq_id)
            updates.append(SeqUpdate(seq, out.token_id, out.logprob, out.top_logprobs, bool(reason)))
        return updates

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        sp = seq.sampling
        if token_id in sp.stop_token_ids:
            return "stop"
        if not sp.ignore_eos and token_id in self.eos_token_ids:
            return "stop"
        if len(seq.output_token_ids) >= sp.max_tokens or seq.num_tokens >= seq.max_len:
            return "length"
        return None

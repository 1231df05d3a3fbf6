"""The running set's shortcuts (the last step's rows kept, every row fed, every row reporting)
give exactly what its general path gives: two running sets, one with `fast=False`, take the
same random workload (admits, forgets, prefill chunks, decode steps fed and not, new blocks,
copy-on-write, tables cut back for recompute, penalties, prompt logprobs, invalid sampling,
outputs with errors, rows changing hands between a step and its record), and a model of
each sequence's table checks the slots and tables both derive."""
import dataclasses
import random

import numpy as np
import pytest

from pagedserve.step.running_set import RunningSet
from pagedserve.step.step_batch import StepBatch
from pagedserve.wire.protocol import SampleOutput, SamplingParams
from tests.support.step_batches import assert_same_batch

BS = 4
SAMPLINGS = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0),
             SamplingParams(temperature=0.7, top_k=5), SamplingParams(repetition_penalty=1.2),
             SamplingParams(temperature=0.0, prompt_logprobs=1), SamplingParams(min_tokens=9, max_tokens=2)]
HELD = ("seq_id", "sampling", "seed", "prompt_len", "history", "prompt", "flags", "error")


@dataclasses.dataclass
class Seq:
    prompt: list[int]
    table: list[int]
    pos: int = 0  # tokens computed
    sampled: bool = False  # its last step sampled, and was recorded: it may be fed


def assert_same(a: StepBatch, b: StepBatch):
    assert_same_batch(a, b, HELD)


def outcome(fn, *args):
    try:
        fn(*args)
        return None
    except Exception as e:  # noqa: BLE001 - both sets must fail alike
        return type(e).__name__, str(e)


class Workload:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.seqs: dict[str, Seq] = {}
        self.next_id = 0
        self.next_block = 1
        self.order: list[str] = []

    def blocks(self, k: int) -> list[int]:
        self.next_block += k
        return list(range(self.next_block - k, self.next_block))

    def admit(self, sets) -> None:
        seq_id = f"s{self.next_id}"
        self.next_id += 1
        prompt = [self.rng.randrange(1000) for _ in range(self.rng.randint(1, 9))]
        sp = self.rng.choice(SAMPLINGS)
        for running in sets:
            running.admit(seq_id, sp, 7, len(prompt), [], prompt)
        self.seqs[seq_id] = Seq(prompt, [])
        self.order.append(seq_id)

    def forget(self, sets, seq_ids) -> None:
        for running in sets:
            running.forget(seq_ids)
        for s in seq_ids:
            self.seqs.pop(s)
            self.order.remove(s)

    def step(self):
        """One step's columns over (most of) the running sequences, mostly in the same order."""
        rng = self.rng
        ids = list(self.order) if rng.random() < 0.7 else [s for s in self.order if rng.random() < 0.8]
        if rng.random() < 0.1:
            rng.shuffle(ids)
        cols = dict(seq_ids=ids, start_pos=[], num_tokens=[], tokens=[], fed=[], sample=[], table_start=[],
                    num_new_blocks=[], new_blocks=[])
        for seq_id in ids:
            seq = self.seqs[seq_id]
            if seq.pos and rng.random() < 0.02:  # preempted for recompute: computed again from a block start
                seq.pos = BS * rng.randrange(0, -(-seq.pos // BS))
                seq.sampled = False
            plen = len(seq.prompt)
            n = rng.randint(1, 5) if seq.pos < plen else 1
            fed = seq.pos >= plen and seq.sampled and rng.random() < 0.97
            if seq.pos >= plen and not seq.sampled and rng.random() < 0.02:
                fed = True  # a token this set does not hold: refused by fill
            need = -(-(seq.pos + n) // BS)
            keep = min(len(seq.table), -(-seq.pos // BS))  # blocks before the computed ones stay
            if rng.random() < 0.1 and keep:  # copy-on-write of the last block kept
                keep -= 1
            tstart = keep if (keep < len(seq.table) or need > len(seq.table)) else len(seq.table)
            new = self.blocks(max(need - tstart, 0)) if tstart < need else []
            seq.table = seq.table[:tstart] + new
            cols["start_pos"].append(seq.pos)
            cols["num_tokens"].append(n)
            cols["fed"].append(fed)
            if not fed:
                cols["tokens"] += [rng.randrange(1000) for _ in range(n)]
            cols["sample"].append(seq.pos + n >= plen)
            cols["table_start"].append(tstart)
            cols["num_new_blocks"].append(len(new))
            cols["new_blocks"] += new
            seq.pos += n
        return cols

    def check_against_model(self, batch: StepBatch) -> None:
        starts = batch.starts
        for i, seq_id in enumerate(batch.seq_ids):
            table = self.seqs[seq_id].table
            assert batch.block_tables[i, :batch.table_lens[i]].tolist() == table
            pos = int(batch.start_pos[i]) + np.arange(batch.num_tokens[i])
            want = [table[p // BS] * BS + p % BS for p in pos]
            assert batch.slot_mapping[starts[i]:starts[i + 1]].tolist() == want

    def outputs(self, batch: StepBatch) -> list[SampleOutput]:
        out = []
        for i in np.flatnonzero(batch.reports()).tolist():
            seq_id = batch.seq_ids[i]
            if i in batch.errors or self.rng.random() < 0.02:
                out.append(SampleOutput(seq_id, -1, sampled=False, error=batch.errors.get(i, "screened out")))
            elif batch.sample[i]:
                out.append(SampleOutput(seq_id, self.rng.randrange(1000)))
            else:
                out.append(SampleOutput(seq_id, -1, sampled=False))
        return out


@pytest.mark.parametrize("seed", range(12))
def test_the_shortcuts_agree_with_the_general_path(seed):
    work = Workload(seed)
    fast, general = RunningSet(BS, rows=4, width=2), RunningSet(BS, rows=4, width=2, fast=False)
    sets = (fast, general)
    for _ in range(6):
        work.admit(sets)
    took = {"fed": 0, "kept rows": 0}
    for _ in range(80):
        cols = work.step()
        last = fast._last
        applied = [running.apply(**{**cols, "fed": cols["fed"] or None}, step=1) for running in sets]
        took["kept rows"] += fast._last is last and last is not None
        assert_same(applied[0].batch, applied[1].batch)
        work.check_against_model(applied[0].batch)
        filled = [outcome(running.fill, a) for running, a in zip(sets, applied)]
        assert filled[0] == filled[1]
        if filled[0] is not None:  # refused whole: the step never ran
            for seq_id in cols["seq_ids"]:
                work.seqs[seq_id].sampled = False
            continue
        took["fed"] += all(cols["fed"]) and len(cols["fed"]) > 0
        assert_same(applied[0].batch, applied[1].batch)
        outputs = work.outputs(applied[0].batch)
        if work.rng.random() < 0.2:  # rows change hands before the step's record
            gone = [s for s in work.order if work.rng.random() < 0.3]
            work.forget(sets, gone)
            for _ in range(len(gone)):
                work.admit(sets)
        for running, a in zip(sets, applied):
            running.record(a, outputs)
        for k in ("last_pos", "last_token", "table_len", "gen"):
            assert np.array_equal(getattr(fast, k), getattr(general, k)), k
        assert fast.left_out == general.left_out and fast.row_of == general.row_of
        recorded = {o.seq_id for o in outputs if o.sampled and not o.error}
        for seq_id, seq in work.seqs.items():
            seq.sampled = seq_id in recorded or (seq.sampled and seq_id not in cols["seq_ids"])
        if work.rng.random() < 0.1:
            work.forget(sets, [s for s in work.order if work.rng.random() < 0.3])
        if work.rng.random() < 0.15 or not work.order:
            work.admit(sets)
    assert took["kept rows"] > 5 and took["fed"] > 0, took  # the shortcuts were taken

"""The running set's steady decode step (`apply_decode`: every row computes one token, fed, and
samples) gives exactly what `apply` gives for the same step in its columns (num_tokens and
sample all 1, every row fed, no tokens): batches, errors, fills and records, on random
workloads of decode steps with new blocks, copy-on-write, rows in another order or left out,
rows changing hands, and faults (a short table, a change that does not fit, a position the
set does not hold, columns of other lengths)."""
import random

import numpy as np
import pytest

from pagedserve.step.running_set import RunningSet
from pagedserve.wire.protocol import SampleOutput, SamplingParams
from tests.support.step_batches import assert_same_batch

BS = 4
SAMPLINGS = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=5),
             SamplingParams(repetition_penalty=1.2), SamplingParams(temperature=0.0, prompt_logprobs=1),
             SamplingParams(min_tokens=9, max_tokens=2)]
HELD = ("seq_id", "sampling", "seed", "prompt_len", "history", "prompt", "flags", "error")


def outcome(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs), None
    except Exception as e:  # noqa: BLE001 - both must fail alike
        return None, (type(e).__name__, str(e))


class Workload:
    def __init__(self, seed: int, sets):
        self.rng, self.sets = random.Random(seed), sets
        self.pos: dict[str, int] = {}
        self.table: dict[str, list[int]] = {}
        self.next_id = self.next_block = 0

    def blocks(self, k: int) -> list[int]:
        self.next_block += k
        return list(range(self.next_block - k, self.next_block))

    def admit(self) -> None:
        """A new sequence, its prompt computed (the general path) and its first token sampled."""
        seq_id, rng = f"s{self.next_id}", self.rng
        self.next_id += 1
        prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 7))]
        sp = rng.choice(SAMPLINGS)
        table = self.blocks(-(-len(prompt) // BS))
        for running in self.sets:
            running.admit(seq_id, sp, 7, len(prompt), [], prompt)
            a = running.apply([seq_id], [0], [len(prompt)], prompt, None, [True], [0], [len(table)], table)
            running.fill(a)
            running.record(a, [SampleOutput(seq_id, 11)])
        self.pos[seq_id], self.table[seq_id] = len(prompt), table

    def forget(self, gone) -> None:
        for running in self.sets:
            running.forget(gone)
        for s in gone:
            del self.pos[s], self.table[s]

    def step(self) -> dict:
        """A decode step's columns, a fault now and then."""
        rng = self.rng
        ids = list(self.pos) if rng.random() < 0.7 else [s for s in self.pos if rng.random() < 0.8]
        if rng.random() < 0.1:
            rng.shuffle(ids)
        cols = {"seq_ids": ids, "start_pos": [], "table_start": [], "num_new_blocks": [], "new_blocks": []}
        for seq_id in ids:
            pos, table = self.pos[seq_id], self.table[seq_id]
            tstart, new = len(table), []
            if pos // BS >= len(table):
                new = self.blocks(1)
            elif rng.random() < 0.05:  # copy-on-write of the last block
                tstart, new = len(table) - 1, self.blocks(1)
            cols["start_pos"].append(pos)
            cols["table_start"].append(tstart)
            cols["num_new_blocks"].append(len(new))
            cols["new_blocks"] += new
        if ids and rng.random() < 0.15:
            fault, i = rng.randrange(6), rng.randrange(len(ids))
            if fault == 0:
                cols["start_pos"][i] = -1
            elif fault == 1:  # a position the set holds no sample for: fill refuses it
                cols["start_pos"][i] += 1
            elif fault == 2:  # its new block left out: the table is short
                cols["num_new_blocks"][i] = 0
                cols["new_blocks"] = []
                cols["num_new_blocks"] = [0] * len(ids)
            elif fault == 3:
                cols["table_start"][i] += 2
            elif fault == 4:
                cols[rng.choice(["start_pos", "table_start", "num_new_blocks"])].pop()
            else:
                cols["seq_ids"] = ids + [ids[i]]
                for k in ("start_pos", "table_start", "num_new_blocks"):
                    cols[k].append(cols[k][i] if k != "num_new_blocks" else 1)
                cols["new_blocks"] += self.blocks(1)
        return cols

    def took(self, cols) -> None:
        """The step ran: the model follows its positions and tables."""
        at = 0
        for seq_id, s, ts, k in zip(cols["seq_ids"], cols["start_pos"], cols["table_start"], cols["num_new_blocks"]):
            self.table[seq_id] = self.table[seq_id][:ts] + cols["new_blocks"][at:at + k]
            self.pos[seq_id] = s + 1
            at += k


@pytest.mark.parametrize("seed", range(10))
def test_a_decode_step_gives_what_the_general_path_gives(seed):
    decode, general = RunningSet(BS, rows=4, width=2), RunningSet(BS, rows=4, width=2, fast=False)
    work = Workload(seed, (decode, general))
    for _ in range(5):
        work.admit()
    ran = 0
    for k in range(120):
        cols = work.step()
        b = len(cols["seq_ids"])
        a, err = outcome(decode.apply_decode, **cols, pool_epoch="e", step=k)
        g, gerr = outcome(general.apply, cols["seq_ids"], cols["start_pos"], [1] * b, [], [True] * b, [True] * b,
                          cols["table_start"], cols["num_new_blocks"], cols["new_blocks"], pool_epoch="e", step=k)
        assert err == gerr
        if err is None:
            assert_same_batch(a.batch, g.batch, HELD)
            assert a.fed.tolist() == g.fed.tolist() and a.rows.tolist() == g.rows.tolist()
            filled = [outcome(decode.fill, a)[1], outcome(general.fill, g)[1]]
            assert filled[0] == filled[1]
            if filled[0] is None:
                assert_same_batch(a.batch, g.batch, HELD)
                outs = [SampleOutput(s, work.rng.randrange(1000)) if work.rng.random() > 0.03
                        else SampleOutput(s, -1, sampled=False, error="screened out") for s in cols["seq_ids"]]
                if work.rng.random() < 0.1:  # rows change hands before the step's record
                    gone = [s for s in work.pos if work.rng.random() < 0.3]
                    work.forget(gone)
                    work.admit()
                decode.record(a, outs)
                general.record(g, outs)
                work.took(_held(cols, work))
                ran += 1
        else:
            _, err = outcome(decode.apply_decode, **cols)  # refused whole: nothing changed, refused again
            assert err == gerr
        for name in ("last_pos", "last_token", "table_len", "gen", "tables"):
            assert np.array_equal(getattr(decode, name), getattr(general, name)), name
        assert decode.left_out == general.left_out and decode.row_of == general.row_of
        if work.rng.random() < 0.1:
            work.forget([s for s in work.pos if work.rng.random() < 0.3])
        if work.rng.random() < 0.15 or not work.pos:
            work.admit()
        for s in [s for s in work.pos if s in decode.left_out]:  # left out: it has no sample to feed
            work.forget([s])
    assert ran > 30


def _held(cols, work) -> dict:
    """The step's columns of the sequences still held."""
    keep = [i for i, s in enumerate(cols["seq_ids"]) if s in work.pos]
    at = np.concatenate([[0], np.cumsum(cols["num_new_blocks"])])
    held = {k: [cols[k][i] for i in keep] for k in ("seq_ids", "start_pos", "table_start", "num_new_blocks")}
    return held | {"new_blocks": [x for i in keep for x in cols["new_blocks"][at[i]:at[i + 1]]]}

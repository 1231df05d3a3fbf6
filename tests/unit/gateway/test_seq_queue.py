"""seq_queue.insert puts each sequence where bisect.insort (the reference) puts it: random
priorities, arrivals and indexes with ties, mostly in order, sometimes not."""
import bisect
import random

from pagedserve.gateway.seq_queue import insert
from pagedserve.gateway.sequence import Sequence
from pagedserve.wire.protocol import SamplingParams


def test_insert_is_insort():
    rng = random.Random(5)
    sp = SamplingParams()
    for _ in range(50):
        queue, reference = [], []
        for k in range(rng.randint(0, 40)):
            in_order = rng.random() < 0.7
            seq = Sequence(f"s{k}", f"r{k}", rng.randrange(3), [1], sp, 0, 8,
                           float(k) if in_order else float(rng.randrange(40)),
                           priority=0 if in_order else rng.randrange(-1, 2))
            insert(queue, seq)
            bisect.insort(reference, seq, key=lambda s: s.sort_key)
            assert [s.seq_id for s in queue] == [s.seq_id for s in reference]

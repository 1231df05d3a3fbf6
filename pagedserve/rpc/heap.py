"""The garbage collector of a long-running service.

A service imports torch, transformers and grpc and loads a model or a tokenizer: some 300,000
objects that live as long as the process. CPython's full collections walk every one of
them, and a step allocates enough short-lived objects (plans, grants, deltas) to trigger
one every few steps: at batch 256 that cost the control plane about 2 ms per step.
`freeze_heap()`, once start-up is done, collects once and moves every object alive then
into the permanent generation, which no collection walks again; the collector still runs
for what the service allocates afterwards.

It also raises the youngest generation's threshold (`YOUNG_THRESHOLD`): a step holds a few
objects per sequence alive at once (plan entries, grants, deltas), so at batch 256 the
default of 700 net allocations started ~6 young collections a step, which promoted each
step's objects into the older generations and their collections (0.5-0.7 ms a step of
the gateway's loop in process, measured with gc.callbacks); at 20,000 a step starts none,
and a collection, when one comes, walks at most that many young objects.
"""
from __future__ import annotations

import gc

YOUNG_THRESHOLD = 20_000  # CPython's default: 700


def freeze_heap() -> int:
    """Collect, then freeze what is left (call once start-up is done). Returns the number
    of objects frozen so far."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(max(YOUNG_THRESHOLD, gc.get_threshold()[0]), older, oldest)
    return gc.get_freeze_count()

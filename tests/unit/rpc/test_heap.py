"""freeze_heap: start-up objects leave the collector's reach; later garbage is still collected."""
import gc
import weakref

from pagedserve.rpc.heap import YOUNG_THRESHOLD, freeze_heap


class _Node:
    pass


def test_freeze_heap_moves_live_objects_out_and_still_collects_new_cycles():
    threshold = gc.get_threshold()
    try:
        assert freeze_heap() > 1000  # (the count then drops as frozen objects are freed)
        assert gc.get_freeze_count() > 1000
        assert gc.isenabled()
        assert gc.get_threshold() == (YOUNG_THRESHOLD, *threshold[1:])
        a, b = _Node(), _Node()
        a.other, b.other = b, a  # a cycle: only the collector frees it
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
    assert gc.get_freeze_count() == 0

"""A step's arrays through the staging buffers come out equal, in their shapes and dtypes,
and stay equal after later sends reuse the buffers (two take turns)."""
import numpy as np
import torch

from pagedserve.executor.staging import Staging


def test_packed_arrays_come_back_equal_and_later_sends_do_not_change_them():
    staging = Staging("cpu", packs=True)
    rng = np.random.default_rng(0)
    sent = []
    for step in range(5):
        arrays = [rng.integers(0, 100, size=n) for n in (3 + step, 1, 7)] + [rng.integers(0, 9, size=(2, 4))]
        out = staging.send(arrays, np.int64)
        assert [tuple(t.shape) for t in out] == [a.shape for a in arrays]
        assert all(t.dtype == torch.int64 for t in out)
        sent.append((arrays, out))
        if len(sent) >= 2:  # the step before's tensors are unchanged by this send
            for a, t in zip(*sent[-2]):
                assert np.array_equal(t.numpy(), a)
    for a, t in zip(*sent[-1]):
        assert np.array_equal(t.numpy(), a)
    small = staging.send([np.array([1, 2], dtype=np.int32), np.zeros((0, 3), dtype=np.int32)], np.int32)
    assert small[0].dtype == torch.int32 and small[0].tolist() == [1, 2] and tuple(small[1].shape) == (0, 3)


def test_on_a_cpu_without_packing_arrays_become_tensors():
    out = Staging("cpu").send([np.arange(4), np.arange(6).reshape(2, 3)], np.int32)
    assert out[0].dtype == torch.int32 and out[1].tolist() == [[0, 1, 2], [3, 4, 5]]

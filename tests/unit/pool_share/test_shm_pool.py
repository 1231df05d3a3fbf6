"""The CPU pool in POSIX shared memory: mode 0600, shared bytes, unlinked at close (another
process attaching it: tests/system/test_shm_pool_process.py)."""
import os
import stat

import pytest
import torch

from pagedserve.memsvc.memory_manager import MemoryConfig, MemoryManager
from pagedserve.pool_share.shm_pool import ShmPool, attach_shm_pool
from pagedserve.wire.protocol import KVGeometry

GEOM = KVGeometry(2, 2, 4, 4, "bfloat16")


def test_segment_is_private_zeroed_and_shared_with_an_attacher():
    pool = ShmPool(GEOM, 3)
    try:
        st = os.stat(pool.path)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size == 3 * GEOM.bytes_per_block
        assert pool.tensor.shape == GEOM.pool_shape(3) and pool.tensor.dtype == torch.bfloat16
        assert pool.tensor.count_nonzero() == 0
        other = attach_shm_pool(pool.name, list(pool.shape), "bfloat16")
        pool.tensor[2, 1, 0, 3] = 1.5
        assert torch.equal(other, pool.tensor)
        other[0] = -2.0
        assert (pool.tensor[0] == -2.0).all()
    finally:
        pool.unlink()
    assert not os.path.exists(pool.path)
    pool.unlink()  # idempotent
    assert pool.tensor[2, 1, 0, 3, 0, 0] == 1.5  # the mapping outlives the name


def test_attach_refuses_a_wrong_name_or_size():
    pool = ShmPool(GEOM, 2)
    try:
        with pytest.raises(ValueError, match="bytes"):
            attach_shm_pool(pool.name, GEOM.pool_shape(3), "bfloat16")
        with pytest.raises(FileNotFoundError):
            attach_shm_pool(pool.name + "-nope", GEOM.pool_shape(2), "bfloat16")
        assert not os.path.exists(pool.path + "-nope")
        with pytest.raises(ValueError, match="name"):
            attach_shm_pool("../etc/passwd", GEOM.pool_shape(2), "bfloat16")
    finally:
        pool.unlink()


def test_a_name_in_use_is_refused():
    pool = ShmPool(GEOM, 1)
    try:
        with pytest.raises(FileExistsError):
            ShmPool(GEOM, 1, name=pool.name)
        assert os.path.exists(pool.path)
    finally:
        pool.unlink()


def test_memory_manager_shares_its_pool_and_unlinks_at_close():
    mem = MemoryManager(MemoryConfig(num_blocks=4, shared=True))
    pool = mem.register_executor(KVGeometry(1, 1, 2, 4))
    assert mem.shm is not None and os.path.exists(mem.shm.path)
    assert mem.register_executor(KVGeometry(1, 1, 2, 4)) is pool
    with pytest.raises(ValueError, match="geometry|exists"):
        mem.register_executor(KVGeometry(1, 1, 2, 8))
    mem.close()
    assert not os.path.exists(mem.shm.path)

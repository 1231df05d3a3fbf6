"""Another process attaches the CPU pool's shared-memory segment and its writes are seen."""
import subprocess
import sys

from pagedserve.pool_share.shm_pool import ShmPool
from tests.support import ROOT
from tests.unit.pool_share.test_shm_pool import GEOM


def test_another_process_sees_the_writes():
    pool = ShmPool(GEOM, 2)
    try:
        code = ("import sys, torch; from pagedserve.pool_share.shm_pool import attach_shm_pool;"
                f"t = attach_shm_pool({pool.name!r}, {list(pool.shape)}, 'bfloat16'); t[1] = 3.0")
        subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
        assert (pool.tensor[1] == 3.0).all() and (pool.tensor[0] == 0).all()
    finally:
        pool.unlink()

"""The CPU KV pool as a POSIX shared-memory segment that memsvc and the executor both map.

Contract:
- memsvc creates `/dev/shm/<name>` with O_EXCL and mode 0600 (only the same user can map
  it), sized to exactly the pool, zero-filled, and views it as the block-major pool tensor.
- The executor attaches by name (`attach_shm_pool`) with the shape and dtype from the
  PoolHandle; both see the same bytes, nothing is copied.
- memsvc unlinks the name at shutdown (`unlink` is idempotent and also runs at exit).
  Mappings stay valid after unlink until their tensors are freed; the memory goes back to
  the system when the last one goes.

The tensor owns its mapping (torch's file-backed storage unmaps when the last view dies),
so no separate object must be kept alive.
"""
from __future__ import annotations

import atexit
import math
import os
import re
import secrets

import torch

from pagedserve.wire.protocol import KVGeometry

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


def default_shm_name() -> str:
    return f"pagedserve-kv-{os.getpid()}-{secrets.token_hex(4)}"


def _path(name: str) -> str:
    if not _NAME.match(name) or name.startswith("."):
        raise ValueError(f"bad shared-memory name {name!r}: use letters, digits, '.', '_', '-'")
    if not os.path.isdir(SHM_DIR):
        raise RuntimeError(f"{SHM_DIR} does not exist: POSIX shared memory needs Linux tmpfs")
    return os.path.join(SHM_DIR, name)


def _map(path: str, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


class ShmPool:
    """A pool tensor in a shared-memory segment this process created and will unlink."""

    def __init__(self, geometry: KVGeometry, num_blocks: int, name: str | None = None):
        self.name = name or default_shm_name()
        self.path = _path(self.name)
        self.shape = geometry.pool_shape(num_blocks)
        self.dtype = getattr(torch, geometry.dtype)
        self.nbytes = math.prod(self.shape) * geometry.element_size
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        self._unlinked = False
        try:
            os.fchmod(fd, 0o600)  # the umask cannot widen it, but be explicit
            os.ftruncate(fd, self.nbytes)
        except BaseException:
            os.close(fd)
            self.unlink()
            raise
        os.close(fd)
        atexit.register(self.unlink)
        self.tensor = _map(self.path, self.nbytes, self.dtype, self.shape)

    def unlink(self) -> None:
        """Remove the name; existing mappings stay valid. Safe to call more than once."""
        if self._unlinked:
            return
        self._unlinked = True
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def attach_shm_pool(name: str, shape: tuple[int, ...] | list[int], dtype: str) -> torch.Tensor:
    """Map an existing segment as the pool tensor (the executor side).

    Raises FileNotFoundError when no segment has this name and ValueError when its size
    is not exactly that of `shape` in `dtype`.
    """
    path = _path(name)
    torch_dtype = getattr(torch, dtype)
    shape = tuple(int(s) for s in shape)
    nbytes = math.prod(shape) * torch.empty(0, dtype=torch_dtype).element_size()
    fd = os.open(path, os.O_RDWR)  # no O_CREAT: a wrong name must fail, not make a file
    try:
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if size != nbytes:
        raise ValueError(f"shared-memory segment {name} has {size} bytes; shape {list(shape)} "
                         f"of {dtype} needs {nbytes}")
    return _map(path, nbytes, torch_dtype, shape)

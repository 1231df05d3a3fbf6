"""Which device a process computes on, and which dtype it defaults to there.

`--device` everywhere (serve, executor, generate, the engine, the benchmarks) takes:
  auto       the GPU when one is visible (the current CUDA device), else the CPU
  cpu        the CPU
  cuda       the current CUDA device (index 0 unless torch.cuda.set_device said otherwise)
  cuda:N     CUDA device N of this process (indices depend on CUDA_VISIBLE_DEVICES)
  GPU-<uuid> (the executor only) the GPU with this physical UUID, whatever its index here
`--dtype auto` is float32 on the CPU and bfloat16 on a GPU.

Nothing here creates a CUDA context: `torch.cuda.is_available()` and `device_count()` use
NVML / the driver's device count, not a context.
"""
from __future__ import annotations

DEVICE_HELP = ("auto (the GPU when one is present, else the CPU), cpu, cuda, cuda:N"
               " or a GPU UUID (executor)")
DTYPE_CHOICES = ["auto", "float32", "bfloat16", "float16"]


def _torch():
    import torch

    return torch


def resolve_device(spec: str | None = "auto") -> str:
    """The torch device string ('cpu' or 'cuda:N') that `spec` names in this process.

    ValueError for a spec that names no device here (cuda without a GPU, an index past
    the visible devices, a malformed name); a GPU UUID goes through pagedserve.pool_share.cuda_ipc."""
    torch = _torch()
    spec = (spec or "auto").strip()
    low = spec.lower()
    if low == "cpu":
        return "cpu"
    if low == "auto":
        if not torch.cuda.is_available():
            return "cpu"
        return f"cuda:{torch.cuda.current_device()}"
    if low.startswith(("gpu-", "mig-")):
        from pagedserve.pool_share.cuda_ipc import device_index_for_uuid

        return f"cuda:{device_index_for_uuid(spec)}"
    if low == "cuda" or low.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ValueError(f"--device {spec}: no CUDA device is visible to this process "
                             "(use --device cpu or auto)")
        if low == "cuda":
            return f"cuda:{torch.cuda.current_device()}"
        try:
            index = int(low.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"--device {spec}: expected cuda:N with N an integer") from None
        count = torch.cuda.device_count()
        if not 0 <= index < count:
            raise ValueError(f"--device {spec}: this process sees {count} CUDA device(s) "
                             "(check CUDA_VISIBLE_DEVICES)")
        return f"cuda:{index}"
    raise ValueError(f"--device {spec!r}: expected {DEVICE_HELP}")


def resolve_dtype(dtype: str | None, device: str) -> str:
    """'auto' (or None): float32 on the CPU, bfloat16 on a GPU; anything else as given."""
    if dtype in (None, "", "auto"):
        return "float32" if device == "cpu" else "bfloat16"
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPE_CHOICES)}")
    return dtype


def device_index(device) -> int | None:
    """The CUDA index of a torch device or device string; None for the CPU."""
    torch = _torch()
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.current_device() if device.index is None else device.index


def on_device(device):
    """A context manager that makes `device` current for CUDA calls (a no-op off CUDA):
    kernel launches, streams, events, pinned allocations and synchronize() then act on the
    pool's GPU, never on GPU 0 by default."""
    import contextlib

    index = device_index(device)
    if index is None:
        return contextlib.nullcontext()
    return _torch().cuda.device(index)


def synchronize(device) -> None:
    """Wait for the work queued on `device` (a no-op off CUDA); never touches another GPU."""
    index = device_index(device)
    if index is not None:
        _torch().cuda.synchronize(index)

"""Build and load the small C++ kernels of the CPU path (pagedserve/kernels/paged_cpu.py, pagedserve/kernels/fused_cpu.py).

Each source is compiled once per source text, target and machine with the system C++
compiler (about a second; plain C ABI through ctypes, no torch headers), with -O3 -fopenmp, so
that its parallel loops run on the OpenMP runtime torch already loaded (same soname) and share
torch's warm thread pool. The target is -march=native (the vector width this CPU and OS
allow: AVX-512 where present, AVX2 on AVX2-only x86; every hot loop vectorizes at either
width, checked with -march=haswell: docs/benchmark-history.md, "The C++ kernels on AVX2"),
or $PAGEDSERVE_NATIVE_MARCH (for example haswell or x86-64-v3: a value the compiler takes
after -march=); when the compiler refuses
the target, the source is built again for the compiler's default target (still vectorized,
at its baseline width) rather than not at all. The shared object is cached in
`kernels/` of pagedserve's cache (pagedserve/wire/cache_dir.py), keyed by the source, the target asked for and this
CPU's flags (/proc/cpuinfo), so a cache shared between machines never hands one another's
build. PAGEDSERVE_NATIVE_KERNELS=0 turns every native kernel off; load() then returns None, as
it does when no compiler is found or no build succeeds, and callers take their torch path.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from typing import Callable

from pagedserve.wire.cache_dir import cache_dir as cache_root


def enabled() -> bool:
    return os.environ.get("PAGEDSERVE_NATIVE_KERNELS", "1") != "0" and platform.system() == "Linux"


def cache_dir() -> str:
    return cache_root("kernels")


def target() -> str:
    """The -march value asked for: $PAGEDSERVE_NATIVE_MARCH, else native."""
    return os.environ.get("PAGEDSERVE_NATIVE_MARCH") or "native"


def target_flags() -> list[list[str]]:
    """The target flags to try, in order: -march=<target()>, then the compiler's default."""
    return [[f"-march={target()}"], []]


def machine_key(source: str) -> str:
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return hashlib.sha256((source + platform.machine() + flags + target()).encode()).hexdigest()[:16]


def load(name: str, source: str) -> ctypes.CDLL | None:
    """The library built from `source`, cached as <name>_<key>.so; None when native kernels are
    off or it cannot be built or loaded. The caller sets argtypes."""
    if not enabled():
        return None
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    directory = cache_dir()
    path = os.path.join(directory, f"{name}_{machine_key(source)}.so")
    if not os.path.exists(path):
        if compiler is None:
            return None
        try:
            os.makedirs(directory, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=directory) as tmp:
                cpp = os.path.join(tmp, "k.cpp")
                with open(cpp, "w") as f:
                    f.write(source)
                so = os.path.join(tmp, "k.so")
                for march in target_flags():
                    try:
                        subprocess.run([compiler, "-O3", *march, "-fopenmp", "-ffp-contract=fast",
                                        "-shared", "-fPIC", "-o", so, cpp],
                                       check=True, capture_output=True, timeout=120)
                        break
                    except subprocess.CalledProcessError:
                        continue  # this target refused: the next one
                else:
                    return None
                os.replace(so, path)  # atomic: concurrent builders agree
        except (OSError, subprocess.SubprocessError):
            return None
    try:
        return ctypes.CDLL(path)
    except OSError:
        return None


class Library:
    """A native library built on first use by `build` (once, thread-safe) and kept; `get()`
    returns it, or None when it could not be built. `reset()` forgets it (the next `get()`
    builds again: tests that flip the switches)."""

    def __init__(self, build: Callable[[], ctypes.CDLL | None]):
        self._build = build
        self._lib: ctypes.CDLL | None = None
        self._tried = False
        self._lock = threading.Lock()

    def get(self) -> ctypes.CDLL | None:
        if not self._tried:
            with self._lock:
                if not self._tried:
                    self._lib = self._build()
                    self._tried = True
        return self._lib

    def reset(self) -> None:
        with self._lock:
            self._lib, self._tried = None, False

    def float32_cpu(self, what: str, device, dtype) -> str | None:
        """Why `what`, a kernel of this library on float32 weights on the CPU, cannot serve
        weights of `dtype` on `device` (a torch.device or its name), or None (builds it)."""
        if getattr(device, "type", str(device).split(":")[0]) != "cpu" or str(dtype) != "torch.float32":
            return f"{what} takes float32 weights on the CPU ({dtype} on {device})"
        if self.get() is None:
            return "the C++ kernels are not built here (pagedserve/kernels/native_build.py)"
        return None

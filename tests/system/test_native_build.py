"""pagedserve/kernels/native_build.py's target flags: -march=native unless PAGEDSERVE_NATIVE_MARCH says
otherwise, a target the compiler refuses falls back to its default one, the cache keys the
target, and an AVX2 (haswell) build holds no AVX-512 instruction."""
import platform
import shutil
import subprocess

import pytest

from pagedserve.kernels import native_build

SOURCE = r"""
extern "C" float dot(const float* a, const float* b, long n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (long i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
}
"""
needs_compiler = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                    reason="no C++ compiler here")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    monkeypatch.delenv("PAGEDSERVE_NATIVE_KERNELS", raising=False)
    return tmp_path / "kernels"


def test_target_and_key(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_NATIVE_MARCH", raising=False)
    assert native_build.target() == "native"
    assert native_build.target_flags() == [["-march=native"], []]
    native = native_build.machine_key(SOURCE)
    monkeypatch.setenv("PAGEDSERVE_NATIVE_MARCH", "haswell")
    assert native_build.target_flags()[0] == ["-march=haswell"]
    assert native_build.machine_key(SOURCE) != native


@needs_compiler
@pytest.mark.skipif(not native_build.enabled(), reason="native kernels are off here")
def test_a_refused_target_builds_for_the_default_one(cache, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_NATIVE_MARCH", "no-such-cpu")
    lib = native_build.load("dot", SOURCE)
    assert lib is not None and len(list(cache.glob("dot_*.so"))) == 1


@needs_compiler
@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("objdump") is None
                    or not native_build.enabled(), reason="x86-64 with objdump only")
def test_haswell_build_uses_avx2_and_no_avx512(cache, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_NATIVE_MARCH", "haswell")
    assert native_build.load("dot", SOURCE) is not None
    (so,) = cache.glob("dot_*.so")
    asm = subprocess.run(["objdump", "-d", str(so)], capture_output=True, text=True, check=True).stdout
    assert "ymm" in asm and "zmm" not in asm

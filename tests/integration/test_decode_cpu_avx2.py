"""The decode kernel's fast-path tests (tests/unit/kernels/test_decode_cpu.py) on the AVX2-only
build (-march=haswell: 8-wide vectors, the path of CPUs without AVX-512), compiled here."""
import pytest

from pagedserve.kernels import paged_decode_cpu
from tests.unit.kernels.test_decode_cpu import (  # noqa: F401 (collected here, with this module's build)
    test_bfloat16_cache_in_float32_arithmetic, test_fast_path_matches_float64, test_maximum_moving_between_blocks,
    test_nan_past_the_lengths_is_never_read)


@pytest.fixture
def build(monkeypatch):
    """The decode kernel built for -march=haswell; the default build again after."""
    monkeypatch.setenv("PAGEDSERVE_NATIVE_MARCH", "haswell")
    paged_decode_cpu._native.reset()
    if not paged_decode_cpu.native_available():
        pytest.skip("the decode kernel does not build for -march=haswell here")
    yield "haswell"
    monkeypatch.undo()
    paged_decode_cpu._native.reset()

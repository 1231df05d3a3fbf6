"""The prefill kernel's tests (tests/unit/kernels/test_prefill_cpu.py) on the AVX2-only build
(-march=haswell: 8-wide vectors, tiles of 24 rows, the path of CPUs without AVX-512), compiled here."""
import pytest

from pagedserve.kernels import paged_prefill_cpu
from tests.unit.kernels.test_prefill_cpu import (  # noqa: F401 (collected here, with this module's build)
    test_long_chunks_match_reference, test_maximum_moving_between_keys, test_nan_past_the_contexts_is_never_read)


@pytest.fixture
def build(monkeypatch):
    """The prefill kernel built for -march=haswell; the default build again after."""
    monkeypatch.setenv("PAGEDSERVE_NATIVE_MARCH", "haswell")
    paged_prefill_cpu._native.reset()
    if not paged_prefill_cpu.native_available():
        pytest.skip("the prefill kernel does not build for -march=haswell here")
    assert paged_prefill_cpu._native.get().paged_prefill_tile_rows() == 24
    yield "haswell"
    monkeypatch.undo()
    paged_prefill_cpu._native.reset()

"""The Triton kernels' integer arguments that change from step to step are not specialized
(pagedserve/kernels/paged_attention_triton.py, "Specialization"): each name given to do_not_specialize
is one of the kernel's parameters (a misspelt name would be ignored silently), and none of
them is a constexpr. Whether the compile cache then grows once per shape is measured on the
GPU (scripts/gpu_check.py, kernels part: `recompiles`)."""
import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

VARYING = {  # kernel: the arguments that vary per step in a server
    "_paged_attention_kernel": {"num_seqs", "tiles_per_split", "num_splits", "stride_btb"},
    "_reduce_splits_kernel": {"num_splits"},
}


def kernels():
    from pagedserve.kernels import paged_attention_triton

    return {name: getattr(paged_attention_triton, name) for name in VARYING}


def names(kernel) -> set[str]:
    return {kernel.arg_names[p] if isinstance(p, int) else p for p in kernel.do_not_specialize}


@pytest.mark.parametrize("name", sorted(VARYING))
def test_varying_arguments_are_not_specialized(name):
    kernel = kernels()[name]
    assert names(kernel) == VARYING[name]
    assert names(kernel) <= set(kernel.arg_names)
    constexprs = {p.name for p in kernel.params if p.is_constexpr}
    assert not names(kernel) & constexprs


def test_the_split_count_is_not_a_constexpr():
    """A constexpr split count compiled the kernel again for each count choose_splits picks."""
    kernel = kernels()["_paged_attention_kernel"]
    constexprs = {p.name for p in kernel.params if p.is_constexpr}
    assert "SPLIT" in constexprs and "NUM_SPLITS" not in constexprs

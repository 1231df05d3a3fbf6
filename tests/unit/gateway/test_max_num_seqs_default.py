"""--max-num-seqs off: the batch the executor names (its largest CUDA graph on a GPU), else the CPU's default."""
import dataclasses

import pytest

from pagedserve.gateway.scheduler_config import CPU_MAX_NUM_SEQS, SchedulerConfig
from pagedserve.wire import convert
from pagedserve.wire.protocol import KVGeometry, ModelInfo

INFO = ModelInfo("m", 128, 100, [1], None, "", KVGeometry(2, 2, 8, 16))


@pytest.mark.parametrize("given, named, expect", [
    (None, 0, CPU_MAX_NUM_SEQS),  # a CPU executor names none
    (None, 256, 256),  # a GPU executor's largest graph
    (24, 256, 24),  # the flag wins
])
def test_max_num_seqs_follows_the_executor_unless_given(given, named, expect):
    info = dataclasses.replace(INFO, max_num_seqs=named)
    assert SchedulerConfig(max_num_seqs=given).resolved(info.max_num_seqs).max_num_seqs == expect


def test_the_executor_names_its_batch_across_the_wire():
    info = dataclasses.replace(INFO, max_num_seqs=256)
    assert convert.model_info_from_proto(convert.model_info_to_proto(info)).max_num_seqs == 256


def test_a_bad_value_names_the_flag():
    with pytest.raises(ValueError, match="--max-num-seqs must be positive"):
        SchedulerConfig(max_num_seqs=0)

"""Where a tensor-parallel group meets and which ranks run here (pagedserve.executor.tp_group, issue 29):
the defaults keep every rank on this host; LeaderWorkerSet's environment places a pod in
its group; settings that disagree with it, or a size the pods cannot split, name the
variable and the flag."""
import pytest

from pagedserve.executor.config import ExecutorConfig
from pagedserve.executor.tp_group import (
    GroupLayout,
    TensorParallelGroupConfig,
    layout_of,
)
from pagedserve.wire.settings import from_args, to_argv

LWS = {"LWS_LEADER_ADDRESS": "pagedserve-0.pagedserve.default", "LWS_GROUP_SIZE": "2",
       "LWS_WORKER_INDEX": "1"}


def group(**kw) -> TensorParallelGroupConfig:
    return TensorParallelGroupConfig(**kw)


def test_the_default_is_every_rank_on_this_host():
    layout = layout_of(2, group(), env={})
    assert layout == GroupLayout(2, 1, 0, "127.0.0.1", 0)
    assert list(layout.local_ranks) == [0, 1]


def test_leaderworkerset_places_a_worker_pod():
    layout = layout_of(4, group(tensor_parallel_port=29500), env=LWS)
    assert (layout.nodes, layout.node, layout.host, layout.port) == (2, 1, LWS["LWS_LEADER_ADDRESS"], 29500)
    assert list(layout.local_ranks) == [2, 3]
    leader = layout_of(4, group(tensor_parallel_port=29500), env=dict(LWS, LWS_WORKER_INDEX="0"))
    assert list(leader.local_ranks) == [0, 1]


def test_flags_alone_place_a_node():
    layout = layout_of(2, group(tensor_parallel_host="10.0.0.5", tensor_parallel_port=29500,
                                tensor_parallel_nodes=2, tensor_parallel_node=1), env={})
    assert list(layout.local_ranks) == [1] and layout.host == "10.0.0.5"


@pytest.mark.parametrize("world, config, env, words", [
    (3, group(tensor_parallel_port=29500), LWS, ["LWS_GROUP_SIZE=2", "--tensor-parallel-size 3"]),
    (1, group(tensor_parallel_port=29500), LWS, ["LWS_GROUP_SIZE=2", "--tensor-parallel-size 1"]),
    (4, group(tensor_parallel_port=29500, tensor_parallel_nodes=4), LWS,
     ["LWS_GROUP_SIZE=2", "--tensor-parallel-nodes 4"]),
    (4, group(tensor_parallel_port=29500, tensor_parallel_node=2), dict(LWS, LWS_GROUP_SIZE="4"),
     ["LWS_WORKER_INDEX=1", "--tensor-parallel-node 2"]),
    (4, group(tensor_parallel_port=29500), dict(LWS, LWS_WORKER_INDEX="2"), ["LWS_WORKER_INDEX=2"]),
    (4, group(tensor_parallel_port=29500), dict(LWS, LWS_GROUP_SIZE="two"), ["LWS_GROUP_SIZE='two'"]),
    (4, group(), LWS, ["--tensor-parallel-port"]),
    (4, group(tensor_parallel_port=29500, tensor_parallel_nodes=2), {}, ["--tensor-parallel-host"]),
    (4, group(tensor_parallel_node=1), {}, ["--tensor-parallel-node 1", "--tensor-parallel-nodes 1"]),
])
def test_disagreements_name_the_variable_and_the_flag(world, config, env, words):
    with pytest.raises(ValueError) as e:
        layout_of(world, config, env=env)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_the_settings_are_flags_of_the_executor():
    import argparse

    from pagedserve.wire.settings import add_flags

    parser = argparse.ArgumentParser()
    add_flags(parser, ExecutorConfig)
    args = parser.parse_args(["--tensor-parallel-size", "4", "--tensor-parallel-host", "leader",
                              "--tensor-parallel-port", "29500", "--tensor-parallel-nodes", "2",
                              "--tensor-parallel-node", "1"])
    config = from_args(ExecutorConfig, args)
    assert config.tensor_parallel_group == group(tensor_parallel_host="leader", tensor_parallel_port=29500,
                                                 tensor_parallel_nodes=2, tensor_parallel_node=1)
    again = from_args(ExecutorConfig, parser.parse_args(to_argv(config)))
    assert again.tensor_parallel_group == config.tensor_parallel_group
    with pytest.raises(ValueError, match="--tensor-parallel-port must be in 0..65535"):
        group(tensor_parallel_port=70000)

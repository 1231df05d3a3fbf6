"""Where a tensor-parallel group meets and which of its ranks this process runs
(docs/ARCHITECTURE.md, "Tensor parallelism"; deploy/README.md for LeaderWorkerSet).

- The group meets at rank 0's `--tensor-parallel-host:--tensor-parallel-port`
  (torch.distributed's TCP store; the collectives then connect rank to rank). Default:
  127.0.0.1 and a free port, every rank on this host.
- A group may span `--tensor-parallel-nodes` nodes (pods), its N ranks split evenly: node i
  runs ranks [i*N/nodes, (i+1)*N/nodes). Node 0 runs rank 0, the executor service that
  registers with memsvc and answers gateways, and its other local ranks; a node i > 0 runs
  only its ranks, as workers that join rank 0's group (`run_worker_node`), holding their
  own KV pools (pagedserve.executor.tp_pools); it exits when one of them does, so its pod restarts
  with the group.
- Under a LeaderWorkerSet the pod's environment says the same: LWS_LEADER_ADDRESS (the
  host), LWS_GROUP_SIZE (the nodes), LWS_WORKER_INDEX (the node, 0 for the leader). They
  fill the settings left at their defaults; a setting given otherwise, or a group size
  that does not divide --tensor-parallel-size, is a ValueError naming the variable.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass

from pagedserve.wire.settings import setting


@dataclass
class TensorParallelGroupConfig:
    tensor_parallel_host: str | None = setting(
        None, "where rank 0 of a tensor-parallel group listens for its other ranks to join "
        "(torch.distributed's TCP store): an address every node of the group reaches (off: "
        "LWS_LEADER_ADDRESS under a LeaderWorkerSet, else 127.0.0.1)", metavar="HOST")
    tensor_parallel_port: int = setting(
        0, "the port of that rendezvous (0: a free one, for a group on one node; a group over "
        "several nodes needs a fixed one)", metavar="PORT")
    tensor_parallel_nodes: int = setting(
        1, "nodes (pods) the tensor-parallel group spans, its ranks split evenly; the ranks of "
        "nodes other than memsvc's hold their own KV pools, so memsvc preempts by recompute "
        "only (off: LWS_GROUP_SIZE under a LeaderWorkerSet, else 1)", metavar="NODES")
    tensor_parallel_node: int = setting(
        0, "this node's index in the group: 0 runs rank 0 (the executor service) and its local "
        "ranks, i > 0 only its ranks, joining rank 0's group (off: LWS_WORKER_INDEX under a "
        "LeaderWorkerSet, else 0)", metavar="INDEX")

    def __post_init__(self) -> None:
        if not 0 <= self.tensor_parallel_port < 65536:
            raise ValueError(f"--tensor-parallel-port must be in 0..65535, got {self.tensor_parallel_port}")
        if self.tensor_parallel_nodes < 1:
            raise ValueError(f"--tensor-parallel-nodes must be >= 1, got {self.tensor_parallel_nodes}")
        if self.tensor_parallel_node < 0:
            raise ValueError(f"--tensor-parallel-node must be >= 0, got {self.tensor_parallel_node}")


@dataclass(frozen=True)
class GroupLayout:
    """The group as this process sees it: N ranks over `nodes`, this one `node`."""

    world: int
    nodes: int = 1
    node: int = 0
    host: str = "127.0.0.1"
    port: int = 0  # 0: rank 0 picks a free one (one node only)

    @property
    def ranks_per_node(self) -> int:
        return self.world // self.nodes

    @property
    def local_ranks(self) -> range:
        k = self.ranks_per_node
        return range(self.node * k, (self.node + 1) * k)

    @property
    def holds_own_pool(self) -> list[bool]:
        """Per rank: whether it holds its own KV pool (pagedserve.executor.tp_pools). memsvc runs on
        node 0, beside rank 0; the ranks of other nodes cannot map its memory."""
        return [r >= self.ranks_per_node for r in range(self.world)]


def _lws(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name)
    return value.strip() if value and value.strip() else None


def _int_var(env: Mapping[str, str], name: str) -> int | None:
    value = _lws(env, name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer (set by LeaderWorkerSet)") from None


def layout_of(world: int, group: TensorParallelGroupConfig,
              env: Mapping[str, str] | None = None) -> GroupLayout:
    """This process's GroupLayout from the settings and LeaderWorkerSet's environment."""
    env = os.environ if env is None else env
    nodes, node, host = group.tensor_parallel_nodes, group.tensor_parallel_node, group.tensor_parallel_host
    lws_size, lws_index = _int_var(env, "LWS_GROUP_SIZE"), _int_var(env, "LWS_WORKER_INDEX")
    lws_leader = _lws(env, "LWS_LEADER_ADDRESS")
    if lws_size is not None:
        if nodes not in (1, lws_size):
            raise ValueError(f"LWS_GROUP_SIZE={lws_size} but --tensor-parallel-nodes {nodes}: leave "
                             f"the flag unset under a LeaderWorkerSet, or make them agree")
        if lws_size < 1:
            raise ValueError(f"LWS_GROUP_SIZE={lws_size}: a LeaderWorkerSet group has at least one pod")
        nodes = lws_size
    if lws_index is not None:
        if node not in (0, lws_index):
            raise ValueError(f"LWS_WORKER_INDEX={lws_index} but --tensor-parallel-node {node}: leave "
                             f"the flag unset under a LeaderWorkerSet, or make them agree")
        if not 0 <= lws_index < nodes:
            raise ValueError(f"LWS_WORKER_INDEX={lws_index} is not below the group's {nodes} pods "
                             f"(LWS_GROUP_SIZE / --tensor-parallel-nodes)")
        node = lws_index
    if lws_leader is not None and host is None:
        host = lws_leader
    if node >= nodes:
        raise ValueError(f"--tensor-parallel-node {node} is not below --tensor-parallel-nodes {nodes}")
    source = f"LWS_GROUP_SIZE={nodes}" if lws_size is not None else f"--tensor-parallel-nodes {nodes}"
    if nodes > 1 and (world < nodes or world % nodes):
        raise ValueError(f"--tensor-parallel-size {world} does not split evenly over {source} pods "
                         f"(each runs the same number of ranks): choose a multiple of {nodes}")
    if nodes > 1 and not group.tensor_parallel_port:
        raise ValueError(f"a tensor-parallel group over {nodes} nodes needs a fixed "
                         f"--tensor-parallel-port (every node's ranks connect to it), not 0")
    if nodes > 1 and host is None:
        raise ValueError(f"a tensor-parallel group over {nodes} nodes needs --tensor-parallel-host "
                         f"(rank 0's address) or LWS_LEADER_ADDRESS")
    return GroupLayout(world, nodes, node, host or "127.0.0.1", group.tensor_parallel_port)


def run_worker_node(config, layout: GroupLayout) -> int:
    """Run this node's ranks (node > 0) as tp_worker processes until one exits (its status)
    or SIGTERM/SIGINT (0): then stop the others."""
    from pagedserve.executor.model_source import resolve_model
    from pagedserve.executor.server import resolve_device
    from pagedserve.executor.tensor_parallel import launch_worker
    from pagedserve.pool_share.device import resolve_dtype
    from pagedserve.rpc.grpc_service import get_logger

    log = get_logger("executor")
    torch_device, _ = resolve_device(config.device)
    args = dict(model=resolve_model(config.model, config.revision), dtype=resolve_dtype(config.dtype, torch_device),
                block_size=config.block_size, device=torch_device,
                linear_backend=config.linear_backend, world=layout.world,
                address=f"{layout.host}:{layout.port}", timeout_s=config.tensor_parallel_timeout)
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stopping.append(signum))
    procs = {r: launch_worker(dict(args, rank=r)) for r in layout.local_ranks}
    log.info("tensor-parallel node %d of %d: ranks %s of %d joining %s", layout.node, layout.nodes,
             list(layout.local_ranks), layout.world, args["address"])
    code = 0
    while not stopping:
        done = [(r, p) for r, p in procs.items() if p.poll() is not None]
        if done:
            rank, proc = done[0]
            code = proc.returncode or 1
            log.error("tensor-parallel rank %d exited with code %s; stopping this node's ranks",
                      rank, proc.returncode)
            break
        time.sleep(0.2)
    for proc in procs.values():
        if proc.poll() is None:
            proc.terminate()
    for proc in procs.values():
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return code

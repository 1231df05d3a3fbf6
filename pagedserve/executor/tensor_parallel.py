"""A tensor-parallel executor group: `world` processes joined by torch.distributed (gloo on a
CPU), each computing every step on its shard of the model (pagedserve.executor.sharding).

- Rank 0 is the executor the rest of pagedserve talks to. `Leader` validates nothing
  itself (ShardPlan.of does, before anything starts), launches its node's other ranks as
  child processes (`python -m pagedserve.executor.tp_worker`, which exit when it does; other nodes'
  join from there: pagedserve.executor.tp_group), joins the group and watches them. Each step goes
  out first, broadcast as a protobuf message in a tensor (`lead`, pagedserve.executor.tp_broadcast:
  never pickled); then every rank runs it, so all ranks meet the same collectives in the
  same order; rank 0's outputs are the answer.
- Collectives: the row-parallel projections (o_proj, down; Mixtral's whole MLP) all-reduce
  their output, the vocab-parallel embedding all-reduces the looked-up rows, the LM head
  all-gathers the logits (every rank samples the same rows; only rank 0's are used).
- The pools: one per rank, each rank mapping only its own (pagedserve.executor.tp_pools).
- Faults: every collective times out after `timeout_s` (gloo raises; no rank waits
  forever); rank 0 broadcasts a heartbeat when idle so waiting ranks do not time out. A
  worker that exits, or a collective that fails, puts the group down: logged, `on_lost`
  called (the executor service exits so its supervisor restarts the whole group), and every
  later step raises GroupDown. A worker whose leader goes away exits.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pagedserve.executor import tp_broadcast
from pagedserve.executor.sharding import ShardPlan
from pagedserve.executor.tp_group import GroupLayout
from pagedserve.rpc.ports import free_port

DEFAULT_TIMEOUT_S = 60.0
log = logging.getLogger("pagedserve.executor")


class GroupDown(RuntimeError):
    """The tensor-parallel group lost a rank: restart the whole group."""


def join(plan: ShardPlan, address: str, device: torch.device, timeout_s: float) -> None:
    """Join the group as plan.rank (blocks until every rank has joined, at most timeout_s)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{address}", rank=plan.rank,
                            world_size=plan.world, timeout=timedelta(seconds=timeout_s))
    if device.type == "cpu":  # the ranks share the cores
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        if not os.environ.get("OMP_NUM_THREADS"):
            torch.set_num_threads(max(1, (cores or 1) // plan.world))


class Collectives:
    """What a shard's forward needs from the group (set as the model's `tp`)."""

    def __init__(self, plan: ShardPlan):
        self.plan = plan

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def embed(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Rows of this rank's vocabulary part looked up, the others zero, summed over ranks."""
        p = self.plan
        local = input_ids - p.vocab_start
        outside = (local < 0) | (local >= p.vocab_per_rank)
        x = F.embedding(local.clamp(0, p.vocab_per_rank - 1), weight)
        x[outside] = 0
        return self.all_reduce(x)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, vocab_per_rank] on each rank -> [N, vocab] on every rank."""
        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.plan.world)]
        dist.all_gather(parts, logits)
        return torch.cat(parts, -1)[:, : self.plan.vocab_size]


class RowParallel(nn.Module):
    """A row-parallel projection: this rank's partial output, summed over the ranks."""

    def __init__(self, inner: nn.Module, collectives: Collectives):
        super().__init__()
        self.inner = inner
        self.collectives = collectives

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.collectives.all_reduce(self.inner(x))


def shard_model(model: nn.Module, plan: ShardPlan) -> None:
    """Wire a model built from plan's weights (ShardPlan.weights) into the group."""
    c = Collectives(plan)
    model.tp = c
    model.cuda_graph_safe = False  # graphs would capture the collectives
    for layer in model.layers:
        layer.o = RowParallel(layer.o, c)
        if hasattr(layer, "down"):
            layer.down = RowParallel(layer.down, c)
        else:  # Mixtral: each expert's down projection is partial, so the whole MLP's sum is
            mlp = layer.mlp
            layer.mlp = lambda h, mlp=mlp: c.all_reduce(mlp(h))


def free_address(host: str = "127.0.0.1") -> str:
    return f"{host}:{free_port(host)}"


class Leader:
    """Rank 0's side: the workers it launched, the step broadcast, the heartbeat and the watch."""

    def __init__(self, plan: ShardPlan, device: torch.device, worker_args: dict, timeout_s: float,
                 on_lost: Callable[[str], None] | None = None, layout: GroupLayout | None = None):
        self.plan, self.device, self.timeout_s, self.on_lost = plan, device, timeout_s, on_lost
        self.lock = threading.Lock()
        self.down: str | None = None
        self.last_send = time.monotonic()
        layout = layout or GroupLayout(plan.world)
        address = f"{layout.host}:{layout.port}" if layout.port else free_address(layout.host)
        # this node's other ranks; those of other nodes join from there (pagedserve.executor.tp_group)
        self.workers = [launch_worker(dict(worker_args, rank=r, world=plan.world, address=address,
                                           timeout_s=timeout_s)) for r in layout.local_ranks if r]
        try:
            join(plan, address, device, timeout_s)
        except BaseException:
            self.stop_workers()
            raise
        log.info("tensor-parallel group of %d ranks joined at %s", plan.world, address)
        for r, proc in enumerate(self.workers, 1):
            threading.Thread(target=self._watch, args=(r, proc), daemon=True,
                             name=f"tp-watch-{r}").start()
        threading.Thread(target=self._heartbeat, daemon=True, name="tp-heartbeat").start()
        atexit.register(self.close)  # a caller that never closes still stops its workers

    def lead(self, kind: str, payload, run: Callable[[], object] | None = None):
        """Broadcast (kind, payload) to the workers (pagedserve.executor.tp_broadcast), then run this
        rank's part (`run`)."""
        with self.lock:
            if self.down is not None:
                raise GroupDown(self.down)
            try:
                tp_broadcast.send(kind, payload, self.device)
                self.last_send = time.monotonic()
                return run() if run is not None else None
            except Exception as e:  # noqa: BLE001  (a bad batch fails alike on every rank)
                if not _is_collective_error(e):
                    raise
                self._lose(f"a collective failed ({e})")
                raise GroupDown(self.down) from e

    def _lose(self, why: str) -> None:
        if self.down is not None:
            return
        self.down = f"tensor-parallel group down: {why}"
        log.error("%s; the whole group must restart", self.down)
        if self.on_lost is not None:
            self.on_lost(self.down)

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self.stopping:
            self._lose(f"rank {rank} (pid {proc.pid}) exited with code {code}")

    def _heartbeat(self) -> None:
        every = self.timeout_s / 4
        while self.down is None and not self.stopping:
            time.sleep(every / 4)
            if time.monotonic() - self.last_send < every or not self.lock.acquire(blocking=False):
                continue
            try:
                if self.down is None and not self.stopping:
                    tp_broadcast.send("ping", None, self.device)
                    self.last_send = time.monotonic()
            except RuntimeError as e:
                self._lose(f"the heartbeat failed ({e})")
            finally:
                self.lock.release()

    stopping = False

    def close(self) -> None:
        """Tell the workers to stop (killed if they do not), then leave the group."""
        if self.stopping:
            return
        try:
            if self.down is None:
                self.lead("stop", None)
        except RuntimeError:
            pass
        self.stopping = True
        self.stop_workers()
        if dist.is_initialized():
            dist.destroy_process_group()

    def stop_workers(self) -> None:
        self.stopping = True
        for proc in self.workers:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _is_collective_error(e: BaseException) -> bool:
    if isinstance(e, dist.DistError):
        return True
    text = str(e).lower()
    return any(w in text for w in ("gloo", "nccl", "connection", "timed out", "peer"))


def launch_worker(args: dict) -> subprocess.Popen:
    """`python -m pagedserve.executor.tp_worker ARGS` as a child process (it exits when its parent goes:
    pagedserve.executor.tp_worker)."""
    return subprocess.Popen([sys.executable, "-m", "pagedserve.executor.tp_worker", json.dumps(args)])

"""A tensor-parallel worker: rank 1.. of an executor group (pagedserve.executor.tensor_parallel).

`python -m pagedserve.executor.tp_worker '{"model": ..., "rank": r, "world": n, "address": "host:port",
"timeout_s": s, ...}'`, started by rank 0. It joins the group, loads its shard, then runs
the commands rank 0 broadcasts (pagedserve.executor.tp_broadcast: protobuf, never pickle), in order,
until "stop": "attach" maps this rank's own pool (the list of every rank's pool specs),
"execute"/"logits" run the step on its shard (outputs dropped: rank 0 answers), "ping" is
the idle heartbeat. A batch rejected as invalid is rejected alike on every rank
and skipped; any other failure, a collective that times out or fails, or rank 0 exiting,
ends this process with status 1 (rank 0 sees it and the group goes down).
"""
from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time

import torch.distributed as dist

from pagedserve.executor import tp_broadcast

log = logging.getLogger("pagedserve.executor")


def run(executor) -> None:
    while True:
        kind, payload = tp_broadcast.receive(executor.device)
        if kind == "stop":
            return
        if kind == "attach":
            executor.attach_pool(payload)
        elif kind in ("execute", "logits"):
            try:
                getattr(executor.runner, kind)(payload)
            except (ValueError, IndexError):
                pass  # rank 0 rejected the same batch, the same way


def exit_with_parent(interval: float = 0.5) -> None:
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(interval)
        log.error("tensor-parallel worker: rank 0 (pid %d) is gone; exiting", parent)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="tp-parent-watch").start()


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s tp-worker %(levelname)s %(message)s")
    args = json.loads(argv[1])
    exit_with_parent()
    from pagedserve.executor import Executor

    rank = args["rank"]
    try:
        executor = Executor(args["model"], dtype=args["dtype"], block_size=args["block_size"],
                            device=args["device"], linear_backend=args["linear_backend"],
                            tensor_parallel_size=args["world"], group_timeout=args["timeout_s"],
                            rank=(rank, args["address"]),
                            kv_cache_dtype=args.get("kv_cache_dtype", "auto"))
        run(executor)
    except Exception as e:  # noqa: BLE001  (logged; rank 0 sees the exit)
        log.error("tensor-parallel rank %d: %s: %s; exiting", rank, type(e).__name__, e)
        return 1
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

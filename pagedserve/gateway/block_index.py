"""Which prefix-cache blocks one replica holds, as its memsvc's WatchBlocks stream says.

A thread follows the stream (reconnecting while memsvc is away): a snapshot replaces the
key set, later messages add what was stored and drop what was evicted, and each carries
the pool's load. `leading(keys)` counts how many of a prompt's chained block keys
(pagedserve.wire.block_keys) the replica holds from the start, which is what a prefix-cache hit
there would reuse. `note_routed(keys)` adds a routed prompt's keys before memsvc reports
them, so requests that arrive together with the same prefix follow the first one; an
eviction reported later removes them again.
"""
from __future__ import annotations

import threading

import grpc

from pagedserve.wire.v1 import memory_pb2, memory_pb2_grpc


class BlockIndex:
    def __init__(self, channel: grpc.Channel, interval_s: float = 1.0, retry_s: float = 0.5):
        self.stub = memory_pb2_grpc.MemoryManagerStub(channel)
        self.interval_s = interval_s
        self.retry_s = retry_s
        self.keys: set[bytes] = set()
        self.num_blocks = 0
        self.blocks_free = 0
        self.pool_id = ""
        self.connected = False
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._call = None
        self._thread = threading.Thread(target=self._follow, name="block-index", daemon=True)
        self._thread.start()

    def leading(self, keys: list[bytes]) -> int:
        with self._lock:
            n = 0
            for key in keys:
                if key not in self.keys:
                    break
                n += 1
            return n

    def note_routed(self, keys: list[bytes]) -> None:
        with self._lock:
            self.keys.update(keys)

    def kv_usage(self) -> float:
        """Fraction of the pool's blocks in use (0 when not known yet)."""
        return 1.0 - self.blocks_free / self.num_blocks if self.num_blocks else 0.0

    def apply(self, events: memory_pb2.BlockEvents) -> None:
        with self._lock:
            if events.snapshot:
                self.keys = set(events.stored)
            else:
                self.keys.update(events.stored)
                self.keys.difference_update(events.evicted)
            self.num_blocks, self.blocks_free = events.num_blocks, events.blocks_free
            self.pool_id = events.pool_id

    def close(self) -> None:
        self._closed.set()
        if self._call is not None:
            self._call.cancel()

    def _follow(self) -> None:
        while not self._closed.is_set():
            try:
                self._call = self.stub.WatchBlocks(
                    memory_pb2.WatchBlocksRequest(interval_s=self.interval_s))
                for events in self._call:
                    self.connected = True
                    self.apply(events)
            except grpc.RpcError:
                pass  # memsvc away or restarting: follow it again
            self.connected = False
            self._closed.wait(self.retry_s)

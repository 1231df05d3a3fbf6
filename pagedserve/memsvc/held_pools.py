"""Ranks that hold their own KV pools (docs/ARCHITECTURE.md, "Tensor parallelism").

A tensor-parallel rank on another node cannot map memsvc's memory, so it allocates a pool of
the same block geometry itself and memsvc holds none for it. What memsvc can then promise:
- preemption by recompute alone and no prefix-cache host tier (either would copy that
  rank's blocks to memsvc's host, which it cannot reach): a setting asking for them is a
  ValueError naming it;
- every copy-on-write copy goes back with the step (`held_copies`), for those ranks to apply
  before its forward pass, in the order of the step stream;
- rank 0 holds no pool of its own: it runs beside memsvc and maps memsvc's.
"""
from __future__ import annotations


def check_holds(holds_pool: list[bool] | None, ranks: int, config) -> list[bool]:
    """One flag per rank (none given: no rank holds its pool); ValueError naming the setting
    that cannot hold with ranks that do."""
    holds = [bool(h) for h in holds_pool] if holds_pool else [False] * ranks
    if len(holds) != ranks:
        raise ValueError(f"rank_holds_pool has {len(holds)} entries for {ranks} ranks: one per rank")
    if not any(holds):
        return holds
    if holds[0]:
        raise ValueError("rank_holds_pool: rank 0 runs beside memsvc and maps memsvc's pool; only "
                         "ranks on other nodes may hold their own")
    if config.preemption_mode == "swap":
        raise ValueError("--preemption-mode swap: ranks on other nodes hold their own KV pools, "
                         "whose blocks memsvc cannot copy to its host; use recompute or auto "
                         "(which then recomputes)")
    if config.kv_offload or config.num_offload_blocks:
        raise ValueError("--kv-offload: ranks on other nodes hold their own KV pools, whose "
                         "blocks memsvc cannot copy to its host tier; leave it at 0")
    return holds


def held_copies(copies: list[tuple[str, int, int]]) -> list[tuple[int, int]]:
    """The (src, dst) pairs of a Reserve's copies for ranks that hold their pools: copy-on-write
    only, since those ranks get neither swap space nor host tier."""
    out = []
    for kind, src, dst in copies:
        if kind != "cow":
            raise AssertionError(f"a {kind!r} copy with ranks that hold their own pools")
        out.append((src, dst))
    return out


def held_text(holds: list[bool]) -> str:
    held = [r for r, h in enumerate(holds) if h]
    return f", ranks {held} holding their own pools" if held else ""

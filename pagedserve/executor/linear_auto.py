"""How `--linear-backend auto` decides one weight shape's routes (for pagedserve.executor.linear_backend).

AutoPlan(rows).decide(layer) -> Decision(seconds, routes, source, note), one per shape.
- The shape is timed at the rows (pagedserve.executor.linear_timing) unless an earlier load kept its
  timings (pagedserve.executor.linear_plan_cache). Only an idle timing (pagedserve.executor.linear_idle) is kept,
  and only an idle one can move a shape off oneDNN (routes_from: oneDNN or the C++ "panel"
  kernel, whichever is faster over every M, holds the shape's one packed copy; a backend on the
  dense weight, MKL or the C++ "dot" kernel, must win an M by PREFER_MARGIN, or win at every M).
  A busy timing is taken once more after RETRY_WAIT_S; busy again, that shape and every
  later one of this load are not timed and nothing is kept: each serves the timings an earlier
  load kept (taken idle) where there are some, else oneDNN at every M.
- Kept timings are checked once a load (check(layers), before the first shape is decided):
  the largest kept shape is timed again at every M, each other one only at the smallest M
  timed warm (check_rows: a decode batch, a few milliseconds; where a contended minute had
  once spoiled one). An idle timing off the kept one (the kept backend at a timed M now
  beaten by a rival by the margin routes_from would move the M at: `beaten`) has every
  shape of this load timed again and its timings replaced. Only the backends' comparison counts: a shared host runs
  them all a third slower or faster from one hour to the next, and a backend no M is routed
  to (MKL at 64 rows, 62-104 GFLOP/s from one load to the next) decides nothing.
  A check the machine is too busy for leaves the kept timings in use (they were taken idle)
  and says so in the note.
Each decision is logged; `source` is "timed", "cache", "busy" or "untimed" (oneDNN failed).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from pagedserve.executor import linear_plan_cache as plan_cache
from pagedserve.executor.linear import DENSE, PACKED, Linear
from pagedserve.executor.linear_timing import COLD_BELOW, Timing, time_shape, timed_backends

PREFER_MARGIN = 1.10  # MKL or "dot" serves an M only where it is faster than the packed backend by more
# than this: a win inside the timing noise would flip from one load to the next
ALL_DENSE_MARGIN = 1.03  # ... or every M, where they win at one by PREFER_MARGIN and are nowhere
# slower by more than this (timing noise): one copy, the dense weight, serves them all
MIXED_MARGIN = 1.25  # the packed backend at most 25% slower than MKL: one copy of the weight beats two
# (measured, AMD EPYC: where MKL wins, at M = 1 on the 576-wide projections, by 15-40%, that is
# <= 0.7 ms of a ~25 ms decode step, for 105 MiB more weights)
ATTEMPTS = 2
RETRY_WAIT_S = 1.0
ONEDNN = [(None, "onednn")]
NAMES = {"mkl": "MKL", "onednn": "oneDNN", "panel": "the panel kernel"}

log = logging.getLogger("pagedserve.executor")


@dataclass
class Decision:
    seconds: dict[int, dict[str, float]]
    routes: list[tuple[int | None, str]]
    source: str
    note: str = ""


class AutoPlan:
    """The decisions of one load: what the check of the kept timings found, and whether the
    machine was found busy (then nothing more is timed)."""

    def __init__(self, rows: tuple[int, ...]):
        self.rows = rows
        self.checked: str | None = None  # the check's finding, once run
        self.stale: str | None = None  # why kept timings are not used at this load
        self.busy: str | None = None  # why nothing more is timed at this load
        self.fresh: dict[tuple[int, int], Timing] = {}  # the check's timing, used once

    def check(self, layers: list[Linear]) -> None:
        """Time the shapes of `layers` whose timings are kept, once a load, against them: the
        largest at every M, the others at check_rows (a contended minute can spoil one shape's
        comparison and not another's: docs/benchmark-history.md, issue 44)."""
        if self.checked is not None:
            return
        kept = {layer.shape: (layer, s) for layer in layers if (s := plan_cache.load(self._key(layer))) is not None}
        order = sorted(kept.values(), key=lambda pair: -math.prod(pair[0].shape))
        checked, full = [], {}
        for i, (layer, seconds) in enumerate(order):
            rows = self.rows if i == 0 else check_rows(self.rows, seconds)
            if not rows:
                continue
            timing, name = self._time(layer, rows), "{}x{}".format(*layer.shape)
            if not timing.seconds:
                self.checked = f"not checked: oneDNN failed at {name}"
                return
            if (busy := timing.busy()) is not None:
                self.busy = f"the machine was busy at {name}: {busy}"
                self.checked = f"not checked: {self.busy}"
                log.warning("linear plan %s: %s; the kept timings serve (taken idle), a shape without "
                            "any gets oneDNN", plan_cache.path(), self.checked)
                return
            if i == 0:
                full[layer.shape] = timing
            if (why := off(seconds, timing.seconds, shared=not layer.owns_weight)) is not None:
                self.checked = self.stale = f"the kept timings were off at {name} ({why}): timed again"
                self.fresh = full
                log.warning("linear plan %s: %s", plan_cache.path(), self.stale)
                return
            checked.append(name if i == 0 else f"{name} at M={','.join(map(str, rows))}")
        if checked:
            self.checked = f"checked idle at {', '.join(checked)}"

    def decide(self, layer: Linear) -> Decision:
        n, k = layer.shape
        key = self._key(layer)
        if self.checked is None and not self.stale:
            self.check([layer])
        kept = plan_cache.load(key)
        if kept is not None and not self.stale:
            log.info("linear %dx%d: timings kept from an earlier load (%s), %s", n, k,
                     plan_cache.path(), self.checked)
            return Decision(kept, routes_from(kept, shared=not layer.owns_weight), "cache", self.checked or "")
        if self.busy:
            return self._unsure(layer, kept, {}, f"not timed: {self.busy}")
        timing = self.fresh.pop(layer.shape, None) or self._time(layer)
        if not timing.seconds:
            return Decision({}, [(None, "mkl")], "untimed", "oneDNN failed here")
        if (busy := timing.busy()) is not None:
            self.busy = f"the machine was busy at {n}x{k}: {busy}"
            log.warning("linear %dx%d: timed while the machine was busy (%s): for this and every later "
                        "shape the timings an earlier load kept, else oneDNN at every M; nothing kept "
                        "(the next load times again)", n, k, busy)
            return self._unsure(layer, kept, timing.seconds, f"timings not kept: {busy}")
        plan_cache.store(key, timing.seconds)
        return Decision(timing.seconds, routes_from(timing.seconds, shared=not layer.owns_weight), "timed",
                        self.stale or "")

    @staticmethod
    def _unsure(layer: Linear, kept: dict[int, dict[str, float]] | None, seconds: dict[int, dict[str, float]],
                why: str) -> Decision:
        """A shape the machine is too busy to time: the timings an earlier load kept serve (taken
        idle, as where the check is too busy), else oneDNN at every M."""
        if kept is not None:
            return Decision(kept, routes_from(kept, shared=not layer.owns_weight), "cache",
                            f"the kept timings serve (taken idle), {why}")
        return Decision(seconds, ONEDNN, "busy", f"oneDNN, {why}")

    def _key(self, layer: Linear) -> str:
        return plan_cache.key(layer.shape, layer.weight.dtype, self.rows, timed_backends(layer))

    def _time(self, layer: Linear, rows: tuple[int, ...] | None = None) -> Timing:
        """time_shape at `rows` (default: the plan's), once more after RETRY_WAIT_S if the
        machine was busy."""
        for attempt in range(ATTEMPTS):
            if attempt:
                time.sleep(RETRY_WAIT_S)
            timing = time_shape(layer, rows or self.rows)
            busy = timing.busy()
            if not timing.seconds or busy is None:
                break
            if attempt + 1 < ATTEMPTS:
                log.info("linear %dx%d: timed while the machine was busy (%s); timing again", *layer.shape, busy)
        return timing


def off(kept: dict[int, dict[str, float]], now: dict[int, dict[str, float]], shared: bool = False) -> str | None:
    """Why an idle timing `now` (at some of the kept M) says the kept routes are wrong, or None."""
    if not set(now) <= set(kept) or any(set(kept[m]) != set(now[m]) for m in now):
        return f"kept at M {sorted(kept)}, timed at {sorted(now)}"
    if not all(s > 0 for t in now.values() for s in t.values()):
        return "a timing is not positive"
    own = packed_of(kept)
    for rival in PACKED:
        if rival != own and rival in kept[min(kept)] and (ratio := mean_ratio(now, rival, own)) * PREFER_MARGIN < 1:
            return (f"{NAMES[own]} kept, where {NAMES[rival]} is now faster by more than "
                    f"{PREFER_MARGIN - 1:.0%} (geometric mean over M {sorted(now)}: {ratio:.2f}x its time)")
    routes = routes_from(kept, shared)
    for m, t in sorted(now.items()):
        serving = backend_at(routes, m)
        for rival in sorted(t, key=t.get):
            if serving in PACKED and rival in PACKED:
                continue  # one of them serves every M a copy serves: compared over all M above
            margin = beaten(serving, rival, shared)
            if rival != serving and t[rival] * margin < t[serving]:
                return (f"{NAMES.get(serving, serving)} kept at M={m}, where {NAMES.get(rival, rival)} "
                        f"is now faster by more than {margin - 1:.0%}: {t[rival] * 1e6:.0f} us against "
                        f"{t[serving] * 1e6:.0f}")
    return None


def check_rows(rows: tuple[int, ...], kept: dict[int, dict[str, float]]) -> tuple[int, ...]:
    """The M at which a shape other than the largest is checked: the smallest of `rows` timed
    warm (a cold one reads a sweep larger than the last-level cache per call), if it was kept."""
    return tuple(m for m in sorted(rows) if m >= COLD_BELOW and m in kept)[:1]


def beaten(kept: str, rival: str, shared: bool) -> float:
    """By how much `rival` must now be faster at an M than the backend kept there for the kept
    routes to be wrong: PREFER_MARGIN where routes_from would move the M to it at that margin
    (between the two dense backends; from a dense backend to a packed one; from a packed one to
    a dense backend on a shared weight), MIXED_MARGIN where it would also weigh a second copy of
    the weight."""
    if kept in DENSE and rival in DENSE:
        return PREFER_MARGIN
    return MIXED_MARGIN if (rival in PACKED) == shared else PREFER_MARGIN


def mean_ratio(seconds: dict[int, dict[str, float]], a: str, b: str) -> float:
    """The geometric mean over the timed M of a's time over b's."""
    return math.exp(sum(math.log(t[a] / t[b]) for t in seconds.values()) / len(seconds))


def packed_of(seconds: dict[int, dict[str, float]]) -> str:
    """The one backend with a copy of its own (PACKED) a shape may use, the others' copies never
    made: the fastest over every timed M (the smallest geometric mean of its times; a tie to
    oneDNN), as one per M would hold two copies of the weight for a few percent."""
    timed = [b for b in PACKED if all(b in t for t in seconds.values())]
    return min(timed, key=lambda b: mean_ratio(seconds, b, timed[0]))


def backend_at(routes: list[tuple[int | None, str]], rows: int) -> str:
    return next(b for below, b in routes if below is None or rows < below)


def routes_from(seconds: dict[int, dict[str, float]], shared: bool = False) -> list[tuple[int | None, str]]:
    """The faster backend per timed M, boundaries at the geometric midpoints, equal
    neighbours merged. Of the backends with a copy of their own, one counts (packed_of: oneDNN
    or "panel"); among the two on the dense weight (MKL, "dot" where timed) the faster at each
    M; the dense one takes an M from the packed one by PREFER_MARGIN, or every M when it wins
    at one by PREFER_MARGIN and is slower at none by more than ALL_DENSE_MARGIN. A shape which
    would mix the packed backend with them goes to it at every M when it is within MIXED_MARGIN
    of them wherever they are faster (a mixed layer holds its weight twice, dense and packed: a
    win inside the timing noise is not worth that).
    `shared`: the dense weight is held anyway (a tied LM head shares the embedding's), so the
    roles swap: the packed copy is made only where it wins by PREFER_MARGIN, and not at all
    where it wins by under MIXED_MARGIN."""
    ms = sorted(seconds)
    own = packed_of(seconds)
    dense = {m: min((b for b in DENSE if b in seconds[m]), key=lambda b: seconds[m][b]) for m in ms}
    ratio = {m: seconds[m][own] / seconds[m][dense[m]] for m in ms}
    if shared:
        best = {m: own if ratio[m] * PREFER_MARGIN < 1 else dense[m] for m in ms}
        if own in best.values() and all(ratio[m] * MIXED_MARGIN >= 1 for m in ms):
            best = dense
    elif min(ratio.values()) * ALL_DENSE_MARGIN >= 1 and max(ratio.values()) > PREFER_MARGIN:
        best = dense
    else:
        best = {m: dense[m] if ratio[m] > PREFER_MARGIN else own for m in ms}
        if own in best.values() and all(r <= MIXED_MARGIN for r in ratio.values()):
            best = dict.fromkeys(ms, own)
    routes: list[tuple[int | None, str]] = []
    for i, m in enumerate(ms):
        below = math.ceil(math.sqrt(m * ms[i + 1])) if i + 1 < len(ms) else None
        if routes and routes[-1][1] == best[m]:
            routes[-1] = (below, best[m])
        else:
            routes.append((below, best[m]))
    return routes

"""Stop strings: find them across token boundaries and keep them out of the text."""
from __future__ import annotations


class StopStringFilter:
    """Holds back just enough text to never emit the start of a stop string."""

    def __init__(self, stop: list[str]):
        self.stop = [s for s in stop if s]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Return the text that is safe to emit; set `stopped` when a stop string appears."""
        if not self.stop:  # nothing is ever held back
            return text
        if self.stopped:
            return ""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            out, self.pending = self.pending[: min(hits)], ""
            return out
        cut = max(len(self.pending) - self.holdback, 0)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out

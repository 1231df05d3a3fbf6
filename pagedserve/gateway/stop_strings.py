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
        pending, at = self.pending + text, -1
        for stop in self.stop:  # the earliest wins
            i = pending.find(stop)
            if i >= 0 and (at < 0 or i < at):
                at = i
        if at >= 0:
            self.stopped, self.pending = True, ""
            return pending[:at]
        cut = len(pending) - self.holdback
        if cut <= 0:
            self.pending = pending
            return ""
        self.pending = pending[cut:]
        return pending[:cut]

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out

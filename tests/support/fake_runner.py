"""A step runner stand-in for replica-set and request-stream tests: records submissions and
aborts, does no work; `refuse` makes the next submission fail with that exception."""
from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace


class FakeRunner:
    def __init__(self):
        self.sinks, self.aborted = {}, []
        self.refuse: BaseException | None = None
        self.loop = SimpleNamespace(info="info", scheduler=SimpleNamespace(running=[], waiting=[]))

    def submit(self, request_id, prompt, sampling, sink, priority=0, salt=None):
        done = Future()
        if self.refuse is not None:
            done.set_exception(self.refuse)
            self.refuse = None
            return done
        self.sinks[request_id] = sink
        done.set_result(None)
        return done

    def abort(self, request_id):
        self.aborted.append(request_id)

    def stop(self, timeout=5.0):
        pass

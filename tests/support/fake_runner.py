"""A step runner stand-in for replica-set tests: records submissions and aborts, does no work."""
from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace


class FakeRunner:
    def __init__(self):
        self.sinks, self.aborted = {}, []
        self.loop = SimpleNamespace(info="info", scheduler=SimpleNamespace(running=[], waiting=[]))

    def submit(self, request_id, prompt, sampling, sink, priority=0):
        self.sinks[request_id] = sink
        done = Future()
        done.set_result(None)
        return done

    def abort(self, request_id):
        self.aborted.append(request_id)

    def stop(self, timeout=5.0):
        pass

"""pagedserve.supervisor's stop, on stand-in processes: wave by wave, the gateways first, and
the executor and memsvc signalled only once the gateways have exited (or been killed after
their own grace, the drain's)."""
import signal
import subprocess

from pagedserve.supervisor import ServiceSpec, Supervisor


class FakeProc:
    """A Popen stand-in that records, in one shared timeline, the signals it gets, how long
    each wait may last, and when it exits; it exits on SIGTERM unless it ignores it."""

    def __init__(self, name, timeline, ignores_term=False):
        self.name, self.timeline, self.ignores_term = name, timeline, ignores_term
        self.pid = hash(name) & 0xFFFF
        self.returncode = None
        self.signalled = None

    def poll(self):
        return self.returncode

    def send_signal(self, sig):
        self.timeline.append((signal.Signals(sig).name, self.name))
        if sig == signal.SIGKILL or not self.ignores_term:
            self.signalled = sig

    def wait(self, timeout=None):
        self.timeline.append(("wait", self.name, timeout))
        if self.signalled is None:
            raise subprocess.TimeoutExpired(self.name, timeout)
        if self.returncode is None:
            self.returncode = -self.signalled
            self.timeline.append(("exited", self.name))
        return self.returncode


def supervised(timeline, drain_grace=40.0, gateway_ignores_term=False):
    specs = [ServiceSpec("memsvc", [], "", stop_wave=2), ServiceSpec("executor", [], "", stop_wave=1),
             ServiceSpec("gateway", [], "", stop_wave=0, stop_grace=drain_grace)]
    sup = Supervisor(specs, log=lambda m: timeline.append(("log", m)), grace=5.0)
    for r in sup.services:
        r.proc = FakeProc(r.spec.name, timeline, r.spec.name == "gateway" and gateway_ignores_term)
    return sup


def events(timeline, kinds):
    return [e[:2] for e in timeline if e[0] in kinds]


def test_the_gateway_is_stopped_and_waited_for_before_the_executor_and_memsvc_are_signalled():
    timeline = []
    supervised(timeline).stop()
    assert events(timeline, {"SIGTERM", "exited"}) == [
        ("SIGTERM", "gateway"), ("exited", "gateway"), ("SIGTERM", "executor"), ("exited", "executor"),
        ("SIGTERM", "memsvc"), ("exited", "memsvc")]
    waits = {name: timeout for kind, name, *rest in timeline if kind == "wait" for timeout in rest}
    assert waits["gateway"] > 39 and waits["executor"] <= 5 and waits["memsvc"] <= 5


def test_a_gateway_that_outlasts_its_drain_grace_is_killed_before_the_others_are_signalled():
    timeline = []
    supervised(timeline, drain_grace=30.0, gateway_ignores_term=True).stop()
    assert events(timeline, {"SIGTERM", "SIGKILL", "exited"}) == [
        ("SIGTERM", "gateway"), ("SIGKILL", "gateway"), ("exited", "gateway"),
        ("SIGTERM", "executor"), ("exited", "executor"), ("SIGTERM", "memsvc"), ("exited", "memsvc")]
    assert any(kind == "log" and "within 30s" in message for kind, message, *_ in timeline)


def test_services_of_one_wave_are_signalled_together_in_reverse_start_order():
    timeline = []
    specs = [ServiceSpec(name, [], "") for name in ("a", "b", "c")]
    sup = Supervisor(specs, log=lambda m: None, grace=5.0)
    for r in sup.services:
        r.proc = FakeProc(r.spec.name, timeline)
    sup.stop()
    assert events(timeline, {"SIGTERM", "exited"})[:3] == [("SIGTERM", "c"), ("SIGTERM", "b"), ("SIGTERM", "a")]

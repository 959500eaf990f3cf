"""``proxy.pod.state``: what a worker forwards, what the supervisor decides, what a replica takes.

One process plays each role in turn (``POD.role``), with real filter state objects: the
supervisor's copy is driven by the ops a "worker" copy forwarded, and the worker's replica
takes the supervisor's export.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from filters.fallback.breaker import Breaker, BreakerSettings, State
from filters.fault.config import ExperimentConfig
from filters.fault.registry import ExperimentRegistry
from proxy.clock import ManualClock
from proxy.config.model import ConfigError, parse_config
from proxy.pod.state import POD, Role, encode, permits_share, share
from proxy.process.supervisor import cpus_available, resolve_workers
from proxy.telemetry import Telemetry


@pytest.fixture(autouse=True)
def single() -> Iterator[None]:
    POD.reset()
    yield
    POD.reset()


class Wire:
    """What a worker's link would send, kept for the test to hand to the 'supervisor'."""

    def __init__(self) -> None:
        self.messages: list[Any] = []

    def __call__(self, message: Any) -> None:
        encode(message)  # it must travel: picklable
        self.messages.append(message)

    def ops(self) -> list[Any]:
        return [op for kind, *rest in self.messages if kind == "ops" for op in rest[0]]


def _state(b: Breaker) -> State:
    return b.state  # read afresh: mypy would keep the narrowing of an earlier check


def _as(role: Role, index: int = 0, workers: int = 2) -> None:
    POD.role, POD.index, POD.workers = role, index, workers


async def _turn() -> None:
    import asyncio
    await asyncio.sleep(0)  # the outbox is flushed once per loop turn


async def test_a_worker_forwards_outcomes_and_only_the_supervisor_opens_the_breaker() -> None:
    clock = ManualClock()
    settings = BreakerSettings(minimum_calls=4, failure_rate=0.5, wait_in_open_s=10,
                               permitted_in_half_open=3)
    authority, replica = Breaker(settings, clock), Breaker(settings, clock)
    _as(Role.WORKER)
    wire = Wire()
    POD.connected(wire)
    share(replica, "breaker/r/r")
    for _ in range(4):
        replica.record(True, 0.01)
    await _turn()
    assert _state(replica) is State.CLOSED  # a worker decides nothing itself
    ops = wire.ops()
    assert [op[:2] for op in ops] == [("breaker/r/r", "record")] * 4

    _as(Role.SUPERVISOR)
    share(authority, "breaker/r/r")
    POD.take_dirty()
    assert POD.apply(ops) == 0
    assert _state(authority) is State.OPEN  # the pod's four outcomes, decided once
    exported = POD.take_dirty()
    assert set(exported) == {"breaker/r/r"}

    _as(Role.WORKER, index=1)
    replica.import_state(exported["breaker/r/r"])
    assert _state(replica) is State.OPEN and not replica.allow()
    clock.now += 11
    assert not replica.allow()  # the wait is over, but half-open is the supervisor's move

    _as(Role.SUPERVISOR)
    POD.tick()
    assert _state(authority) is State.HALF_OPEN
    half_open = POD.take_dirty()["breaker/r/r"]
    _as(Role.WORKER, index=1)
    replica.import_state(half_open)
    # three probes for the pod: worker 0 gets two, worker 1 one
    assert [replica.allow(), replica.allow()] == [True, False]
    assert permits_share(3) == 1
    POD.index = 0
    assert permits_share(3) == 2


async def test_experiments_start_and_stop_only_on_the_supervisor_and_replicas_follow() -> None:
    clock = ManualClock()
    cfg = ExperimentConfig.model_validate({"name": "e", "actions": [{"kind": "abort"}],
                                           "stop": {"min_requests": 2,
                                                    "max_error_rate": 0.4}})
    _as(Role.SUPERVISOR)
    authority = ExperimentRegistry(clock, Telemetry())
    share(authority, "experiments")
    authority.start(cfg, "m", "api")
    state = POD.export_all()["experiments"]

    _as(Role.WORKER)
    wire = Wire()
    POD.connected(wire)
    replica = ExperimentRegistry(clock, Telemetry())
    share(replica, "experiments")
    assert replica.start(cfg, "other", "config") is None  # a worker starts nothing
    assert replica.experiments == {}
    replica.import_state(state)
    assert [e.name for e in replica.running("m")] == ["e"]
    replica.experiments["e"].active = 2  # this worker's faults in flight survive an import
    replica.tally("e", matched=1, injected="abort")
    for _ in range(11):  # 11 of 11: evidence the error rate is past 0.4 at alpha 0.01 split
        # over the stop's two conditions (the error rate, the default p99); 2 of 2 is not
        replica.outcome(["e"], False, False, 0.01)
    await _turn()
    assert replica.running("m")  # errors seen, but the stop is the supervisor's

    _as(Role.SUPERVISOR)
    share(authority, "experiments")  # one process plays both: the id is the supervisor's again
    POD.take_dirty()
    POD.apply(wire.ops())
    exp = authority.experiments["e"]
    assert exp.state == "stopped" and "error rate" in exp.stop_reason
    assert exp.matched == 1 and exp.injected == {"abort": 1}
    update = POD.take_dirty()["experiments"]

    _as(Role.WORKER)
    replica.import_state(update)
    assert replica.running("m") == [] and replica.experiments["e"].active == 2


def test_an_op_for_state_this_config_no_longer_has_is_counted_not_fatal() -> None:
    _as(Role.SUPERVISOR)
    assert POD.apply([("breaker/gone/gone", "record", (True, 0.1), {})]) == 1


def test_outside_a_pod_decided_methods_just_run() -> None:
    clock = ManualClock()
    b = Breaker(BreakerSettings(minimum_calls=1, failure_rate=0.5), clock)
    share(b, "breaker/x/x")
    b.record(True, 0.1)
    assert _state(b) is State.OPEN


def test_workers_auto_is_the_cpus_this_process_may_use() -> None:
    auto = parse_config({"workers": "auto", "backends": [], "models": []}, "test")
    assert resolve_workers(None, auto) == cpus_available()
    assert 1 <= cpus_available() <= len(os.sched_getaffinity(0))
    assert resolve_workers("3", auto) == 3  # the command line wins
    assert resolve_workers(None, parse_config({"backends": [], "models": []}, "test")) == 1
    with pytest.raises(ConfigError, match="workers"):
        parse_config({"workers": 0, "backends": [], "models": []}, "test")

"""Whose outcome a failure is (``filters.outcomes.clients_own``) and whether a fault touched a
call (``filters.call_keys.touched_by_fault``): what breakers, routers, caches and baselines are
allowed to learn from."""

from __future__ import annotations

import pytest

from filters.call_keys import FAULTS, touched_by_fault
from filters.outcomes import clients_own
from proxy.call import CLIENT_DEADLINE, Call, LocalReply, Result
from proxy.errors import ErrorKind


def _call(version: str = "", budget_s: float | None = None) -> Call:
    call = Call(model="m", version=version, inputs=[])
    if budget_s is not None:
        call.state[CLIENT_DEADLINE] = call.started + budget_s
    return call


@pytest.mark.parametrize(("version", "own"), [("9", True), ("", False)])
def test_not_found_is_the_clients_only_for_a_version_it_named(version: str, own: bool) -> None:
    reply = LocalReply(ErrorKind.NOT_FOUND, "Request for unknown model", origin="backend")
    assert clients_own(_call(version), reply, None) is own


@pytest.mark.parametrize(("budget_s", "enough_s", "own"), [
    (0.000001, 0.2, True),   # a budget no call meets: the client's
    (5.0, 0.2, False),       # a budget that normally suffices: the backend was late
    (None, 0.2, False),      # no deadline of the client's: mmguard's own timeout
    (5.0, None, True),       # no bar known: any deadline the client set is its own
])
def test_a_deadline_is_the_clients_when_shorter_than_a_call_needs(
        budget_s: float | None, enough_s: float | None, own: bool) -> None:
    reply = LocalReply(ErrorKind.DEADLINE_EXCEEDED, "deadline exceeded")
    assert clients_own(_call(budget_s=budget_s), reply, enough_s) is own


def test_answers_and_other_failures_are_never_the_clients() -> None:
    call = _call("9", budget_s=0.000001)
    assert not clients_own(call, Result("m"), None)
    assert not clients_own(call, LocalReply(ErrorKind.UNAVAILABLE, "down"), None)
    assert not clients_own(call, LocalReply(ErrorKind.INTERNAL, "boom"), None)


def test_a_call_is_touched_once_any_fault_changed_it() -> None:
    call = _call()
    assert not touched_by_fault(call)
    call.state[FAULTS] = []
    assert not touched_by_fault(call)
    call.state[FAULTS] = ["exp/delay"]
    assert touched_by_fault(call)

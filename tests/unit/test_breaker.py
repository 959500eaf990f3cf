"""The breaker's state machine on an injected clock: no sleeping."""

from __future__ import annotations

from filters.fallback.breaker import Breaker, BreakerSettings, State
from proxy.clock import ManualClock


def state(b: Breaker) -> State:
    """Read afresh (mypy would keep the state narrowed by an earlier assert)."""
    return b.state


def breaker(**kw: object) -> tuple[Breaker, ManualClock, list[tuple[State, State]]]:
    clock = ManualClock()
    moves: list[tuple[State, State]] = []
    b = Breaker(BreakerSettings(**kw), clock,  # type: ignore[arg-type]
                lambda old, new, why: moves.append((old, new)))
    return b, clock, moves


def test_opens_at_the_failure_rate_once_minimum_calls_are_seen() -> None:
    b, _, moves = breaker(window_size=10, minimum_calls=4, failure_rate=0.5)
    for failed in (True, True, True):
        b.record(failed, 0.01)
    assert state(b) == State.CLOSED  # 3 < minimum_calls, however bad
    b.record(False, 0.01)  # 3 of 4 failed = 75 %
    assert state(b) == State.OPEN and moves == [(State.CLOSED, State.OPEN)]
    assert "failure rate 75%" in b.reason
    assert not b.allow()


def test_count_window_judges_only_the_last_n_calls() -> None:
    b, _, _ = breaker(window_size=2, minimum_calls=2, failure_rate=1.0)
    for failed in (True, False, False, True):
        b.record(failed, 0.01)
    assert state(b) == State.CLOSED
    b.record(True, 0.01)  # lifetime 3/5 failed, but the last two both failed
    assert state(b) == State.OPEN


def test_time_window_forgets_calls_older_than_its_size() -> None:
    b, clock, _ = breaker(window="time", window_size=10, minimum_calls=3, failure_rate=0.6)
    b.record(True, 0.01)
    b.record(True, 0.01)
    clock.advance(11)
    b.record(True, 0.01)
    b.record(False, 0.01)
    assert state(b) == State.CLOSED  # only 2 calls inside the last 10 s
    b.record(True, 0.01)
    assert state(b) == State.OPEN  # 2 of 3 inside the window


def test_slow_calls_open_it_too() -> None:
    b, _, _ = breaker(minimum_calls=3, slow_call_s=0.5, slow_call_rate=0.6)
    b.record(False, 0.6)
    b.record(False, 0.1)
    b.record(False, 0.7)
    assert state(b) == State.OPEN and "slow-call rate 67%" in b.reason


def test_half_open_after_the_wait_then_closes_on_good_probes() -> None:
    b, clock, moves = breaker(minimum_calls=2, failure_rate=0.5, wait_in_open_s=5,
                              permitted_in_half_open=2)
    b.record(True, 0.01)
    b.record(True, 0.01)
    assert not b.allow()
    assert b.retry_after_s() == 5
    clock.advance(4.9)
    assert not b.allow()
    clock.advance(0.2)
    assert b.allow() and state(b) == State.HALF_OPEN
    assert b.allow()
    assert not b.allow()  # only two probes
    b.record(False, 0.01)
    assert state(b) == State.HALF_OPEN
    b.record(False, 0.01)
    assert state(b) == State.CLOSED
    assert moves == [(State.CLOSED, State.OPEN), (State.OPEN, State.HALF_OPEN),
                     (State.HALF_OPEN, State.CLOSED)]


def test_a_bad_probe_reopens() -> None:
    b, clock, _ = breaker(minimum_calls=1, failure_rate=0.5, wait_in_open_s=1,
                          permitted_in_half_open=1)
    b.record(True, 0.01)
    clock.advance(1.5)
    assert b.allow()
    b.record(True, 0.01)
    assert state(b) == State.OPEN and not b.allow()


def test_forced_states_hold_until_reset() -> None:
    b, clock, _ = breaker(minimum_calls=1, wait_in_open_s=0)
    b.force("open")
    clock.advance(100)
    assert not b.allow() and state(b) == State.FORCED_OPEN
    b.force("close")
    for _ in range(10):
        b.record(True, 0.01)
    assert b.allow() and state(b) == State.FORCED_CLOSED
    b.force("reset")
    assert state(b) == State.CLOSED
    assert b.snapshot()["state"] == "closed"


def test_the_window_counts_follow_the_window_as_it_slides() -> None:
    """The failed / slow counts the rates are read from are kept as calls enter and leave the
    window: after any run of calls they equal a recount of the window."""
    import random

    rng = random.Random(7)
    for window in ("count", "time"):
        b, clock, _ = breaker(window=window, window_size=7, minimum_calls=50, slow_call_s=0.5)
        for _ in range(400):
            clock.advance(rng.uniform(0, 2))
            b.record(rng.random() < 0.3, rng.uniform(0, 1))
            assert b._failed == sum(o.failed for o in b._window)
            assert b._slow == sum(o.slow for o in b._window)
        snap = b.snapshot()
        assert snap["calls_in_window"] == len(b._window) and state(b) == State.CLOSED

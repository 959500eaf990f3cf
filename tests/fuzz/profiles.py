"""Hypothesis profiles for the fuzz properties: ``fuzz-ci`` (the default, a short run that keeps
``tests/fuzz`` under a minute on 2 cores) and ``fuzz-long`` (``scripts/fuzz_long.py``, or
``MMGUARD_FUZZ_PROFILE=long python -m pytest tests/fuzz``).

The profiles are applied per test (``@FUZZ``), never loaded globally: the other hypothesis tests
in the suite keep their own settings.

``deadline`` is the "no hang" guard: a decoder call that takes longer than it fails the property
(hypothesis replays it once to rule out a scheduling hiccup). It says nothing about speed.
"""

from __future__ import annotations

import os
from datetime import timedelta

from hypothesis import HealthCheck, settings

ENV = "MMGUARD_FUZZ_PROFILE"
CI_EXAMPLES = 400
"""Examples per in-process property in CI."""
CI_FRONT_EXAMPLES = 200
"""Examples per front (HTTP v2, OpenAI, gRPC) in the test over real sockets."""

_SLOW_INPUTS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                HealthCheck.large_base_example]

# CI runs the same examples every time (a fixed seed, no example database): a new finding comes
# from the long run and lands as a reproduction in test_found.py, never as a random CI failure.
settings.register_profile(
    "fuzz-ci", max_examples=CI_EXAMPLES, deadline=timedelta(seconds=2),
    suppress_health_check=_SLOW_INPUTS, print_blob=True, derandomize=True, database=None)
settings.register_profile(
    "fuzz-long", max_examples=20_000, deadline=timedelta(seconds=2),
    suppress_health_check=_SLOW_INPUTS, print_blob=True, database=None)


def profile_name() -> str:
    return "fuzz-long" if os.environ.get(ENV, "ci") == "long" else "fuzz-ci"


FUZZ = settings.get_profile(profile_name())
"""The in-process properties' settings."""
FUZZ_LONG = settings.get_profile("fuzz-long")

FRONTS = settings(
    FUZZ,
    max_examples=CI_FRONT_EXAMPLES if profile_name() == "fuzz-ci" else 2_000,
    # Over sockets the hang guard is the client's timeout (``fronts.CLIENT_TIMEOUT_S``), not a
    # per-example deadline that a busy 2-core machine could trip.
    deadline=None,
    suppress_health_check=[*_SLOW_INPUTS, HealthCheck.function_scoped_fixture],
)

"""``fault``: in-line fault injection on canary traffic, in named experiments that stop themselves.

Where it sits in a chain is where its faults happen: inside ``fallback`` (after it in the list)
an injected abort is what the fallback's levels see, so the degrade path is exercised on canary
calls; outside it, the client sees the fault.

Rules that MUST hold:

- Off unless configured: with no running experiment on the route the filter is one dict lookup.
- Only canary traffic (``call.state[CANARY]``, set by the runtime from ``Config.canary``) is ever
  touched; every other call goes through byte for byte.
- Every injected fault is visible: ``mmguard-fault: <experiment>/<action>`` on the answer, the
  counter ``mmguard_faults_injected_total``, a span event and a log line; an injected refusal is
  counted with code ``injected`` in ``mmguard_requests_total`` and never by a breaker.
- Perturbations are seeded: the same experiment seed and request key (``canary.key``, else the
  request id) give the same perturbation; another seed gives another.
- Which canary calls an experiment (``share``) or an action (``percent``) touches is a keyed draw
  (``FilterContext.share_hash``): stable for retries, not computable by clients.
- Building the filter starts nothing: its experiments start once its runtime serves.
- Experiments stop by themselves: duration over, or a stop condition out on the sliding window
  (checked on every canary answer, so a breach stops it within one window), and at once through
  the admin API (``POST /admin/experiments/stop-all``) or on shutdown. Why it stopped is kept.
"""

from __future__ import annotations

from filters.fault.config import (
    SEEN,
    ExperimentConfig,
    FaultConfig,
)
from filters.fault.filter import (
    Fault,
    FaultFactory,
)
from filters.fault.registry import (
    STOP_CAUSES,
    Experiment,
    ExperimentRegistry,
    registry,
)

__all__ = [
    "SEEN",
    "STOP_CAUSES",
    "Experiment",
    "ExperimentConfig",
    "ExperimentRegistry",
    "Fault",
    "FaultConfig",
    "FaultFactory",
    "registry",
]

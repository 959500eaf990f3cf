"""Call keys that several filters share (a producer and a consumer in different modules)."""

from __future__ import annotations

from collections.abc import Callable

from proxy.call import Call, CallKey

UNUSABLE_MODALITIES: CallKey[dict[str, str]] = CallKey("unusable_modalities")
"""modality ("image", "text") → why it must not be used (set by quality, read by the router)."""
FAULTS: CallKey[list[str]] = CallKey("faults")
"""``<experiment>/<action>`` of each fault injected into this call (shared by its attempts), so
the fallback's breakers never count an injected failure as the backend's."""


def touched_by_fault(call: Call) -> bool:
    """Whether a fault experiment has changed this call so far (its input, its answer, its
    time or its outcome). What a filter learns for every client (the answer cache, the router's
    latencies and failures, a drift or similarity baseline) must not learn from such a call: a
    fault may change the copy it touches and nothing else (a faulted canary answer cached, then
    served to a production client as its last good answer, was the case that showed it)."""
    faults: list[str] | None = call.state.get(FAULTS)
    return bool(faults)


OFF_LANE: CallKey[Callable[[], None]] = CallKey("off_lane")
"""Set by the shadow on each copy it sends: a fault about to make the copy wait (a delay, a slow
stream) calls it first, and the copy's worker goes on to the next copy while this one waits on
its own. Clean copies never queue behind faulted ones (their latency is what the verdict judges).
"""

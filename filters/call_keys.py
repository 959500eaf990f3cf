"""Call keys that several filters share (a producer and a consumer in different modules)."""

from __future__ import annotations

from collections.abc import Callable

from proxy.call import CallKey

UNUSABLE_MODALITIES: CallKey[dict[str, str]] = CallKey("unusable_modalities")
"""modality ("image", "text") → why it must not be used (set by quality, read by the router)."""
FAULTS: CallKey[list[str]] = CallKey("faults")
"""``<experiment>/<action>`` of each fault injected into this call (shared by its attempts), so
the fallback's breakers never count an injected failure as the backend's."""
OFF_LANE: CallKey[Callable[[], None]] = CallKey("off_lane")
"""Set by the shadow on each copy it sends: a fault about to make the copy wait (a delay, a slow
stream) calls it first, and the copy's worker goes on to the next copy while this one waits on
its own. Clean copies never queue behind faulted ones (their latency is what the verdict judges).
"""

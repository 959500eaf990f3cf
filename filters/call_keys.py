"""Call keys that several filters share (a producer and a consumer in different modules)."""

from __future__ import annotations

from proxy.call import CallKey

UNUSABLE_MODALITIES: CallKey[dict[str, str]] = CallKey("unusable_modalities")
"""modality ("image", "text") → why it must not be used (set by quality, read by the router)."""
FAULTS: CallKey[list[str]] = CallKey("faults")
"""``<experiment>/<action>`` of each fault injected into this call (shared by its attempts), so
the fallback's breakers never count an injected failure as the backend's."""

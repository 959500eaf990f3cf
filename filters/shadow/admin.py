"""The shadow filter's state keys and admin routes (declared on ``ShadowFactory``).

``GET /admin/shadows``: route → ``{"canary": route, **Verdict.snapshot()}``;
``POST /admin/shadows/{route}/reset`` (admin token): judge again from nothing, mirror again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from proxy.lifecycle import Access, AdminAnswer, AdminRequest, AdminRoute, StateKey

if TYPE_CHECKING:
    from filters.shadow.filter import Shadow
    from filters.shadow.state import ShadowState

SHADOWS: StateKey[dict[str, Shadow]] = StateKey("shadows")
"""Route → its shadow filter in this runtime (``FilterContext.local``)."""
SHADOW_STATES: StateKey[dict[str, ShadowState]] = StateKey("shadows")
"""Route → its verdict and counts, kept across reloads while the config is the same
(``FilterContext.state``)."""
LIVE_SHADOWS: StateKey[dict[str, Shadow]] = StateKey("shadow_filters")
"""Route → the shadow filter that serves (``FilterContext.state``): its workers end when the
next one takes over, or after the drain on shutdown."""


async def list_shadows(req: AdminRequest) -> AdminAnswer:
    found = req.local.get(SHADOWS) or {}
    return 200, {route: s.snapshot() for route, s in sorted(found.items())}


async def reset_shadow(req: AdminRequest) -> AdminAnswer:
    route = req.params["route"]
    shadow = (req.local.get(SHADOWS) or {}).get(route)
    if shadow is None:
        return 404, {"error": f"route '{route}' has no shadow filter"}
    shadow.reset()
    return 200, shadow.snapshot()


ROUTES = (
    AdminRoute("GET", "/admin/shadows", Access.READ, list_shadows),
    AdminRoute("POST", "/admin/shadows/{route}/reset", Access.MUTATES, reset_shadow),
)

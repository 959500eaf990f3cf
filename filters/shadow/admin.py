"""The shadow filter's state keys and admin routes (declared on ``ShadowFactory``).

``GET /admin/shadows``: route → ``{"canary": route, **Verdict.snapshot()}``;
``POST /admin/shadows/{route}/reset`` (admin token): judge again from nothing, mirror again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from filters.shadow.state import ShadowState
from proxy.keys import Store
from proxy.lifecycle import (
    Access,
    AdminAnswer,
    AdminRequest,
    AdminRoute,
    StateKey,
    Summary,
)


class Shadow(Protocol):
    """What the admin routes need of a shadow filter (``filters.shadow.filter.Shadow``)."""

    def snapshot(self) -> dict[str, Any]: ...

    def reset(self) -> None: ...

SHADOW_STATES: StateKey[dict[str, ShadowState]] = StateKey("shadows")
"""Route → its verdict and counts, kept across reloads while the config is the same
(``FilterContext.state``)."""

Finder = Callable[[Store], Mapping[str, Shadow] | None]
"""How the routes find this runtime's shadow filters (the filter module owns their key)."""


def shadow_routes(find: Finder) -> tuple[AdminRoute, ...]:
    """``GET /admin/shadows`` and ``POST /admin/shadows/{route}/reset`` over ``find``."""

    async def list_shadows(req: AdminRequest) -> AdminAnswer:
        found = find(req.local) or {}
        return 200, {route: s.snapshot() for route, s in sorted(found.items())}

    async def reset_shadow(req: AdminRequest) -> AdminAnswer:
        route = req.params["route"]
        shadow = (find(req.local) or {}).get(route)
        if shadow is None:
            return 404, {"error": f"route '{route}' has no shadow filter"}
        shadow.reset()
        return 200, shadow.snapshot()

    return (AdminRoute("GET", "/admin/shadows", Access.READ, list_shadows),
            AdminRoute("POST", "/admin/shadows/{route}/reset", Access.MUTATES, reset_shadow))


def verdicts_summary(found: Mapping[str, Shadow]) -> Summary:
    """The canary verdicts' table for ``mmguard status``."""
    rows = []
    for route, shadow in sorted(found.items()):
        snap = shadow.snapshot()
        agreement = snap.get("effective_agreement")
        rows.append((route, str(snap.get("canary")), str(snap.get("state")).upper(),
                     str(snap.get("compared", 0)),
                     "-" if agreement is None else f"{agreement:.1%}",
                     "yes" if snap.get("mirroring") else "stopped",
                     "; ".join(snap.get("reasons") or [])[:120]))
    return Summary("canary verdicts", ("route", "canary", "verdict", "compared", "agreement",
                                       "mirroring", "reasons"), tuple(rows),
                   empty="none (no route uses the shadow filter)", order=40)

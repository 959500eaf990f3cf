"""The fallback filter's state keys and admin routes (declared on ``FallbackFactory``).

``GET /admin/breakers`` lists every breaker of the serving runtime;
``POST /admin/breakers/{route}/{level}/{action}`` (admin token) forces one open, closed, or back
to automatic (``reset``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from proxy.lifecycle import Access, AdminAnswer, AdminRequest, AdminRoute, StateKey, Summary

if TYPE_CHECKING:
    from filters.fallback.breaker import Breaker
    from proxy.call import Call, Result

BREAKERS: StateKey[dict[tuple[str, str], Breaker]] = StateKey("breakers")
"""(route, level) → its breaker in this runtime (``FilterContext.local``)."""
CACHED_ANSWERS: StateKey[
    dict[str, Callable[[Call], Awaitable[tuple[float, Result] | None]]]] = StateKey(
    "cached_answers")
"""Route → a function giving the last good answer to a call (``(age_s, Result)`` or None), in
this runtime (``FilterContext.local``). The fallback filter fills it; quality's graded actions
serve from it."""


async def list_breakers(req: AdminRequest) -> AdminAnswer:
    found = req.local.get(BREAKERS) or {}
    return 200, [{"route": route, "level": level, **b.snapshot()}
                 for (route, level), b in sorted(found.items())]


async def act_on_breaker(req: AdminRequest) -> AdminAnswer:
    key = (req.params["route"], req.params["level"])
    action = req.params["action"]
    breaker = (req.local.get(BREAKERS) or {}).get(key)
    if breaker is None:
        return 404, {"error": f"no breaker for route '{key[0]}' level '{key[1]}'"}
    if action not in ("open", "close", "reset"):
        return 400, {"error": f"action must be open, close or reset, not '{action}'"}
    breaker.force(action)  # type: ignore[arg-type]  # checked just above
    return 200, {"route": key[0], "level": key[1], **breaker.snapshot()}


ROUTES = (
    AdminRoute("GET", "/admin/breakers", Access.READ, list_breakers),
    AdminRoute("POST", "/admin/breakers/{route}/{level}/{action}", Access.MUTATES,
               act_on_breaker),
)


async def breakers_summary(req: AdminRequest) -> Summary:
    """The breakers' table for ``mmguard status``."""
    _, found = await list_breakers(req)
    rows = tuple((str(b.get("route", "")), str(b.get("level", "")),
                  str(b.get("state", "")).upper(), str(b.get("calls_in_window", "")),
                  f"{b.get('failure_rate', 0):.0%}", f"{b.get('slow_call_rate', 0):.0%}",
                  str(b.get("reason") or "")) for b in found)
    return Summary("breakers", ("route", "level", "state", "calls", "failure rate", "slow rate",
                                "reason"), rows,
                   empty="none (no route uses the fallback filter)", order=10)

"""The admin listener: ``/metrics`` (Prometheus), ``/healthz`` (liveness), ``/readyz``, and the
operator's handles on filter state (``/admin/breakers``).

It binds to localhost unless configured otherwise; with ``listeners.admin.token`` set, anything
that changes state needs ``Authorization: Bearer <token>``. Secrets are never echoed.
"""

from __future__ import annotations

import hmac
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proxy.dataplane import DataPlane


def admin_app(plane: DataPlane, token: str | None = None) -> web.Application:
    async def metrics(request: web.Request) -> web.Response:
        body = generate_latest(plane.telemetry.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"live": plane.live()})

    async def readyz(request: web.Request) -> web.Response:
        ready = await plane.ready()
        return web.json_response({"ready": ready}, status=200 if ready else 503)

    def breakers() -> dict[tuple[str, str], Any]:
        found: dict[tuple[str, str], Any] = plane.runtime.admin.get("breakers", {})
        return found

    async def list_breakers(request: web.Request) -> web.Response:
        return web.json_response([{"route": route, "level": level, **b.snapshot()}
                                  for (route, level), b in sorted(breakers().items())])

    async def act_on_breaker(request: web.Request) -> web.Response:
        if token is not None:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return web.json_response({"error": "this needs the admin token"}, status=401)
        key = (request.match_info["route"], request.match_info["level"])
        action = request.match_info["action"]
        breaker = breakers().get(key)
        if breaker is None:
            return web.json_response({"error": f"no breaker for route '{key[0]}' level "
                                               f"'{key[1]}'"}, status=404)
        if action not in ("open", "close", "reset"):
            return web.json_response({"error": f"action must be open, close or reset, not "
                                               f"'{action}'"}, status=400)
        breaker.force(action)
        return web.json_response({"route": key[0], "level": key[1], **breaker.snapshot()})

    async def routers(request: web.Request) -> web.Response:
        found: dict[str, Any] = plane.runtime.admin.get("routers", {})
        return web.json_response({route: r.snapshot() for route, r in sorted(found.items())})

    app = web.Application()
    app.router.add_get("/admin/routers", routers)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/admin/breakers", list_breakers)
    app.router.add_post("/admin/breakers/{route}/{level}/{action}", act_on_breaker)
    return app

"""The admin listener: ``/metrics`` (Prometheus), ``/healthz`` (liveness), ``/readyz``.

It binds to localhost unless configured otherwise. Nothing here changes state yet.
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proxy.dataplane import DataPlane


def admin_app(plane: DataPlane) -> web.Application:
    async def metrics(request: web.Request) -> web.Response:
        body = generate_latest(plane.telemetry.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"live": plane.live()})

    async def readyz(request: web.Request) -> web.Response:
        ready = await plane.ready()
        return web.json_response({"ready": ready}, status=200 if ready else 503)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app

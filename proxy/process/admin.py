"""The admin listener: ``/metrics`` (Prometheus), ``/healthz`` (liveness), ``/readyz``,
``POST /admin/reload`` (re-read the config file, as SIGHUP; 200 when applied, 409 with the reason
when rejected) and every route a filter declares (``FilterFactory.admin_routes``: breakers,
experiments, shadows, routers), handed the serving runtime's state at the time of the request.

It binds to localhost unless configured otherwise. The token rule is applied here, once, by each
route's ``Access``: ``READ`` is open; ``MUTATES`` needs ``Authorization: Bearer <token>``
(``listeners.admin.token``) and is refused (403) when no token is configured; ``REDUCES_RISK`` (a
kill switch, e.g. stopping fault experiments) needs the token only when one is configured.
Secrets are never echoed.
"""

from __future__ import annotations

import asyncio
import hmac
import os
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proxy.engine.dataplane import DataPlane
from proxy.fronts.body import INLINE_JSON_BYTES
from proxy.lifecycle import Access, AdminRequest, AdminRoute
from proxy.registry import filter_factories
from proxy.wire.numbers import json_loads


class Outcome(Protocol):
    """What a reload says: applied or not, and why, in one line."""

    @property
    def applied(self) -> bool: ...

    @property
    def message(self) -> str: ...


Handler = Callable[[web.Request], Awaitable[web.Response]]


def admin_app(plane: DataPlane, token: str | None = None,
              reload: Callable[[], Awaitable[Outcome]] | None = None,
              pod: Callable[[], list[dict[str, Any]]] | None = None) -> web.Application:
    def guarded(access: Access, handler: Handler) -> Handler:
        async def checked(request: web.Request) -> web.Response:
            if (denied := _refused(request, token, access)) is not None:
                return denied
            return await handler(request)
        return checked

    app = web.Application(middlewares=[_json_misses])
    app.router.add_post("/admin/reload", guarded(Access.MUTATES, _reloader(reload)))
    for route in _filter_routes():
        app.router.add_route(route.method, route.path,
                             guarded(route.access, _filter_handler(plane, route)))
    for path, handler in _health(plane).items():
        app.router.add_get(path, handler)

    async def workers(request: web.Request) -> web.Response:
        found = pod() if pod is not None else [{"worker": 0, "pid": os.getpid(),
                                                 "connected": True, "ready": await plane.ready(),
                                                 "restarts": 0, "exit_codes": []}]
        return web.json_response({"workers": found, "supervisor_pid": os.getpid()
                                  if pod is not None else None})

    app.router.add_get("/admin/pod", workers)
    app.router.add_get("/admin", _index(plane))
    return app


@web.middleware
async def _json_misses(request: web.Request,
                       handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                       ) -> web.StreamResponse:
    """A path the admin API does not have, or a method a path does not take, answered in the
    API's JSON like every other of its answers (aiohttp's are plain text)."""
    try:
        return await handler(request)
    except web.HTTPMethodNotAllowed as exc:
        return web.json_response(
            {"error": f"{request.method} is not served on {request.path}; it takes "
                      f"{', '.join(sorted(exc.allowed_methods))}"},
            status=405, headers={"Allow": ", ".join(sorted(exc.allowed_methods))})
    except web.HTTPNotFound:
        return web.json_response({"error": f"no such admin endpoint: {request.method} "
                                           f"{request.path}"}, status=404)


def _index(plane: DataPlane) -> Handler:
    """``GET /admin``: every filter's admin routes and its table for ``mmguard status``."""
    async def index(request: web.Request) -> web.Response:
        req = _admin_request(plane, request)
        filters: dict[str, Any] = {}
        for name, factory in sorted(filter_factories().items()):
            summary = await factory.summary(req)
            filters[name] = {
                "routes": [{"method": r.method, "path": r.path, "access": r.access.name.lower()}
                           for r in factory.admin_routes],
                "summary": None if summary is None else summary.as_json()}
        return web.json_response({"filters": filters})
    return index


def _admin_request(plane: DataPlane, request: web.Request) -> AdminRequest:
    """What a filter's admin code sees: the serving runtime's state (a reload is seen at once)."""
    runtime = plane.runtime
    async def read_json() -> Any:
        """The body as JSON; any failure (nesting, a number too long) a ValueError. Bounded by
        the admin listener's ``max_request_bytes`` (at most 1 MiB), parsed in a worker thread
        when not small."""
        body = await request.read()
        try:
            if len(body) > INLINE_JSON_BYTES:
                return await asyncio.to_thread(json_loads, body)
            return json_loads(body)
        except RecursionError:
            raise ValueError("the JSON is nested too deeply") from None

    return AdminRequest(params=request.match_info, state=runtime.state, local=runtime.local,
                        read_json=read_json)


def _refused(request: web.Request, token: str | None, access: Access) -> web.Response | None:
    """None when allowed; 401 without the right token; 403 when the action needs a token and
    none is set."""
    if access is Access.READ:
        return None
    if token is None:
        if access is Access.MUTATES:
            return web.json_response(
                {"error": "this action needs an admin token: set listeners.admin.token"},
                status=403)
        return None
    given = request.headers.get("Authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
        return web.json_response({"error": "this needs the admin token"}, status=401)
    return None


def _filter_routes() -> list[AdminRoute]:
    """Every filter's admin routes, whether or not the config uses the filter (a route without
    it answers as empty), so a reload that adds a filter needs no new listener."""
    return [route for f in filter_factories().values() for route in f.admin_routes]


def _filter_handler(plane: DataPlane, route: AdminRoute) -> Handler:
    async def handle(request: web.Request) -> web.Response:
        status, body = await route.handler(_admin_request(plane, request))
        return web.json_response(body, status=status)
    return handle


def _reloader(reload: Callable[[], Awaitable[Outcome]] | None) -> Handler:
    async def reload_config(request: web.Request) -> web.Response:
        if reload is None:
            return web.json_response({"error": "this mmguard cannot reload"}, status=409)
        outcome = await reload()
        return web.json_response({"applied": outcome.applied, "message": outcome.message},
                                 status=200 if outcome.applied else 409)
    return reload_config


def _health(plane: DataPlane) -> dict[str, Handler]:
    async def metrics(request: web.Request) -> web.Response:
        body = generate_latest(plane.telemetry.exposition)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"live": plane.live()})

    async def readyz(request: web.Request) -> web.Response:
        ready = await plane.ready()
        return web.json_response({"ready": ready, **plane.readiness()},
                                 status=200 if ready else 503)

    found: dict[str, Any] = {"/metrics": metrics, "/healthz": healthz, "/readyz": readyz}
    return found

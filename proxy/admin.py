"""The admin listener: ``/metrics`` (Prometheus), ``/healthz`` (liveness), ``/readyz``, the
operator's handles on filter state (``/admin/breakers``) and ``POST /admin/reload`` (re-read the
config file, as SIGHUP; 200 when applied, 409 with the reason when rejected).

It binds to localhost unless configured otherwise. Anything that changes state needs
``Authorization: Bearer <token>`` (``listeners.admin.token``) and is refused (403) when no token
is configured — with one exception, the kill switch: stopping fault experiments (one or all)
only takes risk away, so it is open on an admin port without a token. Secrets are never echoed.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proxy.dataplane import DataPlane


class Outcome(Protocol):
    """What a reload says: applied or not, and why, in one line."""

    @property
    def applied(self) -> bool: ...

    @property
    def message(self) -> str: ...


def admin_app(plane: DataPlane, token: str | None = None,
              reload: Callable[[], Awaitable[Outcome]] | None = None) -> web.Application:
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

    def refused(request: web.Request, need_token: bool = False) -> web.Response | None:
        """401 without the right token; 403 when the action needs a token and none is set."""
        if token is None:
            if need_token:
                return web.json_response(
                    {"error": "this action needs an admin token: set listeners.admin.token"},
                    status=403)
            return None
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            return web.json_response({"error": "this needs the admin token"}, status=401)
        return None

    async def act_on_breaker(request: web.Request) -> web.Response:
        if (denied := refused(request, need_token=True)) is not None:
            return denied
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

    def experiments() -> Any:
        return plane.runtime.store.get("experiments")

    async def list_experiments(request: web.Request) -> web.Response:
        reg = experiments()
        return web.json_response(reg.snapshot() if reg is not None else [])

    async def get_experiment(request: web.Request) -> web.Response:
        reg = experiments()
        name = request.match_info["name"]
        exp = reg.experiments.get(name) if reg is not None else None
        if exp is None:
            return web.json_response({"error": f"no experiment '{name}'"}, status=404)
        return web.json_response(exp.snapshot())

    async def start_experiment(request: web.Request) -> web.Response:
        # Starting faults is the one admin action that is never open without a token.
        if (denied := refused(request, need_token=True)) is not None:
            return denied
        from pydantic import ValidationError
        try:
            doc = await request.json()
        except ValueError as exc:
            return web.json_response({"error": f"the body must be JSON: {exc}"}, status=400)
        if not isinstance(doc, dict) or not isinstance(doc.get("route"), str):
            return web.json_response({"error": "the body must be {\"route\": <route>, "
                                               "\"experiment\": {...}}"}, status=400)
        route = doc["route"]
        if route not in plane.runtime.admin.get("fault_routes", set()):
            return web.json_response(
                {"error": f"route '{route}' has no fault filter in its chain; add '- fault: {{}}'"
                          " to its filters to run experiments there"}, status=409)
        reg = experiments()
        assert reg is not None
        from filters.fault import ExperimentConfig  # admin is generic; the model is the filter's
        try:
            cfg = ExperimentConfig.model_validate(doc.get("experiment"))
        except ValidationError as exc:
            problems = [f"experiment.{'.'.join(map(str, e['loc']))}: {e['msg']}"
                        for e in exc.errors()]
            return web.json_response({"error": "invalid experiment", "problems": problems},
                                     status=400)
        old = reg.experiments.get(cfg.name)
        if old is not None and old.running:
            return web.json_response({"error": f"experiment '{cfg.name}' is already running"},
                                     status=409)
        return web.json_response(reg.start(cfg, route, "api").snapshot(), status=201)

    async def stop_experiment(request: web.Request) -> web.Response:
        if (denied := refused(request)) is not None:
            return denied
        reg = experiments()
        name = request.match_info["name"]
        exp = reg.stop(name, "stopped through the admin API") if reg is not None else None
        if exp is None:
            return web.json_response({"error": f"no experiment '{name}'"}, status=404)
        return web.json_response(exp.snapshot())

    async def stop_all(request: web.Request) -> web.Response:
        if (denied := refused(request)) is not None:
            return denied
        reg = experiments()
        stopped = reg.stop_all("stop-all through the admin API") if reg is not None else []
        return web.json_response({"stopped": stopped})

    def shadows() -> dict[str, Any]:
        found: dict[str, Any] = plane.runtime.admin.get("shadows", {})
        return found

    async def list_shadows(request: web.Request) -> web.Response:
        return web.json_response({route: s.snapshot() for route, s in sorted(shadows().items())})

    async def reset_shadow(request: web.Request) -> web.Response:
        if (denied := refused(request, need_token=True)) is not None:
            return denied
        route = request.match_info["route"]
        shadow = shadows().get(route)
        if shadow is None:
            return web.json_response({"error": f"route '{route}' has no shadow filter"},
                                     status=404)
        shadow.reset()
        return web.json_response(shadow.snapshot())

    async def reload_config(request: web.Request) -> web.Response:
        if (denied := refused(request, need_token=True)) is not None:
            return denied
        if reload is None:
            return web.json_response({"error": "this mmguard cannot reload"}, status=409)
        outcome = await reload()
        return web.json_response({"applied": outcome.applied, "message": outcome.message},
                                 status=200 if outcome.applied else 409)

    app = web.Application()
    app.router.add_post("/admin/reload", reload_config)
    app.router.add_get("/admin/shadows", list_shadows)
    app.router.add_post("/admin/shadows/{route}/reset", reset_shadow)
    app.router.add_get("/admin/experiments", list_experiments)
    app.router.add_post("/admin/experiments", start_experiment)
    app.router.add_post("/admin/experiments/stop-all", stop_all)
    app.router.add_get("/admin/experiments/{name}", get_experiment)
    app.router.add_post("/admin/experiments/{name}/stop", stop_experiment)
    app.router.add_get("/admin/routers", routers)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/admin/breakers", list_breakers)
    app.router.add_post("/admin/breakers/{route}/{level}/{action}", act_on_breaker)
    return app

"""The fault filter's admin routes and shutdown hook (declared on ``FaultFactory``).

``GET /admin/experiments`` and ``/admin/experiments/{name}`` read; ``POST /admin/experiments``
starts one on a route (``{"route": ..., "experiment": {...}}``) and is never open without the
admin token; stopping one (``/admin/experiments/{name}/stop``) or all (``/stop-all``) only takes
risk away, so it is open on an admin port that has no token (the kill switch).
"""

from __future__ import annotations

from pydantic import ValidationError

from filters.fault.config import ExperimentConfig
from filters.fault.registry import EXPERIMENTS, FAULT_ROUTES
from proxy.lifecycle import Access, AdminAnswer, AdminRequest, AdminRoute, Summary


async def list_experiments(req: AdminRequest) -> AdminAnswer:
    reg = req.state.get(EXPERIMENTS)
    return 200, reg.snapshot() if reg is not None else []


async def get_experiment(req: AdminRequest) -> AdminAnswer:
    reg = req.state.get(EXPERIMENTS)
    name = req.params["name"]
    exp = reg.experiments.get(name) if reg is not None else None
    if exp is None:
        return 404, {"error": f"no experiment '{name}'"}
    return 200, exp.snapshot()


async def start_experiment(req: AdminRequest) -> AdminAnswer:
    try:
        doc = await req.read_json()
    except ValueError as exc:
        return 400, {"error": f"the body must be JSON: {exc}"}
    if not isinstance(doc, dict) or not isinstance(doc.get("route"), str):
        return 400, {"error": "the body must be {\"route\": <route>, \"experiment\": {...}}"}
    route = doc["route"]
    reg = req.state.get(EXPERIMENTS)
    if route not in (req.local.get(FAULT_ROUTES) or set()) or reg is None:
        return 409, {"error": f"route '{route}' has no fault filter in its chain; add "
                              "'- fault: {}' to its filters to run experiments there"}
    try:
        cfg = ExperimentConfig.model_validate(doc.get("experiment"))
    except ValidationError as exc:
        problems = [f"experiment.{'.'.join(map(str, e['loc']))}: {e['msg']}"
                    for e in exc.errors()]
        return 400, {"error": "invalid experiment", "problems": problems}
    old = reg.experiments.get(cfg.name)
    if old is not None and old.running:
        return 409, {"error": f"experiment '{cfg.name}' is already running"}
    return 201, reg.start(cfg, route, "api").snapshot()


async def stop_experiment(req: AdminRequest) -> AdminAnswer:
    reg = req.state.get(EXPERIMENTS)
    name = req.params["name"]
    exp = reg.stop(name, "stopped through the admin API") if reg is not None else None
    if exp is None:
        return 404, {"error": f"no experiment '{name}'"}
    return 200, exp.snapshot()


async def stop_all(req: AdminRequest) -> AdminAnswer:
    reg = req.state.get(EXPERIMENTS)
    return 200, {"stopped": reg.stop_all("stop-all through the admin API") if reg else []}


ROUTES = (
    AdminRoute("GET", "/admin/experiments", Access.READ, list_experiments),
    AdminRoute("POST", "/admin/experiments", Access.MUTATES, start_experiment),
    AdminRoute("POST", "/admin/experiments/stop-all", Access.REDUCES_RISK, stop_all),
    AdminRoute("GET", "/admin/experiments/{name}", Access.READ, get_experiment),
    AdminRoute("POST", "/admin/experiments/{name}/stop", Access.REDUCES_RISK, stop_experiment),
)


async def experiments_summary(req: AdminRequest) -> Summary:
    """The experiments' table for ``mmguard status``."""
    _, found = await list_experiments(req)
    rows = []
    for e in found:
        rate = (e.get("window") or {}).get("error_rate")
        rows.append((str(e.get("name")), str(e.get("route")), str(e.get("state")).upper(),
                     str(e.get("matched", 0)),
                     ", ".join(f"{k} {v}" for k, v in (e.get("injected") or {}).items()) or "0",
                     "-" if rate is None else f"{rate:.1%}", str(e.get("stop_reason") or "")))
    return Summary("fault experiments", ("name", "route", "state", "matched", "injected",
                                         "window errors", "why stopped"), tuple(rows), order=30)

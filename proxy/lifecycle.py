"""A filter's whole life through one interface: what a factory may declare besides ``build()``.

The request path is ``Filter.__call__``; everything around it is declared here, so ``proxy/``
needs to know no filter by name:

- **typed state** (``StateKey[T]`` in a ``Store``): ``FilterContext.state`` outlives reloads (a
  fault registry, a shadow's verdict); ``FilterContext.local`` lives as long as one runtime (the
  breakers a route's chain built). A key is typed, so a reader gets what the writer put;
- **admin routes** (``AdminRoute``): URL, method and ``Access`` — the token rule for each access
  is applied in one place, ``proxy.process.admin``;
- **activation** (``activated``): once a runtime serves, with every config of this filter in it
  (by route); building did nothing live, so a rejected reload changes nothing;
- **observers of final answers** (``observers``): called with every canary call, its final
  answer and its latency, after the data plane counted it;
- **shutdown hooks**: ``before_drain`` (e.g. end fault experiments, so draining calls get clean
  answers) and ``after_drain`` (e.g. drop mirrored copies still queued).

``FilterFactoryBase`` gives every one of them a do-nothing default, so a filter declares only
what it uses. Modelled on Envoy extensions (own admin handlers, typed singletons) and aiohttp's
``AppKey[T]`` / ``cleanup_ctx``.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel

from proxy.keys import BaseKey, Store

if TYPE_CHECKING:
    from proxy.call import Call, Reply

T = TypeVar("T")

Observer = Callable[["Call", "Reply", float], None]
"""Sees a canary call's final answer (what its client got) and its latency in seconds, after the
data plane counted it. Only canary calls: the population experiments and verdicts judge."""


class StateKey(BaseKey[T]):
    """A typed name for one piece of state in a ``Store`` (e.g. ``StateKey[Registry]("x")``)."""

    __slots__ = ()


class Access(enum.Enum):
    """Who may call an admin route; ``proxy.process.admin`` enforces it, the same way for every
    filter."""

    READ = "read"
    """Open on the admin port: it changes nothing."""
    REDUCES_RISK = "reduces-risk"
    """Changes state only by taking risk away (a kill switch): the token when one is configured,
    open without one."""
    MUTATES = "mutates"
    """Changes state: always the admin token, refused (403) when none is configured."""


@dataclass(frozen=True)
class AdminRequest:
    """What an admin handler gets: the URL's parameters, the body, and the serving runtime's
    state (read at the time of the request, so a reload is seen at once)."""

    params: Mapping[str, str]
    state: Store
    """Process-wide: outlives reloads (``FilterContext.state``)."""
    local: Store
    """The serving runtime's (``FilterContext.local``)."""
    read_json: Callable[[], Awaitable[Any]]
    """The body as JSON; raises ``ValueError`` when it is not JSON."""


AdminAnswer = tuple[int, Any]
"""(HTTP status, a JSON-serialisable body)."""


@dataclass(frozen=True)
class AdminRoute:
    method: str
    """``GET`` or ``POST``."""
    path: str
    """aiohttp path, e.g. ``/admin/breakers/{route}/{level}/{action}``."""
    access: Access
    handler: Callable[[AdminRequest], Awaitable[AdminAnswer]]


@dataclass(frozen=True)
class Summary:
    """One filter's part of ``mmguard status``: a titled table of text cells. ``GET /admin``
    serves every filter's, so the command shows any installed filter without naming it."""

    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    empty: str = "none"
    """What the table says when it has no row (e.g. "none (no route uses the filter)")."""
    order: int = 100
    """Where it stands among the filters' tables (lower first)."""

    def as_json(self) -> dict[str, Any]:
        return {"title": self.title, "columns": list(self.columns),
                "rows": [list(r) for r in self.rows], "empty": self.empty, "order": self.order}


class FilterFactoryBase:
    """Do-nothing defaults for every lifecycle member of ``proxy.chain.FilterFactory``."""

    admin_routes: Sequence[AdminRoute] = ()

    async def summary(self, req: AdminRequest) -> Summary | None:
        """This filter's table for ``mmguard status`` (None: it has none)."""
        return None

    def activated(self, state: Store, local: Store, configs: Mapping[str, BaseModel]) -> None:
        """A runtime serves; ``configs`` is this filter's config on each route that has it
        (empty when the new config has none: what the old one started may end here)."""

    def observers(self, state: Store, local: Store) -> Sequence[Observer]:
        """What sees every canary call's final answer while this runtime serves."""
        return ()

    async def before_drain(self, state: Store) -> None:
        """Shutdown, before in-flight calls drain."""

    async def after_drain(self, state: Store) -> None:
        """Shutdown, after in-flight calls drained (backends close next)."""


@dataclass(frozen=True)
class ConfigReferences:
    """What one filter's options name outside the filter, checked when the config loads. A
    filter's config model declares them with a method ``references(self) -> ConfigReferences``."""

    routes: tuple[tuple[str, str], ...] = ()
    """(option, route): routes the filter hands calls to; each must be a route of the config."""
    files: tuple[tuple[str, Path], ...] = ()
    """(option, path): files the filter reads when built; each must exist (``load_config``
    with ``check_files``)."""
    internal: tuple[str, ...] = ()
    """Routes only this filter's own calls should reach (a shadow's canary): not served to
    clients unless the route says ``internal: false``."""
    unique_names: tuple[tuple[str, str], ...] = ()
    """(kind, name): names that must be unique in the whole config, e.g. fault experiments,
    which are process-wide."""

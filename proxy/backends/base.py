"""The backend interface. Every model server protocol implements it.

Rules that MUST hold:
- Errors are raised as ``ProxyError`` with the right kind; a backend's own error keeps its code
  and text (``origin="backend"``); a transport failure says which backend and address failed.
- ``infer`` never waits past ``min(call.remaining(), timeout_s)``.
- ``metadata`` returns the backend's real contract; the caller caches it.
- ``server_metadata`` and the repository methods speak the backend's own answer (or raise its
  error as it gave it); a backend without them says so (UNIMPLEMENTED, naming itself).
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from typing import Any

from proxy.call import Api, Call, Result, StreamItem, Target
from proxy.contract import ModelContract
from proxy.errors import ErrorKind, ProxyError

RepositoryParameter = bool | int | str | bytes
"""A repository load/unload parameter (``config``, ``file:<path>`` contents, ...)."""


class Backend(abc.ABC):
    name: str
    protocol: str  # "grpc", "http" or "inprocess": what wire form it can forward unchanged
    timeout_s: float

    @property
    def api(self) -> Api:
        """The API this backend serves (``protocol`` is its wire form)."""
        return Api.OPENAI if self.protocol == "openai" else Api.KSERVE_V2

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Open connections / load models. May raise; the caller retries."""

    async def reach(self) -> str | None:
        """After ``start``: None when the server answers at its address (any answer, ready or
        not), else why not. A remote backend's start opens a lazy channel or a session, which
        proves nothing of the address; an in-process one has loaded its models."""
        return None

    @abc.abstractmethod
    async def ready(self) -> bool: ...

    @abc.abstractmethod
    async def model_ready(self, model: str, version: str = "") -> bool: ...

    @abc.abstractmethod
    async def metadata(self, model: str, version: str = "") -> ModelContract: ...

    @abc.abstractmethod
    async def infer(self, call: Call, target: Target) -> Result: ...

    async def stream(self, call: Call, target: Target) -> AsyncIterator[StreamItem]:
        """Responses of a (decoupled) model as they come. Default: one response."""
        yield await self.infer(call, target)

    @abc.abstractmethod
    async def close(self, drain: bool = False) -> None:
        """Let go of connections and threads. ``drain`` (a reload retired the backend): the
        calls in flight on it end as they would have first, within the backend's bounds;
        otherwise (the process stops, its calls drained already) they are cut."""

    async def server_metadata(self) -> dict[str, Any] | None:
        """The backend's own ``{name, version, extensions}``; None when it has none."""
        return None

    async def repository_index(self, ready: bool) -> list[dict[str, str]]:
        """The backend's model repository: ``{name, version, state, reason}`` per model (empty
        fields left out, as Triton's HTTP answer does)."""
        raise self._no_repository()

    async def repository_load(self, model: str,
                              parameters: dict[str, RepositoryParameter]) -> None:
        raise self._no_repository()

    async def repository_unload(self, model: str,
                                parameters: dict[str, RepositoryParameter]) -> None:
        raise self._no_repository()

    def _no_repository(self) -> ProxyError:
        return ProxyError(ErrorKind.UNIMPLEMENTED,
                          f"backend '{self.name}' ({self.protocol}) has no model repository API")

    def timeout_for(self, call: Call) -> float:
        remaining = call.remaining()
        timeout = self.timeout_s if remaining is None else min(self.timeout_s, remaining)
        if timeout <= 0:
            raise ProxyError(ErrorKind.DEADLINE_EXCEEDED,
                             f"deadline for model '{call.model}' passed before it reached "
                             f"backend '{self.name}'")
        return timeout

    def too_large(self, where: str, what: str, model: str, limit: int, then: str) -> ProxyError:
        """An answer (or a streamed event) over the backend's ``max_message_bytes``: the
        backend's fault (502), named with the setting that bounds it; ``what``: "an answer
        of N bytes"; ``then``: what mmguard did with the rest of it."""
        return ProxyError(ErrorKind.BAD_GATEWAY,
                          f"backend '{self.name}' ({where}) sent {what} for model '{model}'; "
                          f"mmguard takes at most {limit} bytes (backends[].max_message_bytes) "
                          f"and {then}", origin="backend")

    def deadline_error(self, target: Target, timeout: float) -> ProxyError:
        return ProxyError(ErrorKind.DEADLINE_EXCEEDED,
                          f"backend '{self.name}' did not answer model '{target.model}' within "
                          f"{timeout * 1000:.0f} ms")
